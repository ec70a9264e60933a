"""The norms' torch form: a fixed-tree sum of squares, ``torch.rsqrt`` (correctly rounded; the CPU's
``torch.sqrt`` is not), the IEEE SiLU, one rounding (docs/design.md, "How the bits are kept")."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .. import elementwise as ew
from ..logprobs.sliced import pair_tree
from ..reduce import tree_sum

if TYPE_CHECKING:
    from ...parallel import TPGroup

Norm = Callable[[torch.Tensor, torch.Tensor, float, torch.dtype], torch.Tensor]


def _normalize(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """xf [..., d] float32 -> xf / sqrt(mean(xf^2) + eps)."""
    k = ew.operand  # the constants as 0-dim tensors: the same rounding, half the cost of a Python number
    var = tree_sum(xf * xf) / k(float(xf.shape[-1]), xf)
    return xf * torch.rsqrt(var + k(eps, xf))[..., None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """weight * normalised x [M, d] (any float dtype), rounded once to ``out_dtype`` (default weight's)."""
    out_dtype = out_dtype or weight.dtype
    return _weighted(_normalize(x.to(torch.float32), eps), weight, out_dtype)


def _weighted(n: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """weight (rounded to out_dtype, as every form holds it) times n [..., d] fp32, rounded once."""
    return (weight.to(out_dtype).to(torch.float32) * n).to(out_dtype)


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, n_groups: int
) -> torch.Tensor:
    """norm_g(y * silu(z)) * weight per group: y, z [M, d] (model dtype), weight [d] -> [M, d] in y's dtype."""
    M, d = y.shape
    g = y.to(torch.float32) * ew.silu(z.to(torch.float32))
    return _weighted(_normalize(g.view(M, n_groups, d // n_groups), eps).view(M, d), weight, y.dtype)


def slice_geometry(dl: int, n_groups: int, slices: int, group: TPGroup) -> tuple[int, int, int, int]:
    """A rank's part of the sliced gated norm, its dl channels of the model's n_groups groups cut into
    ``slices`` slices each: (a group's width, ranks per group, groups on this rank, a group's slices on this
    rank). ValueError (one line) where the slices do not fall on the ranks."""
    k = group.size
    width = dl * k // n_groups
    span = max(1, k // n_groups)
    per_rank = slices // span
    if slices % span or width % slices:
        raise ValueError(f"gated norm: {n_groups} groups of {width} channels cannot be cut into {slices} slices "
                         f"per group across {k} ranks")
    return width, span, max(1, n_groups // k), per_rank


def join_slices(ss: torch.Tensor, span: int, group: TPGroup) -> torch.Tensor:
    """The slices' sums [M, local_groups, per_rank] fp32 -> the groups' sums [M, local_groups], joined by
    adjacent pairs: this rank's subtree, then (span > 1 ranks to a group) the tree's top over the all-gathered
    subtrees. Every rank calls it, rows or none."""
    ss = pair_tree(ss)
    if span > 1:
        gathered = group.all_gather(ss[:, 0])  # [k, M]; ranks r0 .. r0 + span - 1 hold one group
        first = (group.rank // span) * span
        ss = pair_tree(gathered[first:first + span].movedim(0, -1)).unsqueeze(-1)
    return ss


def gated_rms_norm_sliced(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, n_groups: int, *,
                          slices: int, group: TPGroup) -> torch.Tensor:
    """``gated_rms_norm`` with each group's sum of squares in ``slices`` (S) slices joined by adjacent
    pairs, the same bits at every TP degree k dividing S: y, z [M, d / k], weight [d / k] (this rank's),
    n_groups the model's G (G < k: a group's subtree sums all-gathered) -> [M, d / k] in y's dtype."""
    M, dl = y.shape
    width, span, local_groups, per_rank = slice_geometry(dl, n_groups, slices, group)
    g = y.to(torch.float32) * ew.silu(z.to(torch.float32))
    u = g.view(M, local_groups, per_rank, width // slices)
    ss = join_slices(tree_sum(u * u), span, group)
    c = ew.operand
    var = ss / c(float(width), ss)
    out = (u.view(M, local_groups, dl // local_groups) * torch.rsqrt(var + c(eps, ss))[..., None]).view(M, dl)
    return _weighted(out, weight, y.dtype)


def embed_norm(token_ids: torch.Tensor, embedding: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype,
               residual_dtype: torch.dtype, *, norm: Norm = rms_norm) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm of the residual as kept, in ``dtype``; residual = embedding[token_ids] in ``residual_dtype``)."""
    residual = embedding[token_ids].to(residual_dtype)
    return norm(residual, w, eps, dtype), residual


def add_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype, *,
             norm: Norm = rms_norm) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [M, d] -> (norm of the sum as kept, in ``dtype``; residual + x in residual's dtype)."""
    residual = residual + x
    return norm(residual, w, eps, dtype), residual


# -- backwards (``triton.py``'s Functions): accuracy, not row invariance, so native torch ops in fp32 ---------


def _normalize_backward(xf: torch.Tensor, gn: torch.Tensor, eps: float) -> torch.Tensor:
    """The gradient of ``_normalize(xf, eps)`` against gn: both [..., d] float32 -> [..., d] float32."""
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * r
    return r * (gn - xhat * (gn * xhat).mean(-1, keepdim=True))


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None,
                      g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of ``rms_norm`` against g [M, d]: (dx in x's dtype, dweight [d] in weight's)."""
    out_dtype = out_dtype or weight.dtype
    xf, gf = x.to(torch.float32), g.to(torch.float32)
    dx = _normalize_backward(xf, gf * weight.to(out_dtype).to(torch.float32), eps)
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return dx.to(x.dtype), (gf * n).sum(0).to(weight.dtype)


def gated_rms_norm_backward(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, n_groups: int,
                            g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient of ``gated_rms_norm`` against g [M, d]: (dy, dz in their dtypes, dweight [d] in weight's)."""
    M, d = y.shape
    yf, zf, gf = y.to(torch.float32), z.to(torch.float32), g.to(torch.float32)
    s = torch.sigmoid(zf)
    u = (yf * (zf * s)).view(M, n_groups, d // n_groups)
    du = _normalize_backward(u, (gf * weight.to(y.dtype).to(torch.float32)).view(u.shape), eps).view(M, d)
    n = (u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)).view(M, d)
    dy = du * (zf * s)
    dz = du * yf * (s * (1.0 + zf * (1.0 - s)))
    return dy.to(y.dtype), dz.to(z.dtype), (gf * n).sum(0).to(weight.dtype)
