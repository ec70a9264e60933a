"""Decode attention over a paged KV cache against the slot cache, in CUDA graphs (one H200); split keys.

Nemotron-H-8B's attention shape (32 heads, 8 KV heads, head_dim 128, bf16): one decode step of B
sequences at ``--context`` tokens, the kernel alone (``attention_triton``, decode tiles), captured in
a CUDA graph; the slot cache [B, max_len, G, D] against pages of ``--page`` keys handed out in
shuffled order (the block table read on the device), at each ``--split`` (``attn_split_n``; 0: no
split, a program per sequence and KV head; S > 0: a program per split and the combine). Records the
median replay times, whether the paged rows equal the slot rows bit for bit, and torch SDPA over the
same contiguous keys as the stock reference. ``--prefill`` tokens: the prefill's cost of the split's
fold, the kernel over one sequence launched 8 times in a graph (8 attention layers' worth) at each
split, against SDPA flash's 8 launches. One JSON: GPU, versions, commit, date.

    python benchmarks/bench_paged_attention_h200.py --out benchmarks/results/h200_paged_attention.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_h200 import git_commit  # noqa: E402

H, G, D = 32, 8, 128
BF16 = torch.bfloat16




def _graph_ms(fn, reps: int = 50) -> float:
    from benchmarks.gpu_validate import captured

    g = captured(fn)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def cell(B: int, ctx: int, page: int, splits: list[int]) -> list[dict]:
    import dataclasses

    import torch.nn.functional as F

    from aligned_mamba.layers.attention import KVPages
    from aligned_mamba.ops.attention.blocked import page_index
    from aligned_mamba.ops.attention.triton import attention_triton, decode_tiles
    from aligned_mamba.ops.configs import TritonKernelConfigs

    g = torch.Generator(device="cuda").manual_seed(B)
    kc = (torch.randn(B, ctx, G, D, device="cuda", generator=g) * 0.5).to(BF16)
    vc = torch.randn(B, ctx, G, D, device="cuda", generator=g).to(BF16)
    q = torch.randn(B, H, D, device="cuda", generator=g).to(BF16)
    pages = KVPages(B, ctx, page, B * -(-ctx // page), "cuda")
    pages.free = torch.randperm(pages.num_pages, generator=torch.Generator().manual_seed(0)).tolist()
    pages.ensure(list(range(B)), [ctx] * B)
    kp = torch.empty(pages.num_pages, page, G, D, dtype=BF16, device="cuda")
    vp = torch.empty_like(kp)
    slot = torch.arange(B, device="cuda").repeat_interleave(ctx)
    pos = torch.arange(ctx, device="cuda").repeat(B)
    pg, off = page_index(pages.table, slot, pos, page)
    kp[pg, off], vp[pg, off] = kc.reshape(-1, G, D), vc.reshape(-1, G, D)
    del slot, pos, pg, off
    tiles = decode_tiles(torch.arange(B, device="cuda"), torch.full((B,), ctx - 1, device="cuda"))
    scale = D ** -0.5
    qs, ks, vs = q[:, :, None], kc.transpose(1, 2), vc.transpose(1, 2)  # [B, H, 1, D], [B, G, ctx, D]
    try:
        sdpa_ms = _graph_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True))
    except RuntimeError as e:  # a reference only: the cell stands without it
        print(f"sdpa: {e}".splitlines()[0], flush=True)
        sdpa_ms = None
    gbytes = 2 * B * ctx * G * D * 2 / 1e9
    rows, first = [], None
    for split in splits:
        cfg = dataclasses.replace(TritonKernelConfigs(), attn_split_n=split)
        slot_out = attention_triton(q, kc, vc, tiles, scale=scale, cfg=cfg)
        paged_out = attention_triton(q, kp, vp, tiles, scale=scale, cfg=cfg, block_table=pages.table)
        slot_ms = _graph_ms(lambda: attention_triton(q, kc, vc, tiles, scale=scale, cfg=cfg))
        paged_ms = _graph_ms(lambda: attention_triton(q, kp, vp, tiles, scale=scale, cfg=cfg,
                                                      block_table=pages.table))
        first = slot_out if first is None else first
        rows.append(dict(batch=B, context=ctx, page=page, split=split, slot_ms=slot_ms, paged_ms=paged_ms,
                         sdpa_ms=sdpa_ms, slot_gbps=gbytes / (slot_ms * 1e-3), paged_gbps=gbytes / (paged_ms * 1e-3),
                         bitwise=bool(torch.equal(slot_out, paged_out)),
                         # the contract's point: another split gives other bits (so it is a contract field)
                         same_bits_as_first_split=bool(torch.equal(slot_out, first))))
    return rows


def prefill_cell(tokens: int, splits: list[int], layers: int = 8) -> list[dict]:
    """One sequence of ``tokens``: the prefill kernel launched ``layers`` times in one graph, at each split."""
    import dataclasses

    import torch.nn.functional as F

    from aligned_mamba.ops.attention.triton import attention_triton, prefill_tiles
    from aligned_mamba.ops.configs import TritonKernelConfigs

    g = torch.Generator(device="cuda").manual_seed(tokens)
    q = torch.randn(tokens, H, D, device="cuda", generator=g).to(BF16)
    k = (torch.randn(1, tokens, G, D, device="cuda", generator=g) * 0.5).to(BF16)
    v = torch.randn(1, tokens, G, D, device="cuda", generator=g).to(BF16)
    scale = D ** -0.5
    flops = layers * 4 * H * D * tokens * tokens / 2  # causal: half of the two dots
    qs, ks, vs = q.transpose(0, 1)[None], k[0].transpose(0, 1)[None], v[0].transpose(0, 1)[None]
    try:
        sdpa_ms = _graph_ms(lambda: [F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                                     for _ in range(layers)], reps=10)
    except RuntimeError as e:
        print(f"sdpa: {e}".splitlines()[0], flush=True)
        sdpa_ms = None
    rows = []
    for split in splits:
        cfg = dataclasses.replace(TritonKernelConfigs(), attn_split_n=split)
        tiles = prefill_tiles([0, tokens], [0], [0], H // G, cfg, "cuda")
        ms = _graph_ms(lambda: [attention_triton(q, k, v, tiles, scale=scale, cfg=cfg) for _ in range(layers)],
                       reps=10)
        rows.append(dict(tokens=tokens, layers=layers, split=split, ours_ms=ms, sdpa_ms=sdpa_ms,
                         ours_tflops=flops / (ms * 1e-3) / 1e12))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/h200_paged_attention.json"))
    ap.add_argument("--context", type=int, nargs="+", default=[16384, 4096])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--page", type=int, default=256)
    ap.add_argument("--split", type=int, nargs="+", default=[0, 512, 1024, 2048])
    ap.add_argument("--prefill", type=int, nargs="*", default=[4096, 16384])
    args = ap.parse_args()
    import triton

    res = dict(script="benchmarks/bench_paged_attention_h200.py", gpu=torch.cuda.get_device_name(),
               torch=torch.__version__, triton=triton.__version__, commit=git_commit() or "unknown",
               date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               shape=dict(heads=H, kv_heads=G, head_dim=D, dtype="bfloat16"), decode=[], prefill=[])
    # the cells in the order they matter (a time limit keeps the first): batch 1 at the longest context first
    for B in args.batch:
        for ctx in args.context:
            if B * ctx * G * D * 2 * 4 > 60e9:  # slot cache and pages, keys and values
                continue
            with torch.no_grad():
                rows = cell(B, ctx, args.page, args.split)
            res["decode"] += rows
            for r in rows:
                print(json.dumps(r), flush=True)
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
            torch.cuda.empty_cache()
    for tokens in args.prefill:
        with torch.no_grad():
            rows = prefill_cell(tokens, args.split)
        res["prefill"] += rows
        for r in rows:
            print(json.dumps(r), flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
