"""Fused RMSNorms in Triton (the GPU path of ``ops.norm``), each row a fixed function of that row.

A program normalises one row in one power-of-two block, its sum of squares one ``tl.sum`` whose tree
follows from the width and ``norm_block_per_warp`` alone; the gated norm's group is one or two
power-of-two blocks (the second past the largest power of two within the width), two sums added. The
arithmetic is ``ops.norm``'s (IEEE sqrt and division, no fp contraction); the sum's order is not
``tree_sum``'s, so the bits may differ from the torch backend's by an fp32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..autograd import deterministic, grad_block, grad_needed, wanted
from ..configs import TritonKernelConfigs
from ..linear.triton import linear_triton
from ..triton_math import silu_exact, silu_of


@triton.jit
def _squares(v, mask):
    """The sum of v^2 over mask, v [BLOCK] fp32: one ``tl.sum``."""
    return tl.sum(tl.where(mask, v * v, 0.0), axis=0)


@triton.jit
def _rstd_of(ss, D, eps):
    """1 / sqrt(ss / D + eps), IEEE operations."""
    return tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(ss, D.to(tl.float32)) + eps))


@triton.jit
def _rstd(v, mask, D, eps):
    """v [BLOCK] fp32 (zeros past D) -> 1 / sqrt(mean(v^2) + eps), IEEE operations."""
    return _rstd_of(_squares(v, mask), D, eps)


@triton.jit
def _normalize_row(v, mask, D, eps):
    """v [BLOCK] fp32 (zeros past D) -> v / sqrt(mean(v^2) + eps), IEEE operations."""
    return v * _rstd(v, mask, D, eps)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, idx_ptr, w_ptr, out_ptr, res_out_ptr, D, stride_x, stride_res, stride_out,
                     stride_res_out, eps, HAS_X: tl.constexpr, HAS_IDX: tl.constexpr, WRITE_RES: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """Row r: v = res[idx[r] or r] (+ x[r], in fp32, rounded to res_out's dtype), written to res_out
    if WRITE_RES; out[r] = round(w * normalise(v)), in fp32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    src = tl.load(idx_ptr + row).to(tl.int64) if HAS_IDX else row
    v = tl.load(res_ptr + src * stride_res + cols, mask=mask, other=0.0)
    if HAS_X:
        v = v.to(tl.float32) + tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if WRITE_RES:
        v = v.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, v, mask=mask)
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    y = _normalize_row(v.to(tl.float32), mask, D, eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(OUT)
    tl.store(out_ptr + row * stride_out + cols, (w.to(tl.float32) * y).to(OUT), mask=mask)


@triton.jit
def _gated_part(y_ptr, z_ptr, row, c, m, stride_y, stride_z, DEVICE_SILU: tl.constexpr):
    """y * silu(z) over one part of a row's group, fp32 (zeros where not m); ``silu_of``'s SiLU."""
    y = tl.load(y_ptr + row * stride_y + c, mask=m, other=0.0)
    z = tl.load(z_ptr + row * stride_z + c, mask=m, other=0.0).to(tl.float32)
    return y.to(tl.float32) * silu_of(z, DEVICE_SILU)


@triton.jit
def _gated_out(g, rstd, w_ptr, out_ptr, row, c, m, stride_out):
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(OUT)
    tl.store(out_ptr + row * stride_out + c, (w.to(tl.float32) * (g * rstd)).to(OUT), mask=m)


@triton.jit
def _gated_norm_kernel(y_ptr, z_ptr, w_ptr, out_ptr, rstd_ptr, GS, stride_y, stride_z, stride_out, eps,
                       WRITE_RSTD: tl.constexpr, DEVICE_SILU: tl.constexpr, BLOCK_A: tl.constexpr,
                       BLOCK_B: tl.constexpr):
    """Row r, group g (program (r, g)): out = round(w * normalise(y * silu(z)) over the group's GS columns);
    with WRITE_RSTD the group's 1 / sqrt(mean square + eps) to rstd [M, G] fp32 (for the backward). A
    group is two power-of-two blocks, BLOCK_A then BLOCK_B (0: none), their sums of squares added:
    5120 columns run 4096 + 1024 lanes, not 8192."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * GS + tl.arange(0, BLOCK_A)
    m = tl.arange(0, BLOCK_A) < GS
    g = _gated_part(y_ptr, z_ptr, row, c, m, stride_y, stride_z, DEVICE_SILU)
    ss = _squares(g, m)
    if BLOCK_B > 0:
        cb = tl.program_id(1) * GS + BLOCK_A + tl.arange(0, BLOCK_B)
        mb = tl.arange(0, BLOCK_B) < GS - BLOCK_A
        gb = _gated_part(y_ptr, z_ptr, row, cb, mb, stride_y, stride_z, DEVICE_SILU)
        ss += _squares(gb, mb)
    rstd = _rstd_of(ss, GS, eps)
    if WRITE_RSTD:
        tl.store(rstd_ptr + row * tl.num_programs(1) + tl.program_id(1), rstd)
    _gated_out(g, rstd, w_ptr, out_ptr, row, c, m, stride_out)
    if BLOCK_B > 0:
        _gated_out(gb, rstd, w_ptr, out_ptr, row, cb, mb, stride_out)


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# -- backwards (gradients: accuracy and determinism, not row invariance) ----------------------------------


@triton.jit
def _norm_backward(v, gw, mask, D, eps):
    """The gradient of normalise(v) against gw, with normalise(v) itself: v, gw [BLOCK] fp32 (zeros past
    D) -> (r (gw - vhat mean(gw vhat)), vhat), r = 1 / sqrt(mean(v^2) + eps), vhat = v r."""
    r = 1.0 / tl.sqrt(tl.sum(tl.where(mask, v * v, 0.0), axis=0) / D.to(tl.float32) + eps)
    vhat = v * r
    return r * (gw - vhat * (tl.sum(tl.where(mask, gw * vhat, 0.0), axis=0) / D.to(tl.float32))), vhat


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, g_ptr, add_ptr, dx_ptr, dx2_ptr, dw_ptr, M, D, stride_x, stride_g, stride_add,
                         eps, HAS_ADD: tl.constexpr, HAS_DX2: tl.constexpr, OUT: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """Rows blk*ROWS .. +ROWS-1 of the gradient of round_OUT(w * normalise(x)): dx fp32 (+ add[r] if HAS_ADD;
    HAS_DX2: also in dx2's dtype), and this block's partial sum of dw (dw_ptr [blocks, D] fp32, summed by the
    caller)."""
    blk = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(OUT).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(ROWS):
        row = (blk * ROWS + i).to(tl.int64)
        m = mask & (row < M)
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
        dx, xhat = _norm_backward(x, g * w, mask, D, eps)
        if HAS_ADD:
            dx += tl.load(add_ptr + row * stride_add + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * D + cols, dx, mask=m)
        if HAS_DX2:
            tl.store(dx2_ptr + row * D + cols, dx.to(dx2_ptr.dtype.element_ty), mask=m)
        dw += g * xhat
    tl.store(dw_ptr + blk * D + cols, dw, mask=mask)


@triton.jit
def _gated_bwd_in(y_ptr, z_ptr, g_ptr, row, c, m, stride_y, stride_z, stride_g, w, rstd, DEVICE_SILU: tl.constexpr):
    """One part of a row's group in fp32 (zeros where not m): (silu(z), vhat, g w, ys = dz / du, g vhat);
    ys formed here so y, z, g need not stay live across the group's sum (a 5120-wide group fits registers)."""
    y = tl.load(y_ptr + row * stride_y + c, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * stride_z + c, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + c, mask=m, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-z))
    if DEVICE_SILU:
        sz = z * s  # silu_device's operations: its s
    else:
        sz = silu_exact(z)
    vhat = (y * sz) * rstd
    return sz, vhat, g * w, y * (s * (1.0 + z * (1.0 - s))), g * vhat


@triton.jit
def _gated_bwd_out(sz, vhat, gw, ys, mean, rstd, w, row, c, m, dy_ptr, dz_ptr, out_ptr, d, stride_dz, stride_out,
                   WRITE_OUT: tl.constexpr, OUT: tl.constexpr):
    """One part's dy, dz (and with WRITE_OUT the norm's output), from mean = mean(g w vhat) over the group."""
    if WRITE_OUT:
        tl.store(out_ptr + row * stride_out + c, (w * vhat).to(OUT), mask=m)
    du = rstd * (gw - vhat * mean)
    tl.store(dy_ptr + row * d + c, (du * sz).to(dy_ptr.dtype.element_ty), mask=m)
    tl.store(dz_ptr + row * stride_dz + c, (du * ys).to(dz_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gated_norm_bwd_kernel(y_ptr, z_ptr, w_ptr, g_ptr, rstd_ptr, dy_ptr, dz_ptr, dw_ptr, out_ptr, M, d, GS,
                           stride_y, stride_z, stride_g, stride_dz, stride_out, eps, WRITE_OUT: tl.constexpr,
                           DEVICE_SILU: tl.constexpr, ROWS: tl.constexpr, BLOCK_A: tl.constexpr,
                           BLOCK_B: tl.constexpr):
    """Rows blk*ROWS .. +ROWS-1, group pid 1: dy, dz of out = round(w * normalise_g(y silu(z))) from the
    forward's rstd [M, G] fp32, this block's dw partial sums (dw_ptr [blocks, d] fp32); WRITE_OUT: out too,
    with the forward's bits. A group is two power-of-two blocks, BLOCK_A then BLOCK_B (0: none): 5120
    columns run 4096 + 1024 lanes, not 8192 (the backward's sum needs only the same order each call)."""
    blk = tl.program_id(0)
    grp = tl.program_id(1)
    ca = grp * GS + tl.arange(0, BLOCK_A)
    ma = tl.arange(0, BLOCK_A) < GS
    OUT: tl.constexpr = y_ptr.dtype.element_ty
    wa = tl.load(w_ptr + ca, mask=ma, other=0.0).to(OUT).to(tl.float32)
    dwa = tl.zeros((BLOCK_A,), dtype=tl.float32)
    if BLOCK_B > 0:
        cb = grp * GS + BLOCK_A + tl.arange(0, BLOCK_B)
        mb = tl.arange(0, BLOCK_B) < GS - BLOCK_A
        wb = tl.load(w_ptr + cb, mask=mb, other=0.0).to(OUT).to(tl.float32)
        dwb = tl.zeros((BLOCK_B,), dtype=tl.float32)
    for i in range(ROWS):
        row = (blk * ROWS + i).to(tl.int64)
        rstd = tl.load(rstd_ptr + row * tl.num_programs(1) + grp, mask=row < M, other=0.0)
        m = ma & (row < M)
        sz, vhat, gw, ys, gv = _gated_bwd_in(y_ptr, z_ptr, g_ptr, row, ca, m, stride_y, stride_z, stride_g, wa, rstd,
                                             DEVICE_SILU)
        dwa += gv
        total = tl.sum(tl.where(m, gw * vhat, 0.0), axis=0)
        if BLOCK_B > 0:
            n = mb & (row < M)
            sz2, vhat2, gw2, ys2, gv2 = _gated_bwd_in(y_ptr, z_ptr, g_ptr, row, cb, n, stride_y, stride_z, stride_g,
                                                      wb, rstd, DEVICE_SILU)
            dwb += gv2
            total += tl.sum(tl.where(n, gw2 * vhat2, 0.0), axis=0)
        mean = total / GS.to(tl.float32)
        _gated_bwd_out(sz, vhat, gw, ys, mean, rstd, wa, row, ca, m, dy_ptr, dz_ptr, out_ptr, d, stride_dz,
                       stride_out, WRITE_OUT, OUT)
        if BLOCK_B > 0:
            _gated_bwd_out(sz2, vhat2, gw2, ys2, mean, rstd, wb, row, cb, n, dy_ptr, dz_ptr, out_ptr, d, stride_dz,
                           stride_out, WRITE_OUT, OUT)
    tl.store(dw_ptr + blk * d + ca, dwa, mask=ma)
    if BLOCK_B > 0:
        tl.store(dw_ptr + blk * d + cb, dwb, mask=mb)


def _two_blocks(width: int) -> tuple[int, int]:
    """A group of ``width`` as (the largest power of two within it, the rest's next power of two; 0: none)."""
    first = 1 << (width.bit_length() - 1)
    return first, triton.next_power_of_2(width - first) if width > first else 0


def gated_launch(width: int, cfg: TritonKernelConfigs) -> tuple[int, int, int]:
    """``_gated_norm_kernel``'s (BLOCK_A, BLOCK_B, warps) for groups of ``width``: the warps of BLOCK_A."""
    first, rest = _two_blocks(width)
    return first, rest, max(1, min(16, first // cfg.norm_block_per_warp))


def gated_bwd_launch(width: int, cfg: TritonKernelConfigs) -> tuple[int, int, int]:
    """``_gated_norm_bwd_kernel``'s (BLOCK_A, BLOCK_B, warps) for groups of ``width``: the warps of one
    next-power-of-two block."""
    first, rest = _two_blocks(width)
    return first, rest, max(1, min(16, triton.next_power_of_2(width) // cfg.norm_bwd_block_per_warp))


def _weight_grad_blocks(M: int, d: int, cfg: TritonKernelConfigs, device: torch.device
                        ) -> tuple[int, torch.Tensor]:
    """(blocks of ``norm_bwd_rows`` rows, their dw partial sums [blocks, d] fp32 to fill; one row of zeros
    for no rows), summed over blocks by the caller."""
    nb = triton.cdiv(M, cfg.norm_bwd_rows)
    return nb, (torch.empty(nb, d, device=device, dtype=torch.float32) if nb else
                torch.zeros(1, d, device=device, dtype=torch.float32))


def rms_norm_backward_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype,
                             g: torch.Tensor, cfg: TritonKernelConfigs, add: torch.Tensor | None = None, *,
                             dx_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """The gradient of ``rms_norm_triton`` against g [M, D]: (dx [M, D] fp32 plus ``add`` [M, D] if given,
    dweight [D] in weight's dtype); deterministic. ``dx_dtype``: (dx, dx in dx_dtype, dweight)."""
    x, g = _rows(x, "x"), _rows(g, "g")
    M, D = x.shape
    dx = torch.empty(M, D, device=x.device, dtype=torch.float32)
    dx2 = None if dx_dtype is None else torch.empty(M, D, device=x.device, dtype=dx_dtype)
    nb, dw = _weight_grad_blocks(M, D, cfg, x.device)
    if M:
        a = _rows(add, "add") if add is not None else g
        block, warps = _block_warps(D, cfg)
        _rms_norm_bwd_kernel[(nb,)](x, weight.contiguous(), g, a, dx, dx if dx2 is None else dx2, dw, M, D,
                                    x.stride(0), g.stride(0), a.stride(0), float(eps),
                                    HAS_ADD=add is not None, HAS_DX2=dx2 is not None,
                                    OUT=_TL[out_dtype], ROWS=cfg.norm_bwd_rows, BLOCK_D=block, num_warps=warps)
    dw = dw.sum(0).to(weight.dtype)
    return (dx, dw) if dx2 is None else (dx, dx2, dw)


def gated_rms_norm_backward_triton(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                                   n_groups: int, g: torch.Tensor, cfg: TritonKernelConfigs,
                                   rstd: torch.Tensor | None = None, *, write_out: bool = False,
                                   dz_out: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The gradient of ``gated_rms_norm_triton`` against g [M, d]: (dy, dz in their dtypes, dweight [d] in
    weight's), from the forward's ``rstd`` [M, n_groups] fp32 (None: formed again); deterministic.
    ``write_out``: the norm's output [M, d] as a fourth, the forward's bits. ``dz_out``: where dz goes
    ([M, d] in z's dtype, unit column stride)."""
    y, z, g = _rows(y, "y"), _rows(z, "z"), _rows(g, "g")
    M, d = y.shape
    gs = d // n_groups
    if rstd is None:
        rstd = gated_rms_norm_triton(y, z, weight, eps, n_groups, cfg, with_rstd=True)[1]
    if rstd.shape != (M, n_groups) or rstd.dtype != torch.float32 or not rstd.is_contiguous():
        raise ValueError(f"rstd must be contiguous [{M}, {n_groups}] float32, got {tuple(rstd.shape)} {rstd.dtype}")
    dy = torch.empty(M, d, device=y.device, dtype=y.dtype)
    dz = torch.empty(M, d, device=y.device, dtype=z.dtype) if dz_out is None else dz_out
    if dz.shape != (M, d) or dz.dtype != z.dtype or (M and dz.stride(1) != 1):
        raise ValueError(f"dz_out must be [{M}, {d}] {z.dtype} with unit column stride, got {tuple(dz.shape)} "
                         f"{dz.dtype}")
    out = torch.empty(M, d, device=y.device, dtype=y.dtype) if write_out else dy
    nb, dw = _weight_grad_blocks(M, d, cfg, y.device)
    if M:
        block_a, block_b, warps = gated_bwd_launch(gs, cfg)
        _gated_norm_bwd_kernel[(nb, n_groups)](y, z, weight.contiguous(), g, rstd, dy, dz, dw, out, M, d, gs,
                                               y.stride(0), z.stride(0), g.stride(0), dz.stride(0), out.stride(0),
                                               float(eps), WRITE_OUT=write_out, DEVICE_SILU=cfg.device_silu,
                                               ROWS=cfg.norm_bwd_rows,
                                               BLOCK_A=block_a, BLOCK_B=block_b, num_warps=warps,
                                               enable_fp_fusion=False)
    dw = dw.sum(0).to(weight.dtype)
    return (dy, dz, dw, out) if write_out else (dy, dz, dw)


def _block_warps(width: int, cfg: TritonKernelConfigs) -> tuple[int, int]:
    """The power-of-two block of a row (or group) of ``width`` and its program's warps."""
    block = triton.next_power_of_2(width)
    return block, max(1, min(16, block // cfg.norm_block_per_warp))


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() != 2:
        raise ValueError(f"{name} must be [M, d], got {tuple(t.shape)}")
    return t if t.stride(1) == 1 else t.contiguous()


def _launch(x: torch.Tensor | None, res: torch.Tensor, idx: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out_dtype: torch.dtype, res_dtype: torch.dtype | None, cfg: TritonKernelConfigs
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    M = idx.shape[0] if idx is not None else res.shape[0]
    D = res.shape[1]
    out = torch.empty(M, D, dtype=out_dtype, device=res.device)
    res_out = torch.empty(M, D, dtype=res_dtype, device=res.device) if res_dtype is not None else None
    if M == 0:
        return out, res_out
    block, warps = _block_warps(D, cfg)
    _rms_norm_kernel[(M,)](
        x if x is not None else res, res, idx if idx is not None else res, weight.contiguous(), out,
        res_out if res_out is not None else out, D, x.stride(0) if x is not None else 0, res.stride(0), out.stride(0),
        res_out.stride(0) if res_out is not None else 0, float(eps), HAS_X=x is not None, HAS_IDX=idx is not None,
        WRITE_RES=res_out is not None, BLOCK_D=block, num_warps=warps, enable_fp_fusion=False)
    return out, res_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None,
                    cfg: TritonKernelConfigs) -> torch.Tensor:
    """``ops.norm.rms_norm``: x [M, d] (any float dtype, rows may be strided), weight [d] -> [M, d] in
    ``out_dtype`` (default weight's dtype)."""
    x = _rows(x, "x")
    out, _ = _launch(None, x, None, weight, eps, out_dtype or weight.dtype, None, cfg)
    return out


def add_rms_norm_triton(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        out_dtype: torch.dtype | None, cfg: TritonKernelConfigs) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one pass: x [M, d] (any float dtype; None: no add),
    residual [M, d] -> (normed [M, d] in ``out_dtype``, default weight's; residual + x, summed in fp32,
    in residual's dtype), both new tensors; the norm is taken of the new residual as it is kept."""
    residual = _rows(residual, "residual")
    if x is not None:
        x = _rows(x, "x")
        if x.shape != residual.shape:
            raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    out, res = _launch(x, residual, None, weight, eps, out_dtype or weight.dtype, residual.dtype, cfg)
    return out, res


def embed_rms_norm_triton(token_ids: torch.Tensor, embedding: torch.Tensor, weight: torch.Tensor, eps: float,
                          out_dtype: torch.dtype | None, residual_dtype: torch.dtype, cfg: TritonKernelConfigs
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedding gather and the first RMSNorm in one pass: token_ids [M] (int32/int64, on the device,
    in range: not checked), embedding [V, d] -> (normed [M, d] in ``out_dtype``, residual =
    embedding[token_ids] [M, d] in ``residual_dtype``)."""
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be [M], got {tuple(token_ids.shape)}")
    embedding = _rows(embedding, "embedding")
    return _launch(None, embedding, token_ids.contiguous(), weight, eps, out_dtype or weight.dtype, residual_dtype,
                   cfg)


def gated_rms_norm_triton(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, n_groups: int,
                          cfg: TritonKernelConfigs, *, with_rstd: bool = False
                          ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``ops.norm.gated_rms_norm``: y, z [M, d] (model dtype; rows may be strided), weight [d] -> a new
    [M, d] in y's dtype; ``with_rstd``: and each group's 1 / sqrt(mean square + eps) [M, n_groups] fp32."""
    y, z = _rows(y, "y"), _rows(z, "z")
    M, d = y.shape
    if z.shape != y.shape or d % n_groups:
        raise ValueError(f"gated_rms_norm_triton: y {tuple(y.shape)}, z {tuple(z.shape)}, {n_groups} groups")
    out = torch.empty(M, d, dtype=y.dtype, device=y.device)
    rstd = torch.empty(M, n_groups, dtype=torch.float32, device=y.device) if with_rstd else out
    if M:
        gs = d // n_groups
        block_a, block_b, warps = gated_launch(gs, cfg)
        _gated_norm_kernel[(M, n_groups)](y, z, weight.contiguous(), out, rstd, gs, y.stride(0), z.stride(0),
                                          out.stride(0), float(eps), WRITE_RSTD=with_rstd,
                                          DEVICE_SILU=cfg.device_silu, BLOCK_A=block_a,
                                          BLOCK_B=block_b, num_warps=warps, enable_fp_fusion=False)
    return (out, rstd) if with_rstd else out


# -- autograd: forward = the kernel, unchanged; backward = the torch form's gradient (Triton kernels) ------


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype,
                cfg: TritonKernelConfigs) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.consts = (eps, out_dtype, cfg)
        return rms_norm_triton(x, w, eps, out_dtype, cfg)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        eps, out_dtype, cfg = ctx.consts
        dx, dw = rms_norm_backward_triton(x, w, eps, out_dtype, g, cfg)
        return wanted(ctx, dx.to(x.dtype), dw)


class _EmbedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token_ids: torch.Tensor, embedding: torch.Tensor, w: torch.Tensor, eps: float,
                dtype: torch.dtype, residual_dtype: torch.dtype,
                cfg: TritonKernelConfigs) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(token_ids, embedding, w)
        ctx.consts = (eps, dtype, residual_dtype, cfg)
        return embed_rms_norm_triton(token_ids, embedding, w, eps, dtype, residual_dtype, cfg)

    @staticmethod
    def backward(ctx, g_normed: torch.Tensor, g_residual: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        token_ids, embedding, w = ctx.saved_tensors
        eps, dtype, residual_dtype, cfg = ctx.consts
        residual = embedding[token_ids].to(residual_dtype)
        g, dw = rms_norm_backward_triton(residual, w, eps, dtype, g_normed, cfg, add=g_residual)
        de = None
        if ctx.needs_input_grad[1]:
            with deterministic():  # repeated token ids: the sorting accumulation, not atomics
                de = torch.zeros(embedding.shape, device=g.device).index_put_((token_ids,), g, accumulate=True)
            de = de.to(embedding.dtype)
        return wanted(ctx, None, de, dw)


class _AddNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype,
                cfg: TritonKernelConfigs) -> tuple[torch.Tensor, torch.Tensor]:
        normed, summed = add_rms_norm_triton(x, residual, w, eps, dtype, cfg)
        # the norm's input is the new residual as kept (the backward kernel would form the same bits from x
        # and residual): holding it, and not them, frees the mixer's output x after the forward
        ctx.save_for_backward(summed, w)
        ctx.consts = (eps, dtype, cfg, x.dtype)
        return normed, summed

    @staticmethod
    def backward(ctx, g_normed: torch.Tensor, g_residual: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        summed, w = ctx.saved_tensors
        eps, dtype, cfg, x_dtype = ctx.consts
        # x's gradient rounded in the same pass (an fp32 x takes dx)
        if x_dtype == torch.float32:
            g, dw = rms_norm_backward_triton(summed, w, eps, dtype, g_normed, cfg, add=g_residual)
            gx = g
        else:
            g, gx, dw = rms_norm_backward_triton(summed, w, eps, dtype, g_normed, cfg, add=g_residual,
                                                 dx_dtype=x_dtype)
        return wanted(ctx, gx, g.to(summed.dtype), dw)


class _GatedRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, n_groups: int,
                cfg: TritonKernelConfigs) -> torch.Tensor:
        out, rstd = gated_rms_norm_triton(y, z, w, eps, n_groups, cfg, with_rstd=True)
        ctx.save_for_backward(y, z, w, rstd)
        ctx.consts = (eps, n_groups, cfg)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, z, w, rstd = ctx.saved_tensors
        eps, n_groups, cfg = ctx.consts
        return wanted(ctx, *gated_rms_norm_backward_triton(y, z, w, eps, n_groups, g, cfg, rstd))


class _GatedNormLinear(torch.autograd.Function):
    """``linear(gated_rms_norm(y, z, nw), w, b)``; the backward forms the norm's output again in the norm's
    backward kernel (for the linear's weight gradient), so the forward's [M, d] output is not held."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, z: torch.Tensor, nw: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                eps: float, n_groups: int, cfg: TritonKernelConfigs) -> torch.Tensor:
        yn, rstd = gated_rms_norm_triton(y, z, nw, eps, n_groups, cfg, with_rstd=True)
        ctx.save_for_backward(y, z, nw, w, rstd)
        ctx.consts = (eps, n_groups, cfg, None if b is None else b.dtype)
        ctx.z_block = grad_block(z)  # z a block of in_proj's output: dz written into its one gradient
        return linear_triton(yn, w, b, cfg)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, z, nw, w, rstd = ctx.saved_tensors
        eps, n_groups, cfg, bias_dtype = ctx.consts
        need_norm, need_w, need_b = any(ctx.needs_input_grad[:3]), ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        dy = dz = dnw = dw = None
        if need_norm or need_w:
            # the input gradient as ``linear``'s backward forms it (cuBLAS), then the norm's, writing its output
            dz_out = ctx.z_block.take() if ctx.z_block is not None and ctx.needs_input_grad[1] else None
            dy, dz, dnw, yn = gated_rms_norm_backward_triton(y, z, nw, eps, n_groups, g @ w, cfg, rstd,
                                                             write_out=True, dz_out=dz_out)
            if need_w:
                dw = (g.t() @ yn).to(w.dtype)
        db = g.to(torch.float32).sum(0).to(bias_dtype) if need_b else None
        return wanted(ctx, dy, dz, dnw, dw, db)


# -- the forms (the triton backend's table): the Function where a gradient is recorded, else the launch ----


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype,
             cfg: TritonKernelConfigs) -> torch.Tensor:
    """[M, d] -> [M, d] in ``out_dtype``; backward of ``tree.rms_norm``."""
    if grad_needed(x, w):
        return _RmsNorm.apply(x, w, eps, out_dtype, cfg)
    return rms_norm_triton(x, w, eps, out_dtype, cfg)


def embed_norm(token_ids: torch.Tensor, embedding: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype,
               residual_dtype: torch.dtype, cfg: TritonKernelConfigs) -> tuple[torch.Tensor, torch.Tensor]:
    """token_ids [T] -> (normed [T, d] in ``dtype``, residual [T, d] in ``residual_dtype``)."""
    if grad_needed(embedding, w):
        return _EmbedNorm.apply(token_ids, embedding, w, eps, dtype, residual_dtype, cfg)
    return embed_rms_norm_triton(token_ids, embedding, w, eps, dtype, residual_dtype, cfg)


def add_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype,
             cfg: TritonKernelConfigs) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [M, d] -> (normed [M, d] in ``dtype``, residual + x [M, d] in residual's dtype)."""
    if grad_needed(x, residual, w):
        return _AddNorm.apply(x, residual, w, eps, dtype, cfg)
    return add_rms_norm_triton(x, residual, w, eps, dtype, cfg)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, n_groups: int,
                   cfg: TritonKernelConfigs) -> torch.Tensor:
    """y, z [M, d] -> [M, d] in y's dtype; backward of ``tree.gated_rms_norm``."""
    if grad_needed(y, z, w):
        return _GatedRmsNorm.apply(y, z, w, eps, n_groups, cfg)
    return gated_rms_norm_triton(y, z, w, eps, n_groups, cfg)


def gated_norm_linear(y: torch.Tensor, z: torch.Tensor, nw: torch.Tensor, eps: float, n_groups: int,
                      w: torch.Tensor, b: torch.Tensor | None, cfg: TritonKernelConfigs) -> torch.Tensor:
    """y, z [M, d] -> ``linear(gated_rms_norm(y, z, nw, eps, n_groups), w, b)`` [M, N] with those two
    ops' bits; under autograd the norm's output is not held for the backward (``_GatedNormLinear``)."""
    if grad_needed(y, z, nw, w, b):
        return _GatedNormLinear.apply(y, z, nw, w, b, eps, n_groups, cfg)
    return linear_triton(gated_rms_norm_triton(y, z, nw, eps, n_groups, cfg), w, b, cfg)
