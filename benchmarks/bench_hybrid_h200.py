#!/usr/bin/env python3
"""Hybrid (Nemotron-H) pieces on one GPU: the triton backend's attention and squared-ReLU MLP against
the stock kernels, and a Nemotron-H-8B-shaped slice of the model on the triton backend.

    python3 benchmarks/bench_hybrid_h200.py --out OUT/h200_hybrid.json [--quick] [--no-model]

Attention alone (32 query heads, 8 key/value heads, head_dim 128, bf16, as Nemotron-H-8B):
- prefill of one sequence of 4k / 8k / 16k / 32k tokens: ours (``ops.attention.triton``, keys read
  from a slot cache) against torch SDPA's flash kernel (causal, k/v expanded to 32 heads beforehand,
  untimed); TFLOP/s count the causal half, 2 T^2 H D.
- decode at batch 1 / 64 / 256 with 4k and 16k contexts over a KV cache [slots, len, G, D]: ours
  (one tile per sequence) against SDPA with the group's query heads as its query rows
  (q [B, G, H/G, D] over k, v [B, G, ctx, D], views of the same cache); bytes/s count the K and V
  read once, against the measured copy bandwidth. ``bitwise``: our decode rows equal our prefill's
  rows of the same positions; ``stock_bitwise`` the same for SDPA (expected false).
MLP alone: up_proj 4096 -> 21504, relu2, down_proj, ours (``mlp_relu2``: row-invariant Triton GEMMs,
relu2 in the up GEMM's epilogue at decode sizes; ``unfused_ms``: the GEMMs and one relu2 pass) against
cuBLAS ``F.linear`` and torch's relu + square, at 4096 and 64 rows; and fwd+bwd at 16384 rows.
Model (unless --no-model): a 13-layer slice of Nemotron-H-8B in its proportions (6 Mamba2 with 128
heads x 64, 8 groups, state 128; 1 attention; 6 MLPs 21504 wide; hidden 4096; vocab 131072) on the
triton backend: trainer forward at 4 x 4096 tokens and decode steps in CUDA graphs at batch 1 / 64 /
256 with 4k contexts (states and caches random: timing only). There is no stock hybrid model here
yet, so these cells have ``stock_ms`` null.

Training (section ``train``; ``attention_bwd``, ``bwd_sweep``):
- the attention backward alone (dq, dk, dv from the saved log-sum-exp) against SDPA flash's backward
  (k, v expanded to 32 heads beforehand, untimed) at 4k-32k tokens, and both forward + backward;
  ``deterministic``: two of our backwards give the same bits. TFLOP/s count 5 T^2 H D (the causal
  half of the backward's five matmuls). ``bwd_sweep`` times backward launch configs first (each
  checked for determinism) and the fastest runs the other training cells (``bwd_config``).
- fwd+bwd (loss: cross entropy of every position's logits; gradients of every weight) of an 8-layer
  slice of Nemotron-H-8B (``M-M*-M-M``: 4 Mamba2, 1 attention, 3 MLPs, embedding and lm_head at full
  size) on the triton backend against a stock step on the same weights: torch SDPA flash for
  attention (HF's repeat_kv before it), cuBLAS ``F.linear`` for every projection, torch's relu and
  square, torch's conv1d + SiLU, mamba_ssm's Triton scan (``mamba_chunk_scan_combined``) and gated
  RMSNorm, and its fused add + RMSNorm (Mamba2 as mamba_ssm's ``Mamba2`` with use_mem_eff_path=False;
  mamba_ssm 2.3.2.post1 from ``--mamba-ssm DIR``, the sdist's package folder). Peak bytes are
  ``max_memory_allocated`` above the weights; ``logits_rel_diff`` says both compute the same model.
  Section ``nano_train``: the same on Nemotron-3-Nano-30B-A3B's first 8 layers (``MEMEM*EM``: 4
  Mamba2, 3 MoE, 1 attention), the stock experts through ``torch._grouped_mm``.

Whole models (sections ``nano``, ``h8b``; ``benchmarks/stock_hybrid.py`` is the stock model): a
Nemotron-3-Nano-30B-A3B-shaped (52 layers: 23 Mamba2 64 heads x 64, 8 groups, state 128; 23 MoE of
128 experts top-6 + a shared expert, width 1856 / 3712; 6 attention 32 / 2 heads x 128; hidden 2688;
vocab 131072; about 63 GB of bf16 weights) or Nemotron-H-8B-shaped model (52 layers) with random bf16
weights, built on the triton backend, against the stock model on the same tensors (the routed experts
shared: one copy): the trainer's forward (all logits) at 4 x 2048 / 4 x 4096 / 1 x 32768 tokens
(Nano; 8B: 4 x 4096, 1 x 32768) with ``logits_rel_diff``, and decode steps in CUDA graphs at batch 1 /
64 / 256 with 4k and 16k contexts (both sides one graph replay; a batch whose cache does not fit
beside the weights runs at the largest that does, ``batch_run``). ``--quick``: the first forward
cell and 4k contexts. Section ``nano_decode``: Nano's decode cells alone (with --profile, a kernel
table of one batch-1 replay of each side). Section ``tiny``: the same code on a small hybrid in
seconds (a smoke run).

CUDA-event medians (triton.testing.do_bench, median) after a warm-up call. The JSON is written after
every entry; it names the GPU, torch, triton, the commit (GIT_COMMIT, else git's HEAD) and the date.
``--sections`` runs some sections only and ``--merge FILE`` keeps the other sections' cells from an
earlier JSON (each section's commit and date in ``sections``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_h200 import git_commit  # noqa: E402
from benchmarks.stock_hybrid import (  # noqa: E402
    H8B,
    NANO,
    LazyWeights,
    StockHybrid,
    draw,
    stock_forward,
    stock_weights,
)

H, G, D = 32, 8, 128
BF16 = torch.bfloat16




def _bench(fn, rep: int = 100) -> float:
    """Median ms of ``fn`` over about ``rep`` ms of calls (at least one) after a warm-up."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def copy_bandwidth() -> float:
    """Device-to-device copy bytes (read + write) per second over 2 GiB."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    ms = _bench(lambda: b.copy_(a))
    return 2 * a.numel() / (ms * 1e-3)


def attention_cells(res: dict, save, quick: bool) -> None:
    from aligned_mamba.ops.attention.triton import attention_triton, decode_tiles, prefill_tiles
    from aligned_mamba.ops.configs import TritonKernelConfigs

    cfg = TritonKernelConfigs()
    scale = D ** -0.5
    rep = H // G
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in ([4096, 16384] if quick else [4096, 8192, 16384, 32768]):
        q = torch.randn(T, H, D, device="cuda", generator=g).to(BF16)
        kc = torch.randn(1, T, G, D, device="cuda", generator=g).to(BF16)
        vc = torch.randn(1, T, G, D, device="cuda", generator=g).to(BF16)
        tiles = prefill_tiles([0, T], [0], [0], rep, cfg, "cuda")
        ours = _bench(lambda: attention_triton(q, kc, vc, tiles, scale=scale, cfg=cfg))
        qh = q.transpose(0, 1)[None]
        kh = kc[0].repeat_interleave(rep, dim=1).transpose(0, 1)[None]
        vh = vc[0].repeat_interleave(rep, dim=1).transpose(0, 1)[None]
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            stock = _bench(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale))
        flops = 2.0 * T * T * H * D
        res["attention"].append(dict(phase="prefill", shape=f"1x{T} H{H} G{G} D{D}", tokens=T, ours_ms=ours,
                                     stock_ms=stock, ours_tflops=flops / ours / 1e9, stock_tflops=flops / stock / 1e9,
                                     throughput_vs_stock=stock / ours))
        save()
        q = kc = vc = kh = vh = qh = None  # freed before the next size's tensors
        torch.cuda.empty_cache()
    bw = res["copy_bandwidth_bytes_per_s"]
    for ctx in (4096, 16384):
        for B in (1, 64, 256):
            kc = torch.randn(B, ctx + 1, G, D, device="cuda", generator=g).to(BF16)
            vc = torch.randn(B, ctx + 1, G, D, device="cuda", generator=g).to(BF16)
            q = torch.randn(B, H, D, device="cuda", generator=g).to(BF16)
            slots = torch.arange(B, device="cuda")
            pos = torch.full((B,), ctx - 1, device="cuda")
            tiles = decode_tiles(slots, pos)
            ours = _bench(lambda: attention_triton(q, kc, vc, tiles, scale=scale, cfg=cfg))
            # stock: the group's query heads as SDPA's query rows over views of the same cache
            qs = q.view(B, G, rep, D)
            ks, vs = kc[:, :ctx].transpose(1, 2), vc[:, :ctx].transpose(1, 2)
            stock = _bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, scale=scale))
            kv_bytes = 2 * B * ctx * G * D * 2
            # bits: a decode row against the same position's row in a prefill (a few sequences)
            n = min(B, 2)
            bit_ours, bit_stock = True, True
            for b in range(n):
                qq = torch.randn(ctx, H, D, device="cuda", generator=g).to(BF16)
                qq[ctx - 1] = q[b]
                full = attention_triton(qq, kc, vc, prefill_tiles([0, ctx], [0], [b], rep, cfg, "cuda"), scale=scale,
                                        cfg=cfg)
                dec = attention_triton(q[b:b + 1], kc, vc, decode_tiles(slots[b:b + 1], pos[b:b + 1]), scale=scale,
                                       cfg=cfg)
                bit_ours &= torch.equal(dec[0], full[ctx - 1])
                sf = F.scaled_dot_product_attention(qq.view(ctx, G, rep, D).permute(1, 2, 0, 3).reshape(1, H, ctx, D),
                                                    ks[b:b + 1].repeat_interleave(rep, 1),
                                                    vs[b:b + 1].repeat_interleave(rep, 1), is_causal=True,
                                                    scale=scale)[0, :, ctx - 1]
                sd = F.scaled_dot_product_attention(qs[b:b + 1], ks[b:b + 1], vs[b:b + 1], scale=scale)[0]
                bit_stock &= torch.equal(sd.reshape(H, D), sf)
            res["attention"].append(dict(phase="decode", shape=f"b{B} ctx{ctx} H{H} G{G} D{D}", tokens=B, batch=B,
                                         context=ctx, ours_ms=ours, stock_ms=stock,
                                         ours_bytes_per_s=kv_bytes / (ours * 1e-3),
                                         stock_bytes_per_s=kv_bytes / (stock * 1e-3),
                                         ours_fraction_of_copy_bw=kv_bytes / (ours * 1e-3) / bw,
                                         bitwise=bool(bit_ours), stock_bitwise=bool(bit_stock)))
            save()
            kc = vc = None
            torch.cuda.empty_cache()


def sweep_cells(res: dict, save) -> None:
    """Launch settings that must not change a row's bits (tile rows, warps, stages): each timed and
    its output compared with the pinned configs' (``equal_to_default``)."""
    import dataclasses

    from aligned_mamba.ops.attention.triton import attention_triton, decode_tiles, prefill_tiles
    from aligned_mamba.ops.configs import TritonKernelConfigs

    base = TritonKernelConfigs()
    scale, rep = D ** -0.5, H // G
    g = torch.Generator(device="cuda").manual_seed(2)
    T = 16384
    q = torch.randn(T, H, D, device="cuda", generator=g).to(BF16)
    kc = torch.randn(64, T, G, D, device="cuda", generator=g).to(BF16)
    vc = torch.randn(64, T, G, D, device="cuda", generator=g).to(BF16)
    ref = None
    for bm, w, st in ((128, 8, 3), (128, 8, 2), (128, 8, 4), (128, 4, 3), (64, 4, 3), (64, 4, 2), (256, 8, 2)):
        cfg = dataclasses.replace(base, attn_block_m=bm, attn_warps=w, attn_stages=st)
        try:
            tiles = prefill_tiles([0, T], [0], [0], rep, cfg, "cuda")
            out = attention_triton(q, kc, vc, tiles, scale=scale, cfg=cfg)
            ref = out if ref is None else ref
            ms = _bench(lambda: attention_triton(q, kc, vc, tiles, scale=scale, cfg=cfg))
            res["sweep"].append(dict(phase="prefill", tokens=T, block_m=bm, warps=w, stages=st, ours_ms=ms,
                                     equal_to_default=bool(torch.equal(out, ref))))
        except Exception as e:
            res["sweep"].append(dict(phase="prefill", block_m=bm, warps=w, stages=st, error=str(e)[:200]))
        save()
    full = ref
    pos = torch.full((64,), T - 1, device="cuda")
    slots = torch.arange(64, device="cuda")
    qd = torch.randn(64, H, D, device="cuda", generator=g).to(BF16)
    qd[0] = q[T - 1]
    dref = None
    for bm, w, st in ((16, 4, 3), (16, 4, 2), (16, 4, 4), (16, 2, 3), (16, 8, 3), (32, 4, 3), (64, 4, 3)):
        cfg = dataclasses.replace(base, attn_decode_block_m=bm, attn_decode_warps=w, attn_decode_stages=st)
        try:
            tiles = decode_tiles(slots, pos)
            out = attention_triton(qd, kc, vc, tiles, scale=scale, cfg=cfg)
            dref = out if dref is None else dref
            ms = _bench(lambda: attention_triton(qd, kc, vc, tiles, scale=scale, cfg=cfg))
            res["sweep"].append(dict(phase="decode", batch=64, context=T, block_m=bm, warps=w, stages=st, ours_ms=ms,
                                     equal_to_default=bool(torch.equal(out, dref)),
                                     equal_to_prefill_row=bool(torch.equal(out[0], full[T - 1]))))
        except Exception as e:
            res["sweep"].append(dict(phase="decode", block_m=bm, warps=w, stages=st, error=str(e)[:200]))
        save()


def mlp_cells(res: dict, save) -> None:
    from aligned_mamba.ops.configs import TritonKernelConfigs
    from aligned_mamba.ops.elementwise.triton import relu2_triton
    from aligned_mamba.ops.linear.triton import linear_triton
    from aligned_mamba.ops.linear.triton_relu2 import mlp_relu2

    cfg = TritonKernelConfigs()
    g = torch.Generator(device="cuda").manual_seed(1)
    up = (torch.randn(21504, 4096, device="cuda", generator=g) / 64).to(BF16)
    down = (torch.randn(4096, 21504, device="cuda", generator=g) / 146).to(BF16)
    for M in (4096, 64):
        x = torch.randn(M, 4096, device="cuda", generator=g).to(BF16)
        ours = _bench(lambda: linear_triton(relu2_triton(linear_triton(x, up, None, cfg), cfg), down, None, cfg))
        stock = _bench(lambda: F.linear(torch.square(torch.relu(F.linear(x, up))), down))
        relu_ms = _bench(lambda: relu2_triton(linear_triton(x, up, None, cfg), cfg)) - _bench(
            lambda: linear_triton(x, up, None, cfg))
        fused = _bench(lambda: mlp_relu2(x, up, None, down, None, cfg=cfg))
        res["mlp"].append(dict(shape=f"{M}x4096->21504", tokens=M, ours_ms=fused, stock_ms=stock,
                               unfused_ms=ours, relu2_ms_approx=relu_ms))
        save()
    # fwd+bwd (gradients of x and both weights): ours (each op's own backward: cuBLAS GEMMs, one relu2
    # pass) and cuBLAS + torch's relu and square
    M = 16384
    x = torch.randn(M, 4096, device="cuda", generator=g).to(BF16)
    gy = torch.randn(M, 4096, device="cuda", generator=g).to(BF16)
    leaves = [t.clone().requires_grad_() for t in (x, up, down)]
    forms = {"ours": lambda a, b, c: mlp_relu2(a, b, None, c, None, cfg=cfg),
             "stock": lambda a, b, c: F.linear(torch.square(torch.relu(F.linear(a, b))), c)}
    row = dict(shape=f"fwd+bwd {M}x4096->21504", tokens=M)
    for name, fn in forms.items():
        row[f"{name}_ms"] = _bench(lambda: torch.autograd.grad(fn(*leaves), leaves, gy))
        save()
    first, again = (torch.autograd.grad(forms["ours"](*leaves), leaves, gy) for _ in range(2))
    row["deterministic"] = all(torch.equal(a, b) for a, b in zip(first, again))
    res["mlp"].append(row)
    save()


PATTERN = "M-M-M*-M-M-M-"  # 13 layers: Nemotron-H-8B's 24 M / 4 * / 24 - in proportion


def noise_cache(model, slots: int, max_len: int):
    """``model.new_cache(slots, max_len=max_len)`` with random states and keys (floating tensors N(0, 0.01),
    the others zero): for timing only."""
    cache = model.new_cache(slots, max_len=max_len)
    for ts in cache.tensors:
        for t in (ts or {}).values():
            if t.is_floating_point():
                t.normal_(0, 0.01)
            else:
                t.zero_()
    return cache


def hybrid_weights(config, seed: int) -> dict:
    from aligned_mamba.models.nemotron_h import expected_shapes

    g = torch.Generator(device="cuda").manual_seed(seed)
    return {name: draw(name, shape, config.torch_dtype, g) for name, shape in expected_shapes(config).items()}


def model_cells(res: dict, save, quick: bool) -> None:
    from aligned_mamba.contract import Contract
    from aligned_mamba.decode_graph import DecodeGraphs
    from aligned_mamba.models import build_model
    from aligned_mamba.models.nemotron_h import NemotronHConfig

    config = NemotronHConfig(hybrid_override_pattern=PATTERN, vocab_size=131072, hidden_size=4096,
                             num_attention_heads=H, num_key_value_heads=G, head_dim=D, intermediate_size=21504,
                             ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64, n_groups=8, chunk_size=256,
                             dtype="bfloat16")
    model = build_model(config, hybrid_weights(config, 0),
                        Contract(chunk_size=256, backend="triton", model_dtype="bfloat16"), device="cuda")
    res["model"] = dict(pattern=PATTERN, note="a 13-layer slice of Nemotron-H-8B in its proportions; no stock "
                        "hybrid model yet (stock_ms null)")
    g = torch.Generator().manual_seed(0)
    V = config.vocab_size
    with torch.no_grad():
        seqs = [torch.randint(0, V, (4096,), generator=g) for _ in range(4)]
        ms = _bench(lambda: model.forward(seqs))
        res["forward"].append(dict(shape="nemotronh8b-slice13", tokens=4 * 4096, ours_ms=ms, stock_ms=None))
        save()
        ctx = 4096
        for B in ((1, 64) if quick else (1, 64, 256)):
            cache = noise_cache(model, B + 1, ctx + 64)
            graphs = DecodeGraphs(model, cache, spare_slot=B)
            slots = list(range(B))
            pos = [ctx - 100] * B  # mid-chunk: no chunk completes in the timed step
            ids = torch.randint(0, V, (B,), generator=g)
            graphs.step(slots, pos, ids)
            graph = graphs.graph(B)
            ms = _bench(lambda: graph.replay())
            res["decode"].append(dict(shape="nemotronh8b-slice13", batch=B, context=ctx, graph=True, ours_ms=ms,
                                      stock_ms=None, bitwise=None))
            save()
            del graphs, cache
            torch.cuda.empty_cache()


BWD_CANDIDATES = (  # attn_bwd_kv_block_n, kv_block_m, q_block_m, q_block_n, warps, stages
    (64, 64, 64, 64, 4, 2), (128, 64, 128, 64, 8, 2), (128, 32, 128, 32, 8, 3), (64, 64, 128, 64, 8, 2),
    (128, 64, 64, 64, 8, 2), (64, 32, 64, 32, 4, 3), (128, 32, 64, 32, 4, 3), (64, 64, 64, 64, 4, 3),
)


def _bwd_cfg(base, c):
    import dataclasses

    n, m, qm, qn, w, st = c
    cfg = dataclasses.replace(base, attn_bwd_kv_block_n=n, attn_bwd_q_block_m=qm, attn_bwd_q_block_n=qn,
                              attn_bwd_warps=w, attn_bwd_stages=st)
    # set past the configs' check: the sweep keeps timing the launches they refuse (32-row pipelined
    # dK/dV steps, wrong dK on the H200) to show why
    object.__setattr__(cfg, "attn_bwd_kv_block_m", m)
    return cfg


def _attn_inputs(T: int, seed: int):
    from aligned_mamba.ops.attention.triton import attention_triton_packed
    from aligned_mamba.ops.configs import TritonKernelConfigs

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, D, device="cuda", generator=g).to(BF16)
    k = torch.randn(T, G, D, device="cuda", generator=g).to(BF16)
    v = torch.randn(T, G, D, device="cuda", generator=g).to(BF16)
    do = torch.randn(T, H, D, device="cuda", generator=g).to(BF16)
    cu = torch.tensor([0, T])
    lse = torch.empty(T, H, device="cuda")
    o = attention_triton_packed(q, k, v, cu, cu, scale=D ** -0.5, cfg=TritonKernelConfigs(), lse=lse)
    return q, k, v, o, lse, do, cu


def bwd_sweep_cells(res: dict, save):
    """Backward launch configs at 16k tokens; returns the fastest deterministic one."""
    from aligned_mamba.ops.attention.triton_backward import attention_backward_triton
    from aligned_mamba.ops.configs import TritonKernelConfigs

    base = TritonKernelConfigs()
    q, k, v, o, lse, do, cu = _attn_inputs(16384, 5)
    best, best_ms, ref = base, math.inf, None
    for c in BWD_CANDIDATES:
        cfg = _bwd_cfg(base, c)
        row = dict(zip(("kv_block_n", "kv_block_m", "q_block_m", "q_block_n", "warps", "stages"), c))
        try:
            run = lambda: attention_backward_triton(q, k, v, o, lse, do, cu, cu, scale=D ** -0.5, cfg=cfg)  # noqa: E731
            a, b = run(), run()
            ref = a if ref is None else ref
            ms = _bench(run)
            det = all(torch.equal(x, y) for x, y in zip(a, b))
            close = all(((x.float() - y.float()).norm() / y.float().norm()).item() < 1e-2 for x, y in zip(a, ref))
            res["bwd_sweep"].append(dict(row, tokens=16384, ours_ms=ms, deterministic=det, close_to_first=close))
            if det and close and ms < best_ms:
                best, best_ms = cfg, ms
        except Exception as e:
            res["bwd_sweep"].append(dict(row, error=str(e)[:200]))
        save()
    fields = ("attn_bwd_kv_block_n", "attn_bwd_kv_block_m", "attn_bwd_q_block_m", "attn_bwd_q_block_n",
              "attn_bwd_warps", "attn_bwd_stages")
    res["bwd_config"] = {f: getattr(best, f) for f in fields}
    save()
    return best


def bwd_determinism_cells(res: dict, save, runs: int = 10) -> None:
    """Each backward config ``runs`` times on two inputs: how many runs differ from the first, per output."""
    from aligned_mamba.ops.attention.triton import attention_triton_packed
    from aligned_mamba.ops.attention.triton_backward import attention_backward_triton
    from aligned_mamba.ops.configs import TritonKernelConfigs

    base = TritonKernelConfigs()
    g = torch.Generator(device="cuda").manual_seed(8)
    cases = []
    for Hq, Gk, Dh, ns in ((32, 8, 128, [16384]), (16, 1, 64, [3000, 77, 1500])):
        T = sum(ns)
        q, do = (torch.randn(T, Hq, Dh, device="cuda", generator=g).to(BF16) for _ in range(2))
        k, v = (torch.randn(T, Gk, Dh, device="cuda", generator=g).to(BF16) for _ in range(2))
        cu = torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()])
        lse = torch.empty(T, Hq, device="cuda")
        o = attention_triton_packed(q, k, v, cu, cu, scale=Dh ** -0.5, cfg=base, lse=lse)
        cases.append((f"H{Hq} G{Gk} D{Dh} {'+'.join(map(str, ns))}", (q, k, v, o, lse, do, cu, cu), Dh ** -0.5))
    for c in ((64, 64, 64, 64, 4, 2), (64, 64, 64, 64, 4, 3), (64, 32, 64, 32, 4, 2), (64, 32, 64, 32, 4, 3),
              (128, 32, 128, 32, 8, 3)):
        cfg = _bwd_cfg(base, c)
        for name, args, scale in cases:
            row = dict(config=list(c), case=name, runs=runs)
            try:
                first = attention_backward_triton(*args, scale=scale, cfg=cfg)
                differ = [0, 0, 0]
                most = [0, 0, 0]
                for _ in range(runs - 1):
                    again = attention_backward_triton(*args, scale=scale, cfg=cfg)
                    for i, (x, y) in enumerate(zip(first, again)):
                        n = int((x != y).sum())
                        differ[i] += n > 0
                        most[i] = max(most[i], n)
                row.update(runs_differing_dq_dk_dv=differ, most_elements_differing=most)
            except Exception as e:
                row["error"] = str(e)[:200]
            res["bwd_determinism"].append(row)
            save()


def attention_bwd_cells(res: dict, save, quick: bool, cfg) -> None:
    for T in ([4096, 16384] if quick else [4096, 8192, 16384, 32768]):
        res["attention"].append(_attention_bwd_cell(T, cfg))
        save()
        torch.cuda.empty_cache()


def _attention_bwd_cell(T: int, cfg) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from aligned_mamba.ops.attention.triton_backward import attention_backward_triton, attention_packed

    scale, rep = D ** -0.5, H // G
    q, k, v, o, lse, do, cu = _attn_inputs(T, T)
    bwd = lambda: attention_backward_triton(q, k, v, o, lse, do, cu, cu, scale=scale, cfg=cfg)  # noqa: E731
    a, b = bwd(), bwd()
    det = all(torch.equal(x, y) for x, y in zip(a, b))
    ours = _bench(bwd)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ours_fb = _bench(lambda: torch.autograd.grad(attention_packed(*leaves, cu, cu, scale=scale, cfg=cfg), leaves, do))
    qh = q.transpose(0, 1)[None].clone().requires_grad_()
    kh = k.repeat_interleave(rep, dim=1).transpose(0, 1)[None].clone().requires_grad_()
    vh = v.repeat_interleave(rep, dim=1).transpose(0, 1)[None].clone().requires_grad_()
    doh = do.transpose(0, 1)[None].contiguous()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        so = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        stock = _bench(lambda: torch.autograd.grad(so, (qh, kh, vh), doh, retain_graph=True))
        stock_fb = _bench(lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale), (qh, kh, vh), doh))
    flops = 5.0 * T * T * H * D
    return dict(phase="backward", shape=f"1x{T} H{H} G{G} D{D}", tokens=T, ours_ms=ours, stock_ms=stock,
                ours_tflops=flops / ours / 1e9, stock_tflops=flops / stock / 1e9, throughput_vs_stock=stock / ours,
                deterministic=det, ours_fwd_bwd_ms=ours_fb, stock_fwd_bwd_ms=stock_fb)


TRAIN_PATTERN = "M-M*-M-M"  # 8 layers: 4 Mamba2, 1 attention, 3 MLPs


def _import_mamba_ssm(path: str | None):
    """mamba_ssm's Triton pieces from the sdist's package folder, without its package __init__ (which
    imports Mamba1's CUDA extension)."""
    import types

    if path is None:
        raise RuntimeError("no --mamba-ssm DIR: the stock step needs mamba_ssm's Triton scan")
    pkg = types.ModuleType("mamba_ssm")
    pkg.__path__ = [str(Path(path).resolve())]
    sys.modules.setdefault("mamba_ssm", pkg)
    from mamba_ssm.ops.triton.layer_norm import rms_norm_fn
    from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    return mamba_chunk_scan_combined, rmsnorm_fn, rms_norm_fn, selective_state_update


NANO_TRAIN_PATTERN = "MEMEM*EM"  # Nano's first 8 layers: 4 Mamba2, 3 MoE, 1 attention


def train_cells(res: dict, save, quick: bool, cfg, mamba_ssm: str | None, which: str = "h8b") -> None:
    """fwd+bwd of an 8-layer slice: Nemotron-H-8B's (``which`` "h8b") or Nemotron-3-Nano's ("nano")."""
    from aligned_mamba.contract import Contract
    from aligned_mamba.models import build_model
    from aligned_mamba.models.nemotron_h import NemotronHConfig
    from aligned_mamba.ops.step import Step

    if which == "nano":
        config = NemotronHConfig(**dict(NANO, hybrid_override_pattern=NANO_TRAIN_PATTERN), dtype="bfloat16")
        label, cells = "nano30b-slice8", [(4, 4096)] if quick else [(4, 4096), (1, 16384)]
    else:
        config = NemotronHConfig(**dict(H8B, hybrid_override_pattern=TRAIN_PATTERN), dtype="bfloat16")
        label, cells = "nemotronh8b-slice8", [(4, 4096)] if quick else [(4, 4096), (1, 16384)]
    weights = hybrid_weights(config, 0)
    # ours: the checkpoint's tensors as leaves (the MoE layers stack the experts on each build, as a
    # trainer's model does); stock: each MoE layer's experts as one stacked leaf (``_grouped_mm``'s form)
    ours_p = {k: v.clone().requires_grad_() for k, v in weights.items()}
    stock_p = {k: v.clone().requires_grad_() for k, v in weights.items() if ".experts." not in k}
    for i, kind in enumerate(config.hybrid_override_pattern):
        m = f"backbone.layers.{i}.mixer."
        if kind == "E":
            for part in ("up", "down"):
                stock_p[m + f"experts_{part}"] = torch.stack(
                    [weights[f"{m}experts.{e}.{part}_proj.weight"] for e in range(config.n_routed_experts)]
                ).requires_grad_()
    # the router's score correction bias only picks experts (no gradient path; a buffer in trainers)
    ours_names, stock_names = ([k for k in sorted(d) if not k.endswith("e_score_correction_bias")]
                               for d in (ours_p, stock_p))
    del weights
    contract = Contract(chunk_size=256, backend="triton", model_dtype="bfloat16", kernel_configs=cfg)
    try:
        ms = _import_mamba_ssm(mamba_ssm)
    except Exception as e:
        ms = None
        res["errors"].append(f"train: stock step unavailable: {type(e).__name__}: {e}"[:300])
    res["train_note" if which == "h8b" else "train_note_nano"] = (
        f"fwd+bwd of an 8-layer {label} ({config.hybrid_override_pattern}) with embedding and lm_head; stock: "
        "SDPA flash, cuBLAS, mamba_ssm 2.3.2.post1's Triton scan and norms" +
        (", torch._grouped_mm experts" if "E" in config.hybrid_override_pattern else ""))
    g = torch.Generator().manual_seed(0)
    V = config.vocab_size
    for Bsz, L in cells:
        ids = torch.randint(0, V, (Bsz, L), generator=g)
        tgt = torch.randint(0, V, (Bsz, L), generator=g).cuda()
        ids_d = ids.cuda()

        def ours_step():
            # as a trainer does: the layers built from the parameters on each step (A = -exp(A_log) etc.),
            # the packed pass a trainer takes (``forward`` splits it per sequence; a cat back copied the
            # 4 GB of logits, and its backward the gradient again)
            model = build_model(config, ours_p, contract, device="cuda")
            logits = model.advance(model.new_cache(Bsz, max_len=L), Step.from_empty([L] * Bsz), ids.reshape(-1))
            loss = F.cross_entropy(logits.float(), tgt.reshape(-1), reduction="sum")
            return logits, torch.autograd.grad(loss, [ours_p[k] for k in ours_names])

        def stock_step():
            logits = stock_forward(config, stock_p, ids_d, ms).reshape(Bsz * L, V)
            loss = F.cross_entropy(logits.float(), tgt.reshape(-1), reduction="sum")
            return logits, torch.autograd.grad(loss, [stock_p[k] for k in stock_names])

        row = dict(shape=f"{label} {Bsz}x{L}", tokens=Bsz * L)
        res["train"].append(row)  # saved after each side: a call cut short keeps what was measured
        kept = {}
        for side, step in (("ours", ours_step), ("stock", stock_step if ms is not None else None)):
            if step is None:
                row[f"{side}_ms"] = row[f"{side}_peak_bytes"] = None
                continue
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            logits, grads = step()
            torch.cuda.synchronize()
            row[f"{side}_first_step_s"] = time.perf_counter() - t0  # the kernels' compiles included
            row[f"{side}_peak_bytes"] = torch.cuda.max_memory_allocated() - base
            kept[side] = logits.detach()
            if side == "ours":
                again = step()[1]
                row["ours_deterministic"] = all(torch.equal(a, b) for a, b in zip(grads, again))
                del again
            del logits, grads
            # a step is ~0.3-0.4 s: a few timed steps, not one
            row[f"{side}_ms"] = _bench(lambda: step(), rep=1200)
            save()
            if PROFILE:
                from benchmarks.bench_mamba_ssm_h200 import kernel_table

                row[f"{side}_profile"] = kernel_table(torch, step, top=40)
                save()
        if len(kept) == 2:
            lo, ls = kept["ours"].float(), kept["stock"].float()
            row["logits_rel_diff"] = ((lo - ls).norm() / ls.norm()).item()
            del lo, ls
        del kept
        save()
        torch.cuda.empty_cache()


WHOLE = {"nano": ("nano30b-52", NANO), "h8b": ("nemotronh8b-52", H8B),
         # a smoke run of the same code in seconds (every layer kind, MoE and MLP): not a result
         "tiny": ("tiny-hybrid", dict(hybrid_override_pattern="MEM*E-M", vocab_size=4096, hidden_size=256,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, ssm_state_size=64,
                                      mamba_num_heads=8, mamba_head_dim=64, n_groups=2, chunk_size=256,
                                      intermediate_size=512, n_routed_experts=16, num_experts_per_tok=6,
                                      moe_intermediate_size=128, moe_shared_expert_intermediate_size=256,
                                      routed_scaling_factor=2.5))}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def whole_cells(res: dict, save, which: str, quick: bool, mamba_ssm: str | None, long: bool = False,
                forward: bool = True) -> None:
    """The whole model (Nemotron-3-Nano-30B-A3B- or Nemotron-H-8B-shaped, random bf16 weights) on the
    triton backend against ``stock_hybrid``'s stock model on the same weights (one copy of the routed
    experts, shared): the trainer's forward (all logits) and decode steps in CUDA graphs, one cell at a
    time, the JSON after each. Decode states are random (timing only); ``bitwise`` is null here, the
    graph rows = prefill rows check being the GPU tests' (tests/check_cases.py). ``long``: only the
    cells ``quick`` leaves out (the later forward cells, 16k contexts). ``forward`` False: the decode
    cells only (section ``nano_decode``); with --profile, each side's kernel table of one batch-1 replay
    (``ours_profile``, ``stock_profile``)."""
    from aligned_mamba.contract import Contract
    from aligned_mamba.decode_graph import DecodeGraphs
    from aligned_mamba.models import build_model
    from aligned_mamba.models.nemotron_h import NemotronHConfig
    from benchmarks.bench_model_h200 import capture_graph

    label, spec = WHOLE[which]
    config = NemotronHConfig(**spec, dtype="bfloat16")
    ms = _import_mamba_ssm(mamba_ssm)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t_build = time.perf_counter()
    weights = LazyWeights(config, 0)
    model = build_model(config, weights, Contract(chunk_size=256, backend="triton", model_dtype="bfloat16"),
                        device="cuda")
    p = stock_weights(config, model, weights)
    stock = StockHybrid(config, p, ms)
    torch.cuda.synchronize()
    res.setdefault("whole", {})[label] = dict(
        pattern=config.hybrid_override_pattern,
        config={k: v for k, v in spec.items() if k != "hybrid_override_pattern"},
        resident_bytes=torch.cuda.memory_allocated(), build_peak_bytes=torch.cuda.max_memory_allocated(),
        build_s=time.perf_counter() - t_build,
        note="random bf16 weights; ours: triton backend (forward = model.forward, all logits; decode = DecodeGraphs "
             "replay); stock: stock_hybrid.py (cuBLAS, SDPA flash / SDPA over a [B, G, len, D] KV cache, mamba_ssm "
             "2.3.2.post1 scan, selective_state_update and norms, torch._grouped_mm experts), its decode step "
             "captured in one CUDA graph; decode states random (timing only)")
    save()
    g = torch.Generator().manual_seed(0)
    V = config.vocab_size
    if which == "tiny":
        fwd = [(2, 512)]
    elif which == "nano":
        fwd = [(4, 2048)] if quick else [(4, 2048), (4, 4096), (1, 32768)]
    else:
        fwd = [(4, 4096)] if quick else [(4, 4096), (1, 32768)]
    if long:
        fwd = fwd[1:]
    build_s = time.perf_counter() - t_build
    print(f"{label}: both models built in {build_s:.1f} s", flush=True)
    for Bsz, L in fwd if forward else []:
        ids = torch.randint(0, V, (Bsz, L), generator=g)
        seqs, ids_d = list(ids), ids.cuda()
        row = dict(shape=label, batch=Bsz, length=L, tokens=Bsz * L, **({"commit": res["commit"]} if long else {}))
        try:
            with torch.no_grad():
                lo = torch.cat(model.forward(seqs))
                ls = stock_forward(config, p, ids_d, ms).reshape(Bsz * L, V)
                row["logits_rel_diff"] = _rel(lo, ls)
                del lo, ls
                row["ours_ms"] = _bench(lambda: model.forward(seqs))
                row["stock_ms"] = _bench(lambda: stock_forward(config, p, ids_d, ms))
                row["ours_over_stock"] = row["ours_ms"] / row["stock_ms"]
        except torch.OutOfMemoryError as e:
            row["error"] = f"OutOfMemoryError: {e}"[:300]
        res["forward"].append(row)
        save()
        torch.cuda.empty_cache()
    for ctx in ((4096,) if quick or which == "tiny" else (16384,) if long else (4096, 16384)):
        per_seq = model.state_bytes_per_sequence(ctx + 64)
        for B in (1, 64, 256):
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info()[0]
            # ours' cache (B + 1 slots: the graphs' spare) must fit with room for the graph's activations
            run_b = min(B, int(0.85 * free / per_seq) - 1)
            row = dict(shape=label, batch=B, context=ctx, graph=True, bitwise=None, ours_state_bytes_per_seq=per_seq,
                       **({"commit": res["commit"]} if long else {}))
            if run_b < B:
                row["batch_run"] = run_b
                row["note"] = f"ours' cache for {B + 1} slots does not fit beside the weights; run at batch {run_b}"
            ids = torch.randint(0, V, (run_b,), generator=g)
            graphs = cache = None
            try:
                cache = noise_cache(model, run_b + 1, ctx + 64)
                graphs = DecodeGraphs(model, cache, spare_slot=run_b)
                graphs.step(list(range(run_b)), [ctx - 100] * run_b, ids)  # mid-chunk: no chunk completes
                row["ours_ms"] = _bench(graphs.graph(run_b).replay)
                if PROFILE and B == 1:
                    from benchmarks.bench_mamba_ssm_h200 import kernel_table

                    row["ours_profile"] = kernel_table(torch, graphs.graph(run_b).replay, top=25)
            except Exception as e:
                row["ours_error"] = f"{type(e).__name__}: {e}"[:300]
            del graphs, cache
            torch.cuda.empty_cache()
            st = graph = None
            try:
                st = stock.new_state(run_b, ctx + 64, seed=B)
                ids_d = ids.cuda()
                with torch.no_grad():
                    graph, _ = capture_graph(lambda: stock.step(st, ids_d, ctx - 100))
                row["stock_ms"] = _bench(graph.replay)
                if PROFILE and B == 1:
                    from benchmarks.bench_mamba_ssm_h200 import kernel_table

                    row["stock_profile"] = kernel_table(torch, graph.replay, top=25)
            except Exception as e:
                row["stock_error"] = f"{type(e).__name__}: {e}"[:300]
            st = graph = None  # freed before the next cell's
            if row.get("ours_ms") and row.get("stock_ms"):
                row["ours_over_stock"] = row["ours_ms"] / row["stock_ms"]
            res["decode"].append(row)
            save()
            torch.cuda.empty_cache()


PROFILE = False  # --profile: kernel tables of one fwd+bwd step of each side (train), one b1 replay (nano_decode)

# which cells each section owns (a merge keeps the others' from the earlier JSON)
OWNED = {
    "attention": [("attention", lambda r: r.get("phase") != "backward")],
    "mlp": [("mlp", None)],
    "sweep": [("sweep", None)],
    "model": [("forward", lambda r: r["shape"] == "nemotronh8b-slice13"),
              ("decode", lambda r: r["shape"] == "nemotronh8b-slice13")],
    "bwd_sweep": [("bwd_sweep", None)],
    "bwd_determinism": [("bwd_determinism", None)],
    "attention_bwd": [("attention", lambda r: r.get("phase") == "backward")],
    "train": [("train", lambda r: r["shape"].startswith("nemotronh8b-slice8"))],
    "nano": [("forward", lambda r: r["shape"] == "nano30b-52"), ("decode", lambda r: r["shape"] == "nano30b-52")],
    "nano_decode": [("decode", lambda r: r["shape"] == "nano30b-52")],
    "nano_train": [("train", lambda r: r["shape"].startswith("nano30b-slice8"))],
    "tiny": [("forward", lambda r: r["shape"] == "tiny-hybrid"), ("decode", lambda r: r["shape"] == "tiny-hybrid")],
    "h8b": [("forward", lambda r: r["shape"] == "nemotronh8b-52"),
            ("decode", lambda r: r["shape"] == "nemotronh8b-52")],
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--long", action="store_true", help="whole models: only the cells --quick leaves out (with "
                    "--merge, the section's earlier cells are kept)")
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--sections", default=",".join(s for s in OWNED if s not in ("tiny", "nano_decode")),
                    help=f"comma-separated, of: {', '.join(OWNED)} (default: all but tiny, a smoke run, and "
                    "nano_decode, nano's decode cells alone)")
    ap.add_argument("--merge", help="an earlier JSON whose other sections' cells are kept")
    ap.add_argument("--mamba-ssm", help="mamba_ssm's package folder (from its sdist) for the stock training step")
    ap.add_argument("--profile", action="store_true",
                    help="kernel tables of each side's fwd+bwd step (train sections) or b1 decode replay (nano_decode)")
    a = ap.parse_args()
    global PROFILE
    PROFILE = a.profile
    sections = set(a.sections.split(","))
    if sections - set(OWNED):
        ap.error(f"unknown sections {sorted(sections - set(OWNED))}; expected some of {', '.join(OWNED)}")
    import triton

    res = dict(script="benchmarks/bench_hybrid_h200.py", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, commit=git_commit() or "unknown",
               date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               forward=[], decode=[], train=[], attention=[], mlp=[], sweep=[], bwd_sweep=[], bwd_determinism=[],
               errors=[])
    stamp = dict(commit=res["commit"], date=res["date"], gpu=res["gpu"], torch=res["torch"], triton=res["triton"])
    if a.merge:
        old = json.loads(Path(a.merge).read_text())
        kept = old.get("sections") or {s: {k: old.get(k) for k in stamp} for s in ("attention", "mlp", "sweep",
                                                                                     "model")}
        for sec, owned in OWNED.items():
            if sec not in sections or (a.long and sec in WHOLE):
                for key, pick in owned:
                    res[key] += [r for r in old.get(key, []) if pick is None or pick(r)]
        for key in ("model", "copy_bandwidth_bytes_per_s", "train_note", "train_note_nano", "bwd_config", "whole"):
            if key in old and key not in res:
                res[key] = old[key]
        res["sections"] = {s: v for s, v in kept.items() if s not in sections}
    res.setdefault("sections", {}).update({s: stamp for s in sections})
    out = Path(a.out)

    def save() -> None:
        out.write_text(json.dumps(res, indent=1))

    if "attention" in sections or "copy_bandwidth_bytes_per_s" not in res:
        res["copy_bandwidth_bytes_per_s"] = copy_bandwidth()
    save()
    from aligned_mamba.ops.configs import TritonKernelConfigs

    bwd = {"cfg": TritonKernelConfigs()}

    def sweep_bwd() -> None:
        bwd["cfg"] = bwd_sweep_cells(res, save)

    for name, fn in (("attention", lambda: attention_cells(res, save, a.quick)), ("mlp", lambda: mlp_cells(res, save)),
                     ("sweep", None if a.quick else lambda: sweep_cells(res, save)),
                     ("model", None if a.no_model else lambda: model_cells(res, save, a.quick)),
                     ("bwd_sweep", None if a.quick else sweep_bwd),
                     ("attention_bwd", lambda: attention_bwd_cells(res, save, a.quick, bwd["cfg"])),
                     ("train", lambda: train_cells(res, save, a.quick, bwd["cfg"], a.mamba_ssm)),
                     ("tiny", lambda: whole_cells(res, save, "tiny", a.quick, a.mamba_ssm)),
                     ("nano", lambda: whole_cells(res, save, "nano", a.quick, a.mamba_ssm)),
                     ("nano_decode", lambda: whole_cells(res, save, "nano", a.quick, a.mamba_ssm, forward=False)),
                     ("nano_train", lambda: train_cells(res, save, a.quick, bwd["cfg"], a.mamba_ssm, "nano")),
                     ("h8b", lambda: whole_cells(res, save, "h8b", a.quick, a.mamba_ssm, a.long)),
                     ("bwd_determinism", lambda: bwd_determinism_cells(res, save))):
        if fn is None or name not in sections:
            continue
        try:
            fn()
        except Exception as e:  # keep what was measured; say what broke
            traceback.print_exc()
            res["errors"].append(f"{name}: {type(e).__name__}: {e}"[:500])
            save()
        torch.cuda.empty_cache()
    print(f"{res['gpu']} torch {res['torch']} triton {res['triton']} commit {res['commit'][:10]}")
    for r in res["attention"]:
        extra = (f"{r['ours_tflops']:.0f} vs {r['stock_tflops']:.0f} TFLOP/s" if r["phase"] != "decode" else
                 f"{r['ours_fraction_of_copy_bw']:.2f} of copy bw, bitwise {r['bitwise']} (stock {r['stock_bitwise']})")
        print(f"attn {r['phase']:7s} {r['shape']:24s} ours {r['ours_ms']:8.3f} ms stock {r['stock_ms']:8.3f} ms",
              extra)
    for r in res["mlp"]:
        print(f"mlp {r['shape']:20s} ours {r['ours_ms']:.3f} ms stock {r['stock_ms']:.3f} ms unfused",
              r.get("unfused_ms"))
    for r in res["sweep"]:
        print("sweep", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    def ms(v) -> str:
        return "-" if v is None else f"{v:.3f}"

    for r in res["forward"] + res["decode"]:
        cell = f"{r['batch']}x{r['length']}" if "length" in r else f"b{r.get('batch', r.get('tokens'))}"
        print(f"model {r['shape']} {cell} ctx {r.get('context', '-')} ours {ms(r.get('ours_ms'))} ms stock "
              f"{ms(r.get('stock_ms'))} ms", {k: v for k, v in r.items() if "error" in k or k == "batch_run"})
    for r in res["bwd_sweep"] + res["bwd_determinism"] + res["train"]:
        print("train", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    print("errors:", res["errors"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
