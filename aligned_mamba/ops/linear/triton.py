"""The row-invariant linear layer on tensor cores (the triton form of ``ops.linear``).

Each output is ``tl.dot``'s fp32 sum over K in BLOCK_K steps, ascending, inside the program that owns
it (no split-K, no atomics), plus the bias in fp32, rounded once; bf16 operands on tensor cores, fp32
ones in IEEE precision (FMA). The tile and schedule follow M, the K block never: a tensor-core dot
gives a row the same bits whatever the tile (tests/ops/linear/test_linear_gemm.py, M 1 to 8192).
Why: docs/design.md, "How the bits are kept".
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..autograd import grad_needed
from ..configs import TritonKernelConfigs


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles sweep the N tiles together, so their x rows stay in L2."""
    width = GROUP_M * num_pid_n
    group = tile // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % size_m
    pid_n = (tile % width) // size_m
    return pid_m, pid_n


@triton.jit
def _bias_round(acc, b_ptr, on, N, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, OUT: tl.constexpr):
    """acc [BM, BN] fp32 (+ bias in fp32), rounded once to OUT."""
    if HAS_BIAS:
        rn = on + tl.arange(0, BLOCK_N)
        acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    return acc.to(OUT)


@triton.jit
def _tma_tile(x_desc, w_desc, y_desc, b_ptr, tile, M, N, K, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EPI_SPLIT: tl.constexpr,
              PRECISION: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
    om = pid_m * BLOCK_M
    on = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        a = x_desc.load([om, ki * BLOCK_K])
        b = w_desc.load([on, ki * BLOCK_K])
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    c = _bias_round(acc, b_ptr, on, N, HAS_BIAS, BLOCK_N, y_desc.dtype)
    if EPI_SPLIT == 2:
        # two half-width stores: half the shared-memory staging, no change to any value
        c0, c1 = c.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
        y_desc.store([om, on], c0)
        y_desc.store([om, on + BLOCK_N // 2], c1)
    else:
        y_desc.store([om, on], c)


@triton.jit(do_not_specialize=["M"])
def _linear_tma_kernel(x_desc, w_desc, y_desc, b_ptr, M, N, K, NUM_PROGS, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       EPI_SPLIT: tl.constexpr, PERSISTENT: tl.constexpr, PRECISION: tl.constexpr):
    """Tiles through TMA descriptors (out-of-range rows and columns load as zero, are not stored); one
    tile per program, or (PERSISTENT) tiles p, p + NUM_PROGS, ..."""
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=True):
            _tma_tile(x_desc, w_desc, y_desc, b_ptr, tile, M, N, K, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                      EPI_SPLIT, PRECISION)
    else:
        _tma_tile(x_desc, w_desc, y_desc, b_ptr, tl.program_id(0), M, N, K, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K,
                  GROUP_M, EPI_SPLIT, PRECISION)


@triton.jit(do_not_specialize=["M"])
def _linear_ptr_kernel(x_ptr, w_ptr, y_ptr, b_ptr, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       PRECISION: tl.constexpr):
    """The same tiles and arithmetic through masked pointer loads (tensors TMA cannot take)."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        rk = ki * BLOCK_K + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None],
                    mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    c = _bias_round(acc, b_ptr, pid_n * BLOCK_N, N, HAS_BIAS, BLOCK_N, y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], c, mask=(rm[:, None] < M) & (rn[None, :] < N))


@dataclass(frozen=True)
class LinearPlan:
    """One launch's tiles and schedule (see ``plan``)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int
    persistent: bool
    tma: bool
    epi_split: int
    precision: str
    programs_per_sm: int = 1


def plan(M: int, weight: torch.Tensor, cfg: TritonKernelConfigs, *, sms: int) -> LinearPlan:
    """The tiles for M rows of weight [N, K] on ``sms`` SMs, from ``cfg``'s linear_* fields: bf16 takes
    the decode, mid or large tile by M (mid: the large tile for lm_head-sized grids, persistent only
    from enough tiles per SM), then ``_fill`` (a decode tile it narrows to 16 columns takes the narrow
    warps and stages); fp32 one tile. The K block is the same in every regime.
    """
    if weight.dtype == torch.float32:
        return _plan("fp32", cfg)
    N = weight.shape[0]
    regime = "decode" if M <= cfg.linear_decode_max_m else "mid" if M <= cfg.linear_mid_max_m else "large"
    p = _plan(regime, cfg)
    if regime == "mid" and cfg.linear_mid_large_min_tiles_per_sm and M >= cfg.linear_block_m:
        big = _plan("large", cfg)
        if _tiles(M, N, big) >= cfg.linear_mid_large_min_tiles_per_sm * sms:
            return _fill(big, triton.cdiv(M, big.block_m), N, cfg.linear_fill_programs)
    p = _fill(p, triton.cdiv(M, p.block_m), N, cfg.linear_fill_programs)
    if regime == "decode" and p.block_n == 16:
        p = dataclasses.replace(p, num_warps=cfg.linear_decode_narrow_warps,
                                num_stages=cfg.linear_decode_narrow_stages)
    if regime == "mid" and p.persistent and _tiles(M, N, p) < cfg.linear_mid_persistent_min_tiles_per_sm * sms:
        p = dataclasses.replace(p, persistent=False, programs_per_sm=1)
    return p


def _tiles(M: int, N: int, p: LinearPlan) -> int:
    return triton.cdiv(M, p.block_m) * triton.cdiv(N, p.block_n)


@functools.lru_cache(maxsize=64)
def _plan(regime: str, cfg: TritonKernelConfigs) -> LinearPlan:
    c = cfg
    if regime == "fp32":
        return LinearPlan(c.linear_fp32_block_m, c.linear_fp32_block_n, c.linear_fp32_block_k, c.linear_fp32_warps,
                          c.linear_fp32_stages, c.linear_group_m, False, c.linear_tma, 1, "ieee")
    if regime == "decode":
        return LinearPlan(c.linear_decode_block_m, c.linear_decode_block_n, c.linear_block_k, c.linear_decode_warps,
                          c.linear_decode_stages, 1, c.linear_decode_persistent, c.linear_decode_tma, 1, "ieee",
                          c.linear_decode_programs_per_sm)
    if regime == "mid":
        return LinearPlan(c.linear_mid_block_m, c.linear_mid_block_n, c.linear_block_k, c.linear_mid_warps,
                          c.linear_mid_stages, c.linear_group_m, c.linear_mid_persistent, c.linear_mid_tma, 1, "ieee",
                          c.linear_mid_programs_per_sm)
    return LinearPlan(c.linear_block_m, c.linear_block_n, c.linear_block_k, c.linear_warps, c.linear_stages,
                      c.linear_group_m, c.linear_persistent, c.linear_tma, c.linear_epi_split, "ieee",
                      c.linear_programs_per_sm)


@functools.lru_cache(maxsize=4096)
def _fill(p: LinearPlan, row_tiles: int, N: int, fill: int) -> LinearPlan:
    """Halve the N tile (down to 16) while the grid has fewer than ``fill`` tiles, so narrow layers
    (out_proj) fill the GPU without split-K; the stages grow to keep the shared memory (up to 8, or the
    configured stages where those are more)."""
    bn, stages = p.block_n, p.num_stages
    while bn > 16 and row_tiles * triton.cdiv(N, bn) < fill:
        stages = min(max(8, p.num_stages), stages * (p.block_m + bn) // (p.block_m + bn // 2))
        bn //= 2
    if bn == p.block_n:
        return p
    return dataclasses.replace(p, block_n=bn, num_stages=stages, epi_split=p.epi_split if bn >= 32 else 1)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Programs of a persistent grid: one per SM (a few in the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tma_ok(*ts: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and row strides and a unit last stride."""
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               for t in ts)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: TritonKernelConfigs,
                  *, tiles: LinearPlan | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> new [M, N] in x's dtype, each row a fixed function of
    that row. x, weight: one model dtype (bf16 or fp32), x's rows may be strided; no host sync.
    ``tiles`` overrides ``plan`` (benchmarks, tests)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_triton: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"linear_triton: x {x.dtype} and weight {weight.dtype} must both be bfloat16 or float32")
    M, K = x.shape
    N = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    p = tiles or plan(M, weight, cfg, sms=_num_sms(x.device))
    num_tiles = triton.cdiv(M, p.block_m) * triton.cdiv(N, p.block_n)
    progs = min(num_tiles, _num_sms(x.device) * p.programs_per_sm) if p.persistent else num_tiles
    has_bias = bias is not None
    b = bias.contiguous() if has_bias else y
    common = dict(HAS_BIAS=has_bias, BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m,
                  PRECISION=p.precision, num_warps=p.num_warps, num_stages=p.num_stages)
    if p.tma and _tma_ok(x, weight, y):
        num_tiles = triton.cdiv(M, p.block_m) * triton.cdiv(N, p.block_n)
        progs = min(num_tiles, _num_sms(x.device) * p.programs_per_sm) if p.persistent else num_tiles
        xd = TensorDescriptor(x, [M, K], [x.stride(0), 1], [p.block_m, p.block_k])
        wd = TensorDescriptor(weight, [N, K], [weight.stride(0), 1], [p.block_n, p.block_k])
        yd = TensorDescriptor(y, [M, N], [N, 1], [p.block_m, p.block_n // p.epi_split])
        _linear_tma_kernel[(progs,)](xd, wd, yd, b, M, N, K, progs, EPI_SPLIT=p.epi_split, PERSISTENT=p.persistent,
                                     **common)
    else:
        grid = (triton.cdiv(M, p.block_m) * triton.cdiv(N, p.block_n),)
        _linear_ptr_kernel[grid](x, weight, y, b, M, N, K, x.stride(0), weight.stride(0), N, **common)
    return y


# -- autograd: the kernel's forward; a cuBLAS backward ------------------------------------------------------


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                cfg: TritonKernelConfigs) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.bias_dtype = None if b is None else b.dtype
        return linear_triton(x, w, b, cfg)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        nx, nw, nb, _ = ctx.needs_input_grad
        return (g @ w if nx else None, (g.t() @ x).to(w.dtype) if nw else None,
                g.to(torch.float32).sum(0).to(ctx.bias_dtype) if nb else None, None)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *,
           cfg: TritonKernelConfigs) -> torch.Tensor:
    """The triton backend's ``linear``: ``linear_triton``, with a cuBLAS backward under autograd."""
    return _Linear.apply(x, w, b, cfg) if grad_needed(x, w, b) else linear_triton(x, w, b, cfg)
