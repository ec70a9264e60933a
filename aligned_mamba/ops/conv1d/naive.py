"""The causal conv in float64: the accuracy reference for the other forms."""

from __future__ import annotations

import torch


def causal_conv1d(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  activation: bool = True) -> torch.Tensor:
    """One sequence: x [T, Cd] after window [K-1, Cd], weight [Cd, K], bias [Cd] -> [T, Cd] float64,
    out[t] = bias + sum_k weight[:, k] * stream[t + k] over the stream window ++ x, then SiLU."""
    stream = torch.cat([window.double(), x.double()])
    K = weight.shape[1]
    out = sum(weight[:, k].double() * stream[k:k + x.shape[0]] for k in range(K))
    if bias is not None:
        out = out + bias.double()
    return torch.nn.functional.silu(out) if activation else out
