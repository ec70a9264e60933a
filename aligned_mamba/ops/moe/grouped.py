"""The deterministic dispatch and the torch form of the routed experts. Why: docs/design.md, "How the
bits are kept" (the MoE paragraph)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .naive import combine


@dataclass(frozen=True)
class Dispatch:
    """The sorted (token, slot) pairs of one call, R = T * k rows, all int64: token [R], perm [R] (flat
    t * k + j), pos [T, k] (perm's inverse), offsets [E + 1] (expert e: rows offsets[e] .. offsets[e + 1]
    - 1); tile_expert, tile_row0, tile_row1 [NT]: ``block_m``-row tiles of one expert (unused: row0 =
    row1 = 0), NT = cdiv(R, block_m) + min(E, R), independent of the routing."""

    token: torch.Tensor
    perm: torch.Tensor
    pos: torch.Tensor
    offsets: torch.Tensor
    tile_expert: torch.Tensor
    tile_row0: torch.Tensor
    tile_row1: torch.Tensor
    block_m: int


def dispatch(experts: torch.Tensor, num_experts: int, block_m: int = 1) -> Dispatch:
    """experts [T, k] int64 (distinct per row) -> ``Dispatch``, by a stable sort on the device."""
    T, k = experts.shape
    dev, i64 = experts.device, torch.int64
    flat = experts.reshape(-1).to(i64)
    R = flat.numel()
    perm = torch.argsort(flat, stable=True)
    pos = torch.empty(R, dtype=i64, device=dev)
    pos[perm] = torch.arange(R, dtype=i64, device=dev)
    offsets = torch.searchsorted(flat[perm], torch.arange(num_experts + 1, dtype=i64, device=dev))
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    NT = -(-R // block_m) + min(num_experts, R)
    p = torch.arange(NT, dtype=i64, device=dev)
    te = torch.searchsorted(tile_end, p, right=True)
    used = te < num_experts
    e = te.clamp(max=num_experts - 1)
    row0 = offsets[e] + (p - (tile_end[e] - tiles[e])) * block_m
    zero = torch.zeros_like(p)
    return Dispatch(perm // k, perm, pos.view(T, k), offsets, e, torch.where(used, row0, zero),
                    torch.where(used, offsets[e + 1], zero), block_m)


def experts_grouped(h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, up_w: Sequence[torch.Tensor],
                    down_w: Sequence[torch.Tensor], up_b: Sequence[torch.Tensor | None] | None = None,
                    down_b: Sequence[torch.Tensor | None] | None = None, *,
                    linear: Callable[..., torch.Tensor], relu2: Callable[[torch.Tensor], torch.Tensor],
                    expert: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
                    join: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The torch form: each expert's sorted tokens through the backend's ``linear`` and ``relu2``, then
    ``naive.combine``; up_b / down_b per-expert or None. ``expert(x [n, d], e)``, where given, replaces
    the two linears (``layers.moe``'s sliced experts); ``join``, where given, takes every expert's rows
    [T * k, d] in sorted order to the outputs in h's dtype before the combine (the sliced experts' one
    all-gather). Experts without rows are skipped."""
    T, k = experts.shape
    if T == 0:
        return h.new_zeros(h.shape)
    d = dispatch(experts, len(up_w))
    bounds = d.offsets.tolist()
    parts = []  # every row belongs to one expert: the parts in expert order are the sorted rows
    for e in range(len(up_w)):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue
        if expert is not None:
            parts.append(expert(h[d.token[lo:hi]], e))
            continue
        ub = up_b[e] if up_b is not None else None
        db = down_b[e] if down_b is not None else None
        parts.append(linear(relu2(linear(h[d.token[lo:hi]], up_w[e], ub)), down_w[e], db))
    ys = torch.cat(parts)
    if join is not None:
        ys = join(ys)
    return combine([ys[d.pos[:, j]] for j in range(k)], weights, h.dtype)


__all__ = ["Dispatch", "dispatch", "experts_grouped"]
