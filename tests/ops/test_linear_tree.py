"""The triton backend's row-parallel tree GEMM (``ops/linear/triton_tree.py``) through the interpreter.

fp32 only (the interpreter's bf16 arithmetic is not the GPU's), small shapes: the logic. TP k (ranks
as threads, each launch computing its subtree, the subtree sums all-gathered and joined by the tree's
top) gives TP 1's bits, TP 1 being one launch with the whole tree, the bias and the rounding; both
equal the per-slice partials summed by ``pair_tree`` (the contract's tree), and the all-reduce of
rank partials that stock tensor parallelism runs differs. The split-slices grid (a program per tile
and slice, the last to finish joining) gives the same bits. tests/ops/test_linear_tree_gpu.py checks
the bits on the GPU at the model shapes.
"""

from __future__ import annotations

import dataclasses
import threading

import interpreted  # noqa: F401  (the interpreter on, before triton is imported)
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

interpreted.require()
pytestmark = pytest.mark.interpreter

from aligned_mamba.contract import Contract  # noqa: E402
from aligned_mamba.errors import AlignedMambaError, ContractError  # noqa: E402
from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.linear import triton as lt  # noqa: E402
from aligned_mamba.ops.linear import triton_tree as tt  # noqa: E402
from aligned_mamba.ops.linear.sliced import row_parallel_linear  # noqa: E402
from aligned_mamba.ops.logprobs.sliced import pair_tree  # noqa: E402
from aligned_mamba.parallel import TPGroup, check_tp, shard, threads  # noqa: E402

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
        # TP 2: each half's subtree (its own global stack from 4 slices up), the top, the bias
        if local > 2:
            k = 16 * local
            halves = [tt.linear_tree_triton(x[:, h * k:(h + 1) * k].contiguous(), w[:, h * k:(h + 1) * k].contiguous(),
                                            None, local // 2, F32, glob, tiles=tiles) for h in range(2)]
            assert torch.equal(pair_tree(torch.stack(halves, -1)) + b, y)


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
        self.kernel, self.grids = tt._tree_split_kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


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
            assert torch.equal(got, tt.linear_tree_triton(x, w, bb, local, out, CFG)), (m, bias, out)
            assert torch.equal(got, (pair_tree(parts) + (b.to(F32) if bias else 0)).to(out)), (m, bias, out)
        want = row_parallel_linear(x, w, b, slices=local, group=TPGroup.single(), partial=_partial)
        assert torch.equal(tt.linear_tree_triton(x, w, b, local, dtype, CFG, split=True), want)
    assert len(spy.grids) == 15 and all(g[1] == local for g in spy.grids)


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


@pytest.mark.parametrize("local", [2, 8])
def test_every_slice_may_finish_a_tile_and_the_counters_end_at_zero(local: int) -> None:
    # 3 x 3 tiles of 16 x 16: each tile's programs start from another slice, so in the interpreter's
    # program order every slice is the last arrival (the finisher) of some tile; rows scaled apart so
    # that a partial read from another slice or tile shows. The counters are back at zero after the
    # call, and a second call through the same counters gives the same bits
    x, w, b = _operands(40, 16 * local, 40, local, True)
    x = x * (10.0 ** torch.arange(-3, 5).repeat(5)[:, None])
    tiles = lt.LinearPlan(16, 16, 32, 4, 2, 1, False, False, 1, "ieee")
    y = tt.linear_tree_triton(x, w, b, local, F32, CFG, tiles=tiles, split=True)
    counters = tt.tile_counters(x.device, 9)
    assert counters.dtype == torch.int32 and not counters.any()
    assert torch.equal(y, tt.linear_tree_triton(x, w, b, local, F32, CFG, tiles=tiles))
    again = tt.linear_tree_triton(x, w, b, local, F32, CFG, tiles=tiles, split=True)
    assert torch.equal(again, y) and tt.tile_counters(x.device, 9).data_ptr() == counters.data_ptr()
    assert not tt.tile_counters(x.device, 9).any()


def test_the_split_grid_is_opt_in_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # off in the pinned configs (not yet timed on the GPU); on, it takes M <= linear_tree_split_grid_max_m
    # rows and more than one slice, at the regime's tile (one accumulator per program)
    assert CFG.linear_tree_split_grid_max_m == 0
    assert not any(tt.split_grid(m, 8, CFG) for m in (1, 16, 64, 256, 8192))
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
    assert spy.grids[-1] == (-(-24 // p.block_n), 4)
    # the finisher's fold fits the registers' stack budget, N halved as the stack's tile would be
    w16 = torch.empty(2048, 4096, dtype=torch.bfloat16)
    for m in (1, 64, 256):
        p = lt.plan(m, w16, on, sms=132)
        for local in (2, 4, 8, 16):
            jn = tt.join_block_n(p, local, on)
            assert p.block_n % jn == 0 and 16 <= jn <= p.block_n
            assert local.bit_length() * p.block_m * jn <= on.linear_tree_acc_regs * 32 * p.num_warps or jn == 16


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
            self._aligned_mamba_hook = SimpleNamespace(backend=lambda dev: be, tp=lambda m: tp, slices=slices)

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
