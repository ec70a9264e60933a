#!/usr/bin/env python3
"""Training on one GPU: forward + backward of the project's Mamba2 LM (triton backend) against a
stock training step, with the same weights in the same process.

    PYTHONPATH=.:.anchors python3 benchmarks/bench_train_h200.py --out OUT/h200_train.json [--quick]
        [--shapes mamba2-1.3b,...]
    python3 benchmarks/bench_train_h200.py --dry-run --out /tmp/t.json   (CPU: Triton interpreter, tiny shapes)

One step = the loss -sum_t log p(target_t) over every position of every sequence, then the
gradient of every weight (``torch.autograd.grad``), for ``mamba2-1.3b`` (and ``mamba2-130m``) at
4 x 2048 and 1 x 16384 tokens; bf16 weights with A_log, D and dt_bias in fp32, drawn as
``bench_model_h200.device_weights`` does; the weights are the autograd leaves (no optimizer).

Ours: ``build_model`` under ``Contract(chunk_size=256, backend="triton", model_dtype="bfloat16")``,
built in the step (as ``PolicyTrainer`` builds it per step), its forward with gradients on (the
Triton kernels of the sampler, recorded by each op's Function), the backend's ``token_logprobs``,
and the backward those Functions define. Stock: ``bench_model_h200.Stock`` under autograd (bf16
``F.linear`` on cuBLAS, torch conv1d and RMSNorms, mamba_ssm's ``mamba_chunk_scan_combined`` with its
own Triton backward), torch's fp32 ``log_softmax``.

Per cell: CUDA-event medians of the step after a first (JIT, autotune) call; peak memory
(``max_memory_allocated``) over one step, absolute and above what was allocated before it (the
weights); tokens/s. Checks: ours' logits with gradients on equal its no-grad forward (``torch.equal``);
two of ours' backwards compared bit for bit (``ours_grads_repeat_equal``: which tensors differ, if
any); ours' gradients against stock's (relative error: the same model in other roundings).
The JSON is written after every cell.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "benchmarks/bench_train_h200.py"
SHAPES = ("mamba2-1.3b", "mamba2-130m")
TRAIN = [("4x2048", [2048] * 4), ("1x16384", [16384])]
TINY_TRAIN = [("2x40", [40, 40]), ("1x70", [70])]


def log(msg: str) -> None:
    print(f"[train {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def ours_loss(model, seqs, targets):
    """The project's trainer forward and the backend's token logprobs, scored packed as its trainers score them
    (one [sum len, V] logits tensor, no per-sequence split): (-sum log p(target), the packed logits)."""
    import torch

    logits = model.forward(seqs, packed=True)
    return -model.backend.token_logprobs(logits, torch.cat(list(targets))).sum(), logits


def stock_loss(stock, leaves, ids, targets):
    """The stock step's forward: A = -exp(A_log) under autograd each step, torch's fp32 log_softmax."""
    import torch

    for i, ly in enumerate(stock.layers):
        ly.A = -torch.exp(leaves[f"backbone.layers.{i}.mixer.A_log"].float())
    logits = stock.forward(ids)
    return -torch.log_softmax(logits.float(), -1).gather(-1, targets.reshape(-1, 1)).sum(), logits


def profile(step, top: int = 40) -> dict:
    """One step under torch.profiler (CUDA activity only, to keep its overhead small): the kernels by
    GPU time, summed by name."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()

    def dev_us(ev) -> float:
        return float(getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0))

    kernels = sorted((ev for ev in events if dev_us(ev) > 0), key=dev_us, reverse=True)
    return {"device_total_ms": sum(dev_us(ev) for ev in kernels) / 1e3,
            "kernels": [{"name": ev.key[:160], "device_ms": dev_us(ev) / 1e3, "calls": ev.count}
                        for ev in kernels[:top]]}


def train_cell(args, dev, name, config, tensors, contract, stock_parts, label, lens, seed, ci) -> dict:
    import torch

    from aligned_mamba.models import build_model
    from benchmarks.bench_h200 import cuda_times
    from benchmarks.bench_model_h200 import Stock

    cuda = dev.type == "cuda"
    S, T = len(lens), lens[0]
    e = {"shape": name, "label": label, "tokens": S * T, "sequences": S, "ours_ms": None, "stock_ms": None,
         "ratio": None, "ours_peak_bytes": None, "stock_peak_bytes": None}
    g = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (S, T), device=dev, generator=g)
    targets = torch.randint(0, config.vocab_size, (S, T), device=dev, generator=g)
    seqs, tgts = list(ids), list(targets)
    leaves = {k: v.detach().requires_grad_() for k, v in tensors.items()}
    names = sorted(leaves)
    n = 1 if args.dry_run else (2 if args.quick else 4)

    def ours_step(_i=0):
        loss, _ = ours_loss(build_model(config, leaves, contract, device=dev), seqs, tgts)
        return torch.autograd.grad(loss, [leaves[k] for k in names])

    def measure(step, prefix):
        t0 = time.perf_counter()
        first = step()
        if cuda:
            torch.cuda.synchronize()
        e[f"{prefix}_first_call_s"] = time.perf_counter() - t0
        del first
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            grads = step()
            torch.cuda.synchronize()
            e[f"{prefix}_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
            e[f"{prefix}_peak_above_weights_bytes"] = e[f"{prefix}_peak_bytes"] - base
            del grads
            ts = cuda_times(torch, lambda i: step(), n, 0)
            e[f"{prefix}_ms"] = statistics.median(ts)
            e[f"{prefix}_times_ms"] = ts
            e[f"{prefix}_tokens_per_s"] = S * T / (e[f"{prefix}_ms"] * 1e-3)

    ours_grads = None
    try:
        with torch.no_grad():
            plain = build_model(config, tensors, contract, device=dev).forward(seqs, packed=True)
        model = build_model(config, leaves, contract, device=dev)
        loss, logits = ours_loss(model, seqs, tgts)
        e["ours_grad_mode_logits_equal"] = torch.equal(logits.detach(), plain)
        del plain, logits
        ours_grads = torch.autograd.grad(loss, [leaves[k] for k in names])
        del loss, model
        again = ours_step()
        differ = [k for k, u, v in zip(names, ours_grads, again) if not torch.equal(u, v)]
        e["ours_grads_repeat_equal"] = not differ
        e["ours_grads_repeat_differ"] = differ
        del again
        measure(ours_step, "ours")
        if args.profile and cuda and ci == 0:
            e["ours_profile"] = profile(ours_step)
    except Exception as exc:  # noqa: BLE001 - a failed cell is a result; the others still run
        e["ours_error"] = f"{type(exc).__name__}: {exc}"
        log(traceback.format_exc())
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    scan, ssu = stock_parts
    if scan is not None:
        try:
            stock = Stock(config, leaves, scan, ssu)

            def stock_step(_i=0):
                loss, _ = stock_loss(stock, leaves, ids, targets)
                return torch.autograd.grad(loss, [leaves[k] for k in names])

            stock_grads = stock_step()
            if ours_grads is not None:
                errs = {k: rel_err(u, v) for k, u, v in zip(names, ours_grads, stock_grads)}
                worst = max(errs, key=errs.get)
                e["grads_vs_stock_rel_err_median"] = statistics.median(errs.values())
                e["grads_vs_stock_rel_err_max"] = {"tensor": worst, "rel_err": errs[worst]}
            del stock_grads
            measure(stock_step, "stock")
        except Exception as exc:  # noqa: BLE001
            e["stock_error"] = f"{type(exc).__name__}: {exc}"
            log(traceback.format_exc())
    del ours_grads
    if e["ours_ms"] and e["stock_ms"]:
        e["ratio"] = e["ours_ms"] / e["stock_ms"]
    if e["ours_peak_bytes"] and e["stock_peak_bytes"]:
        e["peak_ratio"] = e["ours_peak_bytes"] / e["stock_peak_bytes"]
    return e


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="2 timed steps per cell instead of 4")
    ap.add_argument("--dry-run", action="store_true", help="CPU: Triton interpreter, tiny fp32 shapes, no timing")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--cells", default=None, help="comma-separated subset of 4x2048,1x16384")
    ap.add_argument("--profile", action="store_true", help="also profile one of ours' steps (first cell)")
    args = ap.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    sys.path.insert(0, str(ROOT))
    import torch
    import triton

    from aligned_mamba import Contract
    from benchmarks.bench_h200 import git_commit
    from benchmarks.bench_model_h200 import SHAPES as MODEL_SHAPES
    from benchmarks.bench_model_h200 import TINY_SHAPES, device_weights, load_stock, make_config, retune_stock

    if not args.dry_run and not torch.cuda.is_available():
        log("no CUDA device: run with --dry-run on a CPU")
        return 2
    dev = torch.device("cpu" if args.dry_run else "cuda")
    shapes = dict(TINY_SHAPES) if args.dry_run else {k: MODEL_SHAPES[k] for k in args.shapes.split(",")}
    cells = TINY_TRAIN if args.dry_run else [c for c in TRAIN if args.cells is None or c[0] in args.cells.split(",")]
    chunk, dtype = (32, "float32") if args.dry_run else (256, "bfloat16")  # the interpreter computes bf16 wrongly
    contract = Contract(chunk_size=chunk, backend="triton", model_dtype=dtype)
    scan, ssu, stock_impl, stock_err = load_stock(args.dry_run)
    if stock_err:
        log(f"mamba_ssm not importable ({stock_err}): stock columns are null")
    result = {
        "gpu": torch.cuda.get_device_name(0) if not args.dry_run else "cpu (dry run)",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "commit": git_commit(),
        "script": SCRIPT, "argv": sys.argv[1:], "dry_run": args.dry_run, "quick": args.quick,
        "contract": contract.to_dict(), "stock": stock_impl, "stock_error": stock_err,
        "deterministic_note": "ours' backward has no atomics reductions (the embedding's gradient runs torch's "
                              "deterministic accumulation); torch.cumsum on CUDA has no deterministic kernel",
        "train": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for si, (name, spec) in enumerate(shapes.items()):
        config = make_config(spec, chunk, dtype)
        tensors = device_weights(config, dev, seed=4321 + si)
        if scan is not None and not args.dry_run:
            retune_stock()
        for ci, (label, lens) in enumerate(cells):
            log(f"{name} {label}")
            e = train_cell(args, dev, name, config, tensors, contract, (scan, ssu), label, lens,
                           seed=17 + 10 * si + ci, ci=ci)
            result["train"].append(e)
            out.write_text(json.dumps(result, indent=1))
            gib = 2 ** 30
            log(f"{name} {label}: ours {e['ours_ms']} ms, stock {e['stock_ms']} ms, ratio {e['ratio']}; peak "
                f"{(e['ours_peak_bytes'] or 0) / gib:.2f} / {(e['stock_peak_bytes'] or 0) / gib:.2f} GiB; grad-mode "
                f"logits equal {e.get('ours_grad_mode_logits_equal')}, repeat equal {e.get('ours_grads_repeat_equal')} "
                f"{e.get('ours_grads_repeat_differ', [])[:4]}; grads vs stock {e.get('grads_vs_stock_rel_err_max')}; "
                f"errors {e.get('ours_error')} {e.get('stock_error')}")
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        del tensors
    failed = [e for e in result["train"] if e.get("ours_error") or e.get("stock_error")
              or e.get("ours_grad_mode_logits_equal") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
