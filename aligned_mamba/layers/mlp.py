"""Nemotron-H's MLP layer: down_proj(relu(up_proj(x))^2). Stateless and row-invariant.

As transformers' ``NemotronHMLP`` (``mlp_hidden_act="relu2"``): no gate projection, the squared
ReLU applied to the up projection rounded to the model dtype, its square rounded to it again (what
``torch.square`` of a model-dtype tensor gives). Weight names under the layer's prefix:
up_proj.weight [intermediate, hidden], down_proj.weight [hidden, intermediate], and with
``mlp_bias`` up_proj.bias / down_proj.bias.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..ops.backend import Backend
from ..ops.elementwise import relu2
from ..ops.step import Step
from .base import Stateless, take, take_optional

__all__ = ["MLP", "MLPConfig", "relu2"]


@dataclass(frozen=True)
class MLPConfig:
    """hidden_size; intermediate_size; bias: up_proj and down_proj have biases."""

    hidden_size: int
    intermediate_size: int
    bias: bool = False

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        h, i = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"up_proj.weight": (i, h)}
        if self.bias:
            shapes["up_proj.bias"] = (i,)
        shapes["down_proj.weight"] = (h, i)
        if self.bias:
            shapes["down_proj.bias"] = (h,)
        return shapes


class MLP(Stateless):
    """The MLP on a backend, in a model dtype (linear weights from ``backend.linear_weight``; biases fp32)."""

    kind = "mlp"

    def __init__(self, config: MLPConfig, tensors: Mapping[str, torch.Tensor], prefix: str, *, backend: Backend,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.backend = backend
        self.dtype = dtype
        dev = backend.device

        def bias(name: str) -> torch.Tensor | None:
            t = take_optional(tensors, prefix, name)
            return None if t is None else t.to(device=dev, dtype=torch.float32)

        self.up_w = backend.linear_weight(take(tensors, prefix, "up_proj.weight").to(device=dev, dtype=dtype))
        self.up_b = bias("up_proj.bias")
        self.down_w = backend.linear_weight(take(tensors, prefix, "down_proj.weight").to(device=dev, dtype=dtype))
        self.down_b = bias("down_proj.bias")

    def advance(self, state: Any, batch: Step, hidden: torch.Tensor, rows: torch.Tensor | None = None,
                capture: list | None = None) -> torch.Tensor:
        """hidden [T, hidden_size] (model dtype, normed) -> [rows wanted, hidden_size] (model dtype)."""
        x = hidden if rows is None else hidden[rows]
        be = self.backend
        return be.linear(be.relu2(be.linear(x, self.up_w, self.up_b)), self.down_w, self.down_b)
