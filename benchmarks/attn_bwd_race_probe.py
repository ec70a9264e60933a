#!/usr/bin/env python3
"""Which attention-backward launches give different bits run to run, and where (one GPU).

    python3 benchmarks/attn_bwd_race_probe.py --out OUT/attn_bwd_race.json [--runs 10]
    compute-sanitizer --tool racecheck python3 benchmarks/attn_bwd_race_probe.py --one 64,32,64,32,4,2 --tokens 512

``bench_hybrid_h200.py``'s ``bwd_determinism`` cells found dK (never dQ or dV) differing between runs
of the same backward under launches with 32-row query steps (``attn_bwd_kv_block_m`` 32) at 32 / 8
heads x 128, and none at 16 / 1 x 64. Each variant here changes one thing of such a launch (the
pipeline's stages, head_dim, query heads per key/value head, the key block) and counts, over
``--runs`` backwards of one random input, the runs whose dq / dk / dv differ from the first, the
most elements differing and the relative size of the largest difference. ``--one`` runs a single
backward of one launch (for compute-sanitizer's racecheck on the dK/dV kernel).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BF16 = torch.bfloat16
# (kv_block_n, kv_block_m, q_block_m, q_block_n, warps, stages), H, G, D
VARIANTS = [
    ((64, 32, 64, 32, 4, 2), 32, 8, 128),   # the bench's differing launch
    ((64, 32, 64, 32, 4, 1), 32, 8, 128),   # no software pipelining
    ((64, 64, 64, 64, 4, 2), 32, 8, 128),   # the pinned launch (64-row steps)
    ((64, 32, 64, 32, 4, 2), 32, 8, 64),    # head_dim 64
    ((64, 32, 64, 32, 4, 2), 8, 8, 128),    # GQA 1 (32 tokens a step)
    ((64, 32, 64, 32, 4, 2), 16, 1, 128),   # GQA 16 (2 tokens a step)
    ((128, 32, 128, 32, 4, 2), 32, 8, 128),  # 128-key blocks
]


def _cfg(c):
    from aligned_mamba.ops.configs import TritonKernelConfigs

    n, m, qm, qn, w, st = c
    cfg = dataclasses.replace(TritonKernelConfigs(), attn_bwd_kv_block_n=n, attn_bwd_q_block_m=qm,
                              attn_bwd_q_block_n=qn, attn_bwd_warps=w, attn_bwd_stages=st)
    object.__setattr__(cfg, "attn_bwd_kv_block_m", m)  # past the check: the probe studies the launches it refuses
    return cfg


def _inputs(T: int, H: int, G: int, D: int, seed: int):
    from aligned_mamba.ops.attention.triton import attention_triton_packed
    from aligned_mamba.ops.configs import TritonKernelConfigs

    g = torch.Generator(device="cuda").manual_seed(seed)
    q, do = (torch.randn(T, H, D, device="cuda", generator=g).to(BF16) for _ in range(2))
    k, v = (torch.randn(T, G, D, device="cuda", generator=g).to(BF16) for _ in range(2))
    cu = torch.tensor([0, T])
    lse = torch.empty(T, H, device="cuda")
    o = attention_triton_packed(q, k, v, cu, cu, scale=D ** -0.5, cfg=TritonKernelConfigs(), lse=lse)
    return (q, k, v, o, lse, do, cu, cu), D ** -0.5


def probe(c, H: int, G: int, D: int, T: int, runs: int) -> dict:
    from aligned_mamba.ops.attention.triton_backward import attention_backward_triton

    args, scale = _inputs(T, H, G, D, seed=T + H + D)
    cfg = _cfg(c)
    first = attention_backward_triton(*args, scale=scale, cfg=cfg)
    differ, most, worst = [0, 0, 0], [0, 0, 0], [0.0, 0.0, 0.0]
    rows = torch.zeros(T, dtype=torch.bool, device="cuda")
    for _ in range(runs - 1):
        again = attention_backward_triton(*args, scale=scale, cfg=cfg)
        for i, (x, y) in enumerate(zip(first, again)):
            ne = x != y
            n = int(ne.sum())
            differ[i] += n > 0
            most[i] = max(most[i], n)
            if n:
                worst[i] = max(worst[i], ((x.float() - y.float()).abs().max() / x.float().abs().max()).item())
                if i == 1:
                    rows |= ne.flatten(1).any(1)
    kb = c[0]
    blocks = sorted({int(r) // kb for r in rows.nonzero().flatten().tolist()})
    return dict(config=list(c), heads=H, kv_heads=G, head_dim=D, tokens=T, runs=runs,
                runs_differing_dq_dk_dv=differ, most_elements_differing=most, max_rel_diff=worst,
                dk_rows_differing=int(rows.sum()), dk_key_blocks_differing=len(blocks),
                dk_key_blocks=T // kb, dk_first_blocks=blocks[:8])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--one", help="one backward of this launch (n,m,qm,qn,warps,stages) at 32 / 8 heads x 128")
    a = ap.parse_args()
    if a.one:
        from aligned_mamba.ops.attention.triton_backward import attention_backward_triton

        args, scale = _inputs(a.tokens, 32, 8, 128, seed=1)
        attention_backward_triton(*args, scale=scale, cfg=_cfg(tuple(map(int, a.one.split(",")))))
        torch.cuda.synchronize()
        print("one backward done")
        return 0
    import triton

    res = dict(script="benchmarks/attn_bwd_race_probe.py", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               cells=[])
    for c, H, G, D in VARIANTS:
        for T in (a.tokens, 16384):
            try:
                r = probe(c, H, G, D, T, a.runs)
            except Exception as e:  # a launch that does not fit: say so, go on
                r = dict(config=list(c), heads=H, kv_heads=G, head_dim=D, tokens=T, error=str(e)[:200])
            res["cells"].append(r)
            print(r, flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps(res, indent=1))
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
