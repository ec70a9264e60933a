"""The row-parallel linear layer: K in the contract's S slices, their fp32 partials joined by adjacent
pairs (``pair_tree``), one rounding. A rank sums its subtree; the subtree sums are all-gathered and
joined by the top levels, so every TP degree dividing S gives the same bits. Why: docs/design.md,
"How the bits are kept" (Tensor parallelism)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ..logprobs.sliced import pair_tree

if TYPE_CHECKING:
    from ...parallel import TPGroup
    from ..backend import Backend

Partial = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: ``Ops.linear_tree``: (x [M, k], w [N, k], b [N] | None, slices, out_dtype) -> [M, N], the fused subtree
Tree = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int, torch.dtype], torch.Tensor]


def check_slices(k_local: int, slices: int, size: int) -> int:
    """The slices one rank computes; ValueError unless S is a power of two that ``size`` divides and
    ``k_local`` splits into S/size equal slices."""
    if not (isinstance(slices, int) and slices >= 1 and slices & (slices - 1) == 0):
        raise ValueError(f"row_parallel_slices {slices!r} refused: expected a power of two >= 1")
    if slices % size:
        raise ValueError(f"tensor-parallel size {size} refused: it must divide row_parallel_slices {slices} "
                         "(every rank computes whole slices of the fixed tree)")
    local = slices // size
    if k_local % local:
        raise ValueError(f"K {k_local * size} refused for row_parallel_slices {slices}: K must be a multiple of the "
                         "slice count (contiguous equal slices)")
    return local


def row_parallel_weight(backend: Backend, whole: torch.Tensor, raw: Callable[[], torch.Tensor], slices: int,
                        size: int) -> torch.Tensor | list[torch.Tensor]:
    """``row_parallel_linear``'s weight on ``backend``: ``whole`` [N, K/size] where it has a fused tree,
    else one ``linear_weight`` per slice of ``raw()`` (read only then), prepared once."""
    if backend.linear_tree is not None:
        return whole
    w = raw()
    n = slices // size
    cw = w.shape[1] // n
    return [backend.linear_weight(w[:, j * cw:(j + 1) * cw]) for j in range(n)]


def row_parallel_subtree(x: torch.Tensor, w: torch.Tensor | Sequence[torch.Tensor], *, slices: int, size: int,
                         partial: Partial | None = None, tree: Tree | None = None) -> torch.Tensor:
    """This rank's subtree of ``row_parallel_linear``: x [M, K/size] @ w^T over its S/size slices, joined by
    adjacent pairs, [M, N] fp32 (w, partial, tree as there)."""
    k_local = x.shape[1]
    local = check_slices(k_local, slices, size)
    c = k_local // local
    if tree is not None:
        if not isinstance(w, torch.Tensor) or w.shape[1] != k_local:
            raise ValueError(f"row_parallel_linear: the fused tree takes this rank's whole weight of {k_local} K "
                             "columns")
        return tree(x, w, None, local, torch.float32)
    if partial is None:
        raise ValueError("row_parallel_linear: give the backend's partial GEMM or its fused tree")
    if isinstance(w, torch.Tensor):
        if w.shape[1] != k_local:
            raise ValueError(f"row_parallel_linear: x has {k_local} K columns, w {w.shape[1]}")
        ws: Sequence[torch.Tensor] = [w[:, j * c:(j + 1) * c] for j in range(local)]
    else:
        ws = w
        if len(ws) != local or any(t.shape[1] != c for t in ws):
            raise ValueError(f"row_parallel_linear: expected {local} slice weights of {c} K columns, got "
                             f"{[list(t.shape) for t in ws]}")
    return pair_tree(torch.stack([partial(x[:, j * c:(j + 1) * c], ws[j]) for j in range(local)], dim=-1))


def join_subtrees(group: TPGroup, mine: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's subtree ``mine`` [M, N] fp32 all-gathered and joined by the top log2(size) levels, plus
    b ([N], or one row per row) in fp32, rounded once to ``dtype``: the same on every rank. Row-wise, so the
    rows of several GEMMs (a MoE layer's experts) may share one all-gather."""
    total = mine if group.size == 1 else pair_tree(group.all_gather(mine).movedim(0, -1))
    if b is not None:
        total = total + b.to(torch.float32)
    return total.to(dtype)


def row_parallel_linear(x: torch.Tensor, w: torch.Tensor | Sequence[torch.Tensor], b: torch.Tensor | None = None, *,
                        slices: int, group: TPGroup, partial: Partial | None = None,
                        tree: Tree | None = None) -> torch.Tensor:
    """x [M, K/size] @ w [N, K/size]^T (+ b [N], added in fp32) -> [M, N] in x's dtype, the same on
    every rank. x, w: this rank's contiguous K columns; w may be its S/size slice weights [N, K/S]
    (``row_parallel_weight``). slices: S; partial: ``Ops.linear_partial``; tree: ``Ops.linear_tree``
    (then w is the whole rank weight)."""
    if tree is not None and group.size == 1:  # the whole tree, the bias and the rounding in one call
        local = check_slices(x.shape[1], slices, 1)
        if not isinstance(w, torch.Tensor) or w.shape[1] != x.shape[1]:
            raise ValueError(f"row_parallel_linear: the fused tree takes this rank's whole weight of {x.shape[1]} K "
                             "columns")
        return tree(x, w, b, local, x.dtype)
    mine = row_parallel_subtree(x, w, slices=slices, size=group.size, partial=partial, tree=tree)
    return join_subtrees(group, mine, b, x.dtype)


__all__ = ["check_slices", "join_subtrees", "row_parallel_linear", "row_parallel_subtree", "row_parallel_weight"]
