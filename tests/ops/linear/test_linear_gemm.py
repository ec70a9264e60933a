"""The triton backend's plain GEMM (``ops/linear/triton.py``): its plan and its kernels.

- interpreter (the Triton interpreter on a CPU; compiled where a GPU runs them): the plan takes the
  tile of each M regime (decode, mid, large) and one K block, the large tile and a persistent grid
  in the mid regime only where the tiles fill the GPU, a halved N tile where there are few output
  columns, and the configs refuse a mid regime ending below the decode one; fp32 against fp64 with
  a ragged last K block, with and without a bias; every schedule (grouped, persistent, TMA or
  pointer tiles over ragged edges) computes every tile; strided rows taken, mixed dtypes refused.
- gpu (skipped without CUDA; run on the H200): every linear layer of mamba2-130m, -1.3b, -2.7b, a
  Nemotron-H-8B mixer and a 256k lm_head in bf16: a row's bits do not depend on how many rows share
  the call (M from 1 to 8192; fp32 too), where cuBLAS's do; the TMA and pointer tiles agree and sit
  at the bf16 floor; a row's bits do not depend on its offset in the call.

The kernels compile for sm_90 in the ops' script of tests/ops/test_triton_ops.py; the row-
parallel tree GEMM: tests/ops/linear/test_linear_tree.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import CFG, gpu, rand, rows_invariant  # noqa: E402

from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.linear import triton as lt  # noqa: E402

# every regime on pointer loads (a persistent grid and split stores need TMA)
NO_TMA = dataclasses.replace(CFG, linear_tma=False, linear_persistent=False, linear_epi_split=1, linear_mid_tma=False,
                             linear_mid_persistent=False, linear_mid_programs_per_sm=1)


# -- the plan --------------------------------------------------------------------------------------------


@pytest.mark.interpreter
def test_the_mid_regime_cannot_end_below_the_decode_regime():
    with pytest.raises(ValueError, match="linear_mid_max_m"):
        TritonKernelConfigs(linear_decode_max_m=64, linear_mid_max_m=32)


@pytest.mark.interpreter
def test_plan_takes_the_tile_of_each_m_regime_and_one_k_block():
    w = torch.empty(50280, 8, dtype=torch.bfloat16)  # enough columns that no N tile is halved
    c = CFG
    mid_m = c.linear_block_m - 1  # below the rows of the large tile: the mid tile whatever N
    tiles = {M: lt.plan(M, w, c, sms=132) for M in (1, c.linear_decode_max_m, c.linear_decode_max_m + 1, mid_m,
                                                    c.linear_mid_max_m + 1, 8192)}
    assert (tiles[1].block_m, tiles[1].block_n, tiles[1].tma) == (c.linear_decode_block_m, c.linear_decode_block_n,
                                                                  c.linear_decode_tma)
    assert tiles[c.linear_decode_max_m] == tiles[1]
    assert (tiles[mid_m].block_m, tiles[mid_m].block_n) == (c.linear_mid_block_m, c.linear_mid_block_n)
    assert (tiles[8192].block_m, tiles[8192].block_n, tiles[8192].persistent) == (c.linear_block_m, c.linear_block_n,
                                                                                  c.linear_persistent)
    assert {t.block_k for t in tiles.values()} == {c.linear_block_k}
    f32 = {lt.plan(M, w.float(), c, sms=132) for M in (1, 100, 8192)}
    assert len(f32) == 1 and next(iter(f32)).block_k == c.linear_fp32_block_k


@pytest.mark.interpreter
def test_mid_calls_take_the_large_tile_and_a_persistent_grid_only_where_the_tiles_fill_the_gpu():
    c = CFG
    M = c.linear_mid_max_m
    head = lt.plan(M, torch.empty(50280, 8, dtype=torch.bfloat16), c, sms=132)  # 2 x 197 large tiles
    assert (head.block_m, head.block_n) == (c.linear_block_m, c.linear_block_n)
    proj = lt.plan(M, torch.empty(18560, 8, dtype=torch.bfloat16), c, sms=132)  # 2 x 73 large tiles: too few
    assert (proj.block_m, proj.block_n, proj.persistent) == (c.linear_mid_block_m, c.linear_mid_block_n, True)
    assert proj.programs_per_sm == c.linear_mid_programs_per_sm
    small = lt.plan(64, torch.empty(4096, 8, dtype=torch.bfloat16), c, sms=132)  # out_proj: 256 tiles after fill
    assert not small.persistent and small.programs_per_sm == 1
    never = dataclasses.replace(c, linear_mid_large_min_tiles_per_sm=0)
    assert lt.plan(M, torch.empty(50280, 8, dtype=torch.bfloat16), never, sms=132).block_m == c.linear_mid_block_m
    assert lt.plan(M, torch.empty(50280, 8, dtype=torch.bfloat16), c, sms=1024).block_m == c.linear_mid_block_m


@pytest.mark.interpreter
def test_few_output_columns_halve_the_n_tile_and_keep_the_k_block():
    c = dataclasses.replace(CFG, linear_fill_programs=132)
    p = lt.plan(1, torch.empty(2048, 8, dtype=torch.bfloat16), c, sms=132)  # out_proj of a 2048-wide model
    assert p.block_n < c.linear_decode_block_n and p.block_k == c.linear_block_k
    assert 2048 // p.block_n >= 128 or p.block_n == 16
    big = lt.plan(1, torch.empty(50280, 8, dtype=torch.bfloat16), c, sms=132)
    assert big.block_n == c.linear_decode_block_n
    off = lt.plan(1, torch.empty(2048, 8, dtype=torch.bfloat16), dataclasses.replace(c, linear_fill_programs=0),
                  sms=132)
    assert off.block_n == c.linear_decode_block_n


# -- the kernels (fp32 through the interpreter on a CPU) ----------------------------------------------


def _ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


@pytest.mark.interpreter
@pytest.mark.parametrize("M", [1, 3, 17, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_fp32_matches_fp64(M, with_bias):
    # K = 80: the last K block is partly zero padding
    x, w = rand(M, 80, seed=M), rand(90, 80, seed=1)
    b = rand(90, seed=2) if with_bias else None
    y = lt.linear_triton(x, w, b, CFG)
    assert y.dtype == torch.float32 and y.shape == (M, 90)
    ref = _ref(x, w, b)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6


_SCHEDULES = [  # (block_m, block_n, block_k, warps, stages, group_m, persistent, tma, epi_split)
    (16, 32, 32, 4, 2, 1, False, True, 1),
    (32, 64, 32, 4, 2, 2, True, True, 2),
    (16, 16, 32, 4, 2, 4, True, True, 1),
    (32, 32, 32, 4, 2, 8, False, False, 1),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("tiles", _SCHEDULES, ids=lambda t: "x".join(map(str, t)))
def test_linear_every_schedule_computes_every_tile(tiles):
    # grouped, persistent (4 programs in the interpreter), TMA or pointer tiles over ragged edges;
    # the output is poisoned first, so a tile left out shows as NaN
    x, w, b = rand(70, 64, seed=3), rand(90, 64, seed=4), rand(90, seed=5)
    p = lt.LinearPlan(*tiles, precision="ieee")
    y = lt.linear_triton(x, w, b, CFG, tiles=p)
    ref = _ref(x, w, b)
    assert not torch.isnan(y).any()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.interpreter
def test_linear_takes_strided_rows_and_refuses_mixed_dtypes():
    big = rand(6, 100, seed=6)
    x, w = big[:, 10:74], rand(24, 64, seed=7)
    assert torch.allclose(lt.linear_triton(x, w, None, CFG), (x.double() @ w.double().T).float(), rtol=1e-5,
                          atol=1e-5)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        lt.linear_triton(x, w.to(torch.bfloat16), None, CFG)
    assert lt.linear_triton(x[:0], w, None, CFG).shape == (0, 24)


# -- gpu: bits at the model shapes --------------------------------------------------------------------

# (name, K, N): every linear layer of mamba2-130m, -1.3b, -2.7b, a Nemotron-H-8B mixer, a 256k lm_head
GEMM_SHAPES = [
    ("130m.in_proj", 768, 3352), ("130m.out_proj", 1536, 768), ("130m.lm_head", 768, 50280),
    ("1.3b.in_proj", 2048, 8512), ("1.3b.out_proj", 4096, 2048), ("1.3b.lm_head", 2048, 50280),
    ("2.7b.in_proj", 2560, 10576), ("2.7b.out_proj", 5120, 2560),
    ("8b.in_proj", 4096, 18560), ("8b.out_proj", 8192, 4096), ("lm_head_256k", 4096, 256000),
]
MS = [1, 2, 3, 7, 17, 63, 65, 255, 1000, 4097, 8192]


def _gpu_gemm_operands(K: int, N: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(8192, K, device="cuda", generator=g).to(dtype)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("name,K,N", GEMM_SHAPES, ids=[s[0] for s in GEMM_SHAPES])
@gpu
def test_gpu_gemm_rows_do_not_depend_on_m(name, K, N):
    x, w = _gpu_gemm_operands(K, N, torch.bfloat16)
    b = (torch.randn(N, device="cuda") * 0.1).to(torch.bfloat16) if name.endswith("in_proj") else None
    bad = rows_invariant(lambda t: lt.linear_triton(t, w, b, CFG), x, MS)
    assert all(n == 0 for _, n in bad), bad


@gpu
def test_gpu_cublas_rows_do_depend_on_m():
    # the baseline that the GEMM test would catch: cuBLAS at out_proj's shape (K 4096)
    x, w = _gpu_gemm_operands(4096, 2048, torch.bfloat16)
    bad = rows_invariant(lambda t: torch.nn.functional.linear(t, w), x, [1, 7, 64])
    assert any(n > 0 for _, n in bad), bad


@gpu
def test_gpu_gemm_fp32_rows_do_not_depend_on_m():
    x, w = _gpu_gemm_operands(2048, 8512, torch.float32)
    bad = rows_invariant(lambda t: lt.linear_triton(t, w, None, CFG), x[:4097], [1, 3, 17, 255, 1000, 4097])
    assert all(n == 0 for _, n in bad), bad


@gpu
def test_gpu_gemm_tma_and_pointer_tiles_agree_and_sit_at_the_bf16_floor():
    for K, N in ((2048, 8512), (4096, 2048), (768, 50280)):
        x, w = _gpu_gemm_operands(K, N, torch.bfloat16)
        b = torch.randn(N, device="cuda").to(torch.bfloat16)
        for M in (1, 64, 2048):
            y = lt.linear_triton(x[:M], w, b, CFG)
            assert torch.equal(y, lt.linear_triton(x[:M], w, b, NO_TMA))
            ref = x[:M].double() @ w.double().T + b.double()
            floor = ((ref.to(torch.bfloat16).double() - ref).norm() / ref.norm()).item()
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert err <= 1.02 * floor, (K, N, M, err, floor)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_linear_rows_do_not_depend_on_the_call(dtype):
    from aligned_mamba.ops.configs import TritonKernelConfigs
    from aligned_mamba.ops.linear.triton import linear_triton

    cfg = TritonKernelConfigs()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 768, generator=g).to("cuda", dtype)
    w = torch.randn(1600, 768, generator=g).to("cuda", dtype)
    full = linear_triton(x, w, None, cfg)
    for m in (1, 2, 7, 16, 17, 100):
        for start in (0, 5, 333):
            assert torch.equal(linear_triton(x[start:start + m], w, None, cfg), full[start:start + m]), (m, start)
