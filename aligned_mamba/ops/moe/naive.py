"""The router and the readable reference of the routed experts (``ops.moe``'s signature)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def route(scores: torch.Tensor, bias: torch.Tensor, *, top_k: int, n_group: int = 1, topk_group: int = 1,
          norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Nemotron-H's group-limited top-k: scores [T, E] fp32 (sigmoid), bias [E] fp32 -> (experts [T, k]
    int64 ascending, weights [T, k] fp32). Groups score their two best biased scores; stable sorts (ties
    to the lower index); weights the unbiased scores, normalised in one fixed order, scaled."""
    T, E = scores.shape
    per_group = E // n_group
    choice = scores + bias
    top2 = torch.sort(choice.view(T, n_group, per_group), dim=-1, descending=True, stable=True).values[..., :2]
    group_scores = top2[..., 0] + top2[..., 1]  # [T, n_group]: the best plus the second best
    groups = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    allowed = torch.zeros(T, n_group, dtype=torch.bool, device=scores.device)
    allowed.scatter_(1, groups, True)
    masked = choice.masked_fill(~allowed.repeat_interleave(per_group, dim=1), float("-inf"))
    experts = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :top_k]
    experts = torch.sort(experts, dim=-1).values  # the order the outputs are summed in
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        total = weights[:, 0]
        for j in range(1, weights.shape[1]):  # one fixed order (a torch sum's order is its own)
            total = total + weights[:, j]
        weights = weights / (total + 1e-20)[:, None]
    return experts, weights * routed_scaling_factor


def combine(ys: Sequence[torch.Tensor], weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_j weights[:, j] * ys[j] in fp32 from 0, j ascending, rounded once: ys k x [T, d] -> [T, d]."""
    acc = torch.zeros(ys[0].shape, dtype=torch.float32, device=weights.device)
    for j, y in enumerate(ys):
        acc = acc + y.to(torch.float32) * weights[:, j, None]
    return acc.to(dtype)


def experts_naive(h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, up_w: torch.Tensor,
                  down_w: torch.Tensor) -> torch.Tensor:
    """The routed experts token by token (``ops.moe``'s signature; fp64 throughout for fp64 h).
    Differentiable."""
    acc_dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    out = []
    for t in range(h.shape[0]):
        acc = torch.zeros(h.shape[1], dtype=acc_dtype, device=h.device)
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            u = up_w[e] @ h[t]
            r = torch.relu(u.to(acc_dtype))
            y = down_w[e] @ (r * r).to(h.dtype)
            acc = acc + y.to(acc_dtype) * weights[t, j].to(acc_dtype)
        out.append(acc.to(h.dtype))
    return torch.stack(out) if out else h.new_zeros(h.shape)


__all__ = ["combine", "experts_naive", "route"]
