"""The SSD (Mamba2 state-space duality) scan, in three forms.

- ``naive``: the fp64 sequential recurrence, the accuracy reference.
- ``chunk``: the chunked scan, the one shared kernel used by trainer and sampler alike.
- ``fused_recurrent``: the recurrent one-step update (SSU), the baseline engines decode with today.
"""

from .chunk import chunk_scan
from .fused_recurrent import recurrent_step
from .naive import ssd_naive

__all__ = ["chunk_scan", "recurrent_step", "ssd_naive"]
