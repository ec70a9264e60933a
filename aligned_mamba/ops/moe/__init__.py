"""Nemotron-H's mixture of experts. ``route(scores [T, E] fp32, bias [E] fp32) -> (experts [T, k] int64
ascending, weights [T, k] fp32)``; the routed experts ``(h [T, d], experts, weights, up_w [E, f, d],
down_w [E, d, f]) -> out [T, d]`` (model dtype): y_j = down_e(relu(up_e(h_t))^2), out_t = round(sum_j
w_tj y_j) in fp32, experts ascending. Forms: ``naive`` (router; fp64 reference), ``grouped`` (torch),
``triton``. Why: docs/design.md, "How the bits are kept" (the MoE paragraph)."""

from .grouped import Dispatch, dispatch, experts_grouped
from .naive import experts_naive, route

__all__ = ["Dispatch", "dispatch", "experts_grouped", "experts_naive", "route"]
