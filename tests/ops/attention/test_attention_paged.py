"""The Triton attention over a paged KV cache (``block_table``): every row the slot cache's bits.

- interpreter (the Triton interpreter, CPU; logic): pages [num_blocks, page_size, G, D] in shuffled
  order, a block table read on the device: every row must be the bits of the slot cache's launch (the
  same key blocks in the same order, only the addresses differ), for prefill, chunks continuing from
  the pages and decode steps; a key block that does not divide the page size is refused. The
  baseline that shows the check can fail: another key block size gives other bits.
- gpu (skipped without CUDA; run on the H200): decode steps over pages in CUDA graphs and prefill
  chunks over pages give the slot cache's (the packed prefill's) rows at Nemotron-H-8B's attention
  shape; hybrids' graph decode over pages equals the single pass; the engine preempts when pages run
  short and keeps the bits.
- compile (sm_90, the H200, offline, no GPU, to PTX): the paged launch keeps the slot cache's
  arithmetic.
"""


from __future__ import annotations

import dataclasses

import interpreted  # noqa: F401  (before triton: it switches the Triton interpreter on; tests/ops/conftest.py)
import pytest
import torch
from attention_cases import BF16, KERNELS, SMALL, gpu_cfg, gpu_qkv, hybrid, scattered_pages, write_context
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sm90_offline import run_sm90_script

from aligned_mamba.ops.attention.blocked import page_index
from aligned_mamba.ops.attention.triton import attention_triton, decode_tiles, prefill_tiles
from aligned_mamba.ops.configs import TritonKernelConfigs

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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
def test_a_page_the_key_block_does_not_divide_is_refused() -> None:
    kp = torch.zeros(4, 24, 1, D)
    tiles = decode_tiles(torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(ValueError, match="must divide the page size") as e:
        attention_triton(torch.zeros(1, 2, D), kp, kp.clone(), tiles, scale=0.25, cfg=CFG,
                         block_table=torch.zeros(1, 2, dtype=torch.int32))
    assert "\n" not in str(e.value)


@pytest.mark.interpreter
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


# -- gpu ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 64, 256])
def test_paged_decode_in_a_cuda_graph_equals_the_prefill_rows(B: int) -> None:
    """Nemotron-H-8B's attention shape (32 heads, 8 KV heads, D 128, bf16): B sequences at random
    contexts (up to 16k at batch 1) decode 5 steps through one captured graph that writes the new
    keys into pages found through the block table and attends over the pages; pages are handed out
    on the host between replays. Every row equals the single packed prefill's row over the whole
    history (slot-cache addressing); the baseline, a key block of 128, differs."""
    import dataclasses

    from aligned_mamba.ops.attention.blocked import page_index
    from aligned_mamba.ops.attention.triton import attention_triton, attention_triton_packed, decode_tiles

    H, G, D, P, steps, scale = 32, 8, 128, 256, 5, 128 ** -0.5
    cfg = gpu_cfg()
    g = torch.Generator().manual_seed(B)
    top = 16000 if B == 1 else (4000 if B <= 64 else 1500)
    ctx = torch.randint(1, top, (B,), generator=g)
    n = ctx + steps
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)])
    q, k, v = gpu_qkv(int(cu[-1]), H, G, D, seed=B)
    full = attention_triton_packed(q, k, v, cu, cu, scale=scale, cfg=cfg)
    slots = torch.randperm(B, generator=g)
    pages = scattered_pages(B, int(n.max()), P, seed=B)
    kp = torch.full((pages.num_pages, P, G, D), float("nan"), dtype=BF16, device="cuda")
    vp = kp.clone()
    write_context(pages, kp, vp, slots, ctx, cu, k, v, P)
    # the graph's static buffers
    qs, ks, vs = q[:B].clone(), k[:B].clone(), v[:B].clone()
    sl, ps = slots.cuda(), ctx.cuda().clone()

    def step(c=cfg) -> torch.Tensor:
        pg, off = page_index(pages.table, sl, ps, P)
        kp[pg, off], vp[pg, off] = ks, vs
        return attention_triton(qs, kp, vp, decode_tiles(sl, ps), scale=scale, cfg=c, block_table=pages.table)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile before capture (writes the first step's keys, which the replay rewrites)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    got = []
    for t in range(steps):
        at = cu[:-1] + ctx + t  # each sequence's packed row of this step's token
        pages.ensure(slots.numpy(), (ctx + t + 1).numpy())
        for buf, src in ((qs, q), (ks, k), (vs, v)):
            buf.copy_(src[at.cuda()])
        ps.copy_((ctx + t).cuda())
        graph.replay()
        got.append(out.clone())
        assert torch.equal(got[-1], full[at.cuda()]), t
    # the baseline: another key block (pages of 256 take it) gives the long rows other bits
    other = step(dataclasses.replace(cfg, attn_block_n=128))
    long_rows = (ctx + steps - 1 > 128).cuda()
    assert bool(long_rows.any()) and not torch.equal(other[long_rows], got[-1][long_rows])


@pytest.mark.gpu
def test_paged_prefill_chunks_equal_the_slot_caches_rows() -> None:
    """The chunked-prefill continuation over pages (the prefill tile, host-built tiles, the device
    table): chunks of one sequence and two sequences side by side give the slot cache's bits."""
    from aligned_mamba.ops.attention.blocked import page_index
    from aligned_mamba.ops.attention.triton import attention_triton, prefill_tiles

    H, G, D, P, n, scale = 16, 4, 64, 128, 3000, 64 ** -0.5
    cfg = gpu_cfg()
    q, k, v = gpu_qkv(n, H, G, D, seed=17)
    kc = torch.full((2, n, G, D), float("nan"), dtype=BF16, device="cuda")
    vc = kc.clone()
    kc[1], vc[1] = k, v
    pages = scattered_pages(2, n, P, seed=3)
    pages.ensure([1], [n])
    kp = torch.full((pages.num_pages, P, G, D), float("nan"), dtype=BF16, device="cuda")
    vp = kp.clone()
    pg, off = page_index(pages.table, torch.ones(n, dtype=torch.int64, device="cuda"),
                         torch.arange(n, device="cuda"), P)
    kp[pg, off], vp[pg, off] = k, v
    cuts = [0, 700, 701, 2222, n]
    for a, b in zip(cuts, cuts[1:]):
        t = prefill_tiles([0, b - a], [a], [1], H // G, cfg, "cuda")
        assert torch.equal(attention_triton(q[a:b], kp, vp, t, scale=scale, cfg=cfg, block_table=pages.table),
                           attention_triton(q[a:b], kc, vc, t, scale=scale, cfg=cfg)), (a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 64, 256])
def test_hybrid_graph_decode_over_pages_equals_the_single_pass(B: int) -> None:
    from check_cases import assert_graph_decode_equals_single_pass

    assert_graph_decode_equals_single_pass(hybrid("two_attention_gqa8_d64"), B, steps=40, max_start=900,
                                           page_size=64)


@pytest.mark.gpu
def test_the_engine_preempts_when_pages_run_short_and_keeps_the_bits() -> None:
    """The reference engine on the GPU (triton backend, a paged KV cache, decode steps in CUDA graphs)
    with 3 slots over 8 pages of 64 keys, fewer than its requests need together: it preempts the newest
    request whenever a step needs more pages than are free and recomputes it later, and every request's
    tokens and rows are those of an engine with pages to spare and the trainer's single pass. The
    baseline, the single pass of the same weights with a key block of 128, differs on the long rows."""
    from aligned_mamba.engine import SamplerEngine

    model = hybrid("two_attention_gqa8_d64")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, SMALL["vocab_size"], (n,), generator=g).tolist() for n in (70, 300, 150, 20)]

    def run(num_pages: int | None):
        e = SamplerEngine(model, num_slots=3, max_batch_tokens=96, max_len=384, page_size=64, num_pages=num_pages)
        assert e.graphs is not None
        reqs = [e.add_request(p, 40) for p in prompts]
        e.run()
        assert e.cache.pages.pages_free == e.cache.pages.num_pages - 1  # the graphs' spare slot keeps one
        return reqs

    roomy, tight = run(None), run(8)
    assert sum(r.preemptions for r in tight) > 0 and sum(r.preemptions for r in roomy) == 0
    with torch.no_grad():
        ref = model.forward([torch.tensor(r.tokens[:-1]) for r in tight])
        other = hybrid("two_attention_gqa8_d64", attn_block_n=128).forward([torch.tensor(r.tokens[:-1])
                                                                            for r in tight])
    differ = 0
    for a, b, want, base in zip(roomy, tight, ref, other):
        assert a.tokens == b.tokens
        pos = [p for p, _ in b.rows]
        got = torch.stack([x for _, x in b.rows])
        assert torch.equal(got, want[pos]), b.req_id
        assert torch.equal(torch.stack([x for _, x in a.rows]), want[[p for p, _ in a.rows]]), a.req_id
        differ += int((got != base[pos]).any(-1)[torch.tensor(pos, device=got.device) >= 128].sum())
    assert differ > 0, "a key block of 128 gave the long rows the same bits: the check cannot fail"


# -- compile ------------------------------------------------------------------------------------


@pytest.mark.compile
@pytest.mark.slow
def test_the_paged_kernel_compiles_for_sm90_with_the_slot_caches_arithmetic(sm90_cache):
    """The launch over a paged cache (``PAGED``: the block table read on the device) for sm_90: no FMA
    contraction, bf16 prefill on warpgroup MMA, and the same float operations, each as often, as the slot
    cache's launch of the same shape (only the addresses differ: the bits rest on that)."""
    done = run_sm90_script(KERNELS.replace("%PART%", "paged"), sm90_cache)
    assert len(done) == 2 * (2 * 4 * 2 + 2), sorted(done)
    for name, r in done.items():
        if name.startswith("bf16"):
            assert r["fma"] == 0, (name, r)
            assert r["wgmma"] or "decode" in name, name
        if name.endswith(" paged"):
            slot = done[name[: -len(" paged")]]
            # the same operations, each as often (the scheduler interleaves independent ones with the
            # paged address arithmetic, so the PTX text order differs; the GPU tests check the bits)
            a, b = r["arith"], slot["arith"]
            assert sorted(a) == sorted(b) and len(a) > 10, (name, len(a), len(b))
