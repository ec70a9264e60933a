"""Row-wise log_softmax and token logprobs in Triton (the GPU form of ``ops.logprobs``).

A program per row walks the vocabulary in ascending ``logprobs_block_v`` blocks, a running max and rescaled sum,
exp and log from ``triton_math`` (no fp contraction): a row's bits depend on the row alone, though not the torch
form's (another order). A token's logprob is its ``log_softmax_triton`` entry, bit for bit; a row with +inf gives NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..autograd import grad_needed, wanted
from ..configs import TritonKernelConfigs
from ..triton_math import exp_exact, log_exact
from . import sliced


@triton.jit
def _row_lse(x_row, V, BLOCK_V: tl.constexpr):
    """log(sum(exp(x))) of one row of V logits (any float dtype) at ``x_row``, fp32."""
    m = -float("inf")
    s = 0.0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(x_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # no inf - inf while the row is all -inf
        s = s * exp_exact(m - m_safe) + tl.sum(exp_exact(x - m_safe), axis=0)
        m = m_new
    # an all -inf row: s = 0 and lse = -inf, as the torch op (which shifts by 0 there)
    return tl.where(m == -float("inf"), 0.0, m) + log_exact(s)


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, V, stride_x, stride_out, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = _row_lse(x_ptr + row * stride_x, V, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, x - lse, mask=mask)


@triton.jit
def _token_logprobs_kernel(x_ptr, tok_ptr, out_ptr, lse_ptr, V, stride_x, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = _row_lse(x_ptr + row * stride_x, V, BLOCK_V)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + tok).to(tl.float32)
    tl.store(out_ptr + row, x - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _log_softmax_bwd_kernel(out_ptr, g_ptr, dx_ptr, V, stride_out, stride_g, stride_gv, stride_dx,
                            BLOCK_V: tl.constexpr):
    """Row r of dx = g - exp(out) * sum(g) in fp32 (the sum over the row's blocks in order), rounded to dx's dtype;
    g read at its strides (a broadcast g, from ``logprobs.sum()``, where it lies)."""
    row = tl.program_id(0).to(tl.int64)
    s = 0.0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        s += tl.sum(tl.load(g_ptr + row * stride_g + cols * stride_gv, mask=cols < V, other=0.0).to(tl.float32),
                    axis=0)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        g = tl.load(g_ptr + row * stride_g + cols * stride_gv, mask=mask, other=0.0).to(tl.float32)
        o = tl.load(out_ptr + row * stride_out + cols, mask=mask, other=0.0)
        tl.store(dx_ptr + row * stride_dx + cols, (g - tl.exp(o) * s).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _token_logprobs_bwd_kernel(x_ptr, tok_ptr, lse_ptr, g_ptr, dx_ptr, V, stride_x, stride_dx, BLOCK_V: tl.constexpr):
    """Row r of the token logprob's gradient: dx = onehot(tok) g - exp(x - lse) g, the log-softmax backward's
    bits for a gradient that is g at tok and zero elsewhere (its row sum is g), rounded to dx's dtype."""
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    s = tl.load(g_ptr + row).to(tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        o = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32) - lse
        g = tl.where(cols == tok, s, 0.0)
        tl.store(dx_ptr + row * stride_dx + cols, (g - tl.exp(o) * s).to(dx_ptr.dtype.element_ty), mask=mask)


def token_logprobs_backward_triton(logits: torch.Tensor, token_ids: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                                   dtype: torch.dtype, cfg: TritonKernelConfigs) -> torch.Tensor:
    """The gradient of ``token_logprobs_triton`` against g [M] from its inputs and lse [M] fp32, no logits-sized
    fp32 tensor: logits [M, V] -> [M, V] in ``dtype``; ``log_softmax_backward_triton``'s bits for the scattered g."""
    x = _rows(logits)
    M, V = x.shape
    dx = torch.empty(M, V, dtype=dtype, device=x.device)
    if M and V:
        _token_logprobs_bwd_kernel[(M,)](x, token_ids.contiguous(), lse, g.contiguous(), dx, V, x.stride(0),
                                         dx.stride(0), BLOCK_V=cfg.logprobs_block_v,
                                         num_warps=cfg.logprobs_num_warps)
    return dx


def log_softmax_backward_triton(out: torch.Tensor, g: torch.Tensor, dtype: torch.dtype,
                                cfg: TritonKernelConfigs) -> torch.Tensor:
    """``sliced.log_softmax_backward`` in one pass a row, no logits-sized fp32 temporaries: out [M, V] float32
    (log_softmax's output), g [M, V] -> [M, V] in ``dtype`` (deterministic; the sum's order is not torch's)."""
    M, V = out.shape
    if g.shape != (M, V):
        raise ValueError(f"g must be [{M}, {V}] like log_softmax's output, got {tuple(g.shape)}")
    dx = torch.empty(M, V, dtype=dtype, device=out.device)
    if M and V:
        _log_softmax_bwd_kernel[(M,)](out, g, dx, V, out.stride(0), g.stride(0), g.stride(1), dx.stride(0),
                                      BLOCK_V=cfg.logprobs_block_v, num_warps=cfg.logprobs_num_warps)
    return dx


def _rows(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [M, V], got {tuple(logits.shape)}")
    return logits if logits.stride(1) == 1 else logits.contiguous()


def log_softmax_triton(logits: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
    """logits [M, V] (any float dtype, rows may be strided) -> [M, V] float32 logprobs."""
    x = _rows(logits)
    M, V = x.shape
    out = torch.empty(M, V, dtype=torch.float32, device=x.device)
    if M and V:
        _log_softmax_kernel[(M,)](x, out, V, x.stride(0), out.stride(0), BLOCK_V=cfg.logprobs_block_v,
                                  num_warps=cfg.logprobs_num_warps, enable_fp_fusion=False)
    return out


def token_logprobs_triton(logits: torch.Tensor, token_ids: torch.Tensor, cfg: TritonKernelConfigs, *,
                          return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax_triton(logits, cfg)[r, token_ids[r]]``'s bits without writing the row: logits [M, V] (any
    float dtype), token_ids [M] int32/int64 on the device, in [0, V) (unchecked) -> [M] float32 (+ lse [M] if asked)."""
    x = _rows(logits)
    M, V = x.shape
    if token_ids.shape != (M,):
        raise ValueError(f"token_ids {tuple(token_ids.shape)} must be [{M}]")
    out = torch.empty(M, dtype=torch.float32, device=x.device)
    lse = torch.empty(M, dtype=torch.float32, device=x.device)
    if M and V:
        _token_logprobs_kernel[(M,)](x, token_ids.contiguous(), out, lse, V, x.stride(0),
                                     BLOCK_V=cfg.logprobs_block_v, num_warps=cfg.logprobs_num_warps,
                                     enable_fp_fusion=False)
    return (out, lse) if return_lse else out


# -- autograd: forward = the kernel, unchanged; backward = ``log_softmax_backward_triton`` from the output ----


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
        out = log_softmax_triton(logits, cfg)
        ctx.save_for_backward(out)
        ctx.logits_dtype, ctx.cfg = logits.dtype, cfg
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (out,) = ctx.saved_tensors
        return wanted(ctx, log_softmax_backward_triton(out, g, ctx.logits_dtype, ctx.cfg))


def log_softmax(logits: torch.Tensor, temperature: float = 1.0, *, cfg: TritonKernelConfigs) -> torch.Tensor:
    """The op's signature (``sliced.log_softmax``): [..., V] -> [..., V] float32 logprobs of logits /
    temperature, by the kernel on a CUDA tensor (the torch form elsewhere)."""
    if not logits.is_cuda:
        return sliced.log_softmax(logits, temperature)
    if temperature != 1.0:
        logits = sliced.scale(logits, temperature)
    rows = logits.reshape(-1, logits.shape[-1])
    out = _LogSoftmax.apply(rows, cfg) if grad_needed(logits) else log_softmax_triton(rows, cfg)
    return out.reshape(logits.shape)


class _TokenLogprobs(torch.autograd.Function):
    """The token logprob without a logits-sized fp32 tensor held: saves the logits (the caller's), the ids and
    lse [M], where log-softmax then gather would hold its fp32 output and the gather's fp32 gradient."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, token_ids: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
        out, lse = token_logprobs_triton(logits, token_ids, cfg, return_lse=True)
        ctx.save_for_backward(logits, token_ids, lse)
        ctx.cfg = cfg
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, token_ids, lse = ctx.saved_tensors
        return wanted(ctx, token_logprobs_backward_triton(logits, token_ids, lse, g, logits.dtype, ctx.cfg))


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, *,
                   cfg: TritonKernelConfigs) -> torch.Tensor:
    """The op's signature (``sliced.token_logprobs``): [..., V], [...] ids in [0, V) -> [...] float32, the
    kernel's ``log_softmax`` entries at the ids on a CUDA tensor (the torch form elsewhere)."""
    if not logits.is_cuda:
        return sliced.token_logprobs(logits, token_ids, temperature)
    sliced.check_token_inputs(logits, token_ids)  # the kernel reads at the id unchecked
    V = logits.shape[-1]
    ids = token_ids.to(device=logits.device, dtype=torch.int64)
    if temperature != 1.0:
        logits = sliced.scale(logits, temperature)
    rows, ids = logits.reshape(-1, V), ids.reshape(-1)
    out = _TokenLogprobs.apply(rows, ids, cfg) if grad_needed(logits) else token_logprobs_triton(rows, ids, cfg)
    return out.reshape(token_ids.shape)
