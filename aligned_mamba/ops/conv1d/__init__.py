"""The causal depthwise conv1d (+ SiLU) of a Mamba2 mixer: naive (fp64), taps (torch), cpu, triton.

``conv_advance(windows, step, x, weight, bias) -> out``: the step's new rows x [T, Cd] convolved
with the K - 1 inputs before each (windows [slots, K-1, Cd], updated in place), weight [Cd, K],
bias [Cd] or None; out [T, Cd] in x's dtype, a row's bits the same in prefill and decode.
"""

from .taps import causal_conv1d, causal_conv1d_backward, causal_conv1d_step, conv_advance

__all__ = ["causal_conv1d", "causal_conv1d_backward", "causal_conv1d_step", "conv_advance"]
