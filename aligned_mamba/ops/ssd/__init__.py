"""The SSD (Mamba2 state-space duality) scan in its forms (the files: docs/design.md, "Layout"). Scan forms:
``(x, dt, B, C, params, cu_seqlens, initial_states=None, **options) -> (y, final_states)``; replay forms, an advance
of ``step``'s slots from their ``state.SSDState``: ``(state, step, x, dt, B, C, params, *, rows=None, cfg) -> y``
(``decode.replay``, ``cpu_decode.replay`` and ``triton_backward.ssd_advance`` choose a backend's form per step).
The Triton modules import triton: import them where the triton backend is resolved."""

from .chunk import replay_chunk, ssd_chunk
from .fused_recurrent import recurrent_step, ssd_fused_recurrent
from .naive import ssd_naive
from .state import SSDState, SSMParams, Step

__all__ = ["SSDState", "SSMParams", "Step", "recurrent_step", "replay_chunk", "ssd_chunk", "ssd_fused_recurrent",
           "ssd_naive"]
