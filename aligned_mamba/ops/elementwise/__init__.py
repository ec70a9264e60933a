"""Position-invariant elementwise primitives (float32, any shape; relu^2 any float dtype): each takes its C loop
(``cpu.py``) where it applies, else the torch form (``ieee.py``). Why: docs/design.md, "How the bits are kept"."""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import cpu, ieee
from .ieee import operand, relu2


def _run(name: str, form: Callable[..., torch.Tensor], x: torch.Tensor, *arg: float) -> torch.Tensor:
    y = cpu.unary(name, x, *arg)
    return form(x, *arg) if y is None else y


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x), float32 (``ieee.exp``)."""
    return _run("exp", ieee.exp, x)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive float32 x (``ieee.log``)."""
    return _run("log", ieee.log, x)


def log1p(x: torch.Tensor) -> torch.Tensor:
    """log(1 + x) for float32 x > -1 (``ieee.log1p``)."""
    return _run("log1p", ieee.log1p, x)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """log(1 + exp(x)), x itself above ``threshold`` (``ieee.softplus``)."""
    return _run("softplus", ieee.softplus, x, threshold)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), float32 (``ieee.sigmoid``)."""
    return _run("sigmoid", ieee.sigmoid, x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)), float32 (``ieee.silu``)."""
    return _run("silu", ieee.silu, x)


__all__ = ["exp", "log", "log1p", "operand", "relu2", "sigmoid", "silu", "softplus"]
