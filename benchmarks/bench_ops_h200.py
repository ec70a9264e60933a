#!/usr/bin/env python3
"""The row-invariant GEMM and the fused ops on one GPU, against cuBLAS and unfused torch.

    python3 benchmarks/bench_ops_h200.py --out OUT/h200_ops.json [--quick] [--variants]
    python3 benchmarks/bench_ops_h200.py --dry-run --out /tmp/ops.json     (CPU: tiny shapes, interpreter)

GEMM: ``linear_triton`` (pinned configs) vs ``F.linear`` (cuBLAS) in bf16 at every linear layer of
mamba2-130m, -1.3b, -2.7b, a Nemotron-H-8B mixer and a 256k lm_head, M in {1, 64, 256, 2048, 8192}
(and 32768 for in_proj). Bits: for each shape, rows of calls of M rows against the same rows of a call
of 8192 rows (ours and cuBLAS's). Memory-bound sizes (M <= 256) report bytes moved (weight + x + y)
over the measured copy bandwidth. ``--variants`` also times other tile configs per M regime and
checks each gives the pinned config's bits.

Fused ops: add + RMSNorm (fp32 residual, bf16 x), gated RMSNorm, causal conv1d + SiLU (prefill and
decode), log_softmax and token logprobs, each against the project's torch op (ops/*.py) and a plain
torch composition, with their bytes over the copy bandwidth.

Times: GPU time per call from CUDA-graph replays (no host launch cost, as in a captured decode step);
a GEMM's graph cycles through copies of its weight (>= 180 MB in all) so that weights come from DRAM
as they do in a model, and ours and cuBLAS are each timed twice, alternating, the faster kept.
Eager times (``triton.testing.do_bench`` medians, L2 flushed, host launch cost included where it
exceeds the flush) are reported for M <= 256 and the fused ops, and ``host_us`` is the host time
per launch. JSON: GPU, torch/triton versions, commit, date, the configs; a short table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GEMM_SHAPES = [  # (name, K, N)
    ("130m.in_proj", 768, 3352), ("130m.out_proj", 1536, 768), ("130m.lm_head", 768, 50280),
    ("1.3b.in_proj", 2048, 8512), ("1.3b.out_proj", 4096, 2048), ("1.3b.lm_head", 2048, 50280),
    ("2.7b.in_proj", 2560, 10576), ("2.7b.out_proj", 5120, 2560),
    ("8b.in_proj", 4096, 18560), ("8b.out_proj", 8192, 4096), ("8b.lm_head", 4096, 131072),
    ("lm_head_256k", 4096, 256000),
]
TINY_SHAPES = [("tiny.in_proj", 64, 96), ("tiny.out_proj", 96, 64)]
# --variants: config overrides tried per regime (each checked for the pinned config's bits)
VARIANTS = {
    "decode": [dict(linear_fill_programs=0), dict(linear_decode_block_n=64), dict(linear_decode_stages=8),
               dict(linear_decode_tma=True),
               dict(linear_decode_block_m=64, linear_decode_tma=True, linear_decode_stages=6),
               dict(linear_decode_tma=True, linear_decode_persistent=True, linear_decode_programs_per_sm=2),
               dict(linear_decode_warps=8), dict(linear_decode_warps=8, linear_decode_stages=8),
               dict(linear_fill_programs=66), dict(linear_fill_programs=264),
               # deeper pipelines and fewer warps: a decode tile's bytes in flight per SM, its idle warps
               dict(linear_decode_stages=12), dict(linear_decode_stages=16), dict(linear_decode_warps=2),
               dict(linear_decode_warps=1), dict(linear_decode_warps=2, linear_decode_stages=12),
               dict(linear_decode_warps=1, linear_decode_stages=16), dict(linear_decode_block_n=32),
               dict(linear_decode_block_n=32, linear_decode_stages=12),
               dict(linear_decode_tma=True, linear_decode_stages=12),
               dict(linear_fill_programs=264, linear_decode_stages=12)],
    "mid": [dict(linear_fill_programs=0), dict(linear_mid_block_n=64, linear_mid_stages=6),
            dict(linear_mid_persistent=True),
            dict(linear_mid_persistent=True, linear_mid_block_n=64, linear_mid_stages=6),
            dict(linear_mid_persistent=True, linear_mid_block_m=128, linear_mid_warps=8, linear_mid_programs_per_sm=1),
            dict(linear_mid_tma=False, linear_mid_persistent=False, linear_mid_programs_per_sm=1),
            dict(linear_mid_persistent=True, linear_mid_programs_per_sm=2),
            dict(linear_mid_block_m=128, linear_mid_warps=8),
            dict(linear_mid_block_m=128, linear_mid_warps=8, linear_mid_stages=3),
            dict(linear_mid_block_m=128, linear_mid_block_n=256, linear_mid_warps=8, linear_mid_stages=3),
            dict(linear_mid_block_m=128, linear_mid_block_n=256, linear_mid_warps=8, linear_mid_stages=3,
                 linear_mid_persistent=True),
            dict(linear_mid_block_n=256, linear_mid_stages=3),
            dict(linear_mid_block_n=256, linear_mid_warps=8, linear_mid_stages=3),
            dict(linear_mid_block_m=128, linear_mid_block_n=64, linear_mid_stages=4),
            dict(linear_mid_block_m=256, linear_mid_warps=8, linear_mid_stages=3),
            dict(linear_mid_warps=8),
            dict(linear_mid_stages=8), dict(linear_mid_stages=12), dict(linear_mid_warps=2, linear_mid_stages=8),
            dict(linear_mid_warps=2, linear_mid_stages=12), dict(linear_mid_block_n=64, linear_mid_stages=10),
            dict(linear_decode_max_m=64), dict(linear_decode_max_m=64, linear_decode_block_n=32)],
    "large": [dict(linear_fill_programs=0), dict(linear_stages=4), dict(linear_block_n=128, linear_stages=4)],
}
# bytes of weight copies a graph cycles through, so that small weights come from DRAM as in a model
ROTATE_BYTES = 3 * 60 * 2 ** 20

def log(msg: str) -> None:
    print(f"[ops {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def git_commit() -> str | None:
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def graph_replay_ms(torch, fns, trials: int = 12, max_inner: int = 200) -> float:
    """GPU ms per call: all of ``fns`` (closures over distinct inputs) captured in one CUDA graph,
    replayed; median over ``trials`` of the replay time / len(fns). Each trial replays the graph
    enough times (at most ``max_inner``) to span about 2 ms, so event resolution does not dominate."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    inner = max(1, min(max_inner, int(2e-3 / max(time.perf_counter() - t, 1e-6))))
    times = []
    for _ in range(trials):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(inner):
            g.replay()
        en.record()
        en.synchronize()
        times.append(st.elapsed_time(en) / inner / len(fns))
    del g
    times.sort()
    return times[len(times) // 2]


class Bench:
    def __init__(self, torch, triton, dev, quick: bool, dry: bool) -> None:
        self.torch, self.triton, self.dev, self.quick, self.dry = torch, triton, dev, quick, dry

    def ms(self, fn) -> float:
        """Eager: median ms of fn() (CUDA events, L2 flushed before each call, host launch cost
        included where it exceeds the flush); one wall-clock call on a CPU."""
        if self.dev.type != "cuda":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        warm, rep = (5, 20) if self.quick else (25, 100)
        return float(self.triton.testing.do_bench(fn, warmup=warm, rep=rep, return_mode="median"))

    def graph_ms(self, fns) -> float:
        """GPU time per call: ``fns`` replayed in one CUDA graph (``graph_replay_ms``). No host launch cost."""
        if self.dev.type != "cuda":
            return self.ms(lambda: [f() for f in fns]) / len(fns)
        return graph_replay_ms(self.torch, fns, trials=5 if self.quick else 12, max_inner=200)

    def host_us(self, fn, n: int = 200) -> float:
        """Host time per call of fn (launches only, no synchronisation inside), microseconds."""
        torch = self.torch
        n = n if self.dev.type == "cuda" else 2
        fn()
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        return dt / n * 1e6


def ceilings(b: Bench) -> dict:
    torch = b.torch
    if b.dev.type != "cuda":
        return {"copy_gbps": None, "cublas_tflops": None}
    src = torch.randn(2 ** 29 // 2, device=b.dev)  # 1 GiB fp32
    dst = torch.empty_like(src)
    t = b.ms(lambda: dst.copy_(src))
    copy = 2 * src.numel() * 4 / t / 1e6
    a = torch.randn(8192, 8192, device=b.dev).to(torch.bfloat16)
    c = torch.randn(8192, 8192, device=b.dev).to(torch.bfloat16)
    tm = b.ms(lambda: a @ c)
    return {"copy_gbps": round(copy, 1), "cublas_tflops": round(2 * 8192 ** 3 / tm / 1e9, 1)}


def gemm_section(b: Bench, shapes, ms_list, res: dict, variants: bool, save, match: str | None = None) -> None:
    torch = b.torch
    F = torch.nn.functional
    from aligned_mamba.ops.configs import TritonKernelConfigs
    from aligned_mamba.ops.linear import triton as lt

    cfg = TritonKernelConfigs()
    cuda = b.dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    copy = res["ceilings"]["copy_gbps"]
    peak = res["ceilings"]["cublas_tflops"]
    for name, K, N in shapes:
        g = torch.Generator(device=b.dev).manual_seed(K + N)
        ms_here = list(ms_list) + ([32768] if name.endswith("in_proj") and cuda and 8192 in ms_list else [])
        ref_m = 8192 if cuda else max(ms_list)
        x = torch.randn(max(ms_here + [ref_m]), K, device=b.dev, generator=g).to(dtype)
        n_w = max(2, min(64, -(-ROTATE_BYTES // (N * K * 2)))) if cuda else 1
        ws = [(torch.randn(N, K, device=b.dev, generator=g) / K ** 0.5).to(dtype) for _ in range(n_w)]
        w = ws[0]
        # bits: rows of M-row calls against the same rows of one call of ref_m rows
        ours_full = lt.linear_triton(x[:ref_m], w, None, cfg)
        cub_full = F.linear(x[:ref_m], w)
        for M in [m for m in (1, 2, 7, 64, 256, 1000, 2048) if m < ref_m]:
            s = ref_m - M
            ours = lt.linear_triton(x[s:s + M], w, None, cfg)
            cub = F.linear(x[s:s + M], w)
            res["gemm_bits"].append(dict(shape=name, M=M, ref_M=ref_m,
                                         ours_rows_differ=int((ours != ours_full[s:]).any(1).sum()),
                                         cublas_rows_differ=int((cub != cub_full[s:]).any(1).sum())))
        del ours_full, cub_full
        for M in ms_here:
            xm = x[:M]
            wl = ws if M <= 2048 else ws[:2]
            # twice each, alternating, the faster kept: the first graph of a cell was seen to run slower
            t_ours, t_cub = float("inf"), float("inf")
            for _ in range(1 if variants else 2):
                t_ours = min(t_ours, b.graph_ms([lambda w=w: lt.linear_triton(xm, w, None, cfg) for w in wl]))
                t_cub = min(t_cub, b.graph_ms([lambda w=w: F.linear(xm, w) for w in wl]))
            p = lt.plan(M, w, cfg, sms=lt._num_sms(b.dev))
            e = dict(shape=name, K=K, N=N, M=M, ours_ms=round(t_ours, 5), cublas_ms=round(t_cub, 5),
                     ours_over_cublas=round(t_ours / t_cub, 3),
                     tiles=f"{p.block_m}x{p.block_n}x{p.block_k} w{p.num_warps} s{p.num_stages}"
                           + (" tma" if p.tma else " ptr")
                           + (f" persistent{p.programs_per_sm}" if p.persistent else ""),
                     ours_tflops=round(2 * M * N * K / t_ours / 1e9, 1),
                     cublas_tflops=round(2 * M * N * K / t_cub / 1e9, 1))
            if M <= 256:
                e["ours_eager_ms"] = round(b.ms(lambda: lt.linear_triton(xm, w, None, cfg)), 5)
                e["cublas_eager_ms"] = round(b.ms(lambda: F.linear(xm, w)), 5)
                nbytes = (N * K + M * K + M * N) * x.element_size()
                e.update(bytes=nbytes, ours_gbps=round(nbytes / t_ours / 1e6, 1),
                         cublas_gbps=round(nbytes / t_cub / 1e6, 1))
                if copy:
                    e["ours_frac_of_copy"] = round(nbytes / t_ours / 1e6 / copy, 3)
            elif peak:
                e["ours_frac_of_cublas_peak"] = round(2 * M * N * K / t_ours / 1e9 / peak, 3)
            res["gemm"].append(e)
            log(f"gemm {name} M={M}: ours {t_ours:.4f} ms, cuBLAS {t_cub:.4f} ms ({t_ours / t_cub:.2f}x) "
                f"[{e['tiles']}]")
            if variants and M != 32768:
                pinned = lt.linear_triton(xm, w, None, cfg)
                regime = "decode" if M <= cfg.linear_decode_max_m else "mid" if M <= cfg.linear_mid_max_m else "large"
                for v in VARIANTS[regime]:
                    if match and not re.search(match, ",".join(f"{k}={x}" for k, x in v.items())):
                        continue
                    try:  # a variant the configs refuse is recorded with its error, the sweep goes on
                        c = dataclasses.replace(cfg, **v)
                        q = lt.plan(M, w, c, sms=lt._num_sms(b.dev))
                    except ValueError as exc:
                        res["variants"].append(dict(shape=name, M=M, regime=regime, override=v,
                                                    error=f"refused: {str(exc)[:200]}"))
                        continue
                    tiles = (f"{q.block_m}x{q.block_n} w{q.num_warps} s{q.num_stages}" + (" tma" if q.tma else " ptr")
                             + (f" persistent{q.programs_per_sm}" if q.persistent else ""))
                    try:
                        same = bool(torch.equal(lt.linear_triton(xm, w, None, c), pinned))
                        t = b.graph_ms([lambda w=w, c=c: lt.linear_triton(xm, w, None, c) for w in wl])
                        res["variants"].append(dict(shape=name, M=M, regime=regime, override=v, tiles=tiles,
                                                    ms=round(t, 5), over_cublas=round(t / t_cub, 3),
                                                    bits_equal_pinned=same))
                    except Exception as exc:  # noqa: BLE001
                        res["variants"].append(dict(shape=name, M=M, regime=regime, override=v, tiles=tiles,
                                                    error=f"{type(exc).__name__}: {str(exc)[:200]}"))
        torch.cuda.empty_cache() if cuda else None
        save()


def host_section(b: Bench, res: dict) -> None:
    """Host time per launch (eager engines pay it; a CUDA graph does not)."""
    torch = b.torch
    F = torch.nn.functional
    from aligned_mamba.ops.configs import TritonKernelConfigs
    from aligned_mamba.ops.linear import triton as lt
    from aligned_mamba.ops.norm import triton as nt

    cfg = TritonKernelConfigs()
    cuda = b.dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    M, K, N = (64, 2048, 8512) if cuda else (4, 32, 32)
    x = torch.randn(M, K, device=b.dev).to(dtype)
    w = torch.randn(N, K, device=b.dev).to(dtype)
    r = torch.randn(M, K, device=b.dev)
    nw = torch.randn(K, device=b.dev).to(dtype)
    no_tma = dataclasses.replace(cfg, linear_tma=False, linear_persistent=False, linear_epi_split=1,
                                 linear_decode_tma=False, linear_decode_persistent=False, linear_mid_tma=False,
                                 linear_mid_persistent=False, linear_mid_programs_per_sm=1,
                                 linear_programs_per_sm=1, linear_decode_programs_per_sm=1)
    res["host_us"] = {
        "cublas_linear": round(b.host_us(lambda: F.linear(x, w)), 1),
        "linear_triton_tma": round(b.host_us(lambda: lt.linear_triton(x, w, None, cfg)), 1),
        "linear_triton_ptr": round(b.host_us(lambda: lt.linear_triton(x, w, None, no_tma)), 1),
        "add_rms_norm_triton": round(b.host_us(lambda: nt.add_rms_norm_triton(x, r, nw, 1e-5, None, cfg)), 1),
        "torch_empty": round(b.host_us(lambda: torch.empty(M, N, device=b.dev, dtype=dtype)), 1),
    }
    log(f"host us per call {res['host_us']}")


OP_VARIANTS = {
    "norm": [dict(norm_block_per_warp=b) for b in (128, 256, 1024, 2048)],
    "conv": [dict(conv_block_t=t, conv_block_c=c) for t, c in ((4, 512), (8, 256), (16, 128), (16, 512), (32, 256),
                                                                (64, 128))]
    # the prefill walk (the pinned path): one warp a program caps an SM at 32 resident warps
    + [dict(conv_walk_block_t=t, conv_walk_block_c=c, conv_walk_warps=w) for t, c, w in
       ((32, 256, 2), (32, 512, 4), (16, 256, 2), (64, 256, 2), (32, 64, 1), (16, 128, 1))],
    "logprobs": [dict(logprobs_block_v=v, logprobs_num_warps=w) for v, w in ((1024, 4), (2048, 4), (4096, 8),
                                                                             (4096, 16), (8192, 16))]
    # the split grid (a program per row and vocabulary slice) at the pinned block, and with smaller blocks
    + [dict(logprobs_split_max_m=m, logprobs_block_v=v, logprobs_num_warps=w) for m, v, w in
       ((64, 8192, 16), (4096, 8192, 16), (64, 4096, 8), (4096, 2048, 4))],
}


def ops_section(b: Bench, res: dict, variants: bool, save, op_variants: bool = False) -> None:
    torch = b.torch
    F = torch.nn.functional
    from aligned_mamba.ops import conv1d, logprobs, norm
    from aligned_mamba.ops.configs import TritonKernelConfigs
    from aligned_mamba.ops.conv1d import triton as ct
    from aligned_mamba.ops.logprobs import triton as lpt
    from aligned_mamba.ops.norm import triton as nt
    from aligned_mamba.ops.norm import triton_sliced as nst
    from aligned_mamba.parallel import TPGroup

    cfg = TritonKernelConfigs()
    cuda = b.dev.type == "cuda"
    bf = torch.bfloat16 if cuda else torch.float32
    copy = res["ceilings"]["copy_gbps"]
    eps = 1e-5

    def graph_or_eager(fn) -> tuple[float, str]:
        try:
            return b.graph_ms([fn]), "graph"
        except Exception:  # noqa: BLE001  (ops that synchronise the host cannot be captured)
            torch.cuda.synchronize() if cuda else None
            return b.ms(fn), "eager"

    def add(op: str, kind: str, shape: str, nbytes: int, ours, torch_op, plain, bits: bool | None = None) -> None:
        """ours(cfg) runs our kernel; torch_op and plain are closures."""
        t0 = b.graph_ms([lambda: ours(cfg)])
        e = dict(op=op, shape=shape, ours_ms=round(t0, 5), ours_eager_ms=round(b.ms(lambda: ours(cfg)), 5),
                 torch_op_eager_ms=round(b.ms(torch_op), 5), bytes=nbytes, ours_gbps=round(nbytes / t0 / 1e6, 1))
        if plain is not None:
            t2, mode = graph_or_eager(plain)
            e.update(plain_torch_ms=round(t2, 5), plain_torch_mode=mode)
        if copy:
            e["ours_frac_of_copy"] = round(nbytes / t0 / 1e6 / copy, 3)
        if bits is not None:
            e["bits_equal_torch_op"] = bits
        if variants and op_variants:
            e["variants"] = []
            for v in OP_VARIANTS[kind]:
                c = dataclasses.replace(cfg, **v)
                e["variants"].append(dict(v, ms=round(b.graph_ms([lambda c=c: ours(c)]), 5)))
        res["ops"].append(e)
        log(f"{op} {shape}: ours {t0:.4f} ms (eager {e['ours_eager_ms']:.4f}), torch op {e['torch_op_eager_ms']:.4f} ms"
            + (f", plain {e['plain_torch_ms']:.4f} ms ({e['plain_torch_mode']})" if plain is not None else ""))
        save()

    rows = (1, 64, 256, 8192) if cuda else (1, 5)
    for d in ((2048, 4096) if cuda else (64,)):
        w = (1 + 0.1 * torch.randn(d, device=b.dev)).to(bf)
        for M in rows:
            x = torch.randn(M, d, device=b.dev).to(bf)
            r = torch.randn(M, d, device=b.dev)

            def plain_add_norm(x=x, r=r, w=w):
                nr = r + x
                v = nr.pow(2).mean(-1, keepdim=True)
                return (w * (nr * torch.rsqrt(v + eps)).to(bf)), nr

            add("add_rms_norm", "norm", f"M={M} d={d} (fp32 residual)", M * d * (2 + 4 + 4 + 2) + d * 2,
                lambda c, x=x, r=r, w=w: nt.add_rms_norm_triton(x, r, w, eps, None, c),
                lambda x=x, r=r, w=w: (norm.rms_norm(r + x, w, eps), r + x), plain_add_norm)
    for d, groups in (((4096, 1), (8192, 8)) if cuda else ((64, 2),)):
        w = (1 + 0.1 * torch.randn(d, device=b.dev)).to(bf)
        for M in rows:
            y = torch.randn(M, d, device=b.dev).to(bf)
            z = torch.randn(M, d, device=b.dev).to(bf)

            def plain_gated(y=y, z=z, w=w, d=d, groups=groups):
                gg = (y.float() * F.silu(z.float())).view(-1, groups, d // groups)
                gg = gg * torch.rsqrt(gg.pow(2).mean(-1, keepdim=True) + eps)
                return w * gg.view(-1, d).to(bf)

            add("gated_rms_norm", "norm", f"M={M} d={d} groups={groups}", M * d * 2 * 3 + d * 2,
                lambda c, y=y, z=z, w=w, groups=groups: nt.gated_rms_norm_triton(y, z, w, eps, groups, c),
                lambda y=y, z=z, w=w, groups=groups: norm.gated_rms_norm(y, z, w, eps, groups), plain_gated)
            # the contract's 4 TP slices a group at TP 1 (triton_sliced.py) against the torch form on the device
            one = TPGroup.single()
            add("gated_rms_norm_sliced", "norm", f"M={M} d={d} groups={groups} slices=4", M * d * 2 * 3 + d * 2,
                lambda c, y=y, z=z, w=w, groups=groups: nst.gated_rms_norm_sliced_triton(
                    y, z, w, eps, groups, slices=4, group=one, cfg=c),
                lambda y=y, z=z, w=w, groups=groups: norm.gated_rms_norm_sliced(y, z, w, eps, groups, slices=4,
                                                                                 group=one), plain_gated)
    # conv1d: 1.3b's conv width (4096 + 2 * 128), prefill of 4 x 2048 tokens and decode steps
    Cd, K = (4352, 4) if cuda else (40, 4)
    cw = torch.randn(Cd, K, device=b.dev).to(bf)
    cb = torch.randn(Cd, device=b.dev).to(bf)
    for label, lens in ((("prefill 4x2048", [2048] * 4), ("decode b64", [1] * 64), ("decode b256", [1] * 256))
                        if cuda else (("prefill 2x9", [9, 9]), ("decode b3", [1] * 3))):
        S, T = len(lens), sum(lens)
        x = torch.randn(T, Cd, device=b.dev).to(bf)
        cu = torch.zeros(S + 1, dtype=torch.int64, device=b.dev)
        cu[1:] = torch.tensor(lens, device=b.dev).cumsum(0)
        slots = torch.arange(S, device=b.dev)
        win = torch.randn(S, K - 1, Cd, device=b.dev).to(bf)
        ref, _ = conv1d.causal_conv1d(x, cu, win, cw, cb)
        got = ct.causal_conv1d_triton(x, cu, slots, win.clone(), cw, cb, cfg)
        same = bool(torch.equal(got, ref))

        def plain_conv(x=x, S=S, T=T, win=win):
            if S == T:  # decode: one new row per sequence, as a window dot
                stream = torch.cat([win, x[:, None]], dim=1)  # [S, K, Cd]
                return F.silu((stream.float() * cw.float().T[None]).sum(1) + cb.float()).to(bf)
            xs = torch.cat([win, x.view(S, -1, Cd)], dim=1).transpose(1, 2)  # [S, Cd, K-1+L]
            return F.silu(F.conv1d(xs, cw[:, None], cb, groups=Cd)).transpose(1, 2)

        wbuf = win.clone()
        add("causal_conv1d", "conv", f"{label} Cd={Cd}", (2 * T * Cd + 2 * S * (K - 1) * Cd) * x.element_size(),
            lambda c, x=x, cu=cu, slots=slots, wbuf=wbuf: ct.causal_conv1d_triton(x, cu, slots, wbuf, cw, cb, c),
            lambda x=x, cu=cu, win=win: conv1d.causal_conv1d(x, cu, win, cw, cb), plain_conv, bits=same)
    for V in ((50280, 256000) if cuda else (300,)):
        for M in ((1, 64, 2048) if cuda else (3,)):
            x = (torch.randn(M, V, device=b.dev) * 4).to(bf)
            tok = torch.randint(0, V, (M,), device=b.dev)
            add("log_softmax", "logprobs", f"M={M} V={V}", M * V * (x.element_size() * 2 + 4),
                lambda c, x=x: lpt.log_softmax_triton(x, c), lambda x=x: logprobs.log_softmax(x),
                lambda x=x: torch.log_softmax(x.float(), dim=-1))
            add("token_logprobs", "logprobs", f"M={M} V={V}", M * V * x.element_size(),
                lambda c, x=x, tok=tok: lpt.token_logprobs_triton(x, tok, c),
                lambda x=x, tok=tok: logprobs.token_logprobs(x, tok),
                lambda x=x, tok=tok: torch.log_softmax(x.float(), dim=-1).gather(1, tok[:, None]))


def table(res: dict) -> str:
    cols = sorted({e["M"] for e in res["gemm"]})
    lines = [f"{'GEMM ms, ours/cuBLAS':<24}" + "".join(f"{'M=' + str(m):>16}" for m in cols)]
    by = {}
    for e in res["gemm"]:
        by.setdefault(e["shape"], {})[e["M"]] = e
    for shape, row in by.items():
        cells = []
        for m in cols:
            e = row.get(m)
            cells.append(f"{e['ours_ms']:.3f}/{e['cublas_ms']:.3f}" if e else "-")
        lines.append(f"{shape:<24}" + "".join(f"{c:>16}" for c in cells))
    bad = [e for e in res["gemm_bits"] if e["ours_rows_differ"]]
    cub = sum(1 for e in res["gemm_bits"] if e["cublas_rows_differ"])
    lines.append(f"bits: {len(res['gemm_bits'])} (shape, M) checks, ours differing in {len(bad)}, cuBLAS in {cub}")
    lines.append("op              shape                              ours ms (graph)  plain torch ms  "
                 "torch op ms (eager)  ours/copy BW")
    for e in res["ops"]:
        lines.append(f"{e['op']:<15} {e['shape']:<34} {e['ours_ms']:>10.4f}  {e.get('plain_torch_ms', 0):>14.4f}  "
                     f"{e['torch_op_eager_ms']:>19.4f}  {e.get('ours_frac_of_copy', '')}")
    if res.get("host_us"):
        lines.append(f"host us per launch: {res['host_us']}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes through the Triton interpreter")
    ap.add_argument("--variants", action="store_true", help="also time other GEMM configs per M regime")
    ap.add_argument("--variant-match", default=None,
                    help="--variants: only overrides whose 'field=value,...' matches this regex")
    ap.add_argument("--op-variants", action="store_true", help="also time other norm/conv/logprobs configs")
    ap.add_argument("--sections", default="host,gemm,ops")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of GEMM shapes")
    ap.add_argument("--ms", default=None, help="comma-separated GEMM row counts (default 1,16,64,128,256,2048,8192)")
    args = ap.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(ROOT))
    import torch
    import triton

    from aligned_mamba.ops.configs import TritonKernelConfigs

    dev = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if dev.type != "cuda" and not args.dry_run:
        log("no CUDA device: run with --dry-run on a CPU")
        return 2
    b = Bench(torch, triton, dev, args.quick, args.dry_run)
    res = dict(
        script="benchmarks/bench_ops_h200.py", commit=git_commit(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        gpu=torch.cuda.get_device_name(0) if dev.type == "cuda" else None, torch=torch.__version__,
        triton=triton.__version__, configs=dataclasses.asdict(TritonKernelConfigs()), dry_run=args.dry_run,
        ceilings={}, gemm=[], gemm_bits=[], variants=[], ops=[], errors=[])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(res, indent=1))

    res["ceilings"] = ceilings(b)
    log(f"ceilings {res['ceilings']}")
    shapes = TINY_SHAPES if args.dry_run else GEMM_SHAPES
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    ms_list = [1, 5, 20] if args.dry_run else [1, 16, 64, 128, 256, 2048, 8192]
    if args.ms:
        ms_list = [int(m) for m in args.ms.split(",")]
    for sec, fn in (("host", lambda: host_section(b, res)),
                    ("gemm", lambda: gemm_section(b, shapes, ms_list, res, args.variants, save, args.variant_match)),
                    ("ops", lambda: ops_section(b, res, args.variants, save, args.op_variants))):
        if sec not in args.sections.split(","):
            continue
        try:
            fn()
        except Exception:  # noqa: BLE001
            res["errors"].append(f"{sec}: {traceback.format_exc()[-2000:]}")
            log(f"{sec} FAILED:\n{traceback.format_exc()}")
        save()
    save()
    print(table(res), flush=True)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
