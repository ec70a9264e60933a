"""Nemotron-H's MLP, down(relu(up(x))^2), with the squared ReLU in the up GEMM's epilogue (triton backend).

The up GEMM is ``ops.linear.triton``'s (plan, K loop, rounding); the epilogue squares the rounded value
as ``ops.elementwise.triton.relu2`` does, so h has the bits of ``relu2(linear(x, up))`` without a pass
over the [M, intermediate] tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..autograd import grad_needed
from ..configs import TritonKernelConfigs
from ..elementwise.triton import relu2
from .triton import _bias_round, _num_sms, _tile_coords, _tma_ok, linear, linear_triton, plan


@triton.jit
def _relu2_round(u):
    """relu(u)^2 of a model-dtype tile in fp32, rounded once to its dtype (``_relu2_kernel``'s arithmetic)."""
    r = u.to(tl.float32)
    r = tl.where(r < 0.0, 0.0, r)  # nan stays nan
    return (r * r).to(u.dtype)


@triton.jit
def _store_tile(desc, om, on, c, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPI_SPLIT: tl.constexpr):
    if EPI_SPLIT == 2:
        c0, c1 = c.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
        desc.store([om, on], c0)
        desc.store([om, on + BLOCK_N // 2], c1)
    else:
        desc.store([om, on], c)


@triton.jit
def _store_rows(ptr, om, on, c, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """c [BM, BN] into a contiguous [M, N] at (om, on) through masked pointer stores (no shared memory)."""
    rm = om + tl.arange(0, BLOCK_M)
    rn = on + tl.arange(0, BLOCK_N)
    tl.store(ptr + rm[:, None].to(tl.int64) * N + rn[None, :], c, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _up_tma_tile(x_desc, w_desc, h_desc, u_ptr, b_ptr, tile, M, N, K, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 EPI_SPLIT: tl.constexpr, KEEP_PRE: tl.constexpr, PRECISION: tl.constexpr):
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
    u = _bias_round(acc, b_ptr, on, N, HAS_BIAS, BLOCK_N, h_desc.dtype)
    if KEEP_PRE:  # pointer stores: the TMA store's staging stays the linear's
        _store_rows(u_ptr, om, on, u, M, N, BLOCK_M, BLOCK_N)
    _store_tile(h_desc, om, on, _relu2_round(u), BLOCK_M, BLOCK_N, EPI_SPLIT)


@triton.jit(do_not_specialize=["M"])
def _up_tma_kernel(x_desc, w_desc, h_desc, u_ptr, b_ptr, M, N, K, NUM_PROGS, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   EPI_SPLIT: tl.constexpr, PERSISTENT: tl.constexpr, KEEP_PRE: tl.constexpr,
                   PRECISION: tl.constexpr):
    """``_linear_tma_kernel``'s tiles and schedule with the relu2 epilogue (h, and u if KEEP_PRE)."""
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=True):
            _up_tma_tile(x_desc, w_desc, h_desc, u_ptr, b_ptr, tile, M, N, K, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K,
                         GROUP_M, EPI_SPLIT, KEEP_PRE, PRECISION)
    else:
        _up_tma_tile(x_desc, w_desc, h_desc, u_ptr, b_ptr, tl.program_id(0), M, N, K, HAS_BIAS, BLOCK_M, BLOCK_N,
                     BLOCK_K, GROUP_M, EPI_SPLIT, KEEP_PRE, PRECISION)


@triton.jit(do_not_specialize=["M"])
def _up_ptr_kernel(x_ptr, w_ptr, h_ptr, u_ptr, b_ptr, M, N, K, stride_xm, stride_wn, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   KEEP_PRE: tl.constexpr, PRECISION: tl.constexpr):
    """``_linear_ptr_kernel``'s tiles with the relu2 epilogue (h and u [M, N] contiguous)."""
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
    u = _bias_round(acc, b_ptr, pid_n * BLOCK_N, N, HAS_BIAS, BLOCK_N, h_ptr.dtype.element_ty)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(h_ptr + offs, _relu2_round(u), mask=inside)
    if KEEP_PRE:
        tl.store(u_ptr + offs, u, mask=inside)


def linear_relu2_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: TritonKernelConfigs,
                        *, keep_pre: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h = relu(x @ weight.T (+ bias))^2 with ``linear_triton``'s tiles, and the pre-activation u (the
    linear's output) where ``keep_pre``. x [M, K], weight [N, K] in one model dtype (bf16 or fp32),
    bias [N] or None; h, u new contiguous [M, N] in x's dtype on x's CUDA device. Each h row has the
    bits of ``relu2_triton(linear_triton(x, weight, bias))``'s."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_relu2_triton: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"linear_relu2_triton: x {x.dtype} and weight {weight.dtype} must both be bfloat16 or "
                         "float32")
    M, K = x.shape
    N = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    h = torch.empty(M, N, dtype=x.dtype, device=x.device)
    u = torch.empty_like(h) if keep_pre else None
    if M == 0 or N == 0:
        return h, u
    sms = _num_sms(x.device)
    p = plan(M, weight, cfg, sms=sms)
    has_bias = bias is not None
    b = bias.contiguous() if has_bias else h
    common = dict(HAS_BIAS=has_bias, BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m,
                  KEEP_PRE=keep_pre, PRECISION=p.precision, num_warps=p.num_warps, num_stages=p.num_stages)
    if p.tma and _tma_ok(x, weight, h):
        num_tiles = triton.cdiv(M, p.block_m) * triton.cdiv(N, p.block_n)
        progs = min(num_tiles, sms * p.programs_per_sm) if p.persistent else num_tiles
        xd = TensorDescriptor(x, [M, K], [x.stride(0), 1], [p.block_m, p.block_k])
        wd = TensorDescriptor(weight, [N, K], [weight.stride(0), 1], [p.block_n, p.block_k])
        hd = TensorDescriptor(h, [M, N], [N, 1], [p.block_m, p.block_n // p.epi_split])
        _up_tma_kernel[(progs,)](xd, wd, hd, h if u is None else u, b, M, N, K, progs, EPI_SPLIT=p.epi_split,
                                 PERSISTENT=p.persistent, **common)
    else:
        grid = (triton.cdiv(M, p.block_m) * triton.cdiv(N, p.block_n),)
        _up_ptr_kernel[grid](x, weight, h, h if u is None else u, b, M, N, K, x.stride(0), weight.stride(0), **common)
    return h, u


def mlp_relu2(x: torch.Tensor, up_w: torch.Tensor, up_b: torch.Tensor | None, down_w: torch.Tensor,
              down_b: torch.Tensor | None, *, cfg: TritonKernelConfigs) -> torch.Tensor:
    """The triton backend's MLP, the bits of ``linear(relu2(linear(x, up_w, up_b)), down_w, down_b)``:
    x [M, hidden], up_w [inter, hidden], down_w [hidden, inter], biases or None -> [M, hidden]. Fused
    up to ``linear_mid_max_m`` rows without a gradient; larger calls compose the ops, faster there
    (benchmarks/README.md, "Hybrids: attention and MLP")."""
    if x.shape[0] <= cfg.linear_mid_max_m and not grad_needed(x, up_w, up_b, down_w, down_b):
        return linear_triton(linear_relu2_triton(x, up_w, up_b, cfg)[0], down_w, down_b, cfg)
    return linear(relu2(linear(x, up_w, up_b, cfg=cfg), cfg), down_w, down_b, cfg=cfg)


__all__ = ["linear_relu2_triton", "mlp_relu2"]
