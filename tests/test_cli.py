"""``aligned-mamba check``: the main job end to end, its JSON, and its refusals of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aligned_mamba.cli import main
from aligned_mamba.models.mamba2 import make_tiny, save_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "small"
    cfg, tensors = make_tiny(4, num_hidden_layers=2, hidden_size=128, num_heads=4, head_dim=64, n_groups=2,
                             state_size=32, chunk_size=32)
    save_checkpoint(path, cfg, tensors)
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "aligned_mamba.cli", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)


def check_args(ckpt: Path, *extra: str) -> list[str]:
    jobs = [] if "--jobs" in extra else ["--jobs", "1"]
    return ["check", "--model", str(ckpt), "--prompt-len", "70", "--gen-len", "40", "--requests", "2", *jobs, *extra]


def test_check_on_a_checkpoint_writes_the_json_schema(small_ckpt, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(check_args(small_ckpt, "--max-batch-tokens", "23", "--jobs", "2", "--json", str(out))) == 0
    r = json.loads(out.read_text())
    assert {"contract", "cases", "accuracy", "timing"} <= set(r)
    assert r["contract"]["chunk_size"] == 32 and len(r["contract"]["fingerprint"]) == 12
    names = [c["name"] for c in r["cases"]]
    assert names == ["decode", "chunked_prefill_unaligned", "preempt_recompute", "mixed_batch",
                     "baseline_recurrent_decode"]
    for c in r["cases"]:
        assert {"name", "exact_replay", "rows", "mismatched_rows", "first_mismatch", "max_abs_diff"} <= set(c)
        if c["exact_replay"]:
            assert c["mismatched_rows"] == 0 and c["first_mismatch"] is None and c["max_abs_diff"] == 0
    assert r["accuracy"]["within_2x_floor"]
    assert all(c["sampler_pid_differs"] for c in r["cases"])  # samplers ran in worker processes
    table = capsys.readouterr().out
    assert "baseline_recurrent_decode" in table and "OK: every exact-replay case is bit-identical" in table


def test_check_fp32_baseline_shows_the_mismatch(small_ckpt, tmp_path):
    out = tmp_path / "r.json"
    assert main(check_args(small_ckpt, "--dtype", "float32", "--json", str(out))) == 0
    base = json.loads(out.read_text())["cases"][-1]
    assert not base["exact_replay"] and base["mismatched_rows"] > base["rows"] // 2


def test_the_readme_default_run(tmp_path):
    """The README's main job on the embedded default: exact cases 0 rows, the baseline many."""
    out = tmp_path / "default.json"
    proc = run_cli("check", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    cases = {c["name"]: c for c in r["cases"]}
    assert all(c["mismatched_rows"] == 0 for c in r["cases"] if c["exact_replay"])
    base = cases["baseline_recurrent_decode"]
    assert base["mismatched_rows"] >= base["rows"] // 10, base
    assert r["accuracy"]["within_2x_floor"]


def _one_line_error(capsys, code: int, *words: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err and err[-1].startswith("aligned-mamba: error: "), err
    for w in words:
        assert w in err[-1], err[-1]
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def test_missing_model_directory(capsys, tmp_path):
    _one_line_error(capsys, main(check_args(tmp_path / "nope")), "nope")


def test_malformed_config(capsys, small_ckpt, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    (bad / "model.safetensors").write_bytes((small_ckpt / "model.safetensors").read_bytes())
    _one_line_error(capsys, main(check_args(bad)), "config.json")


@pytest.mark.parametrize("damage", ["missing", "misshaped"])
def test_missing_or_misshaped_tensor(capsys, small_ckpt, tmp_path, damage):
    bad = tmp_path / damage
    bad.mkdir()
    (bad / "config.json").write_text((small_ckpt / "config.json").read_text())
    tensors = load_file(small_ckpt / "model.safetensors")
    name = "backbone.layers.1.mixer.out_proj.weight"
    if damage == "missing":
        del tensors[name]
    else:
        tensors[name] = torch.zeros(3, 5, dtype=tensors[name].dtype)
    save_file(tensors, bad / "model.safetensors")
    line = _one_line_error(capsys, main(check_args(bad)), name)
    if damage == "misshaped":
        assert "[3, 5]" in line and "[128, 256]" in line


def test_chunk_size_mismatch_is_refused_before_comparing(capsys, small_ckpt):
    line = _one_line_error(capsys, main(check_args(small_ckpt, "--trainer-contract", "chunk128")), "chunk_size")
    assert "trainer=128" in line and "sampler=32" in line


def test_non_fp32_state_is_refused(capsys, small_ckpt):
    _one_line_error(capsys, main(check_args(small_ckpt, "--state-dtype", "bfloat16")), "bfloat16", "fp32")


def test_bad_numbers_are_refused(capsys, small_ckpt):
    _one_line_error(capsys, main(check_args(small_ckpt, "--gen-len", "0")), "--gen-len")
    _one_line_error(capsys, main(check_args(small_ckpt, "--max-batch-tokens", "0")), "--max-batch-tokens")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_triton_backend_without_gpu_is_refused(capsys, small_ckpt, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _one_line_error(capsys, main(check_args(small_ckpt, "--backend", "triton")), "triton")


def test_console_script_refusal_has_no_traceback(tmp_path):
    proc = run_cli("check", "--model", str(tmp_path / "missing"))
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith("[")]  # "[  2.3s] ..." is progress
    assert len(errors) == 1 and errors[0].startswith("aligned-mamba: error: ") and "Traceback" not in proc.stderr
