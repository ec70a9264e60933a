#!/usr/bin/env python3
"""The scan's backward alone (``ops.ssd.triton_backward.ssd_backward``, what an advance's autograd runs)
at a model's layer shape, per launch choice, against mamba_ssm's ``mamba_chunk_scan_combined`` backward.

    PYTHONPATH=.:.anchors python3 benchmarks/bench_scan_backward_h200.py --out OUT/h200_scan_backward.json \
        [--best OUT/scan_bwd_best.json] [--shape 64,64,1,128] [--sweep chunk,state,round] [--no-stock]
    python3 benchmarks/bench_scan_backward_h200.py --dry-run --out /tmp/s.json   (CPU: interpreter, tiny shapes)

One layer of mamba2-1.3b's scan shape (H 64, P 64, G 1, N 128, chunk 256; ``--shape H,P,G,N``) at
4 x 2048 and 1 x 16384 tokens, bf16 inputs laid out as a trainer's packed rows (whole chunks: the
kernels read x and dy in place). CUDA-event medians of ``ssd_backward`` for:
- chunk: the chunk kernels' choices (dx, dcb, the states' rows), (bwd_block_s, bwd_block_t, warps,
  num_stages, heads a dcb / rows program sums), the chunk-state kernel as pinned;
- state: the chunk-state kernel's (BLOCK_K, BLOCK_P, BLOCK_N, warps, num_stages), the chunk kernels
  as the fastest of the first sweep at the first cell that keeps the contract's blocks;
- vgrid: the pinned launch with the chunk-state dots reading B and C from fp32 chunk grids (copies)
  against reading the packed rows in place, the same bits;
- round: that best with ``bwd_bf16_dots = "round"`` (one MMA per fp32 operand, as mamba_ssm; not the
  contract's: what its precision would buy, for the record);
- accuracy: each gradient's relative error (norm) at the pinned launch with "split2" and with "round",
  and mamba_ssm's, against the same backward with fp32 operands and fp32 FMA dots (the same bf16
  input values; that reference is within ~1e-6 of fp64), with the two modes' times;
and mamba_ssm's forward + backward minus its forward. Every variant's gradients against the first's
(relative norm: a variant that computes something else shows) and two calls of it bit for bit.
``--best`` writes the fastest module knobs that keep the contract's block sizes (summed over both
cells), as ``bench_mamba_ssm_h200.py --scan-bwd`` reads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--dry-run" in sys.argv:  # before triton is imported: its kernels are built for the interpreter then
    os.environ["TRITON_INTERPRET"] = "1"

from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.ssd import triton_backward as ta  # noqa: E402
from aligned_mamba.ops.ssd.chunk import chunk_grid  # noqa: E402
from benchmarks.bench_mamba_ssm_h200 import kernel_table  # noqa: E402
from benchmarks.gpu_validate import cuda_ms  # noqa: E402

# (bwd_block_s, bwd_block_t, warps, num_stages or None for Triton's default, heads a dcb / state-rows program
# sums[, heads a state-rows program sums]); --chunks replaces the list ("64/64/4/2/64/16,..."; 0 for None)
CHUNK = [(64, 64, 4, 2, 16), (64, 64, 8, 2, 16), (64, 64, 4, None, 16), (64, 64, 8, None, 16), (64, 64, 8, 1, 16),
         (64, 64, 4, 2, 64), (64, 64, 8, 2, 64), (64, 64, 4, 2, 4), (64, 64, 8, 2, 4), (32, 64, 8, 2, 16),
         (64, 32, 8, 2, 16), (128, 64, 8, 2, 16), (64, 128, 8, 2, 16)]
# (BLOCK_K, BLOCK_P, BLOCK_N, warps or None for bwd_warps, num_stages or None); the state sweep runs all but
# the first (the launch before the sweep at 7d94dca). A variant whose two calls differ is never picked
# (3 and 4 stages gave non-repeatable garbage on the H200, benchmarks/README.md).
STATE = [(64, 64, 64, 8, None), (32, 64, 128, 4, None), (64, 64, 128, 4, None), (32, 64, 64, 4, None),
         (64, 64, 128, 8, None), (32, 64, 128, 4, 2)]


def timed(fn, reps: int = 10) -> float:
    """Median ms of ``fn``: CUDA events, or wall clock in the dry run."""
    if torch.cuda.is_available():
        return cuda_ms(fn, reps, warmup=2)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def knobs(chunk: tuple, state: tuple) -> dict:
    bs, bt, w, st, hpp, *rows = chunk
    k, p, n, sw, ss = state
    so = {"BLOCK_K": k, "BLOCK_P": p, "BLOCK_N": n}
    so.update({"num_warps": sw} if sw else {})
    so.update({"num_stages": ss} if ss else {})
    launch = dict({"num_warps": w}, **({"num_stages": st} if st else {}))
    return {"bwd_block_s": bs, "bwd_block_t": bt, "BWD_OPTS": launch, "BWD_HEADS_PER_PROGRAM": hpp,
            "BWD_ROWS_HEADS_PER_PROGRAM": rows[0] if rows else hpp, "STATE_OPTS": so}


def apply(k: dict) -> None:
    ta.BWD_OPTS = dict(k["BWD_OPTS"])
    ta.BWD_HEADS_PER_PROGRAM = k["BWD_HEADS_PER_PROGRAM"]
    ta.BWD_ROWS_HEADS_PER_PROGRAM = k.get("BWD_ROWS_HEADS_PER_PROGRAM", k["BWD_HEADS_PER_PROGRAM"])
    ta.STATE_OPTS = dict(k["STATE_OPTS"])


GRADS = ("dx", "ddt", "dB", "dC", "dA", "dD", "ddt_bias")


def accuracy(call, pinned: TritonKernelConfigs, inputs: tuple, S: int, L: int, no_stock: bool) -> dict:
    """Each gradient's relative error against fp32 operands and FMA dots, per bf16 dot mode and for
    mamba_ssm; with each mode's ms."""
    x, dt, B, C, A, D, bias, gy = inputs
    t0 = time.perf_counter()

    def progress(what: str) -> None:  # a step cut at its limit still shows how far the sweep got
        print(f"accuracy: {what} at {time.perf_counter() - t0:.0f} s", flush=True)

    ref = call(pinned, x=x.float(), dt=dt.float(), B=B.float(), C=C.float(), gy=gy.float())
    progress("the fp32 reference")
    out: dict = {}
    for mode in ("split2", "round"):
        cfg = dataclasses.replace(pinned, bwd_bf16_dots=mode)
        got = call(cfg)
        out[mode] = {n: rel(u, r) for n, u, r in zip(GRADS, got, ref)}
        out[mode]["ms"] = timed(lambda c=cfg: call(c))
        progress(mode)
    if not no_stock:
        progress("mamba_ssm next (its Triton autotuning first)")
        try:
            # mamba_ssm's package imports Mamba1's CUDA extension, unbuilt here and unused by the SSD scan
            sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

            Tq = x.shape[0] // S
            leaves = [t.view(S, Tq, *t.shape[1:]).clone().requires_grad_() for t in (x, dt, B, C)]
            leaves += [t.clone().requires_grad_() for t in (A, D, bias)]
            y = mamba_chunk_scan_combined(leaves[0], leaves[1], leaves[4], leaves[2], leaves[3], L, D=leaves[5],
                                          dt_bias=leaves[6], dt_softplus=True)
            y = y[0] if isinstance(y, tuple) else y
            grads = torch.autograd.grad(y, [leaves[i] for i in (0, 1, 2, 3, 4, 5, 6)], gy.view(y.shape))
            out["mamba_ssm"] = {n: rel(u.reshape(r.shape), r) for n, u, r in zip(GRADS, grads, ref)}
        except Exception as e:  # noqa: BLE001
            out["mamba_ssm_error"] = repr(e)[:300]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--best", help="write the fastest knobs at the contract's block sizes here")
    ap.add_argument("--shape", default="64,64,1,128", help="H,P,G,N")
    ap.add_argument("--sweep", default="chunk,state,round")
    ap.add_argument("--no-stock", action="store_true", help="skip mamba_ssm's scan (its autotuning takes a while)")
    ap.add_argument("--chunks", help="the chunk sweep's launches, bs/bt/warps/stages/hpp[/rpp],... (0 stages: "
                    "Triton's default)")
    ap.add_argument("--states", help="the state sweep's launches, k/p/n/warps/stages,... (0: the default), after "
                    "the pinned one")
    ap.add_argument("--cells", default="4x2048,1x16384", help="sequences x length, of 4x2048 and 1x16384")
    ap.add_argument("--dry-run", action="store_true", help="CPU: the Triton interpreter at tiny shapes")
    args = ap.parse_args()
    sweeps = set(args.sweep.split(","))
    chunk_list, state_list = CHUNK, STATE
    if args.chunks:
        chunk_list = [tuple(int(v) or None for v in c.split("/")) for c in args.chunks.split(",")]
    if args.states:
        so = ta.STATE_OPTS
        pinned_state = (so["BLOCK_K"], so["BLOCK_P"], so["BLOCK_N"], so.get("num_warps"), so.get("num_stages"))
        state_list = [pinned_state] + [tuple(int(v) or None for v in c.split("/")) for c in args.states.split(",")]
    pinned = TritonKernelConfigs()
    if args.dry_run:
        dev, dtype = torch.device("cpu"), torch.float32  # the interpreter runs the fp32 dots only
        H, P, G, N, L = 4, 16, 1, 16, 32
        cells = ([32, 32],)
        chunk_list = [(16, 16, 4, None, 1), (16, 16, 4, None, 2)]
        state_list = [(16, 16, 16, None, None), (32, 16, 16, 4, None)]
        pinned = TritonKernelConfigs(bwd_block_s=16, bwd_block_t=16)
    else:
        dev, dtype = torch.device("cuda"), torch.bfloat16
        H, P, G, N = map(int, args.shape.split(","))
        L = 256
        cells = tuple(lens for key, lens in (("4x2048", [2048] * 4), ("1x16384", [16384]))
                      if key in args.cells.split(","))
    res = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (dry run)",
           "torch": torch.__version__, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "commit": os.environ.get("GIT_COMMIT"), "shape": dict(H=H, P=P, G=G, N=N, chunk=L), "cells": []}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        pass
    so = ta.STATE_OPTS  # the chunk sweep runs at the pinned chunk-state launch
    base_state = (so["BLOCK_K"], so["BLOCK_P"], so["BLOCK_N"], so.get("num_warps"), so.get("num_stages"))
    totals: dict[str, float] = {}
    variants: dict[str, dict] = {}

    def run_variant(cell: dict, tag: str, k: dict, cfg: TritonKernelConfigs, call) -> None:
        apply(k)
        try:
            got = call(cfg)
            same = all(torch.equal(u, v) for u, v in zip(got, call(cfg)) if u is not None)
            ms = timed(lambda: call(cfg))
            # the kernels' own time (one call under torch.profiler): at 4 x 2048 the call is near the host's
            kernels = kernel_table(torch, lambda: call(cfg), top=40) if dev.type == "cuda" else None
            first = cell.setdefault("_first", got)
            err = max(rel(u, v) for u, v in zip(got, first) if u is not None)
            kms = kernels["device_total_ms"] if kernels else None
            cell["ours"].append({"variant": tag, "knobs": k, "bwd_bf16_dots": cfg.bwd_bf16_dots, "ms": ms,
                                 "kernels_ms": kms, "kernels": kernels and kernels["kernels"],
                                 "max_rel_vs_first": err, "repeat_equal": same})
            if cfg.bwd_bf16_dots == pinned.bwd_bf16_dots and same:
                totals[tag] = totals.get(tag, 0.0) + ms
                variants[tag] = k
            print(cell["tokens"], tag, f"{ms:.3f} ms", f"kernels {kms or 0:.3f} ms", f"rel {err:.1e}", "repeat", same,
                  flush=True)
        except Exception as e:  # noqa: BLE001
            cell["ours"].append({"variant": tag, "knobs": k, "error": repr(e)[:300]})
            print(cell["tokens"], tag, "error", repr(e)[:300], flush=True)
        torch.cuda.empty_cache() if dev.type == "cuda" else None

    for lens in cells:
        T, S = sum(lens), len(lens)
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(T, H, P, device=dev, generator=g).to(dtype)
        dt = (torch.rand(T, H, device=dev, generator=g) * 3 - 4).to(dtype)
        B = torch.randn(T, G, N, device=dev, generator=g).to(dtype)
        C = torch.randn(T, G, N, device=dev, generator=g).to(dtype)
        A = -torch.exp(torch.rand(H, device=dev, generator=g) * 2.7)
        D = torch.randn(H, device=dev, generator=g)
        bias = torch.randn(H, device=dev, generator=g) * 0.5
        gy = torch.randn(T, H, P, device=dev, generator=g).to(dtype)
        h0 = torch.zeros(S, H, P, N, device=dev)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        off = torch.zeros(S, dtype=torch.int64)
        grid = chunk_grid(cu, off, L, dev)

        def call(cfg, x=x, dt=dt, B=B, C=C, A=A, D=D, bias=bias, h0=h0, gy=gy, cu=cu, off=off, grid=grid):
            return ta.ssd_backward(x, dt, B, C, A, D, bias, h0, None, None, None, gy, (True,) * 8, cu, off.to(dev),
                                   grid, None, L, (0.0, math.inf), cfg)

        cell = {"tokens": T, "sequences": S, "ours": []}
        if "accuracy" in sweeps:
            inputs = (x, dt, B, C, A, D, bias, gy)
            cell["accuracy"] = accuracy(call, pinned, inputs, S, L, args.no_stock or args.dry_run)
            print(T, "accuracy", json.dumps(cell["accuracy"]), flush=True)
        if "chunk" in sweeps:
            for c in chunk_list:
                tag = f"chunk bs{c[0]} bt{c[1]} w{c[2]} st{c[3]} hpp{c[4]}" + (f" rpp{c[5]}" if len(c) > 5 else "")
                k = knobs(c, base_state)
                run_variant(cell, tag, k, TritonKernelConfigs(bwd_block_s=c[0], bwd_block_t=c[1]), call)
        if lens is cells[0]:  # the chunk kernels' pick, from the first cell, for every cell's state sweep
            same_blocks = [t for t in totals if t.startswith("chunk ") and variants[t]["bwd_block_s"] ==
                           pinned.bwd_block_s and variants[t]["bwd_block_t"] == pinned.bwd_block_t]
            best_chunk = min(same_blocks, key=totals.get) if same_blocks else None
        if "vgrid" in sweeps:  # the chunk-state dots reading B and C from fp32 grids, as before they read the rows
            weighted = ta._weighted_states
            ta._weighted_states = lambda u, v, *a: weighted(u, v.float().contiguous(), *a)
            try:
                run_variant(cell, "v fp32 grid | pinned", knobs(chunk_list[0], base_state), pinned, call)
            finally:
                ta._weighted_states = weighted
            run_variant(cell, "v rows | pinned", knobs(chunk_list[0], base_state), pinned, call)
        if "state" in sweeps:
            for s_ in state_list[1:]:
                ck = variants[best_chunk] if best_chunk else knobs(chunk_list[0], base_state)
                k = dict(ck, STATE_OPTS=knobs(chunk_list[0], s_)["STATE_OPTS"])
                tag = f"state k{s_[0]} p{s_[1]} n{s_[2]} w{s_[3]} st{s_[4]} | {best_chunk}"
                run_variant(cell, tag, k, pinned, call)
        if "round" in sweeps and best_chunk:
            run_variant(cell, "round | " + best_chunk, variants[best_chunk],
                        TritonKernelConfigs(bwd_bf16_dots="round"), call)
        cell.pop("_first", None)
        try:
            if args.dry_run or args.no_stock:
                raise RuntimeError("dry run or --no-stock: no mamba_ssm")
            sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

            Tq = T // S  # equal lengths: the batch layout the stock step uses
            xs, dts, Bs, Cs = (t.view(S, Tq, *t.shape[1:]).clone().requires_grad_() for t in (x, dt, B, C))
            As, Ds, bs_ = (t.clone().requires_grad_() for t in (A, D, bias))

            def fwd():
                return mamba_chunk_scan_combined(xs, dts, As, Bs, Cs, L, D=Ds, dt_bias=bs_, dt_softplus=True)

            def fwd_bwd():
                y = fwd()
                y = y[0] if isinstance(y, tuple) else y
                torch.autograd.backward(y, gy.view(y.shape))

            f_ms, fb_ms = timed(lambda: fwd()), timed(fwd_bwd)
            cell["mamba_ssm"] = {"fwd_ms": f_ms, "fwd_bwd_ms": fb_ms, "bwd_ms": fb_ms - f_ms}
            print(T, S, "mamba_ssm fwd", f"{f_ms:.3f}", "fwd+bwd", f"{fb_ms:.3f}", flush=True)
        except Exception as e:  # noqa: BLE001
            cell["mamba_ssm_error"] = repr(e)[:300]
            print("mamba_ssm error", repr(e)[:300], flush=True)
        res["cells"].append(cell)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    # the fastest over both cells, among the variants run at both and at the contract's blocks
    n_cells = len(cells)
    full = {t: v for t, v in totals.items() if sum(1 for c in res["cells"] for o in c["ours"]
                                                  if o.get("variant") == t and o.get("repeat_equal")) == n_cells
            and variants[t]["bwd_block_s"] == pinned.bwd_block_s and variants[t]["bwd_block_t"] == pinned.bwd_block_t}
    res["totals_ms"] = totals
    if full:
        best = min(full, key=full.get)
        res["best"] = {"variant": best, "knobs": variants[best], "total_ms": full[best]}
        print("best", best, f"{full[best]:.3f} ms over the cells", flush=True)
        if args.best:
            with open(args.best, "w") as f:
                json.dump(variants[best], f, indent=1)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
