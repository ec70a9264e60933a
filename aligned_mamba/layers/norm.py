"""The RMSNorm layer (a block's pre-norm and the final norm): stateless, row-invariant."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..ops.backend import Backend
from ..ops.step import Step
from .base import StateSpec, take


@dataclass(frozen=True)
class RMSNormConfig:
    """hidden_size: the normalised width; eps: added to the mean square."""

    hidden_size: int
    eps: float = 1e-5

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.hidden_size,)}


class RMSNorm:
    """weight * (x / sqrt(mean(x^2) + eps)) rounded once to the model dtype, x as it comes (an fp32
    residual unrounded, as mamba_ssm's fused add-norm takes it)."""

    kind = "rms_norm"

    def __init__(self, config: RMSNormConfig, weight: torch.Tensor, backend: Backend, dtype: torch.dtype) -> None:
        self.config = config
        self.weight = weight
        self.backend = backend
        self.dtype = dtype

    @classmethod
    def from_state_dict(cls, tensors: Mapping[str, torch.Tensor], prefix: str, config: RMSNormConfig,
                        backend: Backend, dtype: torch.dtype) -> RMSNorm:
        """The norm from ``tensors[prefix + "weight"]`` [hidden_size] (cast to ``dtype`` on the backend's device)."""
        return cls(config, take(tensors, prefix, "weight").to(device=backend.device, dtype=dtype), backend, dtype)

    def state_spec(self) -> StateSpec | None:
        return None

    def state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, hidden] any float dtype -> [M, hidden] in the model dtype."""
        return self.backend.rms_norm(x, self.weight, self.config.eps, self.dtype)

    def advance(self, state: Any, batch: Step, hidden: torch.Tensor, rows: torch.Tensor | None = None,
                capture: list | None = None) -> torch.Tensor:
        out = self(hidden)
        return out if rows is None else out[rows]
