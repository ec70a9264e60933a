"""The CPU form of the elementwise primitives and ``reduce.tree_sum``: ``native_cpu.c``'s loops, the same bits."""

from __future__ import annotations

import torch

from ..native import UNARY, library, ok, scratch


def unary(name: str, x: torch.Tensor, arg: float = 0.0) -> torch.Tensor | None:
    """``elementwise._<name>(x)`` for float32 x (softplus: ``arg`` the threshold), or None."""
    if x.dtype != torch.float32 or not ok(x) or (lib := library()) is None:
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    lib.am_unary(UNARY[name], x.data_ptr(), y.data_ptr(), x.numel(), arg)
    return y


def tree_sum(x: torch.Tensor) -> torch.Tensor | None:
    """``reduce.tree_sum`` for float32 x [..., n], or None."""
    if x.dtype != torch.float32 or not ok(x) or (lib := library()) is None:
        return None
    x = x.contiguous()
    n = x.shape[-1]
    y = x.new_empty(x.shape[:-1])
    work = scratch(n)  # held here: a temporary's memory would be freed before the call
    lib.am_tree_sum(x.data_ptr(), y.data_ptr(), y.numel(), n, work.data_ptr())
    return y
