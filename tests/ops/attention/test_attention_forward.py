"""The Triton attention kernel (``ops.attention.triton``): logic, schedules, accuracy, and its sm_90 code.

- interpreter (the Triton interpreter, CPU): fp32 and tiny shapes (the interpreter runs each program
  in numpy). Each row must be the same bits whether it is computed in a prefill, a chunk continuing
  from cached keys, a decode step or beside other sequences, and match the fp64 reference to fp32
  rounding. The interpreter proves the logic (the tables, the masks, the no-op blocks).
- gpu (skipped without CUDA; run on the H200): bf16 rows are the same bits in a prefill, chunks
  continuing from the cache, decode steps and beside other sequences, at head_dim 64 and 128 and GQA
  1 to 16; torch's SDPA (the stock path) changes a row's bits between a prefill and a decode step, so
  the check can fail. Accuracy against fp64 at the bf16 floor: within 1.5x of SDPA's own error on the
  same inputs. Whole hybrid models (attention first, last, two in a row; GQA 1, 4, 8; head_dim 64 and
  128): every exact-replay case of ``check`` gives 0 differing rows, the baseline differs; CUDA-graph
  decode rows equal the trainer's single pass.
- compile (sm_90, the H200, offline, no GPU, to PTX: ptxas is left to the GPU tests): the forward (and
  the relu2 kernel) in the configurations the backend launches keeps the arithmetic the bits rest on:
  no FMA contraction, dots on tensor cores for bf16 models, also when the forward saves its
  log-sum-exp for the backward.
"""


from __future__ import annotations

import dataclasses
import math

import interpreted  # noqa: F401  (before triton: it switches the Triton interpreter on; tests/ops/conftest.py)
import pytest
import torch
from attention_cases import BF16, HYBRIDS, assert_the_kernels_compile_for_sm90, gpu_cfg, gpu_qkv, hybrid

from aligned_mamba.ops.attention import attention_naive
from aligned_mamba.ops.attention.triton import (
    attention_triton,
    attention_triton_packed,
    decode_tiles,
    prefill_tiles,
)
from aligned_mamba.ops.configs import TritonKernelConfigs

# small blocks so that a few dozen tokens cross several key blocks and tiles
CFG = dataclasses.replace(TritonKernelConfigs(), attn_block_n=16, attn_block_m=32, attn_decode_block_m=16)


def _qkv(T: int, H: int, G: int, D: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(T, n, D, generator=g) for n in (H, G, G))


def _cu(ns: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()], dtype=torch.int64)


@pytest.mark.interpreter
@pytest.mark.parametrize("H,G,D", [(2, 2, 64), (4, 1, 64), (8, 2, 128), (3, 1, 64)])
def test_prefill_matches_the_fp64_reference(H: int, G: int, D: int) -> None:
    ns = [37, 5, 20]
    q, k, v = _qkv(sum(ns), H, G, D, seed=H * 10 + G)
    cu = _cu(ns)
    out = attention_triton_packed(q, k, v, cu, cu, scale=D ** -0.5, cfg=CFG)
    ref = attention_naive(q, k, v, cu, cu, scale=D ** -0.5)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("H,G", [(4, 2), (2, 2), (16, 1)])
def test_rows_equal_across_prefill_chunks_decode_and_batch(H: int, G: int) -> None:
    """One sequence of 41 tokens in a slot cache: a single prefill, chunks of 13/1/27 continuing from
    the cache, decode steps one token at a time, and the same tokens beside another sequence."""
    D, n = 64, 41
    q, k, v = _qkv(n, H, G, D, seed=7)
    scale = D ** -0.5
    kc = torch.full((3, 64, G, D), float("nan"))  # unwritten cache rows hold garbage
    vc = torch.full((3, 64, G, D), float("nan"))
    kc[1, :n], vc[1, :n] = k, v
    slot = torch.tensor([1])

    def run(lo: int, hi: int, decode: bool) -> torch.Tensor:
        if decode:
            tiles = decode_tiles(slot, torch.tensor([lo]))
        else:
            tiles = prefill_tiles([0, hi - lo], [lo], slot, H // G, CFG, "cpu")
        return attention_triton(q[lo:hi], kc, vc, tiles, scale=scale, cfg=CFG)

    full = run(0, n, False)
    chunks = torch.cat([run(0, 13, False), run(13, 14, False), run(14, n, False)])
    steps = torch.cat([run(0, 1, False)] + [run(t, t + 1, True) for t in range(1, n)])
    assert torch.equal(chunks, full)
    assert torch.equal(steps, full)
    # beside another sequence (slot 2, 19 tokens) in one packed prefill, and decoded beside it
    q2, k2, v2 = _qkv(19, H, G, D, seed=8)
    kc[2, :19], vc[2, :19] = k2, v2
    both = attention_triton(torch.cat([q2, q]), kc, vc, prefill_tiles([0, 19, 19 + n], [0, 0], [2, 1], H // G, CFG,
                                                                      "cpu"), scale=scale, cfg=CFG)
    assert torch.equal(both[19:], full)
    pair = attention_triton(torch.stack([q2[18], q[30]]), kc, vc, decode_tiles(torch.tensor([2, 1]),
                                                                               torch.tensor([18, 30])),
                            scale=scale, cfg=CFG)
    assert torch.equal(pair[1], full[30]) and torch.equal(pair[0], both[18])


@pytest.mark.interpreter
def test_the_key_block_is_part_of_the_bits() -> None:
    """The mismatch the fixed blocks prevent: other key blocks give other bits (so the block size is
    a contract field, not a free launch choice)."""
    H, G, D, n = 2, 1, 64, 70
    q, k, v = _qkv(n, H, G, D, seed=3)
    cu = _cu([n])
    a = attention_triton_packed(q, k, v, cu, cu, scale=D ** -0.5, cfg=CFG)
    b = attention_triton_packed(q, k, v, cu, cu, scale=D ** -0.5, cfg=dataclasses.replace(CFG, attn_block_n=32))
    assert not torch.equal(a[16:], b[16:])
    assert (a - b).abs().max().item() < 1e-5


@pytest.mark.interpreter
def test_bad_input_is_refused() -> None:
    q, k, v = _qkv(4, 3, 2, 64, seed=0)
    with pytest.raises(ValueError, match="multiple"):
        attention_triton_packed(q, k, v, _cu([4]), _cu([4]), scale=0.1, cfg=CFG)
    q, k, v = _qkv(4, 64, 1, 64, seed=0)  # 64 heads per key/value head: over the 32-row tile
    with pytest.raises(ValueError, match="exceed the attention tile"):
        attention_triton_packed(q, k, v, _cu([4]), _cu([4]), scale=0.1, cfg=CFG)


@pytest.mark.interpreter
def test_the_backends_attention_step_writes_the_cache_and_keeps_the_rows() -> None:
    """``TritonBackend.attention`` (its GPU path, run here by the interpreter): a prefill of two
    sequences, then a decode step and a chunk, each through the step's tables; rows equal one pass."""
    from aligned_mamba.ops.backend import TritonBackend
    from aligned_mamba.ops.step import Step

    be = TritonBackend(CFG, torch.device("cpu"), kernels=True)  # the GPU path's logic, through the interpreter
    H, G, D, n = 4, 2, 64, 30
    q, k, v = _qkv(2 * n, H, G, D, seed=11)
    kc, vc = torch.zeros(3, 40, G, D), torch.zeros(3, 40, G, D)
    one = be.attention(q, k, v, kc, vc, Step.make([2, 0], [0, 0], [n, n]), scale=0.125)
    assert torch.equal(kc[2, :n], k[:n]) and torch.equal(vc[0, :n], v[n:])
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    a = be.attention(q[:20], k[:20], v[:20], kc2, vc2, Step.make([2], [0], [20]), scale=0.125)
    b = be.attention(q[20:21], k[20:21], v[20:21], kc2, vc2, Step.make([2], [20], [1]), scale=0.125)
    c = be.attention(q[21:n], k[21:n], v[21:n], kc2, vc2, Step.make([2], [21], [n - 21]), scale=0.125)
    assert torch.equal(torch.cat([a, b, c]), one[:n])
    assert torch.equal(kc2[2, :n], kc[2, :n])


# -- gpu ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,G", [(8, 8), (16, 4), (32, 8), (16, 1)])
def test_rows_equal_across_schedules_bf16(H: int, G: int, D: int) -> None:
    from aligned_mamba.ops.attention.triton import attention_triton, decode_tiles, prefill_tiles

    cfg, n, scale = gpu_cfg(), 3000, D ** -0.5
    q, k, v = gpu_qkv(n, H, G, D, seed=H + G + D)
    kc = torch.full((4, 4096, G, D), float("nan"), dtype=BF16, device="cuda")  # unwritten rows: garbage
    vc = kc.clone()
    kc[2, :n], vc[2, :n] = k, v
    slot = torch.tensor([2], device="cuda")

    def prefill(lo: int, hi: int) -> torch.Tensor:
        t = prefill_tiles([0, hi - lo], [lo], [2], H // G, cfg, "cuda")
        return attention_triton(q[lo:hi], kc, vc, t, scale=scale, cfg=cfg)

    full = prefill(0, n)
    assert torch.isfinite(full).all()
    cuts = [0, 1000, 1001, 1777, n]
    assert torch.equal(torch.cat([prefill(a, b) for a, b in zip(cuts, cuts[1:])]), full)
    # decode steps at many positions, one launch each and all in one launch (a batch of 64 slots' rows)
    pos = torch.tensor([0, 1, 63, 64, 65, 127, 128, 1000, 2047, 2048, 2999], device="cuda")
    one = torch.stack([attention_triton(q[p:p + 1], kc, vc, decode_tiles(slot, pos[i:i + 1]), scale=scale,
                                        cfg=cfg)[0] for i, p in enumerate(pos.tolist())])
    assert torch.equal(one, full[pos])
    many = attention_triton(q[pos], kc, vc, decode_tiles(slot.expand(pos.numel()), pos), scale=scale,
                            cfg=cfg)  # an expanded slot table too
    assert torch.equal(many, full[pos])
    # beside another sequence in one packed prefill
    q2, k2, v2 = gpu_qkv(777, H, G, D, seed=99)
    kc[0, :777], vc[0, :777] = k2, v2
    t = prefill_tiles([0, 777, 777 + n], [0, 0], [0, 2], H // G, cfg, "cuda")
    both = attention_triton(torch.cat([q2, q]), kc, vc, t, scale=scale, cfg=cfg)
    assert torch.equal(both[777:], full)


@pytest.mark.gpu
def test_the_eager_baseline_rows_change_with_the_schedule() -> None:
    """The mismatch the kernel prevents: the eager baseline (``attention_stock``: model-dtype matmuls
    whose shapes follow the call, cuBLAS here) gives a row other bits in a decode step than in the
    prefill. (torch's SDPA flash kernel kept a decode row's bits at these shapes on the H200:
    benchmarks/bench_hybrid_h200.py records ``stock_bitwise``.)"""
    from aligned_mamba.ops.attention import attention_stock

    H, G, D, n = 32, 8, 128, 2048
    q, k, v = gpu_qkv(n, H, G, D, seed=5)
    cu = torch.tensor([0, n])
    full = attention_stock(q, k, v, cu, cu, scale=D ** -0.5)
    differ = sum(not torch.equal(attention_stock(q[p:p + 1], k[:p + 1], v[:p + 1], torch.tensor([0, 1]),
                                                 torch.tensor([0, p + 1]), scale=D ** -0.5)[0], full[p])
                 for p in range(1, n, 97))
    assert differ > 0


@pytest.mark.gpu
@pytest.mark.parametrize("split", [0, 512])
@pytest.mark.parametrize("D", [64, 128])
def test_accuracy_at_the_bf16_floor(D: int, split: int) -> None:
    import dataclasses

    import torch.nn.functional as F

    from aligned_mamba.ops.attention import attention_naive
    from aligned_mamba.ops.attention.triton import attention_triton_packed

    H, G, ns = 16, 4, [1500, 37, 700]
    q, k, v = gpu_qkv(sum(ns), H, G, D, seed=D)
    cu = torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()])
    cfg = dataclasses.replace(gpu_cfg(), attn_split_n=split)  # split keys (attn_split_n): the same floor
    ours = attention_triton_packed(q, k, v, cu, cu, scale=D ** -0.5, cfg=cfg)
    ref = attention_naive(q.double(), k.double(), v.double(), cu, cu, scale=D ** -0.5)
    stock = torch.cat([F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1)[None] for x in (q, k, v)),
                                                      is_causal=True, enable_gqa=True)[0].transpose(0, 1)
                       for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])

    def err(x: torch.Tensor) -> float:
        return ((x.double() - ref).norm() / ref.norm()).item()

    assert math.isfinite(err(ours)) and err(ours) <= 1.5 * err(stock) + 1e-4, (err(ours), err(stock))
    decode = attention_triton_packed(q[cu[1:] - 1], k, v, torch.arange(len(ns) + 1), cu, scale=D ** -0.5,
                                     cfg=cfg, decode=True)
    assert torch.equal(decode, ours[cu[1:] - 1])


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(HYBRIDS))
def test_hybrid_check_on_triton_backend_is_bit_identical(layout: str) -> None:
    from check_cases import assert_every_case

    assert_every_case(hybrid(layout))


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 64])
def test_hybrid_graph_decode_rows_equal_the_single_pass(B: int) -> None:
    from check_cases import assert_graph_decode_equals_single_pass

    assert_graph_decode_equals_single_pass(hybrid("two_attention_gqa8_d64"), B, steps=40, max_start=900)


# -- compile ------------------------------------------------------------------------------------


@pytest.mark.compile
@pytest.mark.slow
def test_attention_forward_kernels_compile_for_sm90(sm90_cache):
    assert_the_kernels_compile_for_sm90("forward", sm90_cache)
