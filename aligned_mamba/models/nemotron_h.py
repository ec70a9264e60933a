"""Nemotron-H in the Hugging Face layout (transformers' ``NemotronHForCausalLM``): pre-norm blocks whose
mixer is a Mamba2 ("M"), attention ("*"), MLP ("-") or MoE ("E") layer, one pattern character per
layer; config, ``make_tiny_hybrid``, ``save_checkpoint``. Weight names as published (``backbone.``;
transformers renames it ``model.``).

As transformers, but dt is clamped to ``time_step_limit`` (default none) as vLLM, mamba_ssm and
Megatron clamp it (transformers' chunked path clamps at ``time_step_min``, its recurrent path not at
all). Refused with one line: sliding windows, multi-token prediction, attention biases, tied
embeddings, other activations, a stack without Mamba2 layers, MoE biases on a CUDA device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..contract import Contract
from ..errors import ModelLoadError
from ..layers import attention as attention_layer
from ..layers import mlp as mlp_layer
from ..layers import moe as moe_layer
from ..layers.attention import Attention, AttentionConfig
from ..layers.base import Layer
from ..layers.mamba2 import Mamba2MixerConfig
from ..layers.mlp import MLP, MLPConfig
from ..layers.moe import MoE, MoEConfig
from ..ops.backend import Backend
from ..parallel import TPGroup
from . import checkpoint as ckpt
from . import hf_config as hf
from .causal_lm import LMShape
from .family import Family
from .hf_config import SUPPORTED_DTYPES
from .registry import register
from .tiny import check_overrides, random_weights

ARCHITECTURE = "NemotronHForCausalLM"
MODEL_TYPE = "nemotron_h"
EMBEDDING = "backbone.embeddings.weight"
LM_HEAD = "lm_head.weight"
MAMBA, ATTENTION, MLP_LAYER, MOE = "M", "*", "-", "E"
# transformers 5's layers_block_type names (and legacy spellings)
_LAYER_NAMES = {"linear_attention": MAMBA, "mamba": MAMBA, "full_attention": ATTENTION, "attention": ATTENTION,
                "mlp": MLP_LAYER, "moe": MOE}
_DEFAULT_LAYERS = "ME*-"  # transformers' NemotronHConfig default layers_block_type
# legacy config keys transformers still reads (the legacy key wins when both are present, as there)
_ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_limit": "time_step_limit",
            "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size"}
_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings", "intermediate_size", "ssm_state_size", "mamba_num_heads",
                  "mamba_head_dim", "n_groups", "conv_kernel", "chunk_size", "n_routed_experts", "n_shared_experts",
                  "moe_intermediate_size", "moe_shared_expert_intermediate_size", "num_experts_per_tok", "n_group",
                  "topk_group")
_BOOLS = ("attention_bias", "mlp_bias", "use_conv_bias", "use_bias", "tie_word_embeddings", "norm_topk_prob")


@dataclass(frozen=True)
class NemotronHConfig:
    """A Nemotron-H causal LM; defaults are transformers' ``NemotronHConfig``'s. ``dtype``: the storage
    dtype; ``time_step_limit``: (lo, hi) clamp of dt after softplus. Construction raises ``ValueError``
    (``TypeError`` for a non-bool flag), one line, also for what is not covered."""

    hybrid_override_pattern: str
    vocab_size: int = 131072
    hidden_size: int = 4096
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    sliding_window: int | None = None
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    ssm_state_size: int = 128
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    mamba_hidden_act: str = "silu"
    n_groups: int = 8
    conv_kernel: int = 4
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    use_conv_bias: bool = True
    chunk_size: int = 128
    use_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    num_experts_per_tok: int = 2
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "time_step_limit", hf.parse_time_step_limit(self.time_step_limit))
        p = self.hybrid_override_pattern
        if not isinstance(p, str) or not p or set(p) - {MAMBA, ATTENTION, MLP_LAYER, MOE}:
            raise ValueError(f"hybrid_override_pattern must be a non-empty string of 'M', '*', '-', 'E'; found {p!r}")
        if MAMBA not in p:
            raise ValueError(f"a stack without Mamba2 layers (hybrid_override_pattern {p!r}) is not covered")
        if self.sliding_window is not None:
            raise ValueError(f"sliding-window attention (sliding_window={self.sliding_window!r}) is not covered")
        if self.num_nextn_predict_layers != 0:
            raise ValueError(f"multi-token prediction (num_nextn_predict_layers={self.num_nextn_predict_layers!r}) "
                             "is not covered")
        hf.check_fields(self, _POSITIVE_INTS, _BOOLS)
        if self.attention_bias:
            raise ValueError("attention_bias true is not covered (transformers' NemotronHAttention has no biases)")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings true is not covered (transformers' NemotronH never ties lm_head)")
        if self.mlp_hidden_act != "relu2":
            raise ValueError(f"mlp_hidden_act {self.mlp_hidden_act!r} is not covered (only 'relu2')")
        if self.mamba_hidden_act != "silu":
            raise ValueError(f"mamba_hidden_act {self.mamba_hidden_act!r} is not covered (only 'silu')")
        object.__setattr__(self, "layer_norm_epsilon", hf.positive_float("layer_norm_epsilon", self.layer_norm_epsilon))
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported (only {', '.join(SUPPORTED_DTYPES)})")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(f"mamba_num_heads ({self.mamba_num_heads}) must be divisible by n_groups "
                             f"({self.n_groups})")
        latent = self.moe_latent_size
        if latent is not None and (type(latent) is not int or latent <= 0):
            raise ValueError(f"moe_latent_size must be a positive int or null, found {latent!r}")
        object.__setattr__(self, "routed_scaling_factor",
                           hf.positive_float("routed_scaling_factor", self.routed_scaling_factor))
        if MOE in p:
            self.moe_config()  # its own checks (groups, top-k)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")

    @property
    def num_hidden_layers(self) -> int:
        return len(self.hybrid_override_pattern)

    @property
    def torch_dtype(self) -> torch.dtype:
        return SUPPORTED_DTYPES[self.dtype]

    def mixer_config(self) -> Mamba2MixerConfig:
        """The Mamba2 layers' mixer (the gated norm shares ``layer_norm_epsilon``)."""
        return Mamba2MixerConfig(hidden_size=self.hidden_size, num_heads=self.mamba_num_heads,
                                 head_dim=self.mamba_head_dim, state_size=self.ssm_state_size, n_groups=self.n_groups,
                                 conv_kernel=self.conv_kernel, use_bias=self.use_bias,
                                 use_conv_bias=self.use_conv_bias, norm_eps=self.layer_norm_epsilon,
                                 dt_limit=self.time_step_limit)

    def attention_config(self) -> AttentionConfig:
        return AttentionConfig(hidden_size=self.hidden_size, num_heads=self.num_attention_heads,
                               num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim)

    def mlp_config(self) -> MLPConfig:
        return MLPConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size, bias=self.mlp_bias)

    def moe_config(self) -> MoEConfig:
        """The MoE layers' config: one shared expert whatever ``n_shared_experts`` says, as transformers."""
        return MoEConfig(hidden_size=self.hidden_size, n_routed_experts=self.n_routed_experts,
                         num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
                         moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
                         moe_latent_size=self.moe_latent_size, n_group=self.n_group, topk_group=self.topk_group,
                         norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor,
                         bias=self.mlp_bias)

    def layer_shapes(self, kind: str) -> dict[str, tuple[int, ...]]:
        """The mixer weights of a layer of ``kind`` (a pattern character)."""
        if kind == MAMBA:
            return self.mixer_config().weight_shapes()
        if kind == ATTENTION:
            return self.attention_config().weight_shapes()
        if kind == MOE:
            return self.moe_config().weight_shapes()
        return self.mlp_config().weight_shapes()

    def lm_shape(self) -> LMShape:
        # the residual in the model dtype, as transformers and vLLM keep it (residual_in_fp32 unread)
        return LMShape(vocab_size=self.vocab_size, hidden_size=self.hidden_size, residual_in_fp32=False,
                       tie_word_embeddings=False)

    @classmethod
    def from_hf_dict(cls, d: Any, *, source: str = "config.json") -> NemotronHConfig:
        """A config from a ``config.json`` dict (absent keys default, unknown ignored, legacy ``mamba_*``
        read). Raises ``ModelLoadError`` (one line, prefixed with ``source``)."""
        hf.check_dict(d, source, MODEL_TYPE)
        d = dict(d)
        for old, new in _ALIASES.items():
            if old in d:
                d[new] = d[old]
        try:
            pattern = _read_pattern(d)
        except ValueError as exc:
            raise ModelLoadError(f"{source}: {exc}") from None
        kwargs = hf.config_kwargs(cls, d, source, skip=("hybrid_override_pattern",))
        return hf.construct(cls, source, hybrid_override_pattern=pattern, **kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers 4 and 5 read (``hybrid_override_pattern``)."""
        return hf.hf_dict(self, ARCHITECTURE, MODEL_TYPE, num_hidden_layers=self.num_hidden_layers,
                          time_step_limit=list(self.time_step_limit), mamba_ssm_cache_dtype="float32",
                          torch_dtype=self.dtype)


def _read_pattern(d: dict[str, Any]) -> str:
    """The config dict's layer types as a pattern; ValueError if malformed, disagreeing, or not
    ``num_hidden_layers`` long."""
    found: list[tuple[str, str]] = []
    if "hybrid_override_pattern" in d:
        p = d["hybrid_override_pattern"]
        if not isinstance(p, str):
            raise ValueError(f"hybrid_override_pattern must be a string, found {p!r}")
        found.append(("hybrid_override_pattern", p))
    for key in ("layers_block_type", "layer_types"):
        names = d.get(key)
        if names is None:
            continue
        if not isinstance(names, list) or any(n not in _LAYER_NAMES for n in names):
            raise ValueError(f"{key} must be a list of {', '.join(map(repr, _LAYER_NAMES))}; found {names!r}")
        found.append((key, "".join(_LAYER_NAMES[n] for n in names)))
    if any(p != found[0][1] for _, p in found):
        raise ValueError("the layer types disagree: " + ", ".join(f"{k} gives {p!r}" for k, p in found))
    pattern = found[0][1] if found else _DEFAULT_LAYERS
    n = d.get("num_hidden_layers")
    if n is not None and n != len(pattern):
        raise ValueError(f"num_hidden_layers is {n!r} but the layer types {pattern!r} list {len(pattern)} layers")
    return pattern


def save_checkpoint(path: str | os.PathLike[str], config: NemotronHConfig, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` under ``path``, a directory that
    ``NemotronHForCausalLM.from_pretrained`` loads; ``ValueError`` for what ``load_checkpoint`` refuses."""
    ckpt.validate(expected_shapes(config), tensors, {name: "tensors" for name in tensors}, ValueError)
    ckpt.save_files(path, config.to_hf_dict(), tensors)


_TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "intermediate_size": 256,
    "ssm_state_size": 32,
    "mamba_num_heads": 4,
    "mamba_head_dim": 32,
    "n_groups": 1,
    "conv_kernel": 4,
    "chunk_size": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 128,
    "n_group": 4,
    "topk_group": 2,
}


def make_tiny_hybrid(seed: int = 0, *, pattern: str = "M*M-", dtype: str = "bfloat16",
                     **overrides: Any) -> tuple[NemotronHConfig, dict[str, torch.Tensor]]:
    """(config, tensors) of a small Nemotron-H with layers ``pattern``, random weights from ``seed``,
    bitwise the same on every machine (A_log, D, dt_bias fp32, the rest ``dtype``). ``overrides``:
    ``NemotronHConfig`` fields; TypeError for an unknown one, ValueError for inconsistent ones."""
    check_overrides("make_tiny_hybrid", NemotronHConfig, overrides, ("dtype", "hybrid_override_pattern"))
    try:
        config = NemotronHConfig(hybrid_override_pattern=pattern, **{**_TINY_DEFAULTS, **overrides, "dtype": dtype})
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"make_tiny_hybrid(): {exc}") from None
    return config, random_weights(expected_shapes(config), config.torch_dtype, seed, conv_kernel=config.conv_kernel)


class NemotronHFamily(Family):
    """transformers' ``NemotronHForCausalLM`` layout: each block's mixer the layer of its pattern character."""

    name = MODEL_TYPE
    config_type = NemotronHConfig
    architectures = (ARCHITECTURE,)
    model_types = (MODEL_TYPE,)  # the base's weight names (backbone.embeddings, lm_head) are this layout's
    free_dtype = (".A_log", ".D", ".dt_bias", ".e_score_correction_bias")

    def layer_kinds(self, config: NemotronHConfig) -> str:
        return config.hybrid_override_pattern

    def block_shapes(self, config: NemotronHConfig, kind: str) -> dict[str, tuple[int, ...]]:
        mixer = {"mixer." + name: shape for name, shape in config.layer_shapes(kind).items()}
        return {"norm.weight": (config.hidden_size,), **mixer}

    def mixer(self, config: NemotronHConfig, kind: str, tensors: Mapping[str, torch.Tensor], prefix: str,
              backend: Backend, dtype: torch.dtype, contract: Contract, tp: TPGroup | None = None) -> Layer:
        if kind == MAMBA:
            return super().mixer(config, kind, tensors, prefix, backend, dtype, contract, tp=tp)
        split = tp is not None and tp.size > 1
        slices = contract.row_parallel_slices
        if kind == MOE:  # experts sharded by channels, the router whole on every rank
            c = config.moe_config()
            if split:
                tensors = moe_layer.shard_weights(c, tensors, prefix, tp)
            return MoE(c, tensors, prefix, backend=backend, dtype=dtype, tp=tp, slices=slices)
        if kind == ATTENTION:
            a = config.attention_config()
            if split:
                tensors = attention_layer.shard_weights(a, tensors, prefix, tp)
            return Attention(a, tensors, prefix, backend=backend, dtype=dtype, tp=tp, slices=slices)
        m = config.mlp_config()
        if split:
            tensors = mlp_layer.shard_weights(m, tensors, prefix, tp)
        return MLP(m, tensors, prefix, backend=backend, dtype=dtype, tp=tp, slices=slices)

    def max_len(self, config: NemotronHConfig) -> int:
        return config.max_position_embeddings


FAMILY = register(NemotronHFamily())
expected_shapes = FAMILY.expected_shapes
build = FAMILY.build
