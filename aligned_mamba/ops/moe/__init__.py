"""Nemotron-H's mixture of experts: the router and the routed experts, their forms side by side.

The router, ``route(scores, bias, ...) -> (experts, weights)``: scores [T, E] fp32 (the sigmoid of
the fp32 router GEMM), the per-expert correction bias [E] fp32; experts [T, k] int64 in ascending
order, weights [T, k] fp32. One form: a handful of exact per-row torch ops (sorts, adds, a gather,
a division), row-invariant on every device.

The routed experts, one signature ``(h, experts, weights, up_w, down_w) -> out``: h [T, d] in the
model dtype (bf16 or fp32), experts / weights from ``route``, up_w [E, f, d] and down_w [E, d, f] in
the model dtype (anything indexable by expert: the torch form takes lists); out [T, d] in the model
dtype. Per token t: y_j = down_e(relu(up_e(h_t))^2) for its j-th expert e (each GEMM rounded to the
model dtype, the squared ReLU squared in fp32 and rounded), out_t = round(sum_j w_tj y_j) summed in
fp32 in ascending expert order from 0.

- ``naive.experts_naive``: a loop over tokens (fp64 inputs: the accuracy reference; differentiable).
- ``grouped.experts_grouped``: the torch form (the backends' linear and relu2 over each expert's
  tokens, sorted by ``grouped.dispatch``).
- ``triton.experts_triton``: the triton backend's grouped GEMM kernels (GPU) and their backward;
  ``triton.route_triton``: the router's sigmoid, top-k and weights (and a few rows' dispatch) in one
  kernel, ``route``'s bits.
"""

from .grouped import Dispatch, dispatch, experts_grouped
from .naive import experts_naive, route

__all__ = ["Dispatch", "dispatch", "experts_grouped", "experts_naive", "route"]
