"""Nemotron-H's MLP activation, the torch form (``ops.elementwise_triton.relu2_triton`` on the GPU)."""

from __future__ import annotations

import torch


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 in x's dtype, squared in fp32 and rounded once (one IEEE multiply per element:
    position-invariant). Any shape; differentiable."""
    r = torch.relu(x.to(torch.float32))
    return (r * r).to(x.dtype)


__all__ = ["relu2"]
