"""The causal depthwise conv1d (+ SiLU) of a Mamba2 mixer, its forms side by side.

One signature: ``conv_advance(windows, step, x, weight, bias) -> out``: the step's new rows x [T, Cd]
convolved with the K - 1 inputs before each (each slot's window, windows [slots, K-1, Cd], updated in
place), weight [Cd, K], bias [Cd] or None; out [T, Cd] in x's dtype. Prefill and decode give a row
the same bits.

- ``naive.py``: float64, the accuracy reference;
- ``taps.py``: the torch form (the K products added in order, in float32);
- ``cpu.py``: ``native_cpu.c``'s loops, the torch form's bits in one pass;
- ``triton.py``: the Triton kernels, their launchers and autograd Function.
"""

from .taps import causal_conv1d, causal_conv1d_backward, causal_conv1d_step, conv_advance

__all__ = ["causal_conv1d", "causal_conv1d_backward", "causal_conv1d_step", "conv_advance"]
