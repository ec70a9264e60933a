"""The SSD (Mamba2 state-space duality) scan, in three forms.

- ``naive``: the fp64 sequential recurrence, the accuracy reference.
- ``chunk``: the chunked scan, the one shared kernel used by trainer and sampler alike.
- ``fused_recurrent``: the recurrent one-step update (SSU), the baseline engines decode with today.
- ``triton_chunk``: the chunked scan as Triton kernels (the GPU backend), same contract.
"""

from collections.abc import Callable

from .chunk import chunk_scan, scan_chunks
from .fused_recurrent import recurrent_step
from .naive import ssd_naive

__all__ = ["chunk_scan", "recurrent_step", "scan_chunks_for", "ssd_naive"]


def scan_chunks_for(backend: str) -> Callable:
    """The ``scan_chunks`` of a backend: "torch" (CPU default) or "triton" (GPU; imported lazily)."""
    if backend == "torch":
        return scan_chunks
    if backend == "triton":
        from .triton_chunk import scan_chunks_triton

        return scan_chunks_triton
    raise ValueError(f"unknown backend {backend!r}; expected 'torch' or 'triton'")
