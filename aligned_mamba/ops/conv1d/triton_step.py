"""A decode step's causal conv1d + SiLU in one launch (every sequence brings one row).

``triton.causal_conv1d_triton`` runs two launches, the outputs from the old windows, then the new
windows. With one row per sequence, program (s, channel block) owns its channels of sequence s's
window: it reads the K - 1 window rows and the new row, computes the output as ``_conv_kernel``
does (bias, then + w_k v_k for k ascending, each product and sum rounded once in fp32, compiled
without fp contraction; ``silu_exact``), and, once every thread has read, shifts the window in
place. The same operations on the same values: the bits of the two-launch form, outputs and
windows (tests/ops/test_triton_ops.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..autograd import grad_needed
from ..configs import TritonKernelConfigs
from ..step import Step
from ..triton_math import silu_exact
from . import triton as conv_triton


@triton.jit
def _conv_step_kernel(x_ptr, slots_ptr, win_ptr, w_ptr, b_ptr, out_ptr, Cd, stride_x, stride_ws, stride_wk,
                      stride_out, K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                      BLOCK_Q: tl.constexpr, BLOCK_C: tl.constexpr):
    """Sequence s (program (s, c)): out[s] = silu(bias + sum_k w_k (window ++ x[s])_k) for the block's
    channels, then its slot's window := window rows 1 .. K - 2 ++ x[s]."""
    s = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < Cd
    slot = tl.load(slots_ptr + s).to(tl.int64)
    base = win_ptr + slot * stride_ws
    xrow = x_ptr + s * stride_x
    if HAS_BIAS:
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32) + tl.load(b_ptr + ch, mask=cmask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for k in tl.static_range(K):
        if k < K - 1:
            v = tl.load(base + k * stride_wk + ch, mask=cmask, other=0.0).to(tl.float32)
        else:
            v = tl.load(xrow + ch, mask=cmask, other=0.0).to(tl.float32)
        acc = acc + tl.load(w_ptr + ch * K + k, mask=cmask, other=0.0).to(tl.float32) * v
    if SILU:
        acc = silu_exact(acc)
    tl.store(out_ptr + s * stride_out + ch, acc.to(out_ptr.dtype.element_ty), mask=cmask)
    if K > 1:
        q = tl.arange(0, BLOCK_Q)
        p = q + 1  # the new window's row q: old row q + 1, or the new row at q = K - 2
        in_win = (p < K - 1)[:, None]
        m2 = (q < K - 1)[:, None] & cmask[None, :]
        wv = tl.load(base + p[:, None] * stride_wk + ch[None, :], mask=m2 & in_win, other=0.0)
        xv = tl.load(xrow + q[:, None] * 0 + ch[None, :], mask=m2 & ~in_win, other=0.0)
        v = tl.where(in_win, wv, xv.to(wv.dtype))
        tl.debug_barrier()  # every thread's reads of the old window before any thread's writes
        tl.store(base + q[:, None] * stride_wk + ch[None, :], v, mask=m2)


def conv_step_triton(x: torch.Tensor, slots: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, cfg: TritonKernelConfigs, activation: bool = True) -> torch.Tensor:
    """One row per sequence: x [S, Cd] (row s is sequence s's, unit channel stride), slots [S] int64
    (distinct), windows [num_slots, K-1, Cd] in x's dtype, weight [Cd, K], bias [Cd] or None.
    Returns out [S, Cd] in x's dtype, ``causal_conv1d_triton``'s bits; the slots' windows are
    moved on by the row, in place."""
    S, Cd = x.shape
    K = weight.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    if windows.dim() != 3 or windows.shape[1:] != (K - 1, Cd) or windows.stride(2) != 1:
        raise ValueError(f"windows {tuple(windows.shape)} must be [num_slots, {K - 1}, {Cd}] with unit last stride")
    if windows.dtype != x.dtype:
        raise ValueError(f"windows are {windows.dtype} but x is {x.dtype}: keeping x in the window would round it")
    if slots.shape != (S,):
        raise ValueError(f"slots {tuple(slots.shape)} do not match {S} rows")
    out = torch.empty(S, Cd, dtype=x.dtype, device=x.device)
    if S == 0:
        return out
    w = weight.contiguous()
    b = bias.contiguous() if bias is not None else w
    bc = cfg.conv_block_c
    _conv_step_kernel[(S, triton.cdiv(Cd, bc))](
        x, slots, windows, w, b, out, Cd, x.stride(0), windows.stride(0), windows.stride(1), out.stride(0), K=K,
        HAS_BIAS=bias is not None, SILU=activation, BLOCK_Q=triton.next_power_of_2(max(K - 1, 1)), BLOCK_C=bc,
        num_warps=4, enable_fp_fusion=False)
    return out


def conv_advance(windows: torch.Tensor, step: Step, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                 cfg: TritonKernelConfigs) -> torch.Tensor:
    """``triton.conv_advance``, with a decode step (one row per sequence, no gradient recorded) in
    one launch (``conv_step_triton``)."""
    if step.decode_only and x.shape[0] == step.slots.numel() and not grad_needed(x, w, b, windows):
        return conv_step_triton(x, step.plans[windows.device].slots, windows, w, b, cfg)
    return conv_triton.conv_advance(windows, step, x, w, b, cfg)


__all__ = ["conv_advance", "conv_step_triton"]
