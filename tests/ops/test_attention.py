"""The Triton attention kernel on the CPU through the Triton interpreter: logic, schedules, accuracy.

fp32 and tiny shapes (the interpreter runs each program in numpy). Each row must be the same bits
whether it is computed in a prefill, a chunk continuing from cached keys, a decode step or beside
other sequences, and match the fp64 reference to fp32 rounding. The interpreter proves the logic
(the tables, the masks, the no-op blocks); the GPU's bits are tests/ops/test_attention_gpu.py's.
"""

from __future__ import annotations

import dataclasses

import interpreted  # before triton: it switches the Triton interpreter on
import pytest
import torch

interpreted.require()
pytestmark = pytest.mark.interpreter

from aligned_mamba.ops.attention import attention_naive  # noqa: E402
from aligned_mamba.ops.attention.triton import (  # noqa: E402
    attention_triton,
    attention_triton_packed,
    decode_tiles,
    prefill_tiles,
)
from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402

# small blocks so that a few dozen tokens cross several key blocks and tiles
CFG = dataclasses.replace(TritonKernelConfigs(), attn_block_n=16, attn_block_m=32, attn_decode_block_m=16)


def _qkv(T: int, H: int, G: int, D: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(T, n, D, generator=g) for n in (H, G, G))


def _cu(ns: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()], dtype=torch.int64)


@pytest.mark.parametrize("H,G,D", [(2, 2, 64), (4, 1, 64), (8, 2, 128), (3, 1, 64)])
def test_prefill_matches_the_fp64_reference(H: int, G: int, D: int) -> None:
    ns = [37, 5, 20]
    q, k, v = _qkv(sum(ns), H, G, D, seed=H * 10 + G)
    cu = _cu(ns)
    out = attention_triton_packed(q, k, v, cu, cu, scale=D ** -0.5, cfg=CFG)
    ref = attention_naive(q, k, v, cu, cu, scale=D ** -0.5)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


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


def test_bad_input_is_refused() -> None:
    q, k, v = _qkv(4, 3, 2, 64, seed=0)
    with pytest.raises(ValueError, match="multiple"):
        attention_triton_packed(q, k, v, _cu([4]), _cu([4]), scale=0.1, cfg=CFG)
    q, k, v = _qkv(4, 64, 1, 64, seed=0)  # 64 heads per key/value head: over the 32-row tile
    with pytest.raises(ValueError, match="exceed the attention tile"):
        attention_triton_packed(q, k, v, _cu([4]), _cu([4]), scale=0.1, cfg=CFG)


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
