#!/usr/bin/env python3
"""The row-parallel tree GEMM at TP 1 against today's GEMM, on one GPU.

    python3 benchmarks/bench_tree_gemm_h200.py --out OUT/h200_tree_gemm.json [--deadline-s 200]
    python3 benchmarks/bench_tree_gemm_h200.py --dry-run --out /tmp/tree.json    (CPU: interpreter, tiny)

Shapes: the row-parallel layers (out_proj of mamba2-1.3b and -2.7b, Nemotron-H-8B's Mamba2 out_proj,
attention o_proj and MLP fc2), bf16, no bias, M in {1, 64, 256, 2048, 8192}. Per cell: today's GEMM
(``linear_triton``, S = 1) and the tree GEMM at TP 1 (``linear_tree_triton``: S = 2, 4, 8 slices,
the whole tree and one rounding in one launch), pinned configs. Times: GPU time per call from
CUDA-graph replays (as bench_ops_h200.py: the graph cycles through copies of the weight, >= 180 MB in
all, so weights come from DRAM as in a model; medians of 12 trials; the two forms timed twice,
alternating, the faster of each kept); ``ratio`` = tree / today's.
Bits, per cell: TP 2, 4 .. S (each rank's launch over its K columns, its fp32 subtree, the tree's top
in torch) against TP 1, ``torch.equal``; a stock all-reduce of TP 2's rounded partials against TP 1
(expected to differ). In every cell the other loop form (``linear_tree_flatten``) and the other stack
(``linear_tree_global_stack``: in registers, or in global memory at today's tile) are timed too, at
every M the split-slices grid (``linear_tree_split_grid_max_m``: a program per tile and slice, the
last to finish joining the partials), and at M >= 2048 a plain grid for the persistent one and
today's GEMM at the tree's tile (what the tile alone costs), each checked for the pinned configs'
bits. JSON: GPU, versions, commit, date, configs, cells; written after every shape, so a cut run
keeps what finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_h200 import git_commit  # noqa: E402
from benchmarks.bench_ops_h200 import ROTATE_BYTES, graph_replay_ms  # noqa: E402

SHAPES = [  # (name, K, N): x [M, K] @ w [N, K]^T
    ("1.3b.out_proj", 4096, 2048), ("2.7b.out_proj", 5120, 2560), ("8b.o_proj", 4096, 4096), ("8b.fc2", 21504, 4096),
    ("8b.out_proj", 8192, 4096),
]
TINY = [("tiny.out_proj", 256, 48)]
MS = [1, 64, 256, 2048, 8192]
SLICES = [2, 4, 8]
SPLIT_MAX_M = 8192  # the split grid's variant: every M (its fp32 scratch is S x M x N)


def log(msg: str) -> None:
    print(f"[tree {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def graph_ms(torch, fns, cuda: bool, trials: int = 12) -> float:
    """GPU ms per call: ``fns`` captured in one CUDA graph, replayed; median over trials. On a CPU
    (dry run) one wall-clock pass."""
    if not cuda:
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) * 1e3 / len(fns)
    return graph_replay_ms(torch, fns, trials=trials, max_inner=100)


def _warm(job: tuple) -> None:
    """Compile (into the shared Triton cache) the kernels of one cell: every launch the cell makes."""
    import torch

    from aligned_mamba.ops.configs import TritonKernelConfigs
    from aligned_mamba.ops.linear import triton as lt
    from aligned_mamba.ops.linear import triton_tree as tt

    K, N, M, variants = job
    cfg = TritonKernelConfigs()
    x = torch.zeros(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.zeros(N, K, device="cuda", dtype=torch.bfloat16)
    lt.linear_triton(x, w, None, cfg)
    for kl in (K // 2,):
        lt.linear_triton(x[:, :kl], w[:, :kl].contiguous(), None, cfg)
    for s in SLICES:
        for c in [cfg, *(dataclasses.replace(cfg, **v) for v in variants)]:
            tt.linear_tree_triton(x, w, None, s, torch.bfloat16, c)
        size = 2
        while size <= s:
            kl = K // size
            tt.linear_tree_triton(x[:, :kl], w[:, :kl].contiguous(), None, s // size, torch.float32, cfg)
            size *= 2
        if M <= SPLIT_MAX_M:
            tt.linear_tree_triton(x, w, None, s, torch.bfloat16, cfg, split=True)
        if M >= 2048:  # the plain grid and today's GEMM at the tree's tile
            p = tt.tree_plan(M, w, s, cfg, sms=lt._num_sms(x.device))
            tt.linear_tree_triton(x, w, None, s, torch.bfloat16, cfg, tiles=dataclasses.replace(p, persistent=False))
            lt.linear_triton(x, w, None, cfg, tiles=p)
    torch.cuda.synchronize()


def warm(shapes, ms_list, variant_fields, procs: int) -> None:
    """Every cell's kernels compiled by ``procs`` processes at once (the timing process then finds them
    in the cache): compiling is most of a cold run."""
    import multiprocessing

    jobs = [(K, N, M, variant_fields) for _, K, N in shapes for M in ms_list]
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        pool.map(_warm, jobs, chunksize=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, a tiny shape")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="stop starting shapes after this many seconds")
    ap.add_argument("--shapes", default="", help="comma-separated names (default: all)")
    ap.add_argument("--warm", type=int, default=0, help="compile every kernel first in this many processes")
    ap.add_argument("--no-tile-variants", action="store_true", help="time only the other loop form")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    t0 = time.time()
    import torch
    import triton

    from aligned_mamba.ops.configs import TritonKernelConfigs
    from aligned_mamba.ops.linear import triton as lt
    from aligned_mamba.ops.linear import triton_tree as tt
    from aligned_mamba.ops.logprobs.sliced import pair_tree

    cuda = torch.cuda.is_available() and not args.dry_run
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter computes bf16 wrongly
    cfg = TritonKernelConfigs()
    fields = {"flatten": dict(linear_tree_flatten=not cfg.linear_tree_flatten),
              "global_stack": dict(linear_tree_global_stack=not cfg.linear_tree_global_stack),
              "level0": dict(linear_tree_global_stack=True,
                             linear_tree_global_stack_level0=not cfg.linear_tree_global_stack_level0)}
    variants = {k: dataclasses.replace(cfg, **v) for k, v in fields.items()}
    shapes = TINY if args.dry_run else SHAPES
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    ms_list = [1, 16, 40] if args.dry_run else MS
    res: dict = dict(
        gpu=torch.cuda.get_device_name() if cuda else "cpu (interpreter dry run)",
        torch=torch.__version__, triton=triton.__version__, commit=git_commit(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        configs=dataclasses.asdict(cfg), dtype=str(dtype), cells=[],
        method="CUDA-graph replay, weights rotated through >= 180 MB of copies, median of 12 trials, "
               "today's and the tree timed twice alternating, the faster kept; bits by torch.equal")

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(args.out)

    if cuda:
        # the split grid's tile counters for the graphs' capture stream, allocated (zeroed) before any
        # capture: a capture that finds none captures a memset with each call, which would be timed
        with torch.cuda.stream(torch.cuda.graph(torch.cuda.CUDAGraph()).capture_stream):
            tt.tile_counters(dev, 1 << 16)
    if cuda and args.warm > 1:
        try:
            warm(shapes, ms_list, list(fields.values()), args.warm)
            log(f"compiled in {time.time() - t0:.0f} s")
        except Exception as e:  # the timing loop compiles what is missing
            log(f"warm-up failed ({type(e).__name__}: {e}); compiling in the run")
    for name, K, N in shapes:
        if time.time() - t0 > args.deadline_s:
            log(f"deadline: {name} and after not run")
            res.setdefault("not_run", []).append(name)
            continue
        g = torch.Generator(device=dev).manual_seed(0)
        n_w = max(2, min(64, -(-ROTATE_BYTES // (N * K * 2)))) if cuda else 1
        ws = [(torch.randn(N, K, device=dev, generator=g) / K ** 0.5).to(dtype) for _ in range(n_w)]
        xa = torch.randn(max(ms_list), K, device=dev, generator=g).to(dtype)
        for M in ms_list:
            x = xa[:M]
            cell: dict = dict(shape=name, K=K, N=N, M=M)

            def today(w, x=x):
                return lt.linear_triton(x, w, None, cfg)

            def tree(w, s, c=cfg, x=x):
                return tt.linear_tree_triton(x, w, None, s, dtype, c)

            # bits first (compiles every kernel before the timing)
            w0 = ws[0]
            ones = {s: tree(w0, s) for s in SLICES}
            tp_ok = True
            for s in SLICES:
                size = 2
                while size <= s:
                    kl = K // size
                    subs = [tt.linear_tree_triton(x[:, r * kl:(r + 1) * kl], w0[:, r * kl:(r + 1) * kl].contiguous(),
                                                  None, s // size, torch.float32, cfg) for r in range(size)]
                    tp_ok &= torch.equal(pair_tree(torch.stack(subs, -1)).to(dtype), ones[s])
                    size *= 2
            cell["tp_k_equals_tp1"] = bool(tp_ok)
            kl = K // 2
            stock = (lt.linear_triton(x[:, :kl], w0[:, :kl].contiguous(), None, cfg)
                     + lt.linear_triton(x[:, kl:], w0[:, kl:].contiguous(), None, cfg))
            cell["stock_tp2_rows_differing"] = int((stock != ones[8]).any(dim=1).sum())
            base = today(w0)
            cell["s8_rows_differing_from_today"] = int((base != ones[8]).any(dim=1).sum())
            # times: today's and each S, twice alternating
            t_today, t_tree = [], {s: [] for s in SLICES}
            for _ in range(2 if cuda else 1):
                t_today.append(graph_ms(torch, [lambda w=w: today(w) for w in ws], cuda))
                for s in SLICES:
                    t_tree[s].append(graph_ms(torch, [lambda w=w, s=s: tree(w, s) for w in ws], cuda))
            cell["today_ms"] = min(t_today)
            cell["today_plan"] = dataclasses.asdict(lt.plan(M, w0, cfg, sms=lt._num_sms(dev)))
            for s in SLICES:
                cell[f"s{s}_ms"] = min(t_tree[s])
                cell[f"s{s}_ratio"] = round(min(t_tree[s]) / cell["today_ms"], 4)
                p = tt.tree_plan(M, w0, s, cfg, sms=lt._num_sms(dev))
                cell[f"s{s}_tile"] = f"{p.block_m}x{p.block_n} w{p.num_warps} s{p.num_stages} " \
                                     f"{'persistent' if p.persistent else 'grid'}"
            big = M >= (2048 if cuda else 40)  # the dry run passes every branch
            for vname, vcfg in variants.items():
                for s in SLICES:
                    y = tt.linear_tree_triton(x, w0, None, s, dtype, vcfg)
                    t = graph_ms(torch, [lambda w=w, s=s, c=vcfg: tree(w, s, c) for w in ws], cuda)
                    p = tt.tree_plan(M, w0, s, vcfg, sms=lt._num_sms(dev))
                    cell[f"{vname}_s{s}"] = dict(ms=t, ratio=round(t / cell["today_ms"], 4),
                                                 same_bits=bool(torch.equal(y, ones[s])),
                                                 tile=f"{p.block_m}x{p.block_n} s{p.num_stages}")
            for s in SLICES if big and not args.no_tile_variants else ():
                p = dataclasses.replace(tt.tree_plan(M, w0, s, cfg, sms=lt._num_sms(dev)), persistent=False)
                y = tt.linear_tree_triton(x, w0, None, s, dtype, cfg, tiles=p)
                t = graph_ms(torch, [lambda w=w, s=s, p=p: tt.linear_tree_triton(x, w, None, s, dtype, cfg,
                                                                                  tiles=p) for w in ws], cuda)
                cell[f"grid_s{s}"] = dict(ms=t, ratio=round(t / cell["today_ms"], 4),
                                          same_bits=bool(torch.equal(y, ones[s])))
            for s in SLICES if M <= SPLIT_MAX_M else ():
                y = tt.linear_tree_triton(x, w0, None, s, dtype, cfg, split=True)
                t = graph_ms(torch, [lambda w=w, s=s: tt.linear_tree_triton(x, w, None, s, dtype, cfg, split=True)
                                     for w in ws], cuda)
                p = lt.plan(M, w0, cfg, sms=lt._num_sms(dev))
                cell[f"split_s{s}"] = dict(ms=t, ratio=round(t / cell["today_ms"], 4),
                                           same_bits=bool(torch.equal(y, ones[s])),
                                           tile=f"{p.block_m}x{p.block_n} s{p.num_stages} x {s} slices, "
                                                f"join {tt.join_block_n(p, s, cfg)} columns")
            for s in SLICES if big else ():
                p = tt.tree_plan(M, w0, s, cfg, sms=lt._num_sms(dev))
                if (p.block_m, p.block_n) != (cell["today_plan"]["block_m"], cell["today_plan"]["block_n"]):
                    t = graph_ms(torch, [lambda w=w, p=p: lt.linear_triton(x, w, None, cfg, tiles=p) for w in ws],
                                 cuda)
                    cell[f"today_at_tree_tile_s{s}"] = dict(ms=t, ratio=round(t / cell["today_ms"], 4))
            res["cells"].append(cell)
            log(f"{name} M={M}: today {cell['today_ms']:.4f} ms, "
                + ", ".join(f"S={s} {cell[f's{s}_ratio']:.3f}x" for s in SLICES)
                + "".join(f"; {v} " + ", ".join(f"{cell[f'{v}_s{s}']['ratio']:.3f}x" if f"{v}_s{s}" in cell
                                                  else "=" for s in SLICES)
                          for v in [*variants, "split", "grid", "today_at_tree_tile"]
                          if any(f"{v}_s{s}" in cell for s in SLICES))
                + f"; TP k == TP 1 {tp_ok}; stock TP 2 rows differing {cell['stock_tp2_rows_differing']}")
        del ws, xa
        save()
    cells = res["cells"]
    res["all_tp_k_equal_tp1"] = all(c["tp_k_equals_tp1"] for c in cells)
    res["max_ratio"] = {f"s{s}": max((c[f"s{s}_ratio"] for c in cells), default=None) for s in SLICES}
    res["over_1.05"] = [f"{c['shape']} M={c['M']} S={s}: {c[f's{s}_ratio']}x" for c in cells for s in SLICES
                        if c[f"s{s}_ratio"] > 1.05]
    for v in [*variants, "split", "grid"]:
        got = [c[f"{v}_s{s}"] for c in cells for s in SLICES if f"{v}_s{s}" in c]
        if got:
            res[f"{v}_max_ratio"] = max(g["ratio"] for g in got)
            res[f"{v}_all_same_bits"] = all(g["same_bits"] for g in got)
    # per cell and S the fastest form measured (pinned or a variant), and whether any is within 1.05x
    best = {}
    for c in cells:
        for s in SLICES:
            forms = {"pinned": c[f"s{s}_ratio"]}
            forms.update({v: c[f"{v}_s{s}"]["ratio"] for v in [*variants, "split", "grid"] if f"{v}_s{s}" in c})
            name = min(forms, key=forms.get)
            best[f"{c['shape']} M={c['M']} S={s}"] = f"{name} {forms[name]}"
    res["best_form"] = best
    res["elapsed_s"] = round(time.time() - t0, 1)
    save()
    log(f"max ratio {res['max_ratio']}; over 1.05x: {len(res['over_1.05'])} of {len(cells) * len(SLICES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
