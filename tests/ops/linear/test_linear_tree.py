"""The triton backend's row-parallel tree GEMM (``ops/linear/triton_tree.py``).

- interpreter (the Triton interpreter, CPU): fp32 only (the interpreter's bf16 arithmetic is not the
  GPU's), small shapes: the logic. TP k (ranks as threads, each launch computing its subtree, the
  subtree sums all-gathered and joined by the tree's top) gives TP 1's bits, TP 1 being one launch
  with the whole tree, the bias and the rounding; both equal the per-slice partials summed by
  ``pair_tree`` (the contract's tree), and the all-reduce of rank partials that stock tensor
  parallelism runs differs. The split-slices grid (a program per tile and slice, the last to finish
  joining) gives the same bits.
- gpu (skipped without CUDA; run on the H200): at the row-parallel layers' shapes (out_proj of
  mamba2-1.3b and 2.7b, Nemotron-H-8B's o_proj and fc2), bf16: TP k (each rank's launch over its K
  columns giving its fp32 subtree, the subtrees joined by the tree's top, the bias, one rounding)
  gives TP 1's bits (one launch: the whole tree), for 2 to 16 slices, in both loop forms and both
  stacks; a row's bits do not depend on how many rows share the call; one slice is today's GEMM bit
  for bit; the split-slices grid gives the pinned form's bits, eager and in CUDA-graph replays; the
  stock all-reduce of the ranks' rounded GEMMs differs. Then the model: the triton backend's logits
  rows at TP 2 and 4 equal TP 1 under row_parallel_slices 4 (Mamba2 with n_groups 1 and 8, a
  hybrid), and stock TP 2 differs.
- compile (sm_90, the H200, offline with the triton wheel's ptxas and cuobjdump, no GPU): the tree
  kernel (TMA and pointer forms) in every plan the row-parallel layers meet, at out_proj / o_proj /
  fc2 widths, decode to prefill row counts, 2 to 16 slices per rank, bf16 and fp32 models. The SASS
  must show HGMMA (wgmma) for bf16 tiles of 64 rows and more, HMMA for 16-row tiles, TMA loads where
  descriptors are used, and no local memory: the stack of partial sums fits in registers
  (``linear_tree_acc_regs``), which the plan's tile halving promises, or lives in global memory
  (``linear_tree_global_stack``) beside one accumulator, as in today's GEMM. Both stacks compile,
  and so does the split-slices grid at the decode and mid tiles (its tile counter an acquire-release
  atomic at GPU scope).
"""

from __future__ import annotations

import dataclasses
import threading

import interpreted  # noqa: F401  (the interpreter on, before triton is imported; tests/ops/conftest.py)
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sm90_offline import run_sm90_script, sass_script

from aligned_mamba.contract import Contract
from aligned_mamba.errors import AlignedMambaError, ContractError
from aligned_mamba.ops.configs import TritonKernelConfigs
from aligned_mamba.ops.linear import triton as lt
from aligned_mamba.ops.linear import triton_tree as tt
from aligned_mamba.ops.linear.sliced import row_parallel_linear
from aligned_mamba.ops.logprobs.sliced import pair_tree
from aligned_mamba.parallel import TPGroup, check_tp, shard, threads

CFG = TritonKernelConfigs()
SPLIT = dataclasses.replace(CFG, linear_tree_split_grid_max_m=256)  # the split grid at every M tested here
F32, BF16 = torch.float32, torch.bfloat16


_INTERPRETER = threading.Lock()  # the interpreter runs one kernel at a time (it patches triton.language)


def _tree(x, w, b, local, out_dtype):
    with _INTERPRETER:
        return tt.linear_tree(x, w, b, local, out_dtype, cfg=CFG)


def _split_tree(x, w, b, local, out_dtype):
    with _INTERPRETER:
        return tt.linear_tree(x, w, b, local, out_dtype, cfg=SPLIT)


def _partial(x, w):
    return tt.linear_partial(x, w, cfg=CFG)


def _tp(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, slices: int, size: int,
        tree=_tree) -> list[torch.Tensor]:
    """Every rank's output at TP ``size``: its K columns, one launch for its subtree (ranks as threads)."""

    def rank(group: TPGroup) -> torch.Tensor:
        k = shard(x.shape[1], group)
        return row_parallel_linear(x[:, k], w[:, k].contiguous(), b, slices=slices, group=group, tree=tree)

    return threads(rank, size)


def _operands(m: int, k: int, n: int, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    return x, w, (torch.randn(n, generator=g) if bias else None)


@pytest.mark.interpreter
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 20), kc=st.sampled_from([4, 8, 12, 32, 40]), n=st.integers(1, 40),
       log_s=st.integers(1, 3), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_every_tp_degree_gives_tp1s_bits(m: int, kc: int, n: int, log_s: int, bias: bool, seed: int) -> None:
    # kc: K columns per slice; 32 and 40 reach whole BLOCK_K (TMA) and a masked last block (pointers)
    s = 1 << log_s
    x, w, b = _operands(m, kc * s, n, seed, bias)
    one = row_parallel_linear(x, w, b, slices=s, group=TPGroup.single(), tree=_tree)
    assert one.dtype == F32 and one.shape == (m, n)
    # the contract's tree over this backend's slice partials, summed outside the kernel
    parts = torch.stack([_partial(x[:, j * kc:(j + 1) * kc], w[:, j * kc:(j + 1) * kc]) for j in range(s)], -1)
    assert torch.equal(one, pair_tree(parts) + (0 if b is None else b))
    size = 2
    while size <= s:
        for got in _tp(x, w, b, s, size):
            assert torch.equal(got, one), (size, s)
        size *= 2


@pytest.mark.interpreter
@pytest.mark.parametrize("split", [False, True], ids=["stack", "split_grid"])
@pytest.mark.parametrize("local", [4, 8, 16])
def test_the_tree_folds_the_slices_by_adjacent_pairs_not_in_a_chain(local: int, split: bool) -> None:
    # 1e8-scaled slices make the order of the adds visible: a chain ((p0 + p1) + p2) + ... or halves
    # (p_i + p_{i + n/2}) would round otherwise than adjacent pairs; in the stack and in the split
    # grid's finisher alike
    g = torch.Generator().manual_seed(local)
    kc = 8
    x = torch.randn(6, kc * local, generator=g)
    x = x * (10.0 ** torch.randint(-4, 5, (1, kc * local), generator=g))
    w = torch.randn(10, kc * local, generator=g)
    y = tt.linear_tree_triton(x, w, None, local, F32, CFG, split=split)
    parts = torch.stack([_partial(x[:, j * kc:(j + 1) * kc], w[:, j * kc:(j + 1) * kc]) for j in range(local)], -1)
    assert torch.equal(y, pair_tree(parts))
    chain = parts[..., 0]
    for j in range(1, local):
        chain = chain + parts[..., j]
    halves = parts
    while halves.shape[-1] > 1:
        h = halves.shape[-1] // 2
        halves = halves[..., :h] + halves[..., h:]
    assert not torch.equal(y, chain) and not torch.equal(y, halves[..., 0])


@pytest.mark.interpreter
@pytest.mark.parametrize("size", [2, 4])
def test_the_all_reduce_it_replaces_differs(size: int) -> None:
    x, w, _ = _operands(24, 256, 40, 3, False)
    w = w / 16
    aligned = [row_parallel_linear(x, w, None, slices=8, group=TPGroup.single(), tree=_tree)]
    aligned += _tp(x, w, None, 8, size)
    assert all(torch.equal(a, aligned[0]) for a in aligned)
    # stock row parallelism: each rank's whole K in one GEMM, the ranks' outputs summed in rank order
    parts = [lt.linear_triton(x[:, k].contiguous(), w[:, k].contiguous(), None, CFG)
             for k in (shard(256, TPGroup(r, size, None)) for r in range(size))]
    stock = parts[0]
    for p in parts[1:]:
        stock = stock + p
    assert (stock != aligned[0]).any(dim=1).sum().item() > 0, "stock TP should round otherwise on some rows"


@pytest.mark.interpreter
def test_one_slice_is_the_plain_gemm_and_other_tiles_compute_every_tile() -> None:
    x, w, b = _operands(9, 128, 24, 4, True)  # 32-column slices: whole K blocks, the TMA kernel
    assert torch.equal(tt.linear_tree_triton(x, w, b, 1, F32, CFG), lt.linear_triton(x, w, b, CFG))
    y = tt.linear_tree_triton(x, w, b, 4, F32, CFG)
    # other tiles and schedules compute every tile (the interpreter's numpy dots round by the tile's
    # shape, so the bits across tiles are the GPU test's)
    for tiles in [lt.LinearPlan(16, 16, 32, 4, 2, 1, False, False, 1, "ieee"),
                  lt.LinearPlan(32, 16, 32, 4, 2, 2, True, True, 1, "ieee")]:
        got = tt.linear_tree_triton(x, w, b, 4, F32, CFG, tiles=tiles)
        assert torch.allclose(got, y, rtol=1e-5, atol=1e-5), tiles


@pytest.mark.interpreter
@pytest.mark.parametrize("local", [2, 4, 8])
def test_a_persistent_program_carries_no_stack_from_one_tile_into_the_next(local: int) -> None:
    # 3 x 3 tiles on the interpreter's 4 programs: programs 0 to 1 compute 3 tiles, 2 to 3 two, each
    # tile's slices one step of the flattened loop; the stack levels are not reset between tiles, so a
    # level read before this tile wrote it would carry the last tile's sums in (rows scaled apart so
    # that any carried sum shows)
    x, w, b = _operands(40, 32 * local, 40, local, True)
    x = x * (10.0 ** torch.arange(-3, 5).repeat(5)[:, None])
    grid = lt.LinearPlan(16, 16, 32, 4, 2, 1, False, True, 1, "ieee")
    persistent = dataclasses.replace(grid, persistent=True)
    y = tt.linear_tree_triton(x, w, b, local, F32, CFG, tiles=grid)
    assert torch.equal(tt.linear_tree_triton(x, w, b, local, F32, CFG, tiles=persistent), y)
    parts = torch.stack([_partial(x[:, j * 32:(j + 1) * 32], w[:, j * 32:(j + 1) * 32]) for j in range(local)], -1)
    ref = pair_tree(parts) + b
    assert ((y - ref).abs() <= 1e-5 * ref.abs().amax(1, keepdim=True)).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("local", [2, 4, 8, 16])
def test_the_stack_in_global_memory_gives_the_registers_bits(local: int) -> None:
    # linear_tree_global_stack: where the registers' stack would quarter the tile (here a 128 x 64 tile
    # of one warp over 64 registers), its levels go to each program's fp32 scratch, read back by the
    # same program; a persistent grid (programs of two tiles, the scratch reused) and a plain one
    glob = dataclasses.replace(CFG, linear_tree_global_stack=True, linear_tree_acc_regs=64)
    regs = dataclasses.replace(glob, linear_tree_global_stack=False)
    x, w, b = _operands(150, 32 * local, 136, local, True)  # rows of 16-byte multiples: TMA
    x = x * (10.0 ** torch.arange(-3, 5).repeat(19)[:150, None])
    for tiles in (lt.LinearPlan(128, 64, 32, 1, 2, 1, True, True, 1, "ieee"),
                  lt.LinearPlan(128, 64, 32, 1, 2, 2, False, True, 1, "ieee")):
        assert tt.global_stack(tiles, local, glob) and not tt.global_stack(tiles, local, regs)
        y = tt.linear_tree_triton(x, w, b, local, F32, regs, tiles=tiles)
        assert torch.equal(tt.linear_tree_triton(x, w, b, local, F32, glob, tiles=tiles), y), tiles
        # level 0 in registers, levels 1 up in the scratch (linear_tree_global_stack_level0)
        assert torch.equal(tt.linear_tree_triton(x, w, b, local, F32, glob, tiles=tiles, stack=(True, True)), y)
        # TP 2: each half's subtree (its own global stack from 4 slices up), the top, the bias
        if local > 2:
            k = 16 * local
            halves = [tt.linear_tree_triton(x[:, h * k:(h + 1) * k].contiguous(), w[:, h * k:(h + 1) * k].contiguous(),
                                            None, local // 2, F32, glob, tiles=tiles) for h in range(2)]
            assert torch.equal(pair_tree(torch.stack(halves, -1)) + b, y)


@pytest.mark.interpreter
def test_the_global_stack_takes_the_tiles_the_registers_would_quarter() -> None:
    # measured on the H200: one halving (S = 2 at the large tile) cost less than the scratch's traffic,
    # two (S = 4 and 8) more
    glob = dataclasses.replace(CFG, linear_tree_global_stack=True)
    regs = dataclasses.replace(CFG, linear_tree_global_stack=False)
    w = torch.empty(2048, 4096, dtype=torch.bfloat16)
    big = lt.plan(8192, w, CFG, sms=132)
    assert (big.block_m, big.block_n) == (128, 256)
    assert tt.tree_plan(8192, w, 2, glob, sms=132) == tt.tree_plan(8192, w, 2, regs, sms=132) != big
    for local in (4, 8, 16):
        p = tt.tree_plan(8192, w, local, glob, sms=132)
        assert p == big and tt.global_stack(p, local, glob), local
        assert not tt.global_stack(tt.tree_plan(8192, w, local, regs, sms=132), local, glob)
    # decode and mid tiles keep the stack in registers
    for M in (1, 64, 256):
        assert not tt.global_stack(tt.tree_plan(M, w, 8, glob, sms=132), 8, glob)
    # linear_tree_global_stack_level0: S = 2's tile (two accumulators), level 0 in registers from S = 4
    level0 = dataclasses.replace(glob, linear_tree_global_stack_level0=True)
    two = tt.tree_plan(8192, w, 2, regs, sms=132)
    assert tt.tree_plan(8192, w, 2, level0, sms=132) == two and tt.stack_form(two, 2, level0) == (False, False)
    for local in (4, 8, 16):
        p = tt.tree_plan(8192, w, local, level0, sms=132)
        assert p == two and tt.stack_form(p, local, level0) == (True, True), local
        assert tt.stack_form(tt.tree_plan(8192, w, local, glob, sms=132), local, glob) == (True, False)
    assert tt.stack_form(tt.tree_plan(64, w, 8, level0, sms=132), 8, level0) == (False, False)


@pytest.mark.interpreter
def test_the_plan_halves_the_tile_until_the_stack_fits() -> None:
    regs = dataclasses.replace(CFG, linear_tree_global_stack=False)
    w = torch.empty(2048, 4096, dtype=torch.bfloat16)
    big = lt.plan(8192, w, CFG, sms=132)
    assert tt.tree_plan(8192, w, 1, regs, sms=132) == big
    for local in (2, 4, 8, 16):
        p = tt.tree_plan(8192, w, local, regs, sms=132)
        acc = local.bit_length() * p.block_m * p.block_n // (32 * p.num_warps)
        assert acc <= CFG.linear_tree_acc_regs and p.block_k == big.block_k, (local, p)
        assert p.block_m * p.block_n < big.block_m * big.block_n
    # decode tiles already fit
    assert tt.tree_plan(1, w, 8, regs, sms=132) == lt.plan(1, w, CFG, sms=132)


class _SplitLaunches:
    """``tt._tree_split_kernel`` that records each launch's grid."""

    def __init__(self) -> None:
        self.kernel, self.grids, self.tma = tt._tree_split_kernel, [], []

    def __getitem__(self, grid):
        self.grids.append(grid)
        launch = self.kernel[grid]

        def run(*args, **kw):
            self.tma.append(kw["TMA"])
            return launch(*args, **kw)

        return run


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("local", [2, 4, 8])
def test_the_split_grid_gives_the_pinned_forms_bits(local: int, dtype: torch.dtype,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # TP 1 (bias, x's dtype), a rank's fp32 subtree (no bias) and the other two pairs, at decode and mid
    # row counts, slices of whole K blocks and of a masked last block; the pinned form and the contract's
    # tree over the backend's slice partials (``sliced.row_parallel_linear``) give the same bits. bf16:
    # the interpreter's bf16 dot is not the GPU's (it multiplies the raw bits), so bf16 checks the
    # plumbing (the bias's load, the rounding) with the same arithmetic on both sides
    spy = _SplitLaunches()
    monkeypatch.setattr(tt, "_tree_split_kernel", spy)
    for i, m in enumerate((1, 5, 33)):
        kc = (32, 24)[i % 2] * 8 // local  # K columns per slice; K = 256 or 192
        x, w, b = _operands(m, kc * local, 40 + i, 100 * local + i, True)
        x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
        parts = torch.stack([_partial(x[:, j * kc:(j + 1) * kc], w[:, j * kc:(j + 1) * kc]) for j in range(local)],
                            -1)
        for bias, out in ((True, dtype), (False, F32), (False, dtype), (True, F32)):
            bb = b if bias else None
            got = tt.linear_tree_triton(x, w, bb, local, out, CFG, split=True)
            assert got.dtype == out and got.shape == (m, 40 + i)
            assert torch.equal(got, tt.linear_tree_triton(x, w, bb, local, out, CFG, split=False)), (m, bias, out)
            assert torch.equal(got, (pair_tree(parts) + (b.to(F32) if bias else 0)).to(out)), (m, bias, out)
        want = row_parallel_linear(x, w, b, slices=local, group=TPGroup.single(), partial=_partial)
        assert torch.equal(tt.linear_tree_triton(x, w, b, local, dtype, CFG, split=True), want)
    # one program per tile and slice, both load forms (TMA where the slices are whole K blocks)
    assert len(spy.grids) == 15 and all(len(g) == 1 and g[0] % local == 0 for g in spy.grids)
    print("TMA", local, spy.tma)


@pytest.mark.interpreter
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 40), kc=st.sampled_from([8, 12, 32]), n=st.integers(1, 48), log_s=st.integers(1, 3),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_the_split_grid_at_every_tp_degree_gives_tp1s_bits(m: int, kc: int, n: int, log_s: int, bias: bool,
                                                           seed: int) -> None:
    # linear_tree_split_grid_max_m on: every rank's subtree on the split grid, joined by the tree's top,
    # equals TP 1 on the split grid and the pinned form's TP 1
    s = 1 << log_s
    x, w, b = _operands(m, kc * s, n, seed, bias)
    one = row_parallel_linear(x, w, b, slices=s, group=TPGroup.single(), tree=_split_tree)
    assert torch.equal(one, row_parallel_linear(x, w, b, slices=s, group=TPGroup.single(), tree=_tree))
    size = 2
    while size <= s:
        for got in _tp(x, w, b, s, size, tree=_split_tree):
            assert torch.equal(got, one), (size, s)
        size *= 2


@pytest.mark.interpreter
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("local", [2, 8])
def test_every_slice_may_finish_a_tile_and_the_counters_end_at_zero(local: int, tma: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 x 3 tiles of 16 x 16: each tile's programs start from another slice, so in the interpreter's
    # program order every slice is the last arrival (the finisher) of some tile; rows scaled apart so
    # that a partial read from another slice or tile shows. The counters are back at zero after the
    # call, and a second call through the same counters gives the same bits. Slices of one K block
    # (32 columns) load through TMA descriptors where the plan says so, of 16 through pointers
    spy = _SplitLaunches()
    monkeypatch.setattr(tt, "_tree_split_kernel", spy)
    x, w, b = _operands(40, (32 if tma else 16) * local, 40, local, True)
    x = x * (10.0 ** torch.arange(-3, 5).repeat(5)[:, None])
    tiles = lt.LinearPlan(16, 16, 32, 4, 2, 1, False, tma, 1, "ieee")
    y = tt.linear_tree_triton(x, w, b, local, F32, CFG, tiles=tiles, split=True)
    assert spy.tma == [tma] and spy.grids == [(9 * local,)]
    counters = tt.tile_counters(x.device, 9)
    assert counters.dtype == torch.int32 and not counters.any()
    assert torch.equal(y, tt.linear_tree_triton(x, w, b, local, F32, CFG, tiles=tiles, split=False))
    again = tt.linear_tree_triton(x, w, b, local, F32, CFG, tiles=tiles, split=True)
    assert torch.equal(again, y) and tt.tile_counters(x.device, 9).data_ptr() == counters.data_ptr()
    assert not tt.tile_counters(x.device, 9).any()


@pytest.mark.interpreter
def test_the_split_grid_is_chosen_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # pinned for decode batches (M <= 16: faster at M = 1 on the H200, benchmarks/README.md); it takes
    # M <= linear_tree_split_grid_max_m rows and more than one slice, at the regime's tile (one
    # accumulator per program); 0 turns it off
    assert CFG.linear_tree_split_grid_max_m == 16
    assert [tt.split_grid(m, 8, CFG) for m in (1, 16, 17, 64, 8192)] == [True, True, False, False, False]
    off = dataclasses.replace(CFG, linear_tree_split_grid_max_m=0)
    assert not any(tt.split_grid(m, 8, off) for m in (1, 16, 64, 256, 8192))
    on = dataclasses.replace(CFG, linear_tree_split_grid_max_m=64)
    assert tt.split_grid(1, 2, on) and tt.split_grid(64, 16, on)
    assert not tt.split_grid(65, 2, on) and not tt.split_grid(1, 1, on)
    with pytest.raises(ValueError, match="linear_tree_split_grid_max_m 32 refused") as e:
        dataclasses.replace(CFG, linear_tree_split_grid_max_m=32)
    assert "\n" not in str(e.value)
    spy = _SplitLaunches()
    monkeypatch.setattr(tt, "_tree_split_kernel", spy)
    x, w, b = _operands(70, 64, 24, 1, True)
    for m, want in ((64, 1), (65, 1), (1, 2)):
        tt.linear_tree_triton(x[:m], w, b, 4, F32, on)
        tt.linear_tree_triton(x[:m], w, b, 1, F32, on)  # one slice: today's GEMM
        assert len(spy.grids) == want, m
    p = lt.plan(1, w, on, sms=lt._num_sms(x.device))  # the regime's tile: one row tile, N / BN column tiles
    assert spy.grids[-1] == (-(-24 // p.block_n) * 4,)
    # the finisher's fold fits the registers' stack budget, N halved as the stack's tile would be
    w16 = torch.empty(2048, 4096, dtype=torch.bfloat16)
    for m in (1, 64, 256):
        p = lt.plan(m, w16, on, sms=132)
        for local in (2, 4, 8, 16):
            jn = tt.join_block_n(p, local, on)
            assert p.block_n % jn == 0 and 16 <= jn <= p.block_n
            assert local.bit_length() * p.block_m * jn <= on.linear_tree_acc_regs * 32 * p.num_warps or jn == 16


@pytest.mark.interpreter
def test_refusals_are_one_line() -> None:
    x, w = torch.zeros(2, 64), torch.zeros(3, 64)
    for bad in (3, 32, 0):
        with pytest.raises(ValueError, match="refused on the triton backend") as e:
            tt.linear_tree_triton(x, w, None, bad, F32, CFG)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not a multiple"):
        tt.linear_tree_triton(x[:, :60], w[:, :60], None, 8, F32, CFG)
    with pytest.raises(ValueError, match="out_dtype"):
        tt.linear_tree_triton(x, w, None, 2, torch.bfloat16, CFG)
    with pytest.raises(ValueError, match="whole weight"):
        row_parallel_linear(x, [w[:, :32], w[:, 32:]], None, slices=2, group=TPGroup.single(), tree=_tree)


@pytest.mark.interpreter
def test_the_contract_and_check_tp_refuse_only_what_does_not_run() -> None:
    assert Contract(256, backend="triton", row_parallel_slices=16).row_parallel_slices == 16
    with pytest.raises(ContractError, match="at most 16 slices") as e:
        Contract(256, backend="triton", row_parallel_slices=32)
    assert "\n" not in str(e.value)
    from aligned_mamba.models.mamba2 import make_tiny

    config, _ = make_tiny(0, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2,
                          num_hidden_layers=1, chunk_size=32)
    check_tp(Contract(32, backend="triton", row_parallel_slices=4), config, 2)
    with pytest.raises(AlignedMambaError, match="row_parallel_slices >= 4"):
        check_tp(Contract(32, backend="triton", row_parallel_slices=2), config, 4)


@pytest.mark.interpreter
@pytest.mark.parametrize("size", [1, 2])
def test_megatrons_row_parallel_linear_is_one_launch_per_rank(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the hook's RowParallelLinear forward on the triton backend: a rank's subtree in one launch of the
    # tree kernel, TP 1's bits at every size; the per-slice path it replaces launched once per slice
    from types import SimpleNamespace

    from aligned_mamba.ops.backend import TritonBackend
    from trainer_hooks.megatron.forwards import linear_forward

    be = TritonBackend(CFG, torch.device("cpu"), kernels=True)
    launches = []
    kernel = tt.linear_tree_triton

    def counted(*args, **kwargs):
        launches.append(args[3])  # the slices the launch sums
        with _INTERPRETER:
            return kernel(*args, **kwargs)

    monkeypatch.setattr(tt, "linear_tree_triton", counted)
    slices, K = 8, 256
    x, w, b = _operands(5, K, 24, 7, True)
    want = row_parallel_linear(x, w, b, slices=slices, group=TPGroup.single(), tree=kernel_tree(kernel))

    class RowParallelLinear:  # the hook tells the layers apart by their class's name
        def __init__(self, weight: torch.Tensor, group: TPGroup) -> None:
            self.weight, self.bias, self.skip_bias_add = weight, b, False
            tp = None if group.size == 1 else group
            self._aligned_mamba_hook = SimpleNamespace(backend=lambda dev: be, tp=lambda m: tp, slices=slices,
                                                       sequence_group=lambda m: None)

    def rank(group: TPGroup) -> torch.Tensor:
        k = shard(K, group)
        return linear_forward(RowParallelLinear(w[:, k].contiguous(), group), x[:, k].unsqueeze(0))[0].squeeze(0)

    launches.clear()
    outs = threads(rank, size) if size > 1 else [rank(TPGroup.single())]
    assert all(torch.equal(o, want) for o in outs)
    assert launches == [slices // size] * size, launches
    # the per-slice path: rank 0's slices through the backend's partial GEMM, one launch each
    launches.clear()
    n, c = slices // size, K // slices
    row_parallel_linear(x[:, :K // size], [w[:, j * c:(j + 1) * c] for j in range(n)], None, slices=slices,
                        group=TPGroup(0, size, lambda t: t.expand(size, *t.shape)), partial=be.linear_partial)
    assert launches == [1] * n, launches


def kernel_tree(kernel):
    """``Ops.linear_tree`` over ``kernel`` (the interpreter's lock held by the caller's wrapper)."""
    return lambda x, w, b, local, out_dtype: kernel(x, w, b, local, out_dtype, CFG)


# -- gpu ----------------------------------------------------------------------------------------


SHAPES = [("mamba2-1.3b out_proj", 4096, 2048), ("mamba2-2.7b out_proj", 5120, 2560),
          ("nemotron-h-8b o_proj", 4096, 4096), ("nemotron-h-8b fc2", 21504, 4096)]


def _gpu_operands(K: int, N: int, M: int = 2048, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
    b = (torch.randn(N, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    return x, w, b


def _gpu_tp(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, slices: int, size: int) -> torch.Tensor:
    """TP ``size``: every rank's subtree launch, all-gathered (stacked in rank order), the top, bias, rounding."""
    kl = x.shape[1] // size
    subs = [tt.linear_tree_triton(x[:, r * kl:(r + 1) * kl], w[:, r * kl:(r + 1) * kl].contiguous(), None,
                                  slices // size, torch.float32, CFG) for r in range(size)]
    return (pair_tree(torch.stack(subs, -1)) + b.to(torch.float32)).to(x.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name,K,N", SHAPES, ids=[s[0] for s in SHAPES])
def test_gpu_every_tp_degree_gives_tp1s_bits(name: str, K: int, N: int) -> None:
    x, w, b = _gpu_operands(K, N)
    bad = []
    for M in (1, 64, 2048):
        for s in (2, 4, 8, 16):
            one = tt.linear_tree_triton(x[:M], w, b, s, torch.bfloat16, CFG)
            # the other loop form (a K loop per slice, or the loops flattened) and the other stack (in
            # registers at a halved tile, or in global memory at the regime's tile): the same bits
            # and level 0 of the global stack in registers
            flip = {"loops": "linear_tree_flatten", "stack": "linear_tree_global_stack",
                    "level0": "linear_tree_global_stack_level0"}
            for name, field in flip.items():
                other = dataclasses.replace(CFG, **{field: not getattr(CFG, field)})
                if not torch.equal(tt.linear_tree_triton(x[:M], w, b, s, torch.bfloat16, other), one):
                    bad.append((M, s, name))
            size = 2
            while size <= s:
                if not torch.equal(_gpu_tp(x[:M], w, b, s, size), one):
                    bad.append((M, s, size))
                size *= 2
        # one slice: today's GEMM, the same bits
        if not torch.equal(tt.linear_tree_triton(x[:M], w, b, 1, torch.bfloat16, CFG),
                           lt.linear_triton(x[:M], w, b, CFG)):
            bad.append((M, 1, 1))
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.parametrize("name,K,N", SHAPES, ids=[s[0] for s in SHAPES])
def test_gpu_the_split_grid_gives_the_pinned_forms_bits(name: str, K: int, N: int) -> None:
    x, w, b = _gpu_operands(K, N, M=256)
    on = dataclasses.replace(CFG, linear_tree_split_grid_max_m=256)
    bad = []
    for M in (1, 17, 64, 256):
        for s in (2, 4, 8, 16):
            one = tt.linear_tree_triton(x[:M], w, b, s, torch.bfloat16, CFG, split=False)
            # forced, and chosen by the configs; then a rank's fp32 subtree at TP 2
            if not torch.equal(tt.linear_tree_triton(x[:M], w, b, s, torch.bfloat16, CFG, split=True), one):
                bad.append((M, s, "forced"))
            if not torch.equal(tt.linear_tree_triton(x[:M], w, b, s, torch.bfloat16, on), one):
                bad.append((M, s, "configs"))
            kl = K // 2
            xs, ws = x[:M, :kl], w[:, :kl].contiguous()
            sub = tt.linear_tree_triton(xs, ws, None, s // 2, torch.float32, CFG, split=False)
            if not torch.equal(tt.linear_tree_triton(xs, ws, None, s // 2, torch.float32, CFG, split=s > 2), sub):
                bad.append((M, s, "subtree"))
    assert not bad, bad


@pytest.mark.gpu
def test_gpu_the_split_grids_counters_survive_cuda_graph_replays() -> None:
    # the finisher resets its tile's counter: replay after replay (and an eager call between them, on
    # the capture's stream and on the default one) gives the pinned form's bits

    K, N = SHAPES[0][1:]
    x, w, b = _gpu_operands(K, N, M=64)
    want = {s: tt.linear_tree_triton(x, w, b, s, torch.bfloat16, CFG) for s in (4, 8)}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in (4, 8):  # compiled, and the stream's counters allocated, before the capture
            tt.linear_tree_triton(x, w, b, s, torch.bfloat16, CFG, split=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = {s: tt.linear_tree_triton(x, w, b, s, torch.bfloat16, CFG, split=True) for s in (4, 8)}
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(outs[s], want[s]) for s in (4, 8)), i
        assert torch.equal(tt.linear_tree_triton(x, w, b, 8, torch.bfloat16, CFG, split=True), want[8]), i


@pytest.mark.gpu
@pytest.mark.parametrize("name,K,N", SHAPES[:3], ids=[s[0] for s in SHAPES[:3]])
def test_gpu_tree_rows_do_not_depend_on_m_and_sit_at_the_bf16_floor(name: str, K: int, N: int) -> None:
    x, w, b = _gpu_operands(K, N, M=8192)
    for s in (2, 8):
        full = tt.linear_tree_triton(x, w, b, s, torch.bfloat16, CFG)
        bad = []
        for i, M in enumerate((1, 3, 17, 64, 255, 1000, 4097)):
            start = [0, (8192 - M) // 2, 8192 - M][i % 3]
            part = tt.linear_tree_triton(x[start:start + M], w, b, s, torch.bfloat16, CFG)
            bad.append((M, int((part != full[start:start + M]).any(dim=1).sum())))
        assert all(n == 0 for _, n in bad), (s, bad)
        ref = x[:512].double() @ w.double().T + b.double()
        floor = ((ref.to(torch.bfloat16).double() - ref).norm() / ref.norm()).item()
        err = ((full[:512].double() - ref).norm() / ref.norm()).item()
        assert err <= 1.02 * floor, (s, err, floor)


@pytest.mark.gpu
def test_gpu_the_all_reduce_it_replaces_differs() -> None:
    x, w, b = _gpu_operands(4096, 2048, M=256)
    one = tt.linear_tree_triton(x, w, b, 8, torch.bfloat16, CFG)
    for size in (2, 4):
        kl = 4096 // size
        parts = [lt.linear_triton(x[:, r * kl:(r + 1) * kl], w[:, r * kl:(r + 1) * kl].contiguous(), None, CFG)
                 for r in range(size)]
        stock = parts[0]
        for p in parts[1:]:
            stock = stock + p
        stock = stock + b
        assert torch.equal(_gpu_tp(x, w, b, 8, size), one)
        assert int((stock != one).any(dim=1).sum()) > 0, size


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["g1", "g8", "hybrid", "moe"])
def test_gpu_model_rows_at_tp_2_and_4_equal_tp_1(name: str) -> None:
    """"moe": a MoE layer, run expert by expert under the slices (each expert's down projection the tree
    GEMM), as the grouped kernels have no sliced tree."""
    from aligned_mamba import tp_reference
    from aligned_mamba.models.mamba2 import make_tiny
    from aligned_mamba.models.nemotron_h import make_tiny_hybrid

    if name == "hybrid":
        config, tensors = make_tiny_hybrid(2, pattern="M*M-", chunk_size=32)
    elif name == "moe":
        config, tensors = make_tiny_hybrid(3, pattern="M*E", chunk_size=32)
    else:
        config, tensors = make_tiny(0 if name == "g1" else 1, hidden_size=128, num_heads=8, head_dim=32,
                                    state_size=32, n_groups=1 if name == "g1" else 8, num_hidden_layers=2,
                                    chunk_size=32)
    c = Contract(32, backend="triton", row_parallel_slices=4)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 512, (n,), generator=g) for n in (45, 7, 70)]
    one = tp_reference.forward(TPGroup.single(), config, tensors, c, seqs)
    assert one[0].is_cuda
    for size in (2, 4):
        # rank 0 alone first, every gather its own tensor repeated: the kernels of this degree compile
        # here, not in the rank threads at once
        tp_reference.forward(TPGroup(0, size, lambda t, k=size: t.unsqueeze(0).repeat(k, *[1] * t.dim())), config,
                             tensors, c, seqs)
        for rank_rows in threads(tp_reference.forward, size, config, tensors, c, seqs):
            assert all(torch.equal(a, b) for a, b in zip(rank_rows, one)), (name, size)
    stock_one = tp_reference.forward(TPGroup.single(), config, tensors, c, seqs, True)
    stock_two = threads(tp_reference.forward, 2, config, tensors, c, seqs, True)[0]
    assert sum(int((a != b).any(dim=-1).sum()) for a, b in zip(stock_one, stock_two)) > 0


# -- compile ------------------------------------------------------------------------------------


_COMPILE_TREE = sass_script({"N", "C", "stride_xm", "stride_wn", "stride_ym"}, r"""
from aligned_mamba.ops.linear import triton_tree as tt

import dataclasses

glob = dataclasses.replace(cfg, linear_tree_global_stack=not cfg.linear_tree_global_stack)
level0 = dataclasses.replace(cfg, linear_tree_global_stack=True,
                             linear_tree_global_stack_level0=not cfg.linear_tree_global_stack_level0)
plans, seen = {}, set()
for N in (2048, 4096):
    for M in (1, 64, 256, 8192):
        for local in (2, 4, 8, 16):
            for dt in ("bf16", "fp32"):
                w = torch.empty(N, 8, dtype=torch.bfloat16 if dt == "bf16" else torch.float32)
                plans[(dt, local, tt.tree_plan(M, w, local, cfg, sms=132))] = None
                # the other stack (linear_tree_global_stack): a global stack keeps the regime's tile;
                # and the global stack's level 0 in registers (the tile halved once)
                for other in (glob, level0):
                    gp = tt.tree_plan(M, w, local, other, sms=132)
                    g, l0 = tt.stack_form(gp, local, other)
                    if not gp.tma or (dt, local, gp, g, l0) in seen:
                        continue
                    seen.add((dt, local, gp, g, l0))
                    tag = f"tree:{dt}:L{local}:{gp.block_m}x{gp.block_n}x{gp.block_k}:w{gp.num_warps}s{gp.num_stages}"
                    comp(tag + f":tma:{dt}:global{int(g)}{int(l0)}", tt._tree_tma_kernel,
                         dict(tma_descs(dt, gp), b_ptr="*" + dt, st_ptr="*fp32"),
                         dict(HAS_BIAS=True, LOCAL=local, LEVELS=local.bit_length() - 1, BLOCK_M=gp.block_m,
                              BLOCK_N=gp.block_n, BLOCK_K=gp.block_k, GROUP_M=gp.group_m, PRECISION=gp.precision,
                              EPI_SPLIT=gp.epi_split, PERSISTENT=gp.persistent, GLOBAL_STACK=g, LEVEL0_REGS=l0,
                              FLATTEN=other.linear_tree_flatten and not g),
                         num_warps=gp.num_warps, num_stages=gp.num_stages)
for dt, local, p in plans:
    tag = f"tree:{dt}:L{local}:{p.block_m}x{p.block_n}x{p.block_k}:w{p.num_warps}s{p.num_stages}"
    opts = dict(num_warps=p.num_warps, num_stages=p.num_stages)
    c = dict(LOCAL=local, LEVELS=local.bit_length() - 1, BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
             GROUP_M=p.group_m, PRECISION=p.precision)
    stack = tt.global_stack(p, local, cfg)
    if p.tma:  # TP 1 (bias, the model dtype) and a rank's fp32 subtree
        for out, bias in ((dt, True), ("fp32", False)):
            comp(tag + f":tma:{out}", tt._tree_tma_kernel,
                 dict(tma_descs(dt, p, out), b_ptr="*" + dt, st_ptr="*fp32"),
                 dict(c, HAS_BIAS=bias, EPI_SPLIT=p.epi_split, PERSISTENT=p.persistent,
                      FLATTEN=cfg.linear_tree_flatten and not stack, GLOBAL_STACK=stack), **opts)
        # the other loop form (linear_tree_flatten), TP 1's launch
        comp(tag + f":tma:{dt}:flatten{int(not cfg.linear_tree_flatten)}", tt._tree_tma_kernel,
             dict(tma_descs(dt, p), b_ptr="*" + dt, st_ptr="*fp32"),
             dict(c, HAS_BIAS=True, EPI_SPLIT=p.epi_split, PERSISTENT=p.persistent,
                  FLATTEN=not cfg.linear_tree_flatten and not stack, GLOBAL_STACK=stack), **opts)
    # the pointer kernel: the plan's own launch without TMA, or a TMA plan's fallback tile
    f = tt.fallback_plan(p, local, cfg) if p.tma else p
    comp(f"tree:{dt}:L{local}:{f.block_m}x{f.block_n}x{f.block_k}:w{f.num_warps}s{f.num_stages}:ptr",
         tt._tree_ptr_kernel, dict(x_ptr="*" + dt, w_ptr="*" + dt, y_ptr="*" + dt, b_ptr="*" + dt),
         dict(c, HAS_BIAS=True, BLOCK_M=f.block_m, BLOCK_N=f.block_n, FLATTEN=cfg.linear_tree_flatten),
         num_warps=f.num_warps,
         num_stages=f.num_stages)
print(json.dumps(done))
""")


@pytest.mark.compile
@pytest.mark.slow
def test_the_tree_gemm_compiles_for_sm90_without_spills(sm90_cache):
    done = run_sm90_script(_COMPILE_TREE, sm90_cache)
    assert len(done) >= 20, [d["name"] for d in done]
    assert any(d["name"].endswith(":global11") for d in done)  # the global stack's level 0 in registers
    for d in done:
        assert d["LDL"] == d["STL"] == 0, d  # the stack of partial sums stays in registers
        _, dt, _, tile = d["name"].split(":")[:4]
        bm = int(tile.split("x")[0])
        if dt == "bf16":
            assert d["HGMMA" if bm >= 64 and ":tma:" in d["name"] else "HMMA"] > 0 or d["HGMMA"] > 0, d
        if ":tma:" in d["name"]:
            assert d["UTMALDG"] > 0, d


_COMPILE_SPLIT = sass_script({"N", "C", "stride_xm", "stride_wn", "stride_ym"}, r"""
from aligned_mamba.ops.linear import triton as lt
from aligned_mamba.ops.linear import triton_tree as tt

compile_ = triton.compile
ptx = []


def keep_ptx(src, target=None, options=None):
    k = compile_(src, target=target, options=options)
    ptx.append(k.asm["ptx"])
    return k


triton.compile = keep_ptx
w = torch.empty(2048, 8, dtype=torch.bfloat16)
for M in (1, 64, 8192):
    p = lt.plan(M, w, cfg, sms=132)
    # TP 1 (bias, bf16) at every local; a rank's fp32 subtree once; pointer loads at the decode and mid
    # tiles, TMA loads at the mid and large (a TMA plan's slices of whole K blocks)
    for local, out, bias in ((2, "bf16", True), (4, "bf16", True), (8, "bf16", True), (4, "fp32", False)):
        if out == "fp32" and M == 1:
            continue
        jn = tt.join_block_n(p, local, cfg)
        for tma in (False, True):
            if (tma and not p.tma) or (not tma and M > 64):
                continue
            ops = (dict(x_ptr=f"tensordesc<bf16[{p.block_m}, {p.block_k}]>",
                        w_ptr=f"tensordesc<bf16[{p.block_n}, {p.block_k}]>") if tma
                   else dict(x_ptr="*bf16", w_ptr="*bf16"))
            comp(f"split:bf16:L{local}:{p.block_m}x{p.block_n}x{p.block_k}:w{p.num_warps}s{p.num_stages}j{jn}:{out}"
                 f":{'tma' if tma else 'ptr'}", tt._tree_split_kernel,
                 dict(ops, y_ptr="*" + out, b_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32"),
                 dict(HAS_BIAS=bias, LOCAL=local, LEVELS=local.bit_length() - 1, BLOCK_M=p.block_m,
                      BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m, PRECISION=p.precision, JOIN_N=jn,
                      TMA=tma),
                 num_warps=p.num_warps, num_stages=p.num_stages)
            done[-1]["acq_rel_adds"] = len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx[-1]))
print(json.dumps(done))
""")


@pytest.mark.compile
@pytest.mark.slow
def test_the_split_grid_compiles_for_sm90_without_spills(sm90_cache):
    done = run_sm90_script(_COMPILE_SPLIT, sm90_cache)
    # pointers at M 1 (3) and 64 (4), TMA at 64 (4) and 8192 (4)
    assert len(done) == 15 and sum(d["name"].endswith(":tma") for d in done) == 8, [d["name"] for d in done]
    for d in done:
        assert d["LDL"] == d["STL"] == 0, d  # one accumulator, then the fold of JOIN_N columns
        bm = int(d["name"].split(":")[3].split("x")[0])
        assert d["HGMMA" if bm >= 64 else "HMMA"] > 0, d
        assert (d["UTMALDG"] > 0) == d["name"].endswith(":tma"), d
        assert d["acq_rel_adds"] == 1, d  # the tile's counter: release the partials, acquire the others'
