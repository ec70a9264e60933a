"""Split keys (``attn_split_n``) in the Triton attention: every row the same bits under a split.

- interpreter (the Triton interpreter, CPU): fp32, tiny blocks (16 keys, splits of 16 to 48) so that
  a few dozen tokens cross several splits. Under a split S every row must be the same bits in a
  prefill (the fold in the program), a chunk continuing from cached keys, a decode step (a program per
  split and the combine) over a slot cache or pages, and beside other sequences of other lengths;
  contexts end inside a split, on its last key and on the next split's first. The baseline that shows
  the checks can fail: decode rows under S against prefill rows without a split (or with another S)
  differ. Accuracy against fp64 is today's.
- gpu (skipped without CUDA; run on the H200): decode in CUDA graphs under a split, over a slot cache
  and over pages, equals the prefill rows at Nemotron-H-8B's attention shape; a hybrid's graph decode
  under a split equals the single pass.
- compile (sm_90, the H200, offline, no GPU, to PTX): the split launches keep the arithmetic the bits
  rest on, and with attn_split_n 0 the kernel's PTX is today's.
"""


from __future__ import annotations

import dataclasses

import interpreted  # noqa: F401  (before triton: it switches the Triton interpreter on; tests/ops/conftest.py)
import pytest
import torch
from attention_cases import BF16, gpu_cfg, gpu_qkv, hybrid, scattered_pages, write_context
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sm90_offline import run_sm90_script

from aligned_mamba.ops.attention import attention_naive
from aligned_mamba.ops.attention.blocked import page_index
from aligned_mamba.ops.attention.triton import (
    attention_triton,
    attention_triton_packed,
    decode_tiles,
    prefill_tiles,
)
from aligned_mamba.ops.configs import TritonKernelConfigs

CFG = dataclasses.replace(TritonKernelConfigs(), attn_block_n=16, attn_block_m=32, attn_decode_block_m=16)
MAX_LEN = 80


def _cfg(split: int) -> TritonKernelConfigs:
    return dataclasses.replace(CFG, attn_split_n=split)


def _cache(lens: list[int], G: int, D: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot caches [S, MAX_LEN, G, D] holding lens[s] random keys in slot s; the rest NaN (garbage)."""
    kc = torch.full((len(lens), MAX_LEN, G, D), float("nan"))
    vc = kc.clone()
    for s, n in enumerate(lens):
        kc[s, :n], vc[s, :n] = torch.randn(n, G, D, generator=g), torch.randn(n, G, D, generator=g)
    return kc, vc


def _pages(kc: torch.Tensor, vc: torch.Tensor, lens: list[int], page: int, g: torch.Generator):
    """The slot caches' keys copied into shuffled pages of ``page`` keys (the rest NaN) and the block
    table [slots, max_blocks] int32 that finds them (entries past a slot's pages out of range)."""
    S, _, G, D = kc.shape
    need = [-(-n // page) for n in lens]
    nb = sum(need) + 2
    ids = torch.randperm(nb, generator=g)
    kp = torch.full((nb, page, G, D), float("nan"))
    vp = kp.clone()
    bt = torch.full((S, MAX_LEN // page + 1), nb + 7, dtype=torch.int32)
    i = 0
    for s, n in enumerate(lens):
        bt[s, :need[s]] = ids[i:i + need[s]].to(torch.int32)
        i += need[s]
        pos = torch.arange(n)
        pg, off = page_index(bt, torch.full_like(pos, s), pos, page)
        kp[pg, off], vp[pg, off] = kc[s, :n], vc[s, :n]
    return kp, vp, bt


def _prefill(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lens: list[int], start: list[int], rep: int,
             cfg: TritonKernelConfigs, **kw) -> torch.Tensor:
    """Each slot's tokens start[s] .. lens[s] - 1 in one packed launch (q packed alike)."""
    cu = [0, *torch.tensor([n - a for n, a in zip(lens, start)]).cumsum(0).tolist()]
    tiles = prefill_tiles(cu, start, list(range(len(lens))), rep, cfg, "cpu")
    return attention_triton(q, kc, vc, tiles, scale=q.shape[2] ** -0.5, cfg=cfg, **kw)


@pytest.mark.interpreter
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_blocks=st.sampled_from([1, 2, 3]), gqa=st.sampled_from([(2, 2), (4, 1), (8, 1)]),
       D=st.sampled_from([64, 128]), ends=st.lists(st.sampled_from(["inside", "on", "after"]), min_size=1, max_size=3),
       splits=st.lists(st.integers(0, 3), min_size=3, max_size=3), cut=st.integers(1, 60),
       page_mult=st.sampled_from([1, 2]), seed=st.integers(0, 99))
def test_rows_equal_across_prefill_chunks_and_decode_under_a_split(
        split_blocks: int, gqa: tuple[int, int], D: int, ends: list[str], splits: list[int], cut: int, page_mult: int,
        seed: int) -> None:
    """Several sequences whose contexts end inside a split, on a split's last key or on the next
    split's first: their decode rows (slot cache and pages, one launch beside each other) equal their
    rows of one packed prefill and of a prefill chunked at ``cut``."""
    H, G = gqa
    S = 16 * split_blocks
    cfg = _cfg(S)
    # a context of k whole splits and 0, 1 or S/2 + 1 keys: the last token on a split's last key, on
    # the next split's first, or inside it
    extra = {"on": 0, "after": 1, "inside": S // 2 + 1}
    kmax = (MAX_LEN - extra["inside"]) // S
    lens = [k % (kmax + 1) * S + extra[e] or S for k, e in zip(splits, ends)]
    g = torch.Generator().manual_seed(seed)
    kc, vc = _cache(lens, G, D, g)
    T = sum(lens)
    q = torch.randn(T, H, D, generator=g)
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    full = _prefill(q, kc, vc, lens, [0] * len(lens), H // G, cfg)
    assert torch.isfinite(full).all()
    # chunked: every sequence's tokens from min(cut, n - 1) on, over the cached earlier ones
    start = [min(cut, n - 1) for n in lens]
    rows = torch.cat([torch.arange(cu[s] + start[s], cu[s + 1]) for s in range(len(lens))])
    assert torch.equal(_prefill(q[rows], kc, vc, lens, start, H // G, cfg), full[rows])
    # decode: each sequence's last token, all in one launch, slot cache and pages
    last = torch.tensor(cu[1:]) - 1
    tiles = decode_tiles(torch.arange(len(lens)), torch.tensor(lens) - 1)
    dec = attention_triton(q[last], kc, vc, tiles, scale=D ** -0.5, cfg=cfg)
    assert torch.equal(dec, full[last])
    kp, vp, bt = _pages(kc, vc, lens, CFG.attn_block_n * page_mult, g)
    assert torch.equal(attention_triton(q[last], kp, vp, tiles, scale=D ** -0.5, cfg=cfg, block_table=bt), dec)
    # one sequence alone: a row's bits do not depend on the others
    alone = attention_triton(q[last[:1]], kc, vc, decode_tiles(torch.tensor([0]), torch.tensor([lens[0] - 1])),
                             scale=D ** -0.5, cfg=cfg)
    assert torch.equal(alone[0], dec[0])


@pytest.mark.interpreter
def test_decode_steps_at_every_position_equal_the_prefill() -> None:
    """One sequence of 70 tokens under S = 32: a decode step at each position (0 .. 69: every split's
    first, inner and last keys) equals its row (and log-sum-exp) of the prefill, and a chunk boundary
    at each split edge (31/32/33) too."""
    H, G, D, n = 4, 2, 64, 70
    cfg = _cfg(32)
    g = torch.Generator().manual_seed(5)
    kc, vc = _cache([n], G, D, g)
    q = torch.randn(n, H, D, generator=g)
    lse, lse_d = torch.empty(n, H), torch.empty(n, H)
    full = _prefill(q, kc, vc, [n], [0], H // G, cfg, lse=lse)
    pos = torch.arange(n)
    steps = attention_triton(q, kc, vc, decode_tiles(torch.zeros(n, dtype=torch.int64), pos), scale=D ** -0.5,
                             cfg=cfg, lse=lse_d)
    assert torch.equal(steps, full)
    assert torch.equal(lse_d, lse)  # the combine's log-sum-exp is the fold's too
    for a, b in ((0, 31), (31, 33), (33, n)):
        assert torch.equal(_prefill(q[a:b], kc, vc, [b], [a], H // G, cfg), full[a:b])


@pytest.mark.interpreter
def test_the_split_is_part_of_the_bits() -> None:
    """The mismatch the contract field prevents: decode rows under S = 32 against prefill rows without
    a split, or with S = 16, differ (rows of the first split alone agree: one partial, folded into the
    empty state, is that partial); each is as accurate as the unsplit kernel against fp64."""
    H, G, D, n = 4, 1, 64, 75
    g = torch.Generator().manual_seed(2)
    kc, vc = _cache([n], G, D, g)
    q = torch.randn(n, H, D, generator=g)
    pos = torch.arange(n)
    tiles = decode_tiles(torch.zeros(n, dtype=torch.int64), pos)
    dec = attention_triton(q, kc, vc, tiles, scale=D ** -0.5, cfg=_cfg(32))
    none = _prefill(q, kc, vc, [n], [0], H // G, _cfg(0))
    other = _prefill(q, kc, vc, [n], [0], H // G, _cfg(16))
    assert torch.equal(dec[:32], none[:32])
    assert not torch.equal(dec[32:], none[32:])
    assert not torch.equal(dec[16:], other[16:])
    cu = torch.tensor([0, n])
    ref = attention_naive(q, kc[0, :n], vc[0, :n], cu, cu, scale=D ** -0.5)
    for out in (dec, none, other):
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("H,G,D", [(2, 2, 64), (8, 1, 128), (3, 1, 64)])
def test_split_rows_match_the_fp64_reference(H: int, G: int, D: int) -> None:
    """Packed prefill and packed decode (the package signature) under S = 32, at today's tolerance."""
    ns = [70, 5, 40]
    g = torch.Generator().manual_seed(H + D)
    q, k, v = (torch.randn(sum(ns), m, D, generator=g) for m in (H, G, G))
    cu = torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()])
    out = attention_triton_packed(q, k, v, cu, cu, scale=D ** -0.5, cfg=_cfg(32))
    ref = attention_naive(q, k, v, cu, cu, scale=D ** -0.5)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    last = cu[1:] - 1
    dec = attention_triton_packed(q[last], k, v, torch.arange(4), cu, scale=D ** -0.5, cfg=_cfg(32), decode=True)
    assert torch.equal(dec, out[last])


@pytest.mark.interpreter
def test_a_bad_split_is_refused_in_one_line() -> None:
    for bad, why in ((24, "multiple of attn_block_n 16"), (-16, "multiple"), (8, "multiple"), (1.5, "multiple")):
        with pytest.raises(ValueError, match="attn_split_n") as e:
            _cfg(bad)
        assert why in str(e.value) and "\n" not in str(e.value)
    # a larger key block must still divide the split
    with pytest.raises(ValueError, match="attn_split_n 32 refused"):
        dataclasses.replace(CFG, attn_block_n=64, attn_split_n=32)
    assert _cfg(0).attn_split_n == 0 and TritonKernelConfigs().attn_split_n == 1024
    q = torch.zeros(1, 2, 16)
    kc = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="max_context 0 refused"):
        attention_triton(q, kc, kc.clone(), decode_tiles(torch.tensor([0]), torch.tensor([0])), scale=0.25,
                         cfg=_cfg(16), max_context=0)


@pytest.mark.interpreter
def test_the_backends_steps_keep_the_rows_under_a_split() -> None:
    """``TritonBackend.attention`` (its GPU path, run by the interpreter) under S = 16: a prefill of two
    sequences; then a chunk, decode steps and a chunk, over a slot cache and over pages; every row
    equals the single pass's, and the decode rows differ from the unsplit backend's."""
    from aligned_mamba.layers.attention import KVPages
    from aligned_mamba.ops.backend import TritonBackend
    from aligned_mamba.ops.step import Step

    cfg = _cfg(16)
    be = TritonBackend(cfg, torch.device("cpu"), kernels=True)
    H, G, D, n = 4, 2, 16, 40
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2 * n, m, D, generator=g) for m in (H, G, G))
    kc, vc = torch.zeros(3, 48, G, D), torch.zeros(3, 48, G, D)
    one = be.attention(q, k, v, kc, vc, Step.make([2, 0], [0, 0], [n, n]), scale=0.25)
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    pages = KVPages(3, 48, 16, 9, "cpu")
    pages.free = [4, 0, 7, 2, 8, 1, 5, 3, 6]
    kp, vp = torch.full((9, 16, G, D), float("nan")), torch.full((9, 16, G, D), float("nan"))
    got, got_p = [], []
    for lo, hi in ((0, 15), (15, 16), (16, 17), (17, 31), (31, 32), (32, 33), (33, n)):
        rows = slice(lo, hi)
        step = Step.make([2], [lo], [hi - lo])
        got.append(be.attention(q[rows], k[rows], v[rows], kc2, vc2, step, scale=0.25))
        pages.ensure([2], [hi])
        got_p.append(be.attention(q[rows], k[rows], v[rows], kp, vp, step, scale=0.25, block_table=pages.table))
    assert torch.equal(torch.cat(got), one[:n])
    assert torch.equal(torch.cat(got_p), one[:n])
    plain = TritonBackend(CFG, torch.device("cpu"), kernels=True)
    step = Step.make([2], [32], [1])
    assert not torch.equal(plain.attention(q[32:33], k[32:33], v[32:33], kc2, vc2, step, scale=0.25), one[32:33])


# -- gpu ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 64])
@pytest.mark.parametrize("split", [1024, 2048])
def test_split_decode_in_cuda_graphs_equals_the_prefill_rows(split: int, B: int) -> None:
    """Nemotron-H-8B's attention shape (32 heads, 8 KV heads, D 128, bf16) under ``attn_split_n``: B
    sequences at contexts up to 16k (the first ones just before a split boundary, so their 5 steps
    end on a split's last key and then on the next one's first; the rest random) decode 5 steps
    through captured graphs, over a slot cache and over shuffled pages: every row equals the single
    packed prefill's row (the fold in the prefill program). The baseline, decode rows without a
    split (``attn_split_n`` 0), differs on rows past the first split."""
    import dataclasses

    from aligned_mamba.ops.attention.blocked import page_index
    from aligned_mamba.ops.attention.triton import attention_triton, attention_triton_packed, decode_tiles

    H, G, D, P, steps, scale = 32, 8, 128, 256, 5, 128 ** -0.5
    cfg = dataclasses.replace(gpu_cfg(), attn_split_n=split)
    g = torch.Generator().manual_seed(B + split)
    ctx = torch.randint(1, 16384, (B,), generator=g)
    edge = torch.tensor([16384, 8 * split, split, 2 * split])[:B] - 2  # positions k*S - 2 .. k*S + 2
    ctx[:edge.numel()] = edge
    n = ctx + steps
    max_len = int(n.max())
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)])
    q, k, v = gpu_qkv(int(cu[-1]), H, G, D, seed=B)
    full = attention_triton_packed(q, k, v, cu, cu, scale=scale, cfg=cfg)
    slots = torch.randperm(B, generator=g)
    kc = torch.full((B, max_len, G, D), float("nan"), dtype=BF16, device="cuda")
    vc = kc.clone()
    pages = scattered_pages(B, max_len, P, seed=B)
    kp = torch.full((pages.num_pages, P, G, D), float("nan"), dtype=BF16, device="cuda")
    vp = kp.clone()
    seq, pos, src = write_context(pages, kp, vp, slots, ctx, cu, k, v, P)
    kc[slots[seq].cuda(), pos.cuda()], vc[slots[seq].cuda(), pos.cuda()] = k[src], v[src]
    qs, ks, vs = q[:B].clone(), k[:B].clone(), v[:B].clone()
    sl, ps = slots.cuda(), ctx.cuda().clone()

    def slot_step(c=cfg) -> torch.Tensor:
        kc[sl, ps], vc[sl, ps] = ks, vs
        return attention_triton(qs, kc, vc, decode_tiles(sl, ps), scale=scale, cfg=c)

    def paged_step(c=cfg) -> torch.Tensor:
        pg, off = page_index(pages.table, sl, ps, P)
        kp[pg, off], vp[pg, off] = ks, vs
        return attention_triton(qs, kp, vp, decode_tiles(sl, ps), scale=scale, cfg=c, block_table=pages.table)

    graphs, outs = [], []
    for fn in (slot_step, paged_step):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # compile before capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(fn())
        graphs.append(graph)
    for t in range(steps):
        at = (cu[:-1] + ctx + t).cuda()
        pages.ensure(slots.numpy(), (ctx + t + 1).numpy())
        for buf, x in ((qs, q), (ks, k), (vs, v)):
            buf.copy_(x[at])
        ps.copy_((ctx + t).cuda())
        for graph, out, name in zip(graphs, outs, ("slot", "paged")):
            graph.replay()
            assert torch.equal(out, full[at]), (name, t)
    plain = slot_step(dataclasses.replace(gpu_cfg(), attn_split_n=0))  # no split, whatever the default
    late = (ctx + steps - 1 >= split).cuda()
    assert bool(late.any()) and not torch.equal(plain[late], outs[0][late])
    assert torch.equal(plain[~late], outs[0][~late])  # one split: its partial alone, the same bits


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("B", [1, 64])
def test_hybrid_graph_decode_under_a_split_equals_the_single_pass(B: int, page_size: int | None) -> None:
    """A hybrid whose contract splits keys every 256 positions (contexts up to 940 cross up to three
    boundaries): ``DecodeGraphs``'s rows, slot cache or pages, equal the trainer's single pass."""
    from check_cases import assert_graph_decode_equals_single_pass

    assert_graph_decode_equals_single_pass(hybrid("two_attention_gqa8_d64", attn_split_n=256), B, steps=40,
                                           max_start=900, page_size=page_size)


# -- compile ------------------------------------------------------------------------------------


_SPLIT = r"""
import hashlib, inspect, json, os, re
os.environ.pop("TRITON_INTERPRET", None)
from triton.compiler import ASTSource
from sm90_offline import compile_until, launch_constexprs
from aligned_mamba.ops.configs import TritonKernelConfigs
from aligned_mamba.ops.attention import triton as at

cfg = TritonKernelConfigs()
S = 1024  # attn_split_n
done = {}


def comp(fn, types, consts, warps, stages):
    consts = launch_constexprs(fn, consts)
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in inspect.signature(fn.fn).parameters}
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    k = compile_until(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                      dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False), until="ptx")
    ptx = k.asm["ptx"]
    # without the debug line information, which moves with every edit of the source file
    bare = "\n".join(ln for ln in ptx.split(".section\t.debug")[0].splitlines()
                     if not ln.strip().startswith((".loc", ".file", "$L__", "//")))
    # the flavours of the merge's and the output's special ops (approximate or rounded, flush or not)
    ops = sorted(set(re.findall(r"\b((?:ex2|lg2|div|rcp)\.[a-z0-9.]*f32)", ptx)))
    arith = [ln.split()[0] for ln in ptx.splitlines() if ln.strip() and re.match(
        r"\s*(ex2|mul|add|sub|max|div|rcp|fma|wgmma.mma_async|mma.sync)[.a-z0-9]*\.(f32|bf16|f16)", ln)]
    return dict(fma=ptx.count("fma.rn.f32"), wgmma="wgmma" in ptx, ops=ops, arith=sorted(arith),
                digest=hashlib.sha256(bare.encode()).hexdigest()[:16])


for dt, D, rep in (("bf16", 128, 4), ("bf16", 64, 1), ("bf16", 128, 16), ("fp32", 64, 4)):
    t = {n: f"*{dt}" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
    t.update({n: "*i64" for n in ("row0_ptr", "ntok_ptr", "pos0_ptr", "slot_ptr")})
    t.update(lse_ptr="*fp32", pm_ptr="*fp32", pl_ptr="*fp32", pa_ptr="*fp32", qk_scale="fp32", bt_ptr="*i32")
    for decode in (False, True):
        tok = at.tokens_per_tile(rep, cfg, decode)
        c = dict(REP=rep, REP_P=at.rep_pad(rep), TOK=tok, D=D, BLOCK_N=cfg.attn_block_n, PRECISION="ieee")
        w = cfg.attn_decode_warps if decode else cfg.attn_warps
        s = cfg.attn_decode_stages if decode else cfg.attn_stages
        name = f"{dt} D{D} rep{rep} {'decode' if decode else 'prefill'}"
        for paged in (False, True):
            p = " paged" if paged else ""
            # today's launch (attn_split_n 0), and the split one
            if (dt, D, rep) == ("bf16", 128, 4) or (dt == "fp32" and not paged and not decode):
                done[name + p + " S0"] = comp(at._attention_kernel, t, {**c, "PAGED": paged}, w, s)
            if decode:
                done[name + p + " partial"] = comp(at._attention_partial_kernel, t,
                                                   {**c, "PAGED": paged, "SPLIT_N": S}, w, s)
            else:
                for lse in (False, True):
                    done[name + p + (" lse" if lse else "") + " split"] = comp(
                        at._attention_kernel, t, {**c, "PAGED": paged, "SPLIT_N": S, "STORE_LSE": lse}, w, s)
    for lse in (False, True):
        done[f"{dt} D{D} rep{rep} combine{' lse' if lse else ''}"] = comp(
            at._attention_combine_kernel, t,
            dict(REP=rep, REP_P=at.rep_pad(rep), D=D, SPLIT_N=S, STORE_LSE=lse), 1, 1)
print(json.dumps(done))
"""


# The normalized PTX (debug line information left out) of today's kernel at attn_split_n 0, compiled
# at b23b7c9 (before the split) by triton 3.6.0: the split's code must leave it as it was. A deliberate
# change of the unsplit kernel updates these (benchmarks/ptx_digest.py's normalization).
_TODAY = {"triton": "3.6.0", "bf16 D128 rep4 prefill S0": "26e7c8c09b16731e",
          "bf16 D128 rep4 prefill paged S0": "00c9a471e162b6b0", "bf16 D128 rep4 decode S0": "413d8d6d33a1eb6a",
          "bf16 D128 rep4 decode paged S0": "0acef48faf4e4a00", "fp32 D64 rep4 prefill S0": "be7bdb32669bd5d4"}


@pytest.mark.compile
@pytest.mark.slow
def test_the_split_kernels_compile_for_sm90_and_leave_todays_ptx(sm90_cache):
    """The split launches (``attn_split_n`` > 0: the prefill's fold, the decode's partial and combine
    kernels) for sm_90: no FMA contraction anywhere in bf16 (nor in the combine at all: a contracted
    merge there would not be the prefill's merge in registers), bf16 prefill on warpgroup MMA, the
    paged launches the slot cache's float operations, and the combine's exp2, division and log2 the
    same instructions as the prefill's fold. With
    attn_split_n 0 the kernel's PTX is the one before the split existed (its code compiles out)."""
    import triton

    done = run_sm90_script(_SPLIT, sm90_cache)
    assert len(done) == 4 * 8 + 5, sorted(done)
    for name, r in done.items():
        if name.startswith("bf16") or "combine" in name:
            assert r["fma"] == 0, (name, r)
        if name.startswith("bf16") and "prefill" in name:
            assert r["wgmma"], (name, r)
        if " paged" in name:  # the same float operations, each as often, as the slot cache's launch
            slot = done[name.replace(" paged", "")]
            assert r["arith"] == slot["arith"] and len(r["arith"]) > 10, (name, len(r["arith"]), len(slot["arith"]))
        if "combine" in name:
            # the merge's exp2 and the output's division (and lse's log2) are the prefill fold's instructions
            fold = name.split(" combine")[0] + (" prefill lse split" if name.endswith("lse") else " prefill split")
            fold = done[fold]
            assert r["ops"] and set(r["ops"]) <= set(fold["ops"]), (name, r["ops"], fold["ops"])
    if triton.__version__ != _TODAY["triton"]:
        pytest.skip(f"today's PTX digests were taken with triton {_TODAY['triton']}, not {triton.__version__}")
    for name, digest in _TODAY.items():
        if name != "triton":
            assert done[name]["digest"] == digest, (name, done[name]["digest"])
