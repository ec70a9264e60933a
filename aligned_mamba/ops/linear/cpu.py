"""The linear layer's CPU form: ``native_cpu.c``'s lane GEMMs, ``gemm.py``'s lanes bits in one call;
each function returns None (or falls back to ``gemm.py``) where the loops do not apply."""

from __future__ import annotations

import torch

from ..native import DTYPES, library, ok, ptr, row_stride
from . import gemm


def _threads() -> int:
    """Two threads where torch has two (a split over outputs: the same bits)."""
    return min(2, torch.get_num_threads())


def _slot_matrices(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor, rows: int,
                   cols: int) -> tuple[int, int, int, torch.Tensor] | None:
    """x [S, Hb, M, ...] taking w [slots, Hb, rows, cols] at w[index[s], j]: (Hb, slot stride, Hb stride,
    index int64) where each [rows, cols] matrix is contiguous, else None."""
    if (x.dim() != 4 or w.dim() != 4 or index.shape != (x.shape[0],) or w.shape[1:] != (x.shape[1], rows, cols)
            or w.stride(3) != 1 or w.stride(2) != cols):
        return None
    return x.shape[1], w.stride(0), w.stride(1), index.to(torch.int64).contiguous()


def lane_gemm(x: torch.Tensor, w: torch.Tensor, exact: bool, *,
              index: torch.Tensor | None = None) -> torch.Tensor | None:
    """``gemm.lane_matmul``: x [..., M, Kp] fp32, w [..., N, Kp] or [N, Kp] fp32/bf16 (Kp a multiple of 8)
    -> [..., M, N] fp32. ``exact``: bf16 products, so FMA keeps the bits. index [S]: x [S, G, M, Kp]
    reads w [slots, G, N, Kp] at those slots in place."""
    if x.dtype != torch.float32 or not ok(x, w) or (lib := library()) is None:
        return None
    M, Kp = x.shape[-2:]
    N = w.shape[-2]
    batch = x.shape[:-2]
    if index is not None:
        if (slotted := _slot_matrices(x, w, index, N, Kp)) is None:
            return None
        hb, sw, sh, index = slotted
    elif w.dim() > 2 and w.shape[:-2] != batch:
        return None
    else:
        w = w.contiguous()
        hb, sw, sh = 1, N * Kp if w.dim() > 2 else 0, 0
    x = x.contiguous().view(-1, M, Kp)
    nb = x.shape[0]
    out = torch.empty(*batch, M, N)
    lib.am_lane_gemm(x.data_ptr(), M * Kp, w.data_ptr(), sw, ptr(index), hb, sh, int(w.dtype == torch.bfloat16),
                     out.data_ptr(), nb, M, N, Kp, int(exact), _threads())
    return out


def lane_gemm_kn(x: torch.Tensor, w: torch.Tensor, exact: bool, *, index: torch.Tensor | None = None,
                 klen: torch.Tensor | None = None) -> torch.Tensor | None:
    """``lane_gemm(x, w^T)`` without a transposed copy: x [..., M, K] fp32, w [..., K, N] fp32/bf16 ->
    [..., M, N] fp32, the same bits (K need not be a multiple of 8). index: as ``lane_gemm``. klen
    (per matrix, or per slot): terms stop at k = klen, the same bits where x is +0.0 beyond."""
    if x.dtype != torch.float32 or not ok(x, w) or (lib := library()) is None:
        return None
    M, K = x.shape[-2:]
    N = w.shape[-1]
    if index is not None:
        if (slotted := _slot_matrices(x, w, index, K, N)) is None:
            return None
        hb, sw, sh, index = slotted
    elif w.shape[:-2] != x.shape[:-2]:
        return None
    else:
        w, hb, sw, sh = w.contiguous(), 1, K * N, 0
    batch = x.shape[:-2]
    x = x.contiguous()
    out = torch.empty(*batch, M, N)
    nb = out.numel() // max(1, M * N)
    if klen is not None:
        klen = klen.to(torch.int64).contiguous()
        if klen.numel() * hb != nb:
            return None
    lib.am_lane_gemm_kn(x.data_ptr(), M * K, w.data_ptr(), sw, ptr(index), hb, sh, int(w.dtype == torch.bfloat16),
                        out.data_ptr(), nb, M, N, K, ptr(klen), int(exact), _threads())
    return out


def linear_loop(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``gemm.linear`` in the lanes' form, one call: x [M, K] fp32/bf16, w [N, Kp] padded, bias [N] or
    None -> [M, N] in x's dtype."""
    if not ok(x, w, bias) or (lib := library()) is None or (ldx := row_stride(x)) is None:
        return None
    M, K = x.shape
    N, Kp = w.shape
    w = w.contiguous()
    b = None if bias is None else bias.contiguous()
    out = torch.empty(M, N, dtype=x.dtype)
    work = torch.empty(M * Kp + M * N)
    lib.am_linear(x.data_ptr(), DTYPES[x.dtype], ldx, w.data_ptr(), int(w.dtype == torch.bfloat16), ptr(b),
                  DTYPES[b.dtype] if b is not None else 0, out.data_ptr(), M, N, K, Kp,
                  int(x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16), work.data_ptr(), _threads())
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, row_tile: int = 16,
           form: str = "lanes") -> torch.Tensor:
    """``gemm.linear``'s signature and bits: the C loop where it applies without a gradient."""
    if form == "lanes" and x.shape[0] and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        if (fused := linear_loop(x, gemm.padded(weight, form), bias)) is not None:
            return fused[:, :weight.shape[0]]
    return gemm.linear(x, weight, bias, row_tile, form)
