"""The gated RMSNorm over tensor-parallel slices in Triton (the triton backend's ``gated_rms_norm_sliced``).

Each group's sum of squares is cut into the contract's S slices (``tree.slice_geometry``): one program per row
and slice sums its slice alone (one or two power-of-two blocks, as ``_gated_norm_kernel``'s group, its width
and warps fixed by the slice's width), so a slice's sum has the same bits on whichever rank holds it; the
slices are joined by adjacent pairs, a rank's subtree here and the top across ranks after the all-gather,
as the torch form joins them. A second launch normalises. Its sums are ``tl.sum``'s, not ``tree_sum``'s: the
bits are this backend's own, the same at every TP degree dividing S.

The backward is the gradient of the function the kernels run (their SiLU, ``silu_of``): per row and slice the
slice's share of sum(g w vhat), joined across slices and ranks as the squares are, then dy, dz and the row
blocks' dw partial sums a slice at a time. Deterministic, the same bits at every TP degree; not row-invariant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ..autograd import grad_needed, wanted
from ..configs import TritonKernelConfigs
from . import tree
from .triton import (
    _gated_bwd_in,
    _gated_bwd_out,
    _gated_out,
    _gated_part,
    _rows,
    _rstd_of,
    _squares,
    _weight_grad_blocks,
    gated_launch,
)

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


@triton.jit
def _slice_bwd_dot_kernel(y_ptr, z_ptr, g_ptr, w_ptr, ss_ptr, part_ptr, SW, PER_GROUP, width, local_groups,
                          stride_y, stride_z, stride_g, eps, DEVICE_SILU: tl.constexpr, BLOCK_A: tl.constexpr,
                          BLOCK_B: tl.constexpr):
    """Row r, slice j: part[r, j] = the slice's sum of g w vhat, vhat = y silu(z) rstd, rstd from the group's
    joined sum of squares ss [M, local_groups] fp32; g [M, d / k] the output's gradient."""
    row = tl.program_id(0).to(tl.int64)
    rstd = _rstd_of(tl.load(ss_ptr + row * local_groups + tl.program_id(1) // PER_GROUP), width, eps)
    OUT: tl.constexpr = y_ptr.dtype.element_ty
    c = tl.program_id(1) * SW + tl.arange(0, BLOCK_A)
    m = tl.arange(0, BLOCK_A) < SW
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(OUT).to(tl.float32)
    _, vhat, gw, _, _ = _gated_bwd_in(y_ptr, z_ptr, g_ptr, row, c, m, stride_y, stride_z, stride_g, w, rstd,
                                      DEVICE_SILU)
    total = tl.sum(tl.where(m, gw * vhat, 0.0), axis=0)
    if BLOCK_B > 0:
        cb = tl.program_id(1) * SW + BLOCK_A + tl.arange(0, BLOCK_B)
        mb = tl.arange(0, BLOCK_B) < SW - BLOCK_A
        wb = tl.load(w_ptr + cb, mask=mb, other=0.0).to(OUT).to(tl.float32)
        _, vhat2, gw2, _, _ = _gated_bwd_in(y_ptr, z_ptr, g_ptr, row, cb, mb, stride_y, stride_z, stride_g, wb,
                                            rstd, DEVICE_SILU)
        total += tl.sum(tl.where(mb, gw2 * vhat2, 0.0), axis=0)
    tl.store(part_ptr + row * tl.num_programs(1) + tl.program_id(1), total)


@triton.jit
def _slice_bwd_kernel(y_ptr, z_ptr, g_ptr, w_ptr, ss_ptr, tot_ptr, dy_ptr, dz_ptr, dw_ptr, M, dl, SW, PER_GROUP,
                      width, local_groups, stride_y, stride_z, stride_g, stride_dz, eps, DEVICE_SILU: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """Rows blk*ROWS .. +ROWS-1 (pid 0), slice j (pid 1): dy, dz of the slice's columns from the group's joined
    sums of squares ss and of g w vhat tot [M, local_groups] fp32; the block's dw partial sums (dw [blocks,
    d / k] fp32). ``_gated_norm_bwd_kernel``'s arithmetic over a slice."""
    blk = tl.program_id(0)
    grp = tl.program_id(1) // PER_GROUP
    OUT: tl.constexpr = y_ptr.dtype.element_ty
    ca = tl.program_id(1) * SW + tl.arange(0, BLOCK_A)
    ma = tl.arange(0, BLOCK_A) < SW
    wa = tl.load(w_ptr + ca, mask=ma, other=0.0).to(OUT).to(tl.float32)
    dwa = tl.zeros((BLOCK_A,), dtype=tl.float32)
    if BLOCK_B > 0:
        cb = tl.program_id(1) * SW + BLOCK_A + tl.arange(0, BLOCK_B)
        mb = tl.arange(0, BLOCK_B) < SW - BLOCK_A
        wb = tl.load(w_ptr + cb, mask=mb, other=0.0).to(OUT).to(tl.float32)
        dwb = tl.zeros((BLOCK_B,), dtype=tl.float32)
    for i in range(ROWS):
        row = (blk * ROWS + i).to(tl.int64)
        live = row < M
        rstd = _rstd_of(tl.load(ss_ptr + row * local_groups + grp, mask=live, other=1.0), width, eps)
        mean = tl.load(tot_ptr + row * local_groups + grp, mask=live, other=0.0) / width.to(tl.float32)
        m = ma & live
        sz, vhat, gw, ys, gv = _gated_bwd_in(y_ptr, z_ptr, g_ptr, row, ca, m, stride_y, stride_z, stride_g, wa, rstd,
                                             DEVICE_SILU)
        dwa += gv
        _gated_bwd_out(sz, vhat, gw, ys, mean, rstd, wa, row, ca, m, dy_ptr, dz_ptr, dy_ptr, dl, stride_dz, 0,
                       False, OUT)
        if BLOCK_B > 0:
            n = mb & live
            sz2, vhat2, gw2, ys2, gv2 = _gated_bwd_in(y_ptr, z_ptr, g_ptr, row, cb, n, stride_y, stride_z, stride_g,
                                                      wb, rstd, DEVICE_SILU)
            dwb += gv2
            _gated_bwd_out(sz2, vhat2, gw2, ys2, mean, rstd, wb, row, cb, n, dy_ptr, dz_ptr, dy_ptr, dl, stride_dz,
                           0, False, OUT)
    tl.store(dw_ptr + blk * dl + ca, dwa, mask=ma)
    if BLOCK_B > 0:
        tl.store(dw_ptr + blk * dl + cb, dwb, mask=mb)


def gated_rms_norm_sliced_triton(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, n_groups: int,
                                 *, slices: int, group: TPGroup, cfg: TritonKernelConfigs, with_ss: bool = False
                                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``tree.gated_rms_norm_sliced``'s arguments and shapes (y, z [M, d / k] in the model dtype, rows may be
    strided; weight [d / k]) -> [M, d / k] in y's dtype; ``with_ss``: (that, the groups' joined sums of squares
    [M, local_groups] fp32, for the backward). Every rank calls it, rows or none (the all-gather)."""
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
    return (out, ss) if with_ss else out


def gated_rms_norm_sliced_backward_triton(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                                          n_groups: int, g: torch.Tensor, ss: torch.Tensor, *, slices: int,
                                          group: TPGroup, cfg: TritonKernelConfigs
                                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient of ``gated_rms_norm_sliced_triton`` against g [M, d / k]: (dy, dz in their dtypes, dweight
    [d / k] in weight's), from the forward's joined sums of squares ss [M, local_groups] fp32. Every rank calls
    it, rows or none (the all-gather of the slices' shares of sum(g w vhat))."""
    y, z, g = _rows(y, "y"), _rows(z, "z"), _rows(g, "g")
    M, dl = y.shape
    width, span, local_groups, per_rank = tree.slice_geometry(dl, n_groups, slices, group)
    if ss.shape != (M, local_groups) or ss.dtype != torch.float32:
        raise ValueError(f"ss must be [{M}, {local_groups}] float32, got {tuple(ss.shape)} {ss.dtype}")
    ss, w = ss.contiguous(), weight.contiguous()
    sw = width // slices
    block_a, block_b, warps = gated_launch(sw, cfg)
    part = torch.empty(M, dl // sw, dtype=torch.float32, device=y.device)
    if M:
        _slice_bwd_dot_kernel[(M, dl // sw)](y, z, g, w, ss, part, sw, per_rank, width, local_groups, y.stride(0),
                                             z.stride(0), g.stride(0), float(eps), DEVICE_SILU=cfg.device_silu,
                                             BLOCK_A=block_a, BLOCK_B=block_b, num_warps=warps,
                                             enable_fp_fusion=False)
    tot = tree.join_slices(part.view(M, local_groups, per_rank), span, group).contiguous()  # [M, local_groups]
    dy = torch.empty(M, dl, device=y.device, dtype=y.dtype)
    dz = torch.empty(M, dl, device=y.device, dtype=z.dtype)
    nb, dw = _weight_grad_blocks(M, dl, cfg, y.device)
    if M:
        _slice_bwd_kernel[(nb, dl // sw)](y, z, g, w, ss, tot, dy, dz, dw, M, dl, sw, per_rank, width, local_groups,
                                          y.stride(0), z.stride(0), g.stride(0), dz.stride(0), float(eps),
                                          DEVICE_SILU=cfg.device_silu, ROWS=cfg.norm_bwd_rows, BLOCK_A=block_a,
                                          BLOCK_B=block_b, num_warps=warps, enable_fp_fusion=False)
    return dy, dz, dw.sum(0).to(weight.dtype)


class _SlicedGatedNorm(torch.autograd.Function):
    """Forward and backward: the kernels (the backward from the forward's joined sums of squares)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, n_groups: int, slices: int,
                group: TPGroup, cfg: TritonKernelConfigs) -> torch.Tensor:
        out, ss = gated_rms_norm_sliced_triton(y, z, w, eps, n_groups, slices=slices, group=group, cfg=cfg,
                                               with_ss=True)
        ctx.save_for_backward(y, z, w, ss)
        ctx.consts = (eps, n_groups, slices, group, cfg)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        eps, n_groups, slices, group, cfg = ctx.consts
        y, z, w, ss = ctx.saved_tensors
        return wanted(ctx, *gated_rms_norm_sliced_backward_triton(y, z, w, eps, n_groups, g, ss, slices=slices,
                                                                  group=group, cfg=cfg))


def gated_rms_norm_sliced(y: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, n_groups: int, *,
                          slices: int, group: TPGroup, cfg: TritonKernelConfigs) -> torch.Tensor:
    """The triton backend's ``gated_rms_norm_sliced``: the Function where a gradient is recorded, else the launches."""
    if grad_needed(y, z, w):
        return _SlicedGatedNorm.apply(y, z, w, eps, n_groups, slices, group, cfg)
    return gated_rms_norm_sliced_triton(y, z, w, eps, n_groups, slices=slices, group=group, cfg=cfg)
