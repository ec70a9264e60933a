"""The row-invariant linear layer, its forms side by side.

One signature: ``linear(x, weight, bias) -> y``, x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in
x's dtype; a row's bits depend on that row alone. A backend takes its weights once through its
``linear_weight`` (padded, in the dtype its GEMM reads).

- ``naive.py``: float64, the accuracy reference;
- ``gemm.py``: the torch form, the contract's ``gemm_form``: "lanes" (eight sequential partial sums
  and a fixed tree per output) or "tiles" (fixed-shape row tiles); ``lanes`` is also the scan's GEMM;
- ``cpu.py``: ``native_cpu.c``'s lane GEMMs, the lanes' bits in one call;
- ``sliced.py``: the row-parallel form (K in the contract's fixed slices, a fixed pairwise tree over
  their fp32 partials; the same bits at every tensor-parallel degree dividing the slice count);
- ``triton.py``: the tensor-core kernel, its launcher and autograd Function (the GPU's own bits).
"""

from .gemm import FORMS, LANES, gemm_weight, lane_matmul, lanes, linear, partial
from .sliced import row_parallel_linear

__all__ = ["FORMS", "LANES", "gemm_weight", "lane_matmul", "lanes", "linear", "partial", "row_parallel_linear"]
