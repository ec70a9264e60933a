"""The SSD (Mamba2 state-space duality) scan, in its forms, side by side.

Scan forms, one signature ``(x, dt, B, C, params, cu_seqlens, initial_states=None, **options) ->
(y, final_states)`` over packed sequences:

- ``naive.ssd_naive``: the fp64 sequential recurrence, the accuracy reference;
- ``chunk.ssd_chunk``: the chunked scan on torch ops (the CPU backend);
- ``chunk_dense.ssd_chunk_dense``: the same function in dense per-chunk blocks, not row-invariant:
  the function whose gradient ``triton_backward.chunk_scan_backward`` (Triton kernels) computes;
- ``fused_recurrent.ssd_fused_recurrent``: the recurrent one-step update (SSU), token by token,
  the baseline engines decode with today;
- ``triton_chunk.ssd_chunk_triton``: the chunked scan as Triton kernels (the GPU backend).

Replay forms, one signature ``(state, step, x, dt, B, C, params, *, rows=None, cfg) -> y``: an
advance of the slots of ``step`` from their boundary states and buffers (``state.SSDState``),
what trainer and sampler both run:

- ``chunk.replay_chunk`` (torch, any step),
- ``decode.replay_decode`` (torch, one new token per sequence; ``decode.replay`` picks between
  the two, the torch backend's ``ssd_advance``),
- ``cpu_decode.replay_decode`` (the same rows in ``native_cpu.c``'s loops; ``cpu_decode.replay``),
- ``triton_chunk.replay_chunk_triton`` (Triton, any step),
- ``triton_decode.replay_decode_triton`` (Triton, one new token per sequence);
  ``triton_backward.ssd_advance`` picks between the two and records the gradient.

The Triton modules import triton; import them where the triton backend is resolved.
"""

from .chunk import replay_chunk, ssd_chunk
from .fused_recurrent import recurrent_step, ssd_fused_recurrent
from .naive import ssd_naive
from .state import SSDState, SSMParams, Step

__all__ = ["SSDState", "SSMParams", "Step", "recurrent_step", "replay_chunk", "ssd_chunk", "ssd_fused_recurrent",
           "ssd_naive"]
