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
MLP alone: up_proj 4096 -> 21504, relu2, down_proj, ours (row-invariant Triton GEMMs + one relu2
pass) against cuBLAS ``F.linear`` and torch's relu + square, at 4096 and 64 rows.
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
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

H, G, D = 32, 8, 128
BF16 = torch.bfloat16


def _commit() -> str:
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def _bench(fn) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


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
        res["mlp"].append(dict(shape=f"{M}x4096->21504", tokens=M, ours_ms=ours, stock_ms=stock,
                               relu2_ms_approx=relu_ms))
        save()


PATTERN = "M-M-M*-M-M-M-"  # 13 layers: Nemotron-H-8B's 24 M / 4 * / 24 - in proportion


def hybrid_weights(config, seed: int) -> dict:
    from aligned_mamba.models.nemotron_h import expected_shapes

    g = torch.Generator(device="cuda").manual_seed(seed)
    f32, dtype = torch.float32, config.torch_dtype
    out = {}
    for name, shape in expected_shapes(config).items():
        u = torch.empty(shape, dtype=f32, device="cuda")
        if name.endswith(".A_log"):
            t = torch.log(u.uniform_(1.0, 16.0, generator=g))
        elif name.endswith(".dt_bias"):
            dt = torch.exp(u.uniform_(math.log(1e-3), math.log(1e-1), generator=g))
            t = dt + torch.log(-torch.expm1(-dt))
        elif name.endswith(".D"):
            t = torch.ones(shape, dtype=f32, device="cuda")
        elif name.endswith("conv1d.weight"):
            t = u.uniform_(-0.5, 0.5, generator=g).to(dtype)
        elif name.endswith(".bias"):
            t = (0.02 * u.normal_(generator=g)).to(dtype)
        elif "norm" in name:
            t = (1.0 + 0.05 * u.normal_(generator=g)).to(dtype)
        elif name.endswith("embeddings.weight"):
            t = u.normal_(generator=g).to(dtype)
        else:
            t = (u.normal_(generator=g) / math.sqrt(shape[-1])).to(dtype)
        out[name] = t
    return out


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
            cache = model.new_cache(B + 1, max_len=ctx + 64)
            for ts in cache.tensors:  # random states and keys: timing only
                for t in (ts or {}).values():
                    if t.is_floating_point():
                        t.normal_(0, 0.01)
                    else:
                        t.zero_()
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
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    return mamba_chunk_scan_combined, rmsnorm_fn, rms_norm_fn


def stock_forward(c, p: dict, ids: torch.Tensor, ms) -> torch.Tensor:
    """Nemotron-H as a stock trainer runs it on a batch ids [B, L] of equal lengths: logits [B, L, V]."""
    scan, gated_norm, add_norm = ms
    eps = c.layer_norm_epsilon
    Bsz, L = ids.shape
    x, residual = p["backbone.embeddings.weight"][ids], None
    for i, kind in enumerate(c.hybrid_override_pattern):
        pre = f"backbone.layers.{i}."
        normed, residual = add_norm(x, p[pre + "norm.weight"], None, residual=residual, prenorm=True, eps=eps)
        m = pre + "mixer."
        if kind == "M":
            Hm, P, Gm, N = c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size
            di = Hm * P
            z, xbc, dt = F.linear(normed, p[m + "in_proj.weight"]).split([di, di + 2 * Gm * N, Hm], dim=-1)
            xbc = F.silu(F.conv1d(xbc.transpose(1, 2), p[m + "conv1d.weight"], p[m + "conv1d.bias"],
                                  padding=c.conv_kernel - 1, groups=xbc.shape[-1])[..., :L]).transpose(1, 2)
            xs, Bm, Cm = xbc.split([di, Gm * N, Gm * N], dim=-1)
            y = scan(xs.reshape(Bsz, L, Hm, P), dt, -torch.exp(p[m + "A_log"].float()), Bm.reshape(Bsz, L, Gm, N),
                     Cm.reshape(Bsz, L, Gm, N), chunk_size=c.chunk_size, D=p[m + "D"], z=None,
                     dt_bias=p[m + "dt_bias"], dt_softplus=True)
            y = gated_norm(y.reshape(Bsz, L, di), p[m + "norm.weight"], None, z=z, eps=eps, group_size=di // Gm,
                           norm_before_gate=False)
            x = F.linear(y, p[m + "out_proj.weight"])
        elif kind == "*":
            Hq, Gk, Dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            q = F.linear(normed, p[m + "q_proj.weight"]).view(Bsz, L, Hq, Dh).transpose(1, 2)
            k = F.linear(normed, p[m + "k_proj.weight"]).view(Bsz, L, Gk, Dh).transpose(1, 2)
            v = F.linear(normed, p[m + "v_proj.weight"]).view(Bsz, L, Gk, Dh).transpose(1, 2)
            k, v = k.repeat_interleave(Hq // Gk, dim=1), v.repeat_interleave(Hq // Gk, dim=1)
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=Dh ** -0.5)
            x = F.linear(o.transpose(1, 2).reshape(Bsz, L, Hq * Dh), p[m + "o_proj.weight"])
        else:
            x = F.linear(torch.square(torch.relu(F.linear(normed, p[m + "up_proj.weight"]))), p[m + "down_proj.weight"])
    normed, _ = add_norm(x, p["backbone.norm_f.weight"], None, residual=residual, prenorm=True, eps=eps)
    return F.linear(normed, p["lm_head.weight"])


def train_cells(res: dict, save, quick: bool, cfg, mamba_ssm: str | None) -> None:
    from aligned_mamba.contract import Contract
    from aligned_mamba.models import build_model
    from aligned_mamba.models.nemotron_h import NemotronHConfig

    config = NemotronHConfig(hybrid_override_pattern=TRAIN_PATTERN, vocab_size=131072, hidden_size=4096,
                             num_attention_heads=H, num_key_value_heads=G, head_dim=D, intermediate_size=21504,
                             ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64, n_groups=8, chunk_size=256,
                             dtype="bfloat16")
    weights = hybrid_weights(config, 0)
    names = sorted(weights)
    ours_p = {k: v.clone().requires_grad_() for k, v in weights.items()}
    stock_p = {k: v.clone().requires_grad_() for k, v in weights.items()}
    del weights
    contract = Contract(chunk_size=256, backend="triton", model_dtype="bfloat16", kernel_configs=cfg)
    try:
        ms = _import_mamba_ssm(mamba_ssm)
    except Exception as e:
        ms = None
        res["errors"].append(f"train: stock step unavailable: {type(e).__name__}: {e}"[:300])
    res["train_note"] = (f"fwd+bwd of an 8-layer Nemotron-H-8B slice ({TRAIN_PATTERN}) with embedding and lm_head; "
                         "stock: SDPA flash, cuBLAS, mamba_ssm 2.3.2.post1's Triton scan and norms")
    g = torch.Generator().manual_seed(0)
    V = config.vocab_size
    for Bsz, L in ([(4, 4096)] if quick else [(4, 4096), (1, 16384)]):
        ids = torch.randint(0, V, (Bsz, L), generator=g)
        tgt = torch.randint(0, V, (Bsz, L), generator=g).cuda()
        seqs = list(ids)
        ids_d = ids.cuda()

        def ours_step():
            # as a trainer does: the layers built from the parameters on each step (A = -exp(A_log) etc.)
            logits = torch.cat(build_model(config, ours_p, contract, device="cuda").forward(seqs))
            loss = F.cross_entropy(logits.float(), tgt.reshape(-1), reduction="sum")
            return logits, torch.autograd.grad(loss, [ours_p[k] for k in names])

        def stock_step():
            logits = stock_forward(config, stock_p, ids_d, ms).reshape(Bsz * L, V)
            loss = F.cross_entropy(logits.float(), tgt.reshape(-1), reduction="sum")
            return logits, torch.autograd.grad(loss, [stock_p[k] for k in names])

        row = dict(shape=f"nemotronh8b-slice8 {Bsz}x{L}", tokens=Bsz * L)
        for side, step in (("ours", ours_step), ("stock", stock_step if ms is not None else None)):
            if step is None:
                row[f"{side}_ms"] = row[f"{side}_peak_bytes"] = None
                continue
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            logits, grads = step()
            torch.cuda.synchronize()
            row[f"{side}_peak_bytes"] = torch.cuda.max_memory_allocated() - base
            row[f"_{side}_logits"] = logits.detach()
            if side == "ours":
                again = step()[1]
                row["ours_deterministic"] = all(torch.equal(a, b) for a, b in zip(grads, again))
                del again
            del logits, grads
            row[f"{side}_ms"] = _bench(lambda: step())
        lo, ls = row.pop("_ours_logits", None), row.pop("_stock_logits", None)
        if lo is not None and ls is not None:
            row["logits_rel_diff"] = ((lo.float() - ls.float()).norm() / ls.float().norm()).item()
        del lo, ls
        res["train"].append(row)
        save()
        torch.cuda.empty_cache()


# which cells each section owns (a merge keeps the others' from the earlier JSON)
OWNED = {
    "attention": [("attention", lambda r: r.get("phase") != "backward")],
    "mlp": [("mlp", None)],
    "sweep": [("sweep", None)],
    "model": [("forward", None), ("decode", None)],
    "bwd_sweep": [("bwd_sweep", None)],
    "bwd_determinism": [("bwd_determinism", None)],
    "attention_bwd": [("attention", lambda r: r.get("phase") == "backward")],
    "train": [("train", None)],
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--sections", default=",".join(OWNED), help=f"comma-separated, of: {', '.join(OWNED)}")
    ap.add_argument("--merge", help="an earlier JSON whose other sections' cells are kept")
    ap.add_argument("--mamba-ssm", help="mamba_ssm's package folder (from its sdist) for the stock training step")
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    if sections - set(OWNED):
        ap.error(f"unknown sections {sorted(sections - set(OWNED))}; expected some of {', '.join(OWNED)}")
    import triton

    res = dict(script="benchmarks/bench_hybrid_h200.py", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, commit=_commit(),
               date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               forward=[], decode=[], train=[], attention=[], mlp=[], sweep=[], bwd_sweep=[], bwd_determinism=[],
               errors=[])
    stamp = dict(commit=res["commit"], date=res["date"], gpu=res["gpu"], torch=res["torch"], triton=res["triton"])
    if a.merge:
        old = json.loads(Path(a.merge).read_text())
        kept = old.get("sections") or {s: {k: old.get(k) for k in stamp} for s in ("attention", "mlp", "sweep",
                                                                                     "model")}
        for sec, owned in OWNED.items():
            if sec not in sections:
                for key, pick in owned:
                    res[key] += [r for r in old.get(key, []) if pick is None or pick(r)]
        for key in ("model", "copy_bandwidth_bytes_per_s", "train_note", "bwd_config"):
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
        print(f"mlp {r['shape']:20s} ours {r['ours_ms']:.3f} ms stock {r['stock_ms']:.3f} ms")
    for r in res["sweep"]:
        print("sweep", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    for r in res["forward"] + res["decode"]:
        print(f"model {r['shape']} {r.get('batch', r.get('tokens'))} ours {r['ours_ms']:.3f} ms")
    for r in res["bwd_sweep"] + res["bwd_determinism"] + res["train"]:
        print("train", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    print("errors:", res["errors"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
