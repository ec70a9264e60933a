"""The gated RMSNorm over tensor-parallel slices in Triton (the triton backend's ``gated_rms_norm_sliced``).

Each group's sum of squares is cut into the contract's S slices (``tree.slice_geometry``): one program per row
and slice sums its slice alone (one or two power-of-two blocks, as ``_gated_norm_kernel``'s group, its width
and warps fixed by the slice's width), so a slice's sum has the same bits on whichever rank holds it; the
slices are joined by adjacent pairs, a rank's subtree here and the top across ranks after the all-gather,
as the torch form joins them. A second launch normalises. Its sums are ``tl.sum``'s, not ``tree_sum``'s: the
bits are this backend's own, the same at every TP degree dividing S. Under autograd the backward is the torch
form's gradient (``tree.gated_rms_norm_sliced``, recomputed), deterministic, not row-invariant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ..autograd import deterministic, grad_needed, wanted
from ..configs import TritonKernelConfigs
from . import tree
from .triton import _gated_out, _gated_part, _rstd_of, _squares, gated_launch

if TYPE_CHECKING:
    from ...parallel import TPGroup


@triton.jit
def _slice_squares_kernel(y_ptr, z_ptr, ss_ptr, SW, stride_y, stride_z, DEVICE_SILU: tl.constexpr,
                          BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """Row r, slice j (program (r, j)): ss[r, j] = sum over the slice's SW columns of (y silu(z))^2, fp32."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * SW + tl.arange(0, BLOCK_A)
    m = tl.arange(0, BLOCK_A) < SW
    ss = _squares(_gated_part(y_ptr, z_ptr, row, c, m, stride_y, stride_z, DEVICE_SILU), m)
    if BLOCK_B > 0:
        cb = tl.program_id(1) * SW + BLOCK_A + tl.arange(0, BLOCK_B)
        mb = tl.arange(0, BLOCK_B) < SW - BLOCK_A
        ss += _squares(_gated_part(y_ptr, z_ptr, row, cb, mb, stride_y, stride_z, DEVICE_SILU), mb)
    tl.store(ss_ptr + row * tl.num_programs(1) + tl.program_id(1), ss)


@triton.jit
def _slice_normalize_kernel(y_ptr, z_ptr, w_ptr, out_ptr, ss_ptr, SW, PER_GROUP, width, local_groups, stride_y,
                            stride_z, stride_out, eps, DEVICE_SILU: tl.constexpr, BLOCK_A: tl.constexpr,
                            BLOCK_B: tl.constexpr):
    """Row r, slice j: out = round(w * y silu(z) / sqrt(ss / width + eps)) over the slice's columns, ss [M,
    local_groups] the group's joined sum (slice j in local group j // PER_GROUP)."""
    row = tl.program_id(0).to(tl.int64)
    ss = tl.load(ss_ptr + row * local_groups + tl.program_id(1) // PER_GROUP)
    rstd = _rstd_of(ss, width, eps)
    c = tl.program_id(1) * SW + tl.arange(0, BLOCK_A)
    m = tl.arange(0, BLOCK_A) < SW
    _gated_out(_gated_part(y_ptr, z_ptr, row, c, m, stride_y, stride_z, DEVICE_SILU), rstd, w_ptr, out_ptr, row, c, m,
               stride_out)
    if BLOCK_B > 0:
        cb = tl.program_id(1) * SW + BLOCK_A + tl.arange(0, BLOCK_B)
        mb = tl.arange(0, BLOCK_B) < SW - BLOCK_A
        _gated_out(_gated_part(y_ptr, z_ptr, row, cb, mb, stride_y, stride_z, DEVICE_SILU), rstd, w_ptr, out_ptr, row,
                   cb, mb, stride_out)


def gated_rms_norm_sliced_triton(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, n_groups: int,
                                 *, slices: int, group: TPGroup, cfg: TritonKernelConfigs) -> torch.Tensor:
    """``tree.gated_rms_norm_sliced``'s arguments and shapes (y, z [M, d / k] in the model dtype, rows may be
    strided; weight [d / k]) -> [M, d / k] in y's dtype. Every rank calls it, rows or none (the all-gather)."""
    if y.dim() != 2 or z.shape != y.shape:
        raise ValueError(f"gated_rms_norm_sliced_triton: y {tuple(y.shape)}, z {tuple(z.shape)}")
    M, dl = y.shape
    width, span, local_groups, per_rank = tree.slice_geometry(dl, n_groups, slices, group)
    y = y if y.stride(1) == 1 else y.contiguous()
    z = z if z.stride(1) == 1 else z.contiguous()
    sw = width // slices
    block_a, block_b, warps = gated_launch(sw, cfg)
    grid = (M, dl // sw)  # the rank's slices, local_groups x per_rank
    ss = torch.empty(M, dl // sw, dtype=torch.float32, device=y.device)
    if M:
        _slice_squares_kernel[grid](y, z, ss, sw, y.stride(0), z.stride(0), DEVICE_SILU=cfg.device_silu,
                                    BLOCK_A=block_a, BLOCK_B=block_b, num_warps=warps, enable_fp_fusion=False)
    ss = tree.join_slices(ss.view(M, local_groups, per_rank), span, group)  # [M, local_groups]
    out = torch.empty(M, dl, dtype=y.dtype, device=y.device)
    if M:
        _slice_normalize_kernel[grid](y, z, weight.contiguous(), out, ss.contiguous(), sw, per_rank, width,
                                      local_groups, y.stride(0), z.stride(0), out.stride(0), float(eps),
                                      DEVICE_SILU=cfg.device_silu, BLOCK_A=block_a, BLOCK_B=block_b,
                                      num_warps=warps, enable_fp_fusion=False)
    return out


class _SlicedGatedNorm(torch.autograd.Function):
    """Forward: the kernels. Backward: the torch form's gradient, the form run again under autograd (its
    all-gather is the group's, differentiable where the caller's is)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, n_groups: int, slices: int,
                group: TPGroup, cfg: TritonKernelConfigs) -> torch.Tensor:
        ctx.save_for_backward(y, z, w)
        ctx.consts = (eps, n_groups, slices, group)
        return gated_rms_norm_sliced_triton(y, z, w, eps, n_groups, slices=slices, group=group, cfg=cfg)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        eps, n_groups, slices, group = ctx.consts
        leaves = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad)]
        with torch.enable_grad(), deterministic():
            out = tree.gated_rms_norm_sliced(*leaves, eps, n_groups, slices=slices, group=group)
            wanted_leaves = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted_leaves, g))
        return wanted(ctx, *(next(grads) if t.requires_grad else None for t in leaves))


def gated_rms_norm_sliced(y: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, n_groups: int, *,
                          slices: int, group: TPGroup, cfg: TritonKernelConfigs) -> torch.Tensor:
    """The triton backend's ``gated_rms_norm_sliced``: the Function where a gradient is recorded, else the launches."""
    if grad_needed(y, z, w):
        return _SlicedGatedNorm.apply(y, z, w, eps, n_groups, slices, group, cfg)
    return gated_rms_norm_sliced_triton(y, z, w, eps, n_groups, slices=slices, group=group, cfg=cfg)
