"""The elementwise primitives in float64 torch: the accuracy reference for ``ieee.py``. Any shape."""

from __future__ import annotations

import torch


def exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.double())


def log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x.double())


def log1p(x: torch.Tensor) -> torch.Tensor:
    return torch.log1p(x.double())


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    xd = x.double()
    return torch.where(xd > threshold, xd, torch.log1p(torch.exp(xd)))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x.double())


def silu(x: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    return xd * torch.sigmoid(xd)


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x.double()) ** 2
