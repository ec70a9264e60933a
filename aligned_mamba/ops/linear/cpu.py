"""The CPU form of the linear layer: ``native_cpu.c``'s lane GEMMs, the bits of ``gemm.py``'s
``"lanes"`` form in one call, falling back to ``gemm.py`` where they do not apply.
"""

from __future__ import annotations

import torch

from ..native import DTYPES, library, ok, ptr, row_stride
from . import gemm


def _threads() -> int:
    """The GEMMs' threads: two where torch runs two or more (a split over outputs: the same bits)."""
    return min(2, torch.get_num_threads())


def _slot_matrices(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor, rows: int,
                   cols: int) -> tuple[int, int, int, torch.Tensor] | None:
    """For x [S, Hb, M, ...] whose item (s, j) takes the matrix w[index[s], j], w [slots, Hb, rows, cols]:
    (Hb, w's slot stride, its Hb stride, index as contiguous int64), where each [rows, cols] matrix is
    contiguous; else None."""
    if (x.dim() != 4 or w.dim() != 4 or index.shape != (x.shape[0],) or w.shape[1:] != (x.shape[1], rows, cols)
            or w.stride(3) != 1 or w.stride(2) != cols):
        return None
    return x.shape[1], w.stride(0), w.stride(1), index.to(torch.int64).contiguous()


def lane_gemm(x: torch.Tensor, w: torch.Tensor, exact: bool, *,
              index: torch.Tensor | None = None) -> torch.Tensor | None:
    """``gemm.lane_matmul``'s sums: x [..., M, Kp] float32, w [..., N, Kp] float32 or bfloat16 (both
    zero-padded to Kp, a multiple of 8; batch dims equal, or w without them) -> [..., M, N] float32.
    ``exact``: every product is exact (bfloat16 values), so fused multiply-adds give the same bits.
    index [S] int64: x [S, G, M, Kp] takes w [slots, G, N, Kp] at slots ``index`` (any slot and G
    strides, [N, Kp] contiguous), read in place. None where it does not apply."""
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
    """``lane_gemm(x, w^T)`` with w as [..., K, N]: x [..., M, K] float32, w [..., K, N] float32 or
    bfloat16 (batch dims equal) -> [..., M, N] float32, the same bits (each output the same chain), with
    no transposed copy of w. K need not be a multiple of 8 (the rest counts as zero-padded). None where
    it does not apply.

    index [S] int64: x [S, H, M, K] takes w [slots, H, K, N] at slots ``index`` (any slot and head
    strides, [K, N] contiguous), read in place. klen (one per matrix, or with index one per slot):
    the terms stop at k = klen (the same bits where x is +0.0 from there on and w finite: the lanes
    add exact zeros there).
    """
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
    """``gemm.linear(x, ...)`` in the lanes' form: x [M, K] (float32 or bfloat16, rows contiguous),
    w [N, Kp] the padded weight (Kp a multiple of 8), bias [N] or None -> [M, N] in x's dtype, the
    same bits in one call. None where it does not apply."""
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
    """``gemm.linear``: x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype; the lanes' form
    in one loop where it applies (no gradient recorded), else ``gemm.linear``."""
    if form == "lanes" and x.shape[0] and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        if (fused := linear_loop(x, gemm.padded(weight, form), bias)) is not None:  # the same bits in one call
            return fused[:, :weight.shape[0]]
    return gemm.linear(x, weight, bias, row_tile, form)
