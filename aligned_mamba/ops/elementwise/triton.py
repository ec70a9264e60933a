"""Nemotron-H's squared ReLU in one Triton pass, and its backward, each with the torch form's bits.

y = relu(x)^2 in fp32, rounded once to x's dtype; dx = 2 relu(x) g in fp32, rounded once: autograd's bits for the
torch form (g r + g r there: one rounding, then an exact doubling), from x alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..autograd import grad_needed
from ..configs import TritonKernelConfigs


@triton.jit
def _relu2_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.where(x < 0.0, 0.0, x)  # nan stays nan, as torch.relu
    tl.store(y_ptr + offs, (r * r).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _relu2_bwd_kernel(x_ptr, g_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dx = tl.where(x <= 0.0, 0.0, (2.0 * x) * g)  # nan stays nan, as relu's backward
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def relu2_triton(x: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
    """relu(x)^2 of a CUDA tensor (any shape, bf16 or fp32) in x's dtype, a new contiguous tensor."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        _relu2_kernel[(triton.cdiv(n, cfg.relu2_block),)](x, y, n, BLOCK=cfg.relu2_block, num_warps=4)
    return y


def relu2_backward_triton(x: torch.Tensor, g: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
    """dx of relu2 at x against g (CUDA tensors of one shape): 2 relu(x) g in fp32, rounded to x's dtype."""
    x, g = x.contiguous(), g.contiguous()
    dx = torch.empty_like(x)
    n = x.numel()
    if n:
        _relu2_bwd_kernel[(triton.cdiv(n, cfg.relu2_block),)](x, g, dx, n, BLOCK=cfg.relu2_block, num_warps=4)
    return dx


class _Relu2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.cfg = cfg
        return relu2_triton(x, cfg)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        (x,) = ctx.saved_tensors
        return relu2_backward_triton(x, g, ctx.cfg), None


def relu2(x: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
    """The op's signature (``ieee.relu2``): the kernel, with its one-pass gradient
    (``relu2_backward_triton``, saving only x) where a gradient is recorded; x [any shape] bf16 or fp32."""
    return _Relu2.apply(x, cfg) if grad_needed(x) else relu2_triton(x, cfg)


__all__ = ["relu2", "relu2_backward_triton", "relu2_triton"]
