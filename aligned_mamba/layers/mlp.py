"""Nemotron-H's MLP layer, as transformers' ``NemotronHMLP``: down_proj(relu(up_proj(x))^2), stateless.

up_proj's output and its square are each rounded to the model dtype (as ``torch.square`` of a
model-dtype tensor). Weights: up_proj.weight [intermediate, hidden], down_proj.weight [hidden,
intermediate], with ``mlp_bias`` their biases."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ModelLoadError
from ..ops.backend import Backend
from ..ops.elementwise import relu2
from ..ops.linear.sliced import row_parallel_linear, row_parallel_weight
from ..ops.step import Step
from ..parallel import TPGroup
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


def shard_weights(config: MLPConfig, tensors: Mapping[str, torch.Tensor], prefix: str,
                  group: TPGroup) -> dict[str, torch.Tensor]:
    """Rank ``group.rank``'s cut of a full checkpoint: up_proj's rows of its channels, down_proj's columns."""
    i, k, r = config.intermediate_size, group.size, group.rank
    if i % k:
        raise ModelLoadError(f"MLP intermediate_size {i} cannot be split across {k} tensor-parallel ranks")
    ch = slice(r * i // k, (r + 1) * i // k)
    out = {prefix + "up_proj.weight": take(tensors, prefix, "up_proj.weight")[ch],
           prefix + "down_proj.weight": take(tensors, prefix, "down_proj.weight")[:, ch]}
    if config.bias:
        out[prefix + "up_proj.bias"] = take(tensors, prefix, "up_proj.bias")[ch]
        out[prefix + "down_proj.bias"] = take(tensors, prefix, "down_proj.bias")
    return out


class MLP(Stateless):
    """The MLP on a backend, in a model dtype (biases fp32). With ``tp``: ``config`` the full layer's,
    ``tensors`` this rank's (``shard_weights``), down_proj the row-parallel GEMM over ``slices``."""

    kind = "mlp"
    #: the row-parallel GEMM (``baseline.stock_tp_model`` puts stock tensor parallelism's in its place)
    row_parallel = staticmethod(row_parallel_linear)

    def __init__(self, config: MLPConfig, tensors: Mapping[str, torch.Tensor], prefix: str, *, backend: Backend,
                 dtype: torch.dtype, tp: TPGroup | None = None, slices: int = 1) -> None:
        self.tp = tp
        self.slices = slices
        self.sliced = slices > 1 or (tp is not None and tp.size > 1)
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
        if self.sliced:
            if backend.linear_partial is None:
                raise ModelLoadError(f"row_parallel_slices {slices} refused on the {backend.name} backend: its "
                                     "sliced tree GEMM is not implemented yet")
            self.down_slices = row_parallel_weight(
                backend, self.down_w, lambda: take(tensors, prefix, "down_proj.weight").to(device=dev, dtype=dtype),
                slices, 1 if tp is None else tp.size)

    def advance(self, state: Any, batch: Step, hidden: torch.Tensor, rows: torch.Tensor | None = None,
                capture: list | None = None) -> torch.Tensor:
        """hidden [T, hidden_size] (model dtype, normed) -> [rows wanted, hidden_size] (model dtype)."""
        x = hidden if rows is None else hidden[rows]
        be = self.backend
        if be.mlp_relu2 is not None and not self.sliced:  # the same bits, relu2 in the GEMMs' epilogues
            return be.mlp_relu2(x, self.up_w, self.up_b, self.down_w, self.down_b)
        h = be.relu2(be.linear(x, self.up_w, self.up_b))
        if self.sliced:
            return self.row_parallel(h, self.down_slices, self.down_b, slices=self.slices,
                                     group=self.tp or TPGroup.single(), partial=be.linear_partial,
                                     tree=be.linear_tree)
        return be.linear(h, self.down_w, self.down_b)
