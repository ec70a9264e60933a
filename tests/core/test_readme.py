"""The README runs as written: its Python blocks (``DIR`` and ``ids`` bound to a small checkpoint and a
prompt, as the README says) and its ``python examples/...`` commands, each in a fresh process as a user
runs them; the examples' baselines (hook off, stock vLLM) differ, so the examples' zero can fail."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aligned_mamba.models.mamba2 import make_tiny, save_checkpoint

pytestmark = pytest.mark.engines("own")  # the examples start vLLM engines

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_MEGATRON = importlib.util.find_spec("megatron") is not None
DIFFER = re.compile(r"(\d+) of (\d+) (?:token|reported) logprobs differ")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ALIGNED_MAMBA_EXACT_REPLAY", "TRITON_INTERPRET",
                                                              "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, list[int]]:
    root = tmp_path_factory.mktemp("readme")
    config, tensors = make_tiny(0)
    save_checkpoint(root / "ckpt", config, tensors)
    ids = torch.randint(0, config.vocab_size, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    return root / "ckpt", ids


def test_readme_is_at_most_8000_characters() -> None:
    assert len(README) <= 8000, len(README)


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_readme_python_block_runs(index: int, checkpoint, tmp_path) -> None:
    code = _blocks("python")[index]
    if "vllm" in code and not HAS_VLLM:
        pytest.skip("vllm is not installed (pip install -e '.[vllm]')")
    ckpt, ids = checkpoint
    script = tmp_path / "block.py"
    script.write_text(f"DIR = {str(ckpt)!r}\nids = {ids!r}\n" + code)
    run = _run([sys.executable, str(script)], tmp_path)
    assert run.returncode == 0, f"README block {index}:\n{code}\n{(run.stdout + run.stderr)[-3000:]}"
    if "vllm" in code:  # the plugin said it is on, in the engine's processes
        assert "aligned-mamba exact replay on" in run.stdout + run.stderr


def _example_commands() -> list[list[str]]:
    lines = [ln.strip() for block in _blocks("bash") for ln in block.splitlines()]
    return [ln.split() for ln in lines if ln.startswith("python examples/")]


@pytest.mark.skipif(not (HAS_VLLM and HAS_MEGATRON), reason="the examples need the vllm and megatron extras")
def test_readme_example_commands_run_and_their_baselines_differ(tmp_path) -> None:
    commands = _example_commands()
    assert [c[1] for c in commands] == ["examples/megatron_train.py", "examples/vllm_rollout.py"], commands
    ckpt = str(tmp_path / "ckpt")
    seen = []
    for args in commands:
        args = [sys.executable, *[ckpt if a == "/tmp/am_ckpt" else a for a in args[1:]]]
        run = _run(args, ROOT)
        out = run.stdout + run.stderr
        assert run.returncode == 0, f"{' '.join(args)}:\n{out[-3000:]}"
        (differ, total), = DIFFER.findall(out)
        seen.append((int(differ), int(total)))
    print(f"\nexamples as the README runs them: {seen}")
    assert all(d == 0 and n > 0 for d, n in seen)

    # the same examples without the hook / the plugin: Megatron's stock forward and stock vLLM differ
    base = []
    for args in ([ROOT / "examples/megatron_train.py", "--steps", "1"],
                 [ROOT / "examples/vllm_rollout.py", "--model", ckpt, "--stock"]):
        run = _run([sys.executable, *map(str, args)], ROOT)
        out = run.stdout + run.stderr
        assert run.returncode == 1, out[-3000:]
        (differ, total), = DIFFER.findall(out)
        base.append((int(differ), int(total)))
    print(f"baselines: {base}")
    assert all(d > 0 for d, _ in base)
