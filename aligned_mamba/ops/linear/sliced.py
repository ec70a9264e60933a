"""The row-parallel linear layer: K in the contract's fixed slices, a fixed tree over their partials.

A row-parallel layer (Mamba2's out_proj, attention's o_proj, the MLP's down projection) splits the
K reduction across tensor-parallel ranks; summing the ranks' partials with an all-reduce rounds in
the library's order, which changes with the degree. Here the contract fixes the arithmetic and the
degree only decides who computes what:

- K is cut into S contiguous equal slices (``Contract.row_parallel_slices``); slice j's partial is
  the backend's row-invariant GEMM over that slice, kept in float32 (``Ops.linear_partial``);
- the S partials are summed by adjacent pairs ((p0 + p1) + (p2 + p3)) + ... (``pair_tree``), the
  bias added in float32, and the sum rounded once to x's dtype.

At TP k (k | S) rank r holds K columns [r K/k, (r + 1) K/k), i.e. slices r S/k ... (r + 1) S/k - 1,
a whole subtree of the pairwise tree: it sums them locally, the k subtree sums are all-gathered
(never all-reduced) and every rank joins them by the tree's top log2(k) levels. So TP 1, 2, 4 ... S
give the same bits, and S = 1 is the plain ``linear``.

A backend with a fused form of the subtree (``Ops.linear_tree``: the triton backend's one launch,
``triton_tree.py``) passes it as ``tree``; the arithmetic is the same, in that backend's own bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ..logprobs.sliced import pair_tree

if TYPE_CHECKING:
    from ...parallel import TPGroup
    from ..backend import Backend

Partial = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: (x [M, k], w [N, k], b [N] | None, slices, out_dtype) -> [M, N]: the pairwise tree over ``slices``
#: contiguous K slices' fp32 sums (+ b in fp32), rounded once to out_dtype (``Ops.linear_tree``)
Tree = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int, torch.dtype], torch.Tensor]


def check_slices(k_local: int, slices: int, size: int) -> int:
    """The slices one rank computes, or ValueError (one line): ``slices`` a power of two that ``size``
    divides, and the rank's K (``k_local``) a whole number of equal slices."""
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
    """The weight ``row_parallel_linear`` takes on ``backend``: ``whole`` (this rank's [N, K/size] weight,
    already ``linear_weight``'s form) where the backend has a fused tree; otherwise one
    ``linear_weight`` per slice of ``raw()`` (the same [N, K/size] weight before that form, read only
    then), prepared once so no call slices or pads."""
    if backend.linear_tree is not None:
        return whole
    w = raw()
    n = slices // size
    cw = w.shape[1] // n
    return [backend.linear_weight(w[:, j * cw:(j + 1) * cw]) for j in range(n)]


def row_parallel_linear(x: torch.Tensor, w: torch.Tensor | Sequence[torch.Tensor], b: torch.Tensor | None = None, *,
                        slices: int, group: TPGroup, partial: Partial | None = None,
                        tree: Tree | None = None) -> torch.Tensor:
    """The contract's row-parallel GEMM: x [M, K/size] @ w [N, K/size]^T (+ b [N]) -> [M, N] in x's dtype.

    x, w: this rank's K columns (rank ``group.rank`` of ``group.size``, contiguous, in rank order).
    w may instead be the sequence of this rank's S/size slice weights, each [N, K/S] as the backend's
    ``linear_weight`` made it (prepared once: no per-call slicing and padding). b: [N] (any float
    dtype, added in float32) or None. slices: S, the contract's ``row_parallel_slices``. partial:
    the backend's float32-output GEMM over one slice (``Ops.linear_partial``: [M, k] x [N, k] ->
    [M, N] float32, row-invariant). tree: the backend's fused subtree (``Ops.linear_tree``), used
    instead of ``partial`` where given; w is then this rank's whole [N, K/size] weight. Every rank
    returns the same full [M, N].
    """
    size = group.size
    k_local = x.shape[1]
    local = check_slices(k_local, slices, size)
    c = k_local // local
    if tree is not None:
        if not isinstance(w, torch.Tensor) or w.shape[1] != k_local:
            raise ValueError(f"row_parallel_linear: the fused tree takes this rank's whole weight of {k_local} K "
                             "columns")
        if size == 1:  # the whole tree, the bias and the rounding in one call
            return tree(x, w, b, local, x.dtype)
        total = pair_tree(group.all_gather(tree(x, w, None, local, torch.float32)).movedim(0, -1))
        if b is not None:
            total = total + b.to(torch.float32)
        return total.to(x.dtype)
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
    parts = torch.stack([partial(x[:, j * c:(j + 1) * c], ws[j]) for j in range(local)], dim=-1)
    mine = pair_tree(parts)  # [M, N]: this rank's subtree of the fixed tree
    total = mine if size == 1 else pair_tree(group.all_gather(mine).movedim(0, -1))  # the top log2(size) levels
    if b is not None:
        total = total + b.to(torch.float32)
    return total.to(x.dtype)


__all__ = ["check_slices", "row_parallel_linear", "row_parallel_weight"]
