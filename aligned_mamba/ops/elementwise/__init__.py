"""Elementwise primitives with position-invariant bits: exp, log, log1p, softplus, sigmoid, SiLU
(float32, any shape) and relu^2 (any float dtype), each a fixed function of its own element.

One signature per function, ``f(x) -> y`` of x's shape. Forms:

- ``naive.py``: float64 torch, the accuracy reference;
- ``ieee.py``: the torch form, IEEE basic operations only (differentiable);
- ``cpu.py``: ``native_cpu.c``'s loops, the torch form's bits in one pass;
- ``triton.py``: relu^2 as one Triton kernel; ``ops/triton_math.py`` has the transcendentals as
  Triton device functions for the other ops' kernels.

The ops' torch forms build on these, so each function here takes the CPU loop where it applies
(a CPU float32 tensor that records no gradient, the library loaded) and the torch form otherwise:
the one place where a primitive, rather than the backend, picks its C form.
"""

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
