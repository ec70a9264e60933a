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

CUDA-event medians (triton.testing.do_bench, median) after a warm-up call. The JSON is written after
every entry; it names the GPU, torch, triton, the commit (GIT_COMMIT, else git's HEAD) and the date.
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-model", action="store_true")
    a = ap.parse_args()
    import triton

    res = dict(script="benchmarks/bench_hybrid_h200.py", gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, commit=_commit(),
               date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               forward=[], decode=[], train=[], attention=[], mlp=[], sweep=[], errors=[],
               train_note="no attention backward yet: training a hybrid on the GPU is refused")
    out = Path(a.out)

    def save() -> None:
        out.write_text(json.dumps(res, indent=1))

    res["copy_bandwidth_bytes_per_s"] = copy_bandwidth()
    save()
    for name, fn in (("attention", lambda: attention_cells(res, save, a.quick)), ("mlp", lambda: mlp_cells(res, save)),
                     ("sweep", None if a.quick else lambda: sweep_cells(res, save)),
                     ("model", None if a.no_model else lambda: model_cells(res, save, a.quick))):
        if fn is None:
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
        extra = (f"{r['ours_tflops']:.0f} vs {r['stock_tflops']:.0f} TFLOP/s" if r["phase"] == "prefill" else
                 f"{r['ours_fraction_of_copy_bw']:.2f} of copy bw, bitwise {r['bitwise']} (stock {r['stock_bitwise']})")
        print(f"attn {r['phase']:7s} {r['shape']:24s} ours {r['ours_ms']:8.3f} ms stock {r['stock_ms']:8.3f} ms",
              extra)
    for r in res["mlp"]:
        print(f"mlp {r['shape']:20s} ours {r['ours_ms']:.3f} ms stock {r['stock_ms']:.3f} ms")
    for r in res["sweep"]:
        print("sweep", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    for r in res["forward"] + res["decode"]:
        print(f"model {r['shape']} {r.get('batch', r.get('tokens'))} ours {r['ours_ms']:.3f} ms")
    print("errors:", res["errors"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
