"""Decode attention over a paged KV cache against the slot cache, in CUDA graphs (one H200).

Nemotron-H-8B's attention shape (32 heads, 8 KV heads, head_dim 128, bf16): one decode step of B
sequences at ``--context`` tokens, the kernel alone (``attention_triton``, decode tiles), captured in
a CUDA graph; the slot cache [B, max_len, G, D] against pages of ``--page`` keys handed out in
shuffled order (the block table read on the device). Records the median replay times, whether the
paged rows equal the slot rows bit for bit, and torch SDPA over the same contiguous keys as the
stock reference. One JSON: GPU, versions, commit, date.

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


def cell(B: int, ctx: int, page: int) -> dict:
    import torch.nn.functional as F

    from aligned_mamba.layers.attention import KVPages
    from aligned_mamba.ops.attention.blocked import page_index
    from aligned_mamba.ops.attention.triton import attention_triton, decode_tiles
    from aligned_mamba.ops.configs import TritonKernelConfigs

    cfg = TritonKernelConfigs()
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
    tiles = decode_tiles(torch.arange(B, device="cuda"), torch.full((B,), ctx - 1, device="cuda"))
    scale = D ** -0.5
    slot_out = attention_triton(q, kc, vc, tiles, scale=scale, cfg=cfg)
    paged_out = attention_triton(q, kp, vp, tiles, scale=scale, cfg=cfg, block_table=pages.table)
    slot_ms = _graph_ms(lambda: attention_triton(q, kc, vc, tiles, scale=scale, cfg=cfg))
    paged_ms = _graph_ms(lambda: attention_triton(q, kp, vp, tiles, scale=scale, cfg=cfg, block_table=pages.table))
    qs, ks, vs = q[:, :, None], kc.transpose(1, 2), vc.transpose(1, 2)  # [B, H, 1, D], [B, G, ctx, D]
    try:
        sdpa_ms = _graph_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True))
    except RuntimeError as e:  # a reference only: the cell stands without it
        print(f"sdpa: {e}".splitlines()[0], flush=True)
        sdpa_ms = None
    gbytes = 2 * B * ctx * G * D * 2 / 1e9
    return dict(batch=B, context=ctx, page=page, slot_ms=slot_ms, paged_ms=paged_ms, sdpa_ms=sdpa_ms,
                paged_gbps=gbytes / (paged_ms * 1e-3), bitwise=bool(torch.equal(slot_out, paged_out)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/h200_paged_attention.json"))
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--page", type=int, default=256)
    args = ap.parse_args()
    import triton

    res = dict(script="benchmarks/bench_paged_attention_h200.py", gpu=torch.cuda.get_device_name(),
               torch=torch.__version__, triton=triton.__version__, commit=git_commit() or "unknown",
               date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               shape=dict(heads=H, kv_heads=G, head_dim=D, dtype="bfloat16"), decode=[])
    for ctx in args.context:
        for B in args.batch:
            if B * ctx * G * D * 2 * 4 > 60e9:  # slot cache and pages, keys and values
                continue
            with torch.no_grad():
                r = cell(B, ctx, args.page)
            res["decode"].append(r)
            print(json.dumps(r), flush=True)
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
