"""The linear layer in float64: the accuracy reference for the other forms."""

from __future__ import annotations

import torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] float64."""
    y = x.double() @ weight.double().t()
    return y if bias is None else y + bias.double()
