"""The Triton attention over a paged KV cache, on the CPU through the Triton interpreter (logic).

Pages [num_blocks, page_size, G, D] in shuffled order, a block table read on the device: every row
must be the bits of the slot cache's launch (the same key blocks in the same order, only the
addresses differ), for prefill, chunks continuing from the pages and decode steps; a key block that
does not divide the page size is refused. The baseline that shows the check can fail: another key
block size gives other bits. The GPU's bits: tests/ops/test_attention_gpu.py.
"""

from __future__ import annotations

import dataclasses

import interpreted  # before triton: it switches the Triton interpreter on
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

interpreted.require()
pytestmark = pytest.mark.interpreter

from aligned_mamba.ops.attention.blocked import page_index  # noqa: E402
from aligned_mamba.ops.attention.triton import attention_triton, decode_tiles, prefill_tiles  # noqa: E402
from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402

CFG = dataclasses.replace(TritonKernelConfigs(), attn_block_n=16, attn_block_m=32, attn_decode_block_m=16)
D = 16  # the smallest head_dim the kernel takes: the interpreter runs each program in numpy


def _pages(kc: torch.Tensor, vc: torch.Tensor, lens: list[int], page: int, seed: int, spare: int = 3):
    """The slot caches' first ``lens[s]`` keys of slot s copied into shuffled pages (unused pages and
    rows NaN: garbage), and the block table [slots, max_blocks] int32 that finds them."""
    S, _, G, _ = kc.shape
    need = [-(-n // page) for n in lens]
    nb = sum(need) + spare
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(nb, generator=g)
    kp = torch.full((nb, page, G, D), float("nan"))
    vp = kp.clone()
    bt = torch.full((S, max(need) + 1), nb + 7, dtype=torch.int32)  # entries past a slot's pages: out of range
    i = 0
    for s, n in enumerate(lens):
        for b in range(need[s]):
            bt[s, b] = int(ids[i])
            i += 1
        pos = torch.arange(n)
        pg, off = page_index(bt, torch.full_like(pos, s), pos, page)
        kp[pg, off], vp[pg, off] = kc[s, :n], vc[s, :n]
    return kp, vp, bt


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=3), page_mult=st.sampled_from([1, 2, 4]),
       gqa=st.sampled_from([(2, 2), (4, 1), (4, 2), (3, 1)]), cut=st.integers(0, 69), seed=st.integers(0, 99))
def test_paged_rows_equal_the_slot_caches(lens: list[int], page_mult: int, gqa: tuple[int, int], cut: int,
                                          seed: int) -> None:
    H, G = gqa
    S, page = len(lens), CFG.attn_block_n * page_mult
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, H, D, generator=g)
    kc = torch.full((S, 80, G, D), float("nan"))
    vc = kc.clone()
    for s, n in enumerate(lens):
        kc[s, :n], vc[s, :n] = torch.randn(n, G, D, generator=g), torch.randn(n, G, D, generator=g)
    kp, vp, bt = _pages(kc, vc, lens, page, seed)
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    slots = list(range(S))
    # a prefill split at ``cut`` (each sequence's tokens from min(cut, n - 1) on, over the earlier ones)
    start = [min(cut, n - 1) for n in lens]
    rows = torch.cat([torch.arange(cu[s] + start[s], cu[s + 1]) for s in range(S)])
    cq = [0, *torch.tensor([n - a for n, a in zip(lens, start)]).cumsum(0).tolist()]
    tiles = prefill_tiles(cq, start, slots, H // G, CFG, "cpu")
    want = attention_triton(q[rows], kc, vc, tiles, scale=D ** -0.5, cfg=CFG)
    got = attention_triton(q[rows], kp, vp, tiles, scale=D ** -0.5, cfg=CFG, block_table=bt)
    assert torch.isfinite(want).all()
    assert torch.equal(got, want)
    # decode: each sequence's last token, one launch; the table as int64 too
    last = torch.tensor([n - 1 for n in lens])
    dt = decode_tiles(torch.tensor(slots), last)
    qd = q[torch.tensor(cu[1:]) - 1]
    want_d = attention_triton(qd, kc, vc, dt, scale=D ** -0.5, cfg=CFG)
    assert torch.equal(attention_triton(qd, kp, vp, dt, scale=D ** -0.5, cfg=CFG, block_table=bt.long()), want_d)


def test_another_key_block_gives_other_bits() -> None:
    """The baseline: the paged rows are the slot cache's because the blocks are the same; the same
    pages read with a key block of 32 instead of 16 give other bits (the check above can fail)."""
    H, G, n = 2, 1, 70
    g = torch.Generator().manual_seed(1)
    q = torch.randn(n, H, D, generator=g)
    kc, vc = torch.randn(1, n, G, D, generator=g), torch.randn(1, n, G, D, generator=g)
    kp, vp, bt = _pages(kc, vc, [n], 32, seed=1)
    tiles = prefill_tiles([0, n], [0], [0], H // G, CFG, "cpu")
    a = attention_triton(q, kp, vp, tiles, scale=D ** -0.5, cfg=CFG, block_table=bt)
    cfg32 = dataclasses.replace(CFG, attn_block_n=32)
    b = attention_triton(q, kp, vp, prefill_tiles([0, n], [0], [0], H // G, cfg32, "cpu"), scale=D ** -0.5,
                         cfg=cfg32, block_table=bt)
    assert torch.equal(a, attention_triton(q, kc, vc, tiles, scale=D ** -0.5, cfg=CFG))
    assert not torch.equal(a[16:], b[16:]) and (a - b).abs().max().item() < 1e-5


def test_a_page_the_key_block_does_not_divide_is_refused() -> None:
    kp = torch.zeros(4, 24, 1, D)
    tiles = decode_tiles(torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(ValueError, match="must divide the page size") as e:
        attention_triton(torch.zeros(1, 2, D), kp, kp.clone(), tiles, scale=0.25, cfg=CFG,
                         block_table=torch.zeros(1, 2, dtype=torch.int32))
    assert "\n" not in str(e.value)


def test_the_backends_paged_step_writes_pages_and_keeps_the_rows() -> None:
    """``TritonBackend.attention`` with a block table (its GPU path, run by the interpreter): a prefill
    of two sequences, then a decode step and a chunk; the keys land in the table's pages and every
    row equals the slot cache's step."""
    from aligned_mamba.layers.attention import KVPages
    from aligned_mamba.ops.backend import TritonBackend
    from aligned_mamba.ops.step import Step

    be = TritonBackend(CFG, torch.device("cpu"), kernels=True)
    H, G, n = 4, 2, 30
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2 * n, m, D, generator=g) for m in (H, G, G))
    kc, vc = torch.zeros(3, 40, G, D), torch.zeros(3, 40, G, D)
    pages = KVPages(3, 40, 16, 9, "cpu")
    pages.free = [4, 0, 7, 2, 8, 1, 5, 3, 6]
    kp, vp = torch.full((9, 16, G, D), float("nan")), torch.full((9, 16, G, D), float("nan"))

    def both(lo: int, hi: int, step: Step, rows: slice) -> torch.Tensor:
        pages.ensure(step.slots.numpy(), (step.start_pos + step.lengths).numpy())
        a = be.attention(q[rows], k[rows], v[rows], kc, vc, step, scale=0.25)
        b = be.attention(q[rows], k[rows], v[rows], kp, vp, step, scale=0.25, block_table=pages.table)
        assert torch.equal(a, b), (lo, hi)
        return b

    both(0, n, Step.make([2, 0], [0, 0], [20, 20]), slice(0, 40))
    both(20, 21, Step.make([2, 0], [20, 20], [1, 1]), slice(40, 42))
    both(21, n, Step.make([2], [21], [9]), slice(42, 51))
    assert pages.held.tolist() == [2, 0, 2]
    for s in (0, 2):
        for p in range(21 if s == 0 else n):
            page, off = pages.host[s, p // 16], p % 16
            assert torch.equal(kp[page, off], kc[s, p]) and torch.equal(vp[page, off], vc[s, p])
