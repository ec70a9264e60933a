"""Nemotron-H's mixture-of-experts layer, as transformers' ``NemotronHMoE``; stateless, row-invariant.

A sigmoid router with a score correction bias picks, by group-limited top-k, the experts of a row;
their outputs down(relu(up(h))^2), h the row or its latent projection, are weighted and summed in
fp32 in ascending expert order, rounded once, plus a shared expert on the row (why the rows keep
their bits: docs/design.md, "How the bits are kept"). Weights: gate.weight [E, hidden],
gate.e_score_correction_bias [E], experts.{e}.up_proj / down_proj.weight, shared_experts.*, with a
latent size fc1_latent_proj / fc2_latent_proj.weight, with ``mlp_bias`` every bias.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ModelLoadError
from ..ops import elementwise as ew
from ..ops.autograd import grad_needed
from ..ops.backend import Backend
from ..ops.linear.sliced import join_subtrees, row_parallel_linear, row_parallel_subtree
from ..ops.moe import experts_grouped
from ..ops.moe import route as _route
from ..ops.step import Step
from ..parallel import TPGroup
from . import mlp as mlp_layer
from .base import Stateless, take, take_optional
from .mlp import MLP, MLPConfig


@dataclass(frozen=True)
class MoEConfig:
    """The MoE layer's shape and routing (transformers' NemotronHConfig fields of the same names)."""

    hidden_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    bias: bool = False

    def __post_init__(self) -> None:
        E, k, g = self.n_routed_experts, self.num_experts_per_tok, self.n_group
        if E % g:
            raise ValueError(f"n_routed_experts {E} is not divisible by n_group {g}")
        if E // g < 2:
            raise ValueError(f"each of the {g} expert groups needs >= 2 experts (a group is scored by its two best)")
        if not 1 <= self.topk_group <= g:
            raise ValueError(f"topk_group {self.topk_group} must be in 1 .. n_group {g}")
        if not 1 <= k <= self.topk_group * (E // g):
            raise ValueError(f"num_experts_per_tok {k} must be in 1 .. the {self.topk_group * (E // g)} experts "
                             f"of the {self.topk_group} chosen groups")

    @property
    def expert_input_size(self) -> int:
        return self.moe_latent_size or self.hidden_size

    def expert_config(self) -> MLPConfig:
        """A routed expert: the MLP on the (latent) row, up_proj / down_proj as ``layers.mlp`` names them."""
        return MLPConfig(self.expert_input_size, self.moe_intermediate_size, self.bias)

    def shared_config(self) -> MLPConfig:
        return MLPConfig(self.hidden_size, self.moe_shared_expert_intermediate_size, self.bias)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        h, E = self.hidden_size, self.n_routed_experts
        shapes: dict[str, tuple[int, ...]] = {"gate.weight": (E, h), "gate.e_score_correction_bias": (E,)}
        for e in range(E):
            shapes.update({f"experts.{e}.{k}": v for k, v in self.expert_config().weight_shapes().items()})
        shapes.update({f"shared_experts.{k}": v for k, v in self.shared_config().weight_shapes().items()})
        if self.moe_latent_size is not None:
            shapes["fc1_latent_proj.weight"] = (self.moe_latent_size, h)
            if self.bias:
                shapes["fc1_latent_proj.bias"] = (self.moe_latent_size,)
            shapes["fc2_latent_proj.weight"] = (h, self.moe_latent_size)
            if self.bias:
                shapes["fc2_latent_proj.bias"] = (h,)
        return shapes


def route(scores: torch.Tensor, bias: torch.Tensor, config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, E] fp32 (the router's sigmoid), bias [E] fp32 -> (experts [T, k] int64 ascending,
    weights [T, k] fp32); ties to the lower index (``ops.moe.route``)."""
    c = config
    return _route(scores, bias, top_k=c.num_experts_per_tok, n_group=c.n_group, topk_group=c.topk_group,
                  norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor)


def shard_weights(config: MoEConfig, tensors: Mapping[str, torch.Tensor], prefix: str,
                  group: TPGroup) -> dict[str, torch.Tensor]:
    """Rank ``group.rank``'s cut of a full checkpoint: each expert as ``mlp.shard_weights`` cuts it; the
    router and the latent projections whole (every rank routes every row)."""
    experts = (prefix + "experts.", prefix + "shared_experts.")
    out = {k: v for k, v in tensors.items() if k.startswith(prefix) and not k.startswith(experts)}
    for e in range(config.n_routed_experts):
        out.update(mlp_layer.shard_weights(config.expert_config(), tensors, f"{prefix}experts.{e}.", group))
    out.update(mlp_layer.shard_weights(config.shared_config(), tensors, prefix + "shared_experts.", group))
    return out


class MoE(Stateless):
    """The MoE layer on a backend, in a model dtype (router and biases fp32). With ``tp`` or ``slices``
    > 1: ``config`` the full layer's, ``tensors`` this rank's (``shard_weights``), each expert an
    ``MLP`` with a row-parallel down projection, run expert by expert (on the triton backend too, whose
    grouped kernels have no sliced tree; its per-expert token counts are read on the host, so such a layer
    is not captured in CUDA graphs), at TP > 1 their subtrees joined after one all-gather; no expert
    parallelism. ModelLoadError for expert biases on the triton backend (its grouped kernels have no bias
    term)."""

    kind = "moe"

    def __init__(self, config: MoEConfig, tensors: Mapping[str, torch.Tensor], prefix: str, *, backend: Backend,
                 dtype: torch.dtype, tp: TPGroup | None = None, slices: int = 1) -> None:
        if backend.stacked_experts and config.bias:
            raise ModelLoadError("MoE expert biases on a CUDA device are refused: the grouped expert kernels have no "
                                 "bias term (mlp_bias MoE checkpoints run on the torch backend)")
        self.sliced = slices > 1 or (tp is not None and tp.size > 1)
        self.tp = tp
        self.config = config
        self.backend = backend
        self.dtype = dtype
        dev = backend.device
        f32 = torch.float32

        def weight(name: str, dt: torch.dtype = dtype) -> torch.Tensor:
            return backend.linear_weight(take(tensors, prefix, name).to(device=dev, dtype=dt))

        def bias(name: str) -> torch.Tensor | None:
            t = take_optional(tensors, prefix, name)
            return None if t is None else t.to(device=dev, dtype=f32)

        self.gate_w = weight("gate.weight", f32)
        self.score_bias = take(tensors, prefix, "gate.e_score_correction_bias").to(device=dev, dtype=f32)
        E = config.n_routed_experts
        self.expert_mlps: list[MLP] = []
        if self.sliced:
            self.expert_mlps = [MLP(config.expert_config(), tensors, f"{prefix}experts.{e}.", backend=backend,
                                    dtype=dtype, tp=tp, slices=slices) for e in range(E)]
            self.up_w = self.down_w = [m.up_w for m in self.expert_mlps]  # for their count; the MLPs compute
            self.up_b = self.down_b = None
        elif backend.stacked_experts:
            up = [weight(f"experts.{e}.up_proj.weight") for e in range(E)]
            down = [weight(f"experts.{e}.down_proj.weight") for e in range(E)]
            if any(w.requires_grad for w in (*up, *down)):
                # a trainer's weights: the kernels read each where it lies, no stacked copy
                # (``ops.moe.triton.ExpertTable``)
                self.up_w, self.down_w = up, down
            else:  # [E, f, d] / [E, d, f] for the grouped GEMM, stacked once
                self.up_w, self.down_w = torch.stack(up), torch.stack(down)
            self.up_b = self.down_b = None
        else:
            experts = [MLP(config.expert_config(), tensors, f"{prefix}experts.{e}.", backend=backend, dtype=dtype)
                       for e in range(E)]
            self.up_w, self.down_w = [m.up_w for m in experts], [m.down_w for m in experts]
            self.up_b = [m.up_b for m in experts] if config.bias else None
            self.down_b = [m.down_b for m in experts] if config.bias else None
        self.shared = MLP(config.shared_config(), tensors, prefix + "shared_experts.", backend=backend, dtype=dtype,
                          tp=tp, slices=slices)
        latent = config.moe_latent_size is not None
        self.fc1 = (weight("fc1_latent_proj.weight"), bias("fc1_latent_proj.bias")) if latent else None
        self.fc2 = (weight("fc2_latent_proj.weight"), bias("fc2_latent_proj.bias")) if latent else None

    @property
    def uncapturable(self) -> str | None:
        """Why this layer's step cannot be captured in a CUDA graph (None where it can)."""
        if self.sliced:
            return ("its MoE layers run expert by expert under row_parallel_slices > 1 or tensor parallelism (each "
                    "expert's token count read on the host)")
        return None

    def route_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden_size] (model dtype, normed) -> ``route``'s (experts, weights [T, k])."""
        fused = self._route_kernels(x, with_dispatch=False)
        if fused is not None:
            return fused[0], fused[1]
        if self.backend.stacked_experts:  # the kernels' router GEMM, with gradients (not backend.linear)
            from ..ops.moe import triton as moe_triton

            logits = moe_triton.router_logits(x, self.gate_w, self.backend.configs)
        else:
            logits = self.backend.linear(x.to(torch.float32), self.gate_w)
        return route(ew.sigmoid(logits), self.score_bias, self.config)

    def _route_kernels(self, x: torch.Tensor, *, with_dispatch: bool) -> tuple | None:
        """``route_rows`` (and for a few rows the dispatch) in two triton launches, the same bits; None
        where the torch ops run (gradients, slices, another backend)."""
        be, c = self.backend, self.config
        if (not be.stacked_experts or self.sliced or grad_needed(x, self.gate_w, self.score_bias)
                or c.n_routed_experts > 1024):
            return None
        from ..ops.moe import triton as moe_triton

        logits = moe_triton.router_logits(x, self.gate_w, be.configs)
        return moe_triton.route_triton(logits, self.score_bias, top_k=c.num_experts_per_tok, n_group=c.n_group,
                                       topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                                       routed_scaling_factor=c.routed_scaling_factor, cfg=be.configs,
                                       with_dispatch=with_dispatch, dtype=self.dtype)

    def advance(self, state: Any, batch: Step, hidden: torch.Tensor, rows: torch.Tensor | None = None,
                capture: list | None = None) -> torch.Tensor:
        """hidden [T, hidden_size] (model dtype, normed) -> [rows wanted, hidden_size] (model dtype)."""
        x = hidden if rows is None else hidden[rows]
        fused = self._route_kernels(x, with_dispatch=True)
        if fused is None:
            return self.experts_out(batch, x, *self.route_rows(x))
        return self.experts_out(batch, x, fused[0], fused[1], dispatch=fused[2])

    def experts_out(self, batch: Step | None, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, *,
                    dispatch: Any = None) -> torch.Tensor:
        """x [T, hidden_size] (model dtype, normed), routed (experts, weights [T, k]) -> [T, hidden_size];
        ``dispatch``: ``route_triton``'s sorted tables, where it made them."""
        be = self.backend
        h = x if self.fc1 is None else be.linear(x, *self.fc1)
        # out[t] = sum over t's experts in ascending order of weight * expert(h[t]), in fp32, rounded once
        if self.sliced:
            one = self._one_gather()
            routed = experts_grouped(h, experts, weights, self.up_w, self.down_w, linear=be.linear, relu2=be.relu2,
                                     expert=self._expert_subtree if one else self._expert,
                                     join=functools.partial(join_subtrees, self.tp, b=None, dtype=h.dtype) if one
                                     else None)
        elif dispatch is not None and self.fc2 is None:  # the shared expert added in the combine's pass
            shared = self.shared.advance(None, batch, x)
            return be.moe_experts(h, experts, weights, self.up_w, self.down_w, dispatch=dispatch, add=shared)
        elif dispatch is not None:
            routed = be.moe_experts(h, experts, weights, self.up_w, self.down_w, dispatch=dispatch)
        else:
            routed = be.moe_experts(h, experts, weights, self.up_w, self.down_w, self.up_b, self.down_b)
        if self.fc2 is not None:
            routed = be.linear(routed, *self.fc2)
        return routed + self.shared.advance(None, batch, x)

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return self.expert_mlps[e].advance(None, None, x)

    def _one_gather(self) -> bool:
        """Whether the experts' down projections can share one all-gather (``_expert_subtree``, joined after
        it: the tree's top is row-wise, so each row keeps its expert's bits): TP > 1, every expert on the
        contract's row-parallel tree (``with_row_parallel`` puts another sum in its place), no biases."""
        return (self.tp is not None and self.tp.size > 1
                and all(m.row_parallel is row_parallel_linear and m.down_b is None for m in self.expert_mlps))

    def _expert_subtree(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's rows x [n, d] -> this rank's subtree of its down projection, [n, d] fp32."""
        m, be = self.expert_mlps[e], self.backend
        return row_parallel_subtree(be.relu2(be.linear(x, m.up_w, m.up_b)), m.down_slices, slices=m.slices,
                                    size=self.tp.size, partial=be.linear_partial, tree=be.linear_tree)

    def with_row_parallel(self, fn: Callable[..., torch.Tensor]) -> MoE:
        """A copy whose experts' and shared expert's down projections sum as ``fn`` does (the same
        weights; ``baseline.stock_tp_model`` passes stock tensor parallelism's sum)."""
        out = copy.copy(self)

        def swapped(m: MLP) -> MLP:
            m = copy.copy(m)
            m.row_parallel = fn
            return m

        out.expert_mlps = [swapped(m) for m in self.expert_mlps]
        out.shared = swapped(self.shared)
        return out
