"""Realistic random weights for small checkpoints, bitwise the same on every machine.

Only ``torch.rand`` from a seeded CPU generator, in a fixed weight order, then correctly rounded
float64 arithmetic (libm for per-head scalars) before rounding to the output dtype; normal draws are
sums of 12 uniforms, exact in float64 (``randn``'s vectorised log/cos depend on the ISA).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields

import torch


def init_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, *,
                conv_kernel: int = 4, embedding: str = "embeddings.weight") -> torch.Tensor:
    """The initial value of the weight ``name`` (its suffix decides): A_log, dt_bias, D in fp32, the
    rest in ``dtype``; A in [-16, -1], softplus(dt_bias) log-uniform in [1e-3, 1e-1], D = 1."""
    if name.endswith(".A_log"):  # A ~ U[1, 16], stored as log(A) so that A = -exp(A_log) lies in [-16, -1]
        return _per_head(lambda u: math.log(1.0 + 15.0 * u), shape, gen)
    if name.endswith(".dt_bias"):  # dt log-uniform in [1e-3, 1e-1]; dt_bias = softplus^-1(dt) = dt + log(-expm1(-dt))
        lo, hi = math.log(1e-3), math.log(1e-1)
        return _per_head(lambda u: _inv_softplus(math.exp(lo + (hi - lo) * u)), shape, gen)
    if name.endswith(".D"):
        return torch.ones(shape, dtype=torch.float32)
    if name.endswith(".e_score_correction_bias"):  # a MoE router's per-expert offset, fp32 as published
        return (0.1 * _normal(shape, gen)).to(torch.float32)
    if name.endswith("conv1d.weight"):
        bound = 1.0 / math.sqrt(conv_kernel)
        values = _uniform(shape, -bound, bound, gen)
    elif name.endswith("conv1d.bias"):
        values = _uniform(shape, -0.1, 0.1, gen)
    elif name.endswith(("norm.weight", "norm_f.weight", "layernorm.weight")):
        values = 1.0 + 0.05 * _normal(shape, gen)  # ones + noise, so a norm bug cannot hide behind all-ones
    elif name.endswith(embedding):
        values = _normal(shape, gen)
    elif name.endswith(".weight"):  # projections and lm_head: shape [out, in]
        values = _normal(shape, gen) / math.sqrt(shape[1])
    elif name.endswith(".bias"):
        values = 0.02 * _normal(shape, gen)
    else:
        raise AssertionError(f"no initialiser for {name}")
    # to fp32, then to dtype: a bf16 model is exactly the fp32 model cast
    return values.to(torch.float32).to(dtype)


def random_weights(shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype, seed: int, *,
                   conv_kernel: int) -> dict[str, torch.Tensor]:
    """``init_tensor`` of every name in ``shapes``, in its order, from one CPU generator seeded ``seed``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return {name: init_tensor(name, shape, dtype, gen, conv_kernel=conv_kernel) for name, shape in shapes.items()}


def check_overrides(maker: str, config_type: type, overrides: Mapping[str, object], fixed: Iterable[str]) -> None:
    """TypeError (one line) for ``overrides`` that are not fields of ``config_type`` or are ``fixed`` by ``maker``."""
    names = {f.name for f in fields(config_type)} - set(fixed)
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"{maker}() got unknown config fields: {', '.join(unknown)}")


def _uniform(shape: tuple[int, ...], lo: float, hi: float, gen: torch.Generator) -> torch.Tensor:
    """float64 U[lo, hi) from float32 torch.rand (exact k * 2**-24 values)."""
    return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float32).to(torch.float64)


def _normal(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """float64 approximately N(0, 1): sum of 12 U[0, 1) minus 6, in [-6, 6]; every partial sum is
    exact, so summing one draw at a time gives the bits of ``torch.rand((12, *shape))`` summed."""
    total = torch.zeros(shape, dtype=torch.float64)
    for _ in range(12):
        total += torch.rand(shape, generator=gen, dtype=torch.float32)
    return total - 6.0


def _per_head(fn: Callable[[float], float], shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """fp32 tensor of ``fn(u)`` for u ~ U[0, 1), evaluated per element in Python float64 (libm, no SIMD)."""
    u = torch.rand(shape, generator=gen, dtype=torch.float32).tolist()
    return torch.tensor([fn(x) for x in u], dtype=torch.float64).to(torch.float32)


def _inv_softplus(y: float) -> float:
    """x with softplus(x) = y, for y > 0."""
    return y + math.log(-math.expm1(-y))
