"""The row-invariant linear layer: ``linear(x [M, K], weight [N, K], bias [N] | None) -> [M, N]``
in x's dtype, a row's bits fixed by that row alone. Forms: ``naive`` (fp64), ``gemm`` (torch: lanes
or tiles), ``cpu``, ``sliced`` (row-parallel tree), ``triton``. Why: docs/design.md, "How the bits
are kept"."""

from .gemm import FORMS, LANES, gemm_weight, lane_matmul, lanes, linear, partial
from .sliced import row_parallel_linear

__all__ = ["FORMS", "LANES", "gemm_weight", "lane_matmul", "lanes", "linear", "partial", "row_parallel_linear"]
