"""The GPU training benchmarks' CPU dry runs: every code path that needs no CUDA runs, and the
results they write say what the GPU runs report (so a script that rots is caught here, not in a
device session)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)  # the script sets it where it needs it
    # one intra-op thread: with more, on a loaded machine, two CPU backwards have differed in the
    # first layer's gradients (ops/autograd.py); the repeat check here is for the GPU bench's plumbing
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--dry-run", "--out", str(out), *args],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


def test_bench_train_dry_run(tmp_path: Path) -> None:
    """Ours' fwd+bwd through the Triton interpreter against the stock step's torch stand-ins: grad mode
    keeps the logits' bits, two backwards agree bit for bit, and in fp32 the two gradients agree."""
    pytest.importorskip("triton")
    out = tmp_path / "train.json"
    r = _run("bench_train_h200.py", out)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cells = json.loads(out.read_text())["train"]
    assert len(cells) == 4
    for e in cells:
        assert e["ours_grad_mode_logits_equal"] and e["ours_grads_repeat_equal"], e
        assert e["grads_vs_stock_rel_err_max"]["rel_err"] < 1e-4, e


@pytest.mark.parametrize("model", ["tiny", "moe"])
def test_train_megatron_dry_run(tmp_path: Path, model: str) -> None:
    """The in-process RL loop on Megatron with the hook (torch backend), on the default Mamba2 and on
    the MoE hybrid the GPU run trains: no token or raw row differs, and each step lowers its batch's
    loss."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "megatron.json"
    r = _run("train_megatron_h200.py", out, "--prompt-len", "40", "--gen-len", "12", "--model", model)
    assert r.returncode in (0, 1), r.stdout[-2000:] + r.stderr[-2000:]  # 1: the stock worker happened to agree
    s = json.loads(out.read_text())["summary"]
    assert s["iterations"] == 2 and s["rows"] == s["tokens"] > 0, s
    assert s["mismatched_tokens"] == 0 and s["differing_rows"] == 0, s
    assert s["steps_lowering_their_loss"] == 2, s


def test_bench_scan_backward_dry_run(tmp_path: Path) -> None:
    """The scan-backward benchmark's kernel configs through the interpreter (two chunk-kernel configs,
    one state-kernel config, the rounded dots): each computes the first one's gradients up to fp32
    rounding, the same bits when repeated."""
    pytest.importorskip("triton")
    out = tmp_path / "scan_backward.json"
    r = _run("bench_scan_backward_h200.py", out)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cells = json.loads(out.read_text())["cells"]
    assert len(cells) == 1 and [e["variant"].split()[0] for e in cells[0]["ours"]] == ["chunk", "chunk", "state",
                                                                                         "round"], cells
    assert all(e["max_rel_vs_first"] < 1e-5 and e["repeat_equal"] for c in cells for e in c["ours"]), cells


def test_bench_conv_backward_dry_run(tmp_path: Path) -> None:
    """The conv backward benchmark through the interpreter: the tile kernel once, then the walk at two
    launches, each loading two and four rows ahead (``--ahead``); each walk gives the tile kernel's dx
    bits, its dweight and dbias up to fp32 rounding, the same bits when repeated."""
    pytest.importorskip("triton")
    out = tmp_path / "conv_backward.json"
    r = _run("bench_conv_backward_h200.py", out, "--ahead", "2,4")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cells = json.loads(out.read_text())["cells"]
    assert [("tile" in e, e.get("ahead")) for e in cells] == [(True, None)] + [(False, 2)] * 2 + [(False, 4)] * 2, cells
    assert all(e["repeat_equal"] and "error" not in e for e in cells), cells
    walks = cells[1:]
    assert all(e["dx_equal_tile"] and e["dw_rel_tile"] < 1e-5 and e["db_rel_tile"] < 1e-5 for e in walks), cells


def test_bench_conv_forward_tiles_dry_run(tmp_path: Path) -> None:
    """``--forward``: the conv forward's tile kernel, then its walk at the pinned launch and two others
    through the interpreter, every output the tile kernel's bit for bit and repeatable; then the pinned
    walk timed without its SiLU."""
    pytest.importorskip("triton")
    out = tmp_path / "conv_forward.json"
    r = _run("bench_conv_backward_h200.py", out, "--forward", "8x16x1,16x32x2", "--walk=")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    *cells, plain = json.loads(out.read_text())["cells"]
    assert plain["forward"] == [16, 128, 1] and plain["silu"] is False and plain["ms"] > 0, plain
    assert [e["forward"] for e in cells] == ["tile", [16, 128, 1], [8, 16, 1], [16, 32, 2]], cells
    assert [e["pinned"] for e in cells] == [False, True, False, False], cells
    assert all(e["equal_tile"] and e["repeat_equal"] and "error" not in e for e in cells), cells


def test_bench_norm_backward_dry_run(tmp_path: Path) -> None:
    """The gated norm's backward benchmark through the interpreter: at every launch the output it writes
    again is the forward's bit for bit, and two calls give the same bits."""
    pytest.importorskip("triton")
    out = tmp_path / "norm_backward.json"
    r = _run("bench_norm_backward_h200.py", out, "--launches", "256x16,512x4")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cells = json.loads(out.read_text())["cells"]
    assert len(cells) == 1 and [(e["block_per_warp"], e["rows"]) for e in cells[0]["launches"]] == [(256, 16), (512, 4)]
    assert all(e["out_equal_forward"] and e["repeat_equal"] for e in cells[0]["launches"]), cells


def test_bench_tree_gemm_dry_run(tmp_path: Path) -> None:
    """The row-parallel tree GEMM benchmark through the interpreter: TP k gives TP 1's bits in every
    cell, and every variant (the other loop form, the other stack, the split-slices grid at each M, the
    plain grid) the pinned form's."""
    pytest.importorskip("triton")
    out = tmp_path / "tree.json"
    r = _run("bench_tree_gemm_h200.py", out)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [c["M"] for c in res["cells"]] == [1, 16, 40] and res["all_tp_k_equal_tp1"], res["cells"]
    assert all(f"split_s{s}" in c for c in res["cells"] for s in (2, 4, 8)), res["cells"]
    for v in ("flatten", "global_stack", "split", "grid"):
        assert res[f"{v}_all_same_bits"], v


def test_norm_rounding_runs_each_variant(tmp_path: Path) -> None:
    """The norms' rounding study: five variants, each a different model (a variant whose forms did not
    reach the layers would repeat the contract's error exactly)."""
    out = tmp_path / "norms.json"
    r = _run("norm_rounding_cpu.py", out)
    assert r.returncode == 0, r.stderr[-2000:]
    errs = [c["rel_err"] for c in json.loads(out.read_text())["cells"]]
    assert len(errs) == 5 and len(set(errs)) == 5 and all(0 < e < 0.1 for e in errs), errs


def test_gpu_timeline_finds_the_idle_gaps() -> None:
    """``bench_mamba_ssm_h200.gpu_timeline`` on a hand-made profile: the lead before the first kernel, the
    gaps between kernels (overlapping kernels count once), the busy and idle time."""
    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_mamba_ssm_h200 import gpu_timeline

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name: str, a: float, b: float, dev: object) -> types.SimpleNamespace:
        return types.SimpleNamespace(name=name, time_range=types.SimpleNamespace(start=a, end=b), device_type=dev)

    prof = types.SimpleNamespace(events=lambda: [ev("step", 0, 500, cpu), ev("k1", 100, 200, cuda),
                                                 ev("k2", 150, 250, cuda), ev("k3", 400, 450, cuda),
                                                 ev("k4", 460, 470, cuda), ev("other", 10, 20, cpu)])
    t = gpu_timeline(torch, prof)
    assert (t["span_ms"], t["busy_ms"], t["lead_ms"]) == pytest.approx((0.47, 0.21, 0.1))
    assert t["idle_ms"] == pytest.approx(0.26)
    assert [(g["after"], g["before"]) for g in t["gaps"]] == [("k2", "k3"), ("(the step's start)", "k1"),
                                                              ("k3", "k4")]
    assert gpu_timeline(torch, types.SimpleNamespace(events=lambda: [ev("step", 0, 5, cpu)])) == {}


def test_summarize_marks_each_mamba_ssm_cell_against_its_target() -> None:
    """``summarize.vs_mamba_ssm`` on a hand-made result: each ratio beside issue 31's target (fwd+bwd and peak
    <= 1.0x, forward <= 0.9x, graph decode <= 1.0x the bf16-state stock, error <= the stock's), a cell just
    over its target is "not met", and a cell that did not run says why instead of a ratio."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.summarize import VS_MAMBA_SSM, vs_mamba_ssm

    r = {"gpu": "GPU", "torch": "t", "triton": "tr", "commit": "c0ffee", "date": "d", "script": VS_MAMBA_SSM,
         "stock": "mamba_ssm", "train": [
             {"shape": "s", "label": "1x16384", "ours_ms": 102.0, "stock_ms": 100.0, "ratio": 1.02,
              "peak_ratio": 0.9, "ours_peak_bytes": 9 * 2 ** 30, "stock_peak_bytes": 10 * 2 ** 30},
             {"shape": "s", "label": "4x2048", "ours_ms": 98.0, "stock_ms": 100.0, "ratio": 0.98,
              "turns_ours_ms": 101.0, "turns_stock_ms": 100.0, "ratio_turns": 1.01,
              "peak_ratio": 0.9, "ours_peak_bytes": 9 * 2 ** 30, "stock_peak_bytes": 10 * 2 ** 30}],
         "forward": [{"shape": "s", "label": "4x2048", "ours_ms": 91.0, "stock_ms": 100.0, "ratio": 0.91},
                     {"shape": "s", "label": "1x16384", "ours_ms": 89.0, "stock_ms": 100.0, "ratio": 0.89}],
         "decode": [{"shape": "s", "batch": 1, "ours_ms": 2.0, "stock_bf16_ms": 2.02, "ratio_stock_bf16": 0.99,
                     "stock_fp32_ms": 2.1, "ratio_stock_fp32": 0.952, "ours_round_ms": [2.0, 2.1, 1.9],
                     "graph_rows_equal_forward": 1, "graph_rows_checked": 1},
                    {"shape": "s", "batch": 256, "ours_ms": None, "stock_bf16_ms": 28.0,
                     "ours_error": "OutOfMemoryError: CUDA out of memory. Tried"}],
         "accuracy": [{"shape": "s", "ours_rel_err_vs_stock_fp32": 0.0205, "stock_bf16_rel_err_vs_stock_fp32": 0.0204,
                       "ours_top1_agree": 0.94, "stock_bf16_top1_agree": 0.95}]}
    rows = [line for line in vs_mamba_ssm(r).splitlines() if line.startswith("| s")]
    assert rows == [
        "| s 1x16384 | 102.0 | 100.0 | 1.020x | not met | 9.000 / 10.00 | 0.900x | met |",
        "| s 4x2048 | 101.0 | 100.0 | 1.010x | not met | 9.000 / 10.00 | 0.900x | met |",
        "| s 4x2048 | 91.00 | 100.0 | 0.910x | not met |",
        "| s 1x16384 | 89.00 | 100.0 | 0.890x | met |",
        "| s b1 | 2.000 | 2.020 | 0.990x | met | 2.100 | 0.952x | 2.000, 2.100, 1.900 | 1 / 1 |",
        "| s b256 | - | 28.00 | - | not run: OutOfMemoryError: CUDA out of memory | - | - | - | - |",
        "| s | 2.050% | 2.040% | not met | 94.0% / 95.0% |"]


def test_stock_turns_alternate_the_sides_and_keep_a_failure(monkeypatch) -> None:
    """``--turns``: ours and the stock called one after the other each round, the medians and their ratio
    recorded (a held step's beside them); a stock call that raises leaves ``turns_error`` and no ratio; a cell
    whose blocks did not both run is not timed in turns; a negative ``--turns`` is refused in one line."""
    sys.path.insert(0, str(ROOT))
    import benchmarks.bench_mamba_ssm_h200 as bench

    calls: list[str] = []

    def cuda_ms(torch, step, n, warmup=0):  # the warm-up calls' values are not times
        return [step(0) for _ in range(warmup + n)][warmup:]

    monkeypatch.setattr(bench, "cuda_ms", cuda_ms)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(empty_cache=lambda: None))
    ms = {"ours": iter([0.0, 10.0, 0.0, 12.0, 0.0, 11.0]), "stock": iter([0.0, 20.0, 0.0, 21.0, 0.0, 22.0])}

    def side(k):
        def f():
            calls.append(k)
            return next(ms[k])
        return f

    e = {"ours_ms": 1.0, "stock_ms": 1.0}
    bench.stock_turns(fake, side("ours"), side("stock"), 3, e)
    assert calls == ["ours", "ours", "stock", "stock"] * 3  # each timed call after an untimed one of its side
    assert (e["turns_ours_ms"], e["turns_stock_ms"]) == (11.0, 21.0) and e["ratio_turns"] == 11.0 / 21.0
    assert e["turns_ours_times_ms"] == [10.0, 12.0, 11.0]

    def broken():
        raise RuntimeError("out of memory")

    e = {"ours_ms": 1.0, "stock_ms": 1.0}
    bench.stock_turns(fake, lambda: 1.0, broken, 3, e)
    assert "ratio_turns" not in e and e["turns_error"] == "RuntimeError: out of memory"
    e = {"ours_ms": 1.0, "stock_ms": 1.0}
    ms = {"ours": iter([0.0, 10.0]), "held": iter([0.0, 9.0]), "stock": iter([0.0, 20.0])}
    bench.stock_turns(fake, side("ours"), side("stock"), 1, e, {"ours_hold": side("held")})
    assert calls[-6:] == ["ours", "ours", "held", "held", "stock", "stock"]
    assert e["ratio_ours_hold_turns"] == 9.0 / 20.0
    e = {"ours_ms": 1.0, "stock_ms": None}
    bench.stock_turns(fake, side("ours"), side("stock"), 3, e)
    assert e == {"ours_ms": 1.0, "stock_ms": None} and len(calls) == 18
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_mamba_ssm_h200.py"), "--out-dir", "x",
                        "--turns", "-1"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
        "--turns: a number of rounds, 0 for none, got -1"), r.stderr  # refused in one line, not run as 0


def test_summarize_refuses_a_foreign_json_in_one_line(tmp_path, capsys) -> None:
    """A JSON another bench wrote (the tree GEMM's), a list and a mamba_ssm result missing a field: exit 1 and one
    line naming the file, not a traceback; a readable result still prints."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.summarize import VS_MAMBA_SSM, main

    cases = {"tree.json": {"gpu": "GPU", "cells": []}, "list.json": [1, 2],
             "partial.json": {"script": VS_MAMBA_SSM, "gpu": "GPU"}}
    for name, body in cases.items():
        (tmp_path / name).write_text(json.dumps(body))
        assert main([str(tmp_path / name)]) == 1, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"{tmp_path / name}: not a result of"), err
    ok = {"gpu": "GPU", "torch": "t", "triton": "tr", "commit": "c", "date": "d", "script": VS_MAMBA_SSM,
          "stock": "mamba_ssm"}
    (tmp_path / "ok.json").write_text(json.dumps(ok))
    assert main([str(tmp_path / "ok.json")]) == 0 and "commit c" in capsys.readouterr().out


def test_forward_bytes_scale_with_tokens_and_print_a_table() -> None:
    """``bytes_moved.forward_layer_bytes``: every kernel's count is linear in the tokens over whole chunks, the
    stored boundary states' width moves the state pass and the scan output alone (by one state per chunk and
    head each), and the CLI prints a row per kernel and their sum."""
    from benchmarks.bytes_moved import forward_layer_bytes

    shape = dict(H=80, P=64, G=1, N=128, hidden=2560)
    one, two = forward_layer_bytes(4096, **shape), forward_layer_bytes(8192, **shape)
    assert {k: 2 * v for k, v in one.items()} == two
    wide = forward_layer_bytes(4096, **shape, boundary_bytes=4)
    per_state = (4096 // 256) * 80 * 64 * 128 * 2
    assert {k for k in one if wide[k] != one[k]} == {"state pass", "scan output"}
    assert all(wide[k] - one[k] == per_state for k in ("state pass", "scan output"))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bytes_moved.py"), "--shape", "mamba2-1.3b",
                        "--tokens", "8192"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [line.split(" | ")[0][2:] for line in rows] == [*one, "all"]
