#!/usr/bin/env python3
"""The scan's backward kernels alone (``ops.ssd.triton_backward.chunk_scan_backward``) at a model's
layer shape, per kernel config, against mamba_ssm's ``mamba_chunk_scan_combined`` backward.

    PYTHONPATH=.:.anchors python3 benchmarks/bench_scan_backward_h200.py --out OUT/h200_scan_backward.json
    python3 benchmarks/bench_scan_backward_h200.py --dry-run --out /tmp/s.json   (CPU: interpreter, tiny shapes)

One layer of mamba2-1.3b's shape (H 64, P 64, G 1, N 128, chunk 256) at 4 x 2048 and 1 x 16384 tokens,
bf16 inputs. CUDA-event medians of ``chunk_scan_backward`` (the chunk-grid gradient, what
``ssd_backward`` adds around it is packing) for each (bwd_block_s, bwd_block_t, bwd_warps), and of
mamba_ssm's forward + backward minus its forward. Gradients of each config against the first
(relative norm), so a config that computes something else shows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--dry-run" in sys.argv:  # before triton is imported: its kernels are built for the interpreter then
    os.environ["TRITON_INTERPRET"] = "1"

from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.ssd.chunk import chunk_grid, pack_chunks  # noqa: E402
from aligned_mamba.ops.ssd.triton_backward import chunk_scan_backward  # noqa: E402
from benchmarks.gpu_validate import cuda_ms  # noqa: E402

CONFIGS = [(64, 64, 8), (64, 64, 4), (32, 64, 4), (64, 32, 4), (128, 64, 8), (64, 128, 8), (32, 32, 4)]


def timed(fn, reps: int = 10) -> float:
    """Median ms of ``fn``: CUDA events (``gpu_validate.cuda_ms``), or wall clock in the dry run."""
    if torch.cuda.is_available():
        return cuda_ms(fn, reps)
    import time

    out = []
    for _ in range(1):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU: the Triton interpreter at tiny shapes")
    args = ap.parse_args()
    global CONFIGS
    if args.dry_run:
        dev = torch.device("cpu")
        H, P, G, N, L = 4, 16, 1, 16, 32
        cells, CONFIGS = ([64, 40],), [(16, 16, 4), (32, 16, 4)]
    else:
        dev = torch.device("cuda")
        H, P, G, N, L = 64, 64, 1, 128, 256
        cells = ([2048] * 4, [16384])
    res = {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (dry run)",
           "torch": torch.__version__, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "commit": os.environ.get("GIT_COMMIT"), "shape": dict(H=H, P=P, G=G, N=N, chunk=L), "cells": []}
    for lens in cells:
        T, S = sum(lens), len(lens)
        g = torch.Generator(device=dev).manual_seed(0)
        bf = torch.bfloat16
        x = torch.randn(T, H, P, device=dev, generator=g).to(bf)
        dt = (torch.rand(T, H, device=dev, generator=g) * 3 - 4).to(bf)
        B = torch.randn(T, G, N, device=dev, generator=g).to(bf)
        C = torch.randn(T, G, N, device=dev, generator=g).to(bf)
        A = -torch.exp(torch.rand(H, device=dev, generator=g) * 2.7)
        D = torch.randn(H, device=dev, generator=g)
        bias = torch.randn(H, device=dev, generator=g) * 0.5
        gy = torch.randn(T, H, P, device=dev, generator=g).to(bf)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev)
        ch = pack_chunks(x, dt, B, cu, L, bias, (0.0, math.inf))
        NC = ch.x.shape[0]
        Cc = torch.zeros(NC, G, L, N, device=dev)
        Cc[ch.row_chunk, :, ch.row_pos] = C.float()
        dyc = torch.zeros(NC, H, L, P, device=dev)
        dyc[ch.row_chunk, :, ch.row_pos] = gy.float()
        h0 = torch.zeros(S, H, P, N, device=dev)
        grid = chunk_grid(cu.cpu(), None, L, dev)
        cell = {"tokens": T, "sequences": S, "ours": []}
        first = None
        for bs, bt, w in CONFIGS:
            cfg = TritonKernelConfigs(bwd_block_s=bs, bwd_block_t=bt, bwd_warps=w)
            try:
                # the interpreter runs the fp32 dots only (bf16 tensor-core dots need the GPU)
                run = lambda: chunk_scan_backward(ch, Cc, A, D, h0, dyc, cfg, bf16_operands=not args.dry_run,  # noqa: E731
                                                  first=grid.first, count=grid.count)
                got = run()
                ms = timed(run)
                first = first or got
                errs = [rel(u, v) for u, v in zip(got, first)]
                cell["ours"].append({"bwd_block_s": bs, "bwd_block_t": bt, "bwd_warps": w, "ms": ms,
                                     "max_rel_vs_first": max(errs)})
                print(T, S, bs, bt, w, f"{ms:.3f} ms", f"{max(errs):.1e}", flush=True)
            except Exception as e:  # noqa: BLE001
                cell["ours"].append({"bwd_block_s": bs, "bwd_block_t": bt, "bwd_warps": w, "error": repr(e)[:300]})
                print(T, S, bs, bt, w, "error", repr(e)[:300], flush=True)
        try:
            if args.dry_run:
                raise RuntimeError("dry run: no mamba_ssm")
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


if __name__ == "__main__":
    main()
