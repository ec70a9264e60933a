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

REPO = Path(__file__).resolve().parents[2]


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
    """A small check. In bfloat16 its baseline shows no differing row (exit 4, no control); tests
    that expect OK compute in float32, where the baseline differs."""
    jobs = [] if "--jobs" in extra else ["--jobs", "1"]
    return ["check", "--model", str(ckpt), "--prompt-len", "70", "--gen-len", "40", "--requests", "2", *jobs, *extra]


def test_check_on_a_checkpoint_writes_the_json_schema(small_ckpt, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = check_args(small_ckpt, "--dtype", "float32", "--max-batch-tokens", "23", "--jobs", "2", "--json", str(out))
    assert main(args) == 0
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


# -- reports that survive, exit codes that mean one thing ---------------------------------------------------


def test_a_json_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    import aligned_mamba.models as models

    monkeypatch.setattr(models, "load_source", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["check", "--json", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["check", "--json", "/proc/aligned-mamba.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be written" in err[0]


def test_the_report_has_a_status_hardware_and_row_digests(small_ckpt, tmp_path):
    out = tmp_path / "r.json"
    assert main(check_args(small_ckpt, "--dtype", "float32", "--json", str(out))) == 0
    r = json.loads(out.read_text())
    assert r["status"] == "ok" and r["hardware"]["key"] == r["trainer_hardware"]
    for c in r["cases"]:
        assert c["sampler_hardware"] == r["trainer_hardware"]
        # equal rows, equal digests; the baseline's rows differ, and so do its digests
        assert (c["trainer_digest"] == c["sampler_digest"]) == (c["mismatched_rows"] == 0), c["name"]


def test_two_runs_on_one_machine_give_the_same_digests(small_ckpt, tmp_path):
    """The digests are what two machines compare instead of rows: a rerun must reproduce every one,
    while the baseline's sampler digest differs from its trainer's (so a digest can tell)."""
    runs = []
    for name in ("a.json", "b.json"):
        # fp32: there the baseline's rows differ from the trainer's (in bf16 they round alike here)
        assert main(check_args(small_ckpt, "--dtype", "float32", "--json", str(tmp_path / name))) == 0
        runs.append(json.loads((tmp_path / name).read_text()))
    digests = [[(c["name"], c["trainer_digest"], c["sampler_digest"]) for c in r["cases"]] for r in runs]
    assert digests[0] == digests[1]
    base = next(c for c in runs[0]["cases"] if not c["exact_replay"])
    assert base["trainer_digest"] != base["sampler_digest"]


def test_an_interrupted_check_leaves_the_cases_it_finished(small_ckpt, tmp_path, monkeypatch):
    import aligned_mamba.check as check

    real, calls = check.compare, []

    def compare(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(check, "compare", compare)
    out = tmp_path / "r.json"
    assert main(check_args(small_ckpt, "--json", str(out))) == 130
    r = json.loads(out.read_text())
    assert r["status"] == "interrupted" and [c["name"] for c in r["cases"]] == ["decode"]


def test_a_failed_run_exits_3_with_one_line_and_a_failed_report(small_ckpt, tmp_path, monkeypatch, capsys):
    from aligned_mamba.train import PolicyTrainer

    def oom(self, sequences):
        raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 40 GB (out of memory)")

    monkeypatch.setattr(PolicyTrainer, "forward", oom)
    out = tmp_path / "r.json"
    assert main(check_args(small_ckpt, "--json", str(out))) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("aligned-mamba: runtime failure: out of memory")
    r = json.loads(out.read_text())
    assert r["status"] == "failed" and r["error"].startswith("out of memory") and not r.get("cases")


def test_exit_statuses_mean_one_thing_each():
    from concurrent.futures.process import BrokenProcessPool

    from aligned_mamba.cli import exit_status
    from aligned_mamba.errors import AlignedMambaError, ModelLoadError, RuntimeFailure, TrainingDiverged

    assert exit_status(ModelLoadError("bad config"))[0] == 2
    assert exit_status(ValueError("--lr must be > 0"))[0] == 2
    assert exit_status(AlignedMambaError("refused"))[0] == 2
    assert exit_status(RuntimeFailure("cannot reach the Ray cluster"))[0] == 3
    assert exit_status(TrainingDiverged("step 3 diverged"))[0] == 3
    assert exit_status(MemoryError())[0] == 3
    assert exit_status(BrokenProcessPool("gone")) == (3, "a sampler worker process died (killed, e.g. out of memory)")
    assert exit_status(KeyError("x"))[0] == 3  # a bug is a failed run, never "refused input"


def test_a_run_that_cannot_fit_in_memory_is_refused_before_it_starts(monkeypatch, capsys):
    import aligned_mamba.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 4 << 30)
    assert main(["check", "--prompt-len", "20000", "--jobs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("aligned-mamba: error: check of 4 x (20000+300) tokens needs about") and \
        "4.0 GiB is available" in err, err
    # the main job's default sizes fit in the same 4 GiB
    from aligned_mamba.cli import _check_memory, build_parser
    from aligned_mamba.contract import Contract
    from aligned_mamba.models import load_source

    config, _ = load_source("tiny")
    _check_memory(config, Contract(chunk_size=256), build_parser().parse_args(["check"]), jobs=2)


def test_the_memory_estimate_is_above_what_a_forward_takes():
    """The estimate must not undercount (it is what stands between a user and the OOM killer):
    the default model's measured 105-108 KiB per token (benchmarks/README.md) is below it."""
    from aligned_mamba.memory import forward_bytes_per_token

    per = forward_bytes_per_token(hidden=256, heads=8, head_dim=64, groups=1, state=128, chunk=256, vocab=512,
                                  dtype_bytes=2)
    assert 108 * 1024 < per < 2 * 108 * 1024


def test_a_flag_that_contradicts_the_contract_file_is_refused(tmp_path, capsys, monkeypatch):
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 256\nbackend: triton\nmodel_dtype: bfloat16\nstate_dtype: float32\n")
    assert main(["check", "--contract", str(f), "--backend", "torch"]) == 2
    assert "--backend torch contradicts contract" in capsys.readouterr().err
    assert main(["check", "--contract", str(f), "--dtype", "float32", "--backend", "auto"]) == 2
    assert "--dtype float32 contradicts contract" in capsys.readouterr().err
    if not torch.cuda.is_available():  # the file's triton backend is refused here, not run on torch
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        assert main(["check", "--contract", str(f)]) == 2
        assert "backend 'triton' needs a CUDA GPU" in capsys.readouterr().err


def test_rows_from_another_hardware_class_are_refused_unless_allowed(small_ckpt, tmp_path, monkeypatch, capsys):
    import dataclasses

    import aligned_mamba.hardware as hardware

    real = hardware.hardware_class

    def elsewhere(device=None):  # the sampler's process, as if started with other ISA settings
        hw = real(device)
        return dataclasses.replace(hw, isa="default" if hw.isa != "default" else "avx2")

    import aligned_mamba.check as check

    monkeypatch.setattr(hardware, "hardware_class", elsewhere)  # the engines' processes look it up at run time
    monkeypatch.setattr(check, "hardware_class", real)  # the trainer's side stays this machine's
    assert main(check_args(small_ckpt)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress lines: one line, the reason
    assert err.startswith("aligned-mamba: error:") and "--allow-cross-hardware" in err
    out = tmp_path / "r.json"
    assert main(check_args(small_ckpt, "--dtype", "float32", "--allow-cross-hardware", "--json", str(out))) == 0
    r = json.loads(out.read_text())
    sampler, trainer = r["cases"][0]["sampler_hardware"], r["trainer_hardware"]
    assert sampler != trainer and sampler == elsewhere("cpu").key


def test_a_contract_file_does_not_silently_cast_the_checkpoint(tmp_path, capsys):
    path = tmp_path / "fp32"
    cfg, tensors = make_tiny(4, dtype="float32", num_hidden_layers=1, hidden_size=64, num_heads=2, head_dim=64,
                             state_size=16, chunk_size=32, vocab_size=64)
    save_checkpoint(path, cfg, tensors)
    f = tmp_path / "c.yaml"
    f.write_text("chunk_size: 32\nbackend: torch\nmodel_dtype: bfloat16\nstate_dtype: float32\n")
    assert main(["check", "--model", str(path), "--contract", str(f), "--prompt-len", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("the contract's model_dtype bfloat16 is not the checkpoint's stored float32: pass --dtype "
                        "bfloat16 to compute in it from these weights")


# -- tensor parallelism (the reference trainer and engine as gloo processes) ------------------------------


@pytest.mark.engines("own")
def test_check_at_trainer_tp2_sampler_tp2(small_ckpt, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = check_args(small_ckpt, "--dtype", "float32", "--trainer-tp", "2", "--sampler-tp", "2",
                      "--row-parallel-slices", "4", "--json", str(out))
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["trainer_tp"] == 2 and r["sampler_tp"] == 2 and r["contract"]["row_parallel_slices"] == 4
    for c in r["cases"]:
        if c["exact_replay"]:
            assert c["mismatched_rows"] == 0 and c["mismatched_logprobs"] == 0 and c["rows"] > 0
    assert r["tp_control"]["could_fail"] and r["tp_control"]["stock_mismatched_rows"] > 0
    assert "stock TP 2 (partials all-reduced) differs" in capsys.readouterr().out


def test_tensor_parallel_refusals(capsys, small_ckpt):
    _one_line_error(capsys, main(check_args(small_ckpt, "--trainer-tp", "2")), "row_parallel_slices >= 2")
    _one_line_error(capsys, main(check_args(small_ckpt, "--sampler-tp", "3", "--row-parallel-slices", "4")),
                    "power of two")
    _one_line_error(capsys, main(check_args(small_ckpt, "--trainer-tp", "8", "--row-parallel-slices", "8")),
                    "num_heads 4")
    _one_line_error(capsys, main(check_args(small_ckpt, "--row-parallel-slices", "6")), "row_parallel_slices 6")
