"""The norms' CPU form: ``native_cpu.c``'s loops (``tree.py``'s bits, the residual add fused), else ``tree.py``."""

from __future__ import annotations

import torch

from ..native import DTYPES, library, ok, ptr, scratch
from . import tree


def rms_norm_loop(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``tree.rms_norm`` of x [M, d] -> (normed, None); with ``residual`` [M, d] ``tree.add_norm``'s
    (normed, residual + x). None where it does not apply."""
    if out_dtype not in DTYPES or not ok(x, weight, residual) or (lib := library()) is None:
        return None
    M, d = x.shape
    x = x.contiguous()
    w = weight.to(out_dtype).contiguous()
    out = torch.empty(M, d, dtype=out_dtype)
    res = res_out = None
    if residual is not None:
        if residual.dtype != torch.promote_types(residual.dtype, x.dtype):
            return None  # the sum would be in another dtype than residual's
        res = residual.contiguous()
        res_out = torch.empty_like(res)
    work = scratch(d)
    lib.am_rms_norm(x.data_ptr(), DTYPES[x.dtype], ptr(res), ptr(res_out),
                    DTYPES[res.dtype] if res is not None else 0, w.data_ptr(), out.data_ptr(), DTYPES[out_dtype],
                    M, d, eps, work.data_ptr())
    return out, res_out


def gated_rms_norm_loop(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   n_groups: int) -> torch.Tensor | None:
    """``tree.gated_rms_norm`` for y, z [M, d] of one dtype, or None."""
    if z.dtype != y.dtype or not ok(y, z, weight) or (lib := library()) is None:
        return None
    M, d = y.shape
    y, z = y.contiguous(), z.contiguous()
    w = weight.to(y.dtype).contiguous()
    out = torch.empty_like(y)
    work = scratch(d // n_groups)
    lib.am_gated_norm(y.data_ptr(), z.data_ptr(), w.data_ptr(), out.data_ptr(), DTYPES[y.dtype], M, d, n_groups,
                      eps, work.data_ptr())
    return out


# -- the forms (the CPU backend's table): the loops, else the torch form ------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tree.rms_norm``: [M, d] -> [M, d] in ``out_dtype`` (default weight's dtype)."""
    out_dtype = out_dtype or weight.dtype
    fused = rms_norm_loop(x, weight, eps, out_dtype)
    return tree.rms_norm(x, weight, eps, out_dtype) if fused is None else fused[0]


def add_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``tree.add_norm``, the add and the norm in one loop where it applies."""
    fused = rms_norm_loop(x, w, eps, dtype, residual=residual)
    return tree.add_norm(x, residual, w, eps, dtype, norm=rms_norm) if fused is None else (fused[0], fused[1])


def embed_norm(token_ids: torch.Tensor, embedding: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype,
               residual_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``tree.embed_norm`` with this form's norm."""
    return tree.embed_norm(token_ids, embedding, w, eps, dtype, residual_dtype, norm=rms_norm)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, n_groups: int) -> torch.Tensor:
    """``tree.gated_rms_norm``: y, z [M, d] -> [M, d] in y's dtype."""
    fused = gated_rms_norm_loop(y, z, weight, eps, n_groups)
    return tree.gated_rms_norm(y, z, weight, eps, n_groups) if fused is None else fused
