"""Row-invariant linear layer as a Triton kernel (the GPU path of ``ops.linear``).

cuBLAS picks its GEMM algorithm by shape, batch count included, so the torch tiling of
``ops.linear`` does not keep a row's bits fixed on a GPU (measured on an H200: the model's
decode rows differed from its prefill rows until this kernel replaced it). Here every program
computes a fixed BLOCK_M x BLOCK_N output tile with the same loop over K in BLOCK_K steps, and a
row of the tile depends only on that row's operands: the rows of a decode step equal the same
rows of a prefill, whatever M is. Operands are taken to float32 and multiplied in IEEE fp32
(exact for bf16 inputs), accumulated in fp32, rounded once to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import PINNED

_CFG = PINNED["triton"]
BLOCK_M: int = _CFG["linear_row_tile"]
BLOCK_N: int = 64
BLOCK_K: int = 32
NUM_WARPS: int = _CFG["num_warps"]


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K: tl.constexpr, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0).to(tl.float32)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K),
                    other=0.0).to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, on x's (CUDA) device."""
    M, K = x.shape
    N = weight.shape[0]
    x = x.contiguous()
    weight = weight.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _linear_kernel[grid](x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0),
                         y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                         PRECISION=_CFG["dot_precision"], num_warps=NUM_WARPS)
    return y
