"""The norms in float64: the accuracy reference for the other forms. x, y, z [M, d]; weight [d]."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), float64 [M, d]."""
    xd = x.double()
    return weight.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, n_groups: int) -> torch.Tensor:
    """weight * norm_g(y * silu(z)), each of ``n_groups`` column groups normalised on its own; float64 [M, d]."""
    M, d = y.shape
    g = (y.double() * torch.nn.functional.silu(z.double())).view(M, n_groups, d // n_groups)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight.double() * g.view(M, d)
