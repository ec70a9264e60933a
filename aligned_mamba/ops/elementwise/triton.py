"""Elementwise kernels of the triton backend: Nemotron-H's squared ReLU in one pass.

relu2(x) = relu(x)^2, taken to fp32, squared with one IEEE multiply and rounded once (RNE) to
x's dtype: each element a fixed function of itself, the bits of ``layers.mlp.relu2``'s torch form
(three ATen kernels there, one read and one write here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..autograd import grad_needed
from ..configs import TritonKernelConfigs
from . import ieee


@triton.jit
def _relu2_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.where(x < 0.0, 0.0, x)  # nan stays nan, as torch.relu
    tl.store(y_ptr + offs, (r * r).to(y_ptr.dtype.element_ty), mask=mask)


def relu2_triton(x: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
    """relu(x)^2 of a CUDA tensor (any shape, bf16 or fp32) in x's dtype, a new contiguous tensor."""
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        _relu2_kernel[(triton.cdiv(n, cfg.relu2_block),)](x, y, n, BLOCK=cfg.relu2_block, num_warps=4)
    return y


__all__ = ["relu2", "relu2_triton"]


def relu2(x: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
    """The op's signature (``ieee.relu2``): the kernel, or the torch form where a gradient is recorded
    (the same bits: one rounding of one IEEE multiply, differentiable)."""
    return ieee.relu2(x) if grad_needed(x) else relu2_triton(x, cfg)
