"""Mamba2 in the Hugging Face layout (transformers' ``Mamba2ForCausalLM``): config, the embedded
default (``make_tiny``), ``save_checkpoint``. Weights: ``backbone.embeddings.weight``,
``backbone.layers.{i}.norm.weight`` / ``.mixer.*``, ``backbone.norm_f.weight``, ``lm_head.weight``."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..layers.mamba2 import Mamba2MixerConfig
from . import checkpoint as ckpt
from . import hf_config as hf
from .causal_lm import LMShape
from .family import Family
from .hf_config import SUPPORTED_DTYPES, stated_dtype
from .registry import register
from .tiny import check_overrides, random_weights

ARCHITECTURE = "Mamba2ForCausalLM"
MODEL_TYPE = "mamba2"
EMBEDDING = "backbone.embeddings.weight"
LM_HEAD = "lm_head.weight"

_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "state_size", "n_groups",
                  "conv_kernel", "expand", "chunk_size")
_BOOLS = ("use_bias", "use_conv_bias", "residual_in_fp32", "tie_word_embeddings")
# the keys that decide tensor shapes, named with their defaults when absent and the tensors disagree
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "state_size", "n_groups",
              "conv_kernel", "expand", "use_bias", "use_conv_bias", "tie_word_embeddings")


@dataclass(frozen=True)
class Mamba2Config:
    """A Mamba2 causal LM; defaults are transformers' ``Mamba2Config``'s. ``dtype``: the storage dtype
    ("bfloat16" or "float32"); ``time_step_limit``: (lo, hi) clamp of dt after softplus, (0, inf) none.
    Construction raises ``ValueError`` (``TypeError`` for a non-bool flag), one line."""

    vocab_size: int = 32768
    hidden_size: int = 4096
    num_hidden_layers: int = 64
    num_heads: int = 128
    head_dim: int = 64
    state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    expand: int = 2
    chunk_size: int = 256
    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    residual_in_fp32: bool = True
    tie_word_embeddings: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    hidden_act: str = "silu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "time_step_limit", hf.parse_time_step_limit(self.time_step_limit))
        hf.check_fields(self, _POSITIVE_INTS, _BOOLS)
        object.__setattr__(self, "layer_norm_epsilon", hf.positive_float("layer_norm_epsilon", self.layer_norm_epsilon))
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported (only {', '.join(SUPPORTED_DTYPES)})")
        if self.num_heads * self.head_dim != self.intermediate_size:
            raise ValueError(
                f"num_heads * head_dim ({self.num_heads} * {self.head_dim} = {self.num_heads * self.head_dim}) "
                f"must equal intermediate_size = expand * hidden_size "
                f"({self.expand} * {self.hidden_size} = {self.intermediate_size})"
            )
        if self.num_heads % self.n_groups != 0:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by n_groups ({self.n_groups})")

    @property
    def intermediate_size(self) -> int:
        """Width of the SSM branch (``int(expand * hidden_size)``, as transformers computes it)."""
        return int(self.expand * self.hidden_size)

    @property
    def conv_dim(self) -> int:
        return self.mixer_config().conv_dim

    @property
    def in_proj_size(self) -> int:
        return self.mixer_config().in_proj_size

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a torch dtype (torch.bfloat16 or torch.float32)."""
        return SUPPORTED_DTYPES[self.dtype]

    def mixer_config(self) -> Mamba2MixerConfig:
        """Every layer's mixer (the gated norm shares ``layer_norm_epsilon`` with the block norms)."""
        return Mamba2MixerConfig(hidden_size=self.hidden_size, num_heads=self.num_heads, head_dim=self.head_dim,
                                 state_size=self.state_size, n_groups=self.n_groups, conv_kernel=self.conv_kernel,
                                 use_bias=self.use_bias, use_conv_bias=self.use_conv_bias,
                                 norm_eps=self.layer_norm_epsilon, dt_limit=self.time_step_limit)

    def lm_shape(self) -> LMShape:
        return LMShape(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                       residual_in_fp32=self.residual_in_fp32, tie_word_embeddings=self.tie_word_embeddings)

    @classmethod
    def from_hf_dict(cls, d: Any, *, source: str = "config.json") -> Mamba2Config:
        """A config from a ``config.json`` dict: absent keys take the defaults, unknown ones are ignored.
        Raises ``ModelLoadError`` (one line, prefixed with ``source``)."""
        hf.check_dict(d, source, MODEL_TYPE)
        return hf.construct(cls, source, **hf.config_kwargs(cls, d, source))

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict transformers accepts (``models.checkpoint.config_json_text`` writes it)."""
        return hf.hf_dict(self, ARCHITECTURE, MODEL_TYPE, time_step_limit=list(self.time_step_limit),
                          torch_dtype=self.dtype)


def save_checkpoint(path: str | os.PathLike[str], config: Mamba2Config, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` under ``path``, a directory transformers loads.

    ``tensors`` as ``make_tiny`` or ``load_checkpoint`` gives them (a tied lm_head equal to the
    embedding is dropped). Raises ``ValueError`` for what ``load_checkpoint`` would refuse, and when
    their storage dtype is not ``config.dtype``."""
    tensors = ckpt.untie(dict(tensors), LM_HEAD, EMBEDDING, config.tie_word_embeddings, {}, ValueError)
    origin = {name: "tensors" for name in tensors}
    ckpt.validate(expected_shapes(config), tensors, origin, ValueError)
    stored = ckpt.storage_dtype(tensors, origin, FAMILY.free_dtype, ValueError)
    if stored != config.dtype:
        raise ValueError(f"config dtype {config.dtype!r} but the tensors are {stored}: config.json would state a "
                         "dtype the weights do not have")
    ckpt.save_files(path, config.to_hf_dict(), tensors)


_TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 256,
    "num_hidden_layers": 3,
    "num_heads": 8,
    "head_dim": 64,
    "state_size": 128,
    "n_groups": 1,
    "conv_kernel": 4,
    "expand": 2,
    "chunk_size": 256,
    "layer_norm_epsilon": 1e-5,
    "residual_in_fp32": True,
    "tie_word_embeddings": False,
    "use_bias": False,
    "use_conv_bias": True,
}


def make_tiny(seed: int = 0, *, dtype: str = "bfloat16",
              **overrides: Any) -> tuple[Mamba2Config, dict[str, torch.Tensor]]:
    """(config, tensors) of a small Mamba2 with random weights from ``seed``, bitwise the same on every
    machine (A_log, D, dt_bias fp32, the rest ``dtype``). ``overrides``: ``Mamba2Config`` fields (e.g.
    ``n_groups=2, num_heads=16, head_dim=32``); TypeError for an unknown one, ValueError naming the
    rule for inconsistent ones."""
    check_overrides("make_tiny", Mamba2Config, overrides, ("dtype",))
    try:
        config = Mamba2Config(**{**_TINY_DEFAULTS, **overrides, "dtype": dtype})
    except (TypeError, ValueError) as exc:
        hint = "; override num_heads, head_dim, hidden_size and expand together" if "head_dim" in str(exc) else ""
        raise type(exc)(f"make_tiny(): {exc}{hint}") from None
    return config, random_weights(expected_shapes(config), config.torch_dtype, seed, conv_kernel=config.conv_kernel)


class Mamba2Family(Family):
    """transformers' ``Mamba2ForCausalLM`` layout: the base's stack of Mamba2 blocks, HF names."""

    name = MODEL_TYPE
    config_type = Mamba2Config
    architectures = (ARCHITECTURE,)
    model_types = (MODEL_TYPE,)  # the base's weight names (backbone.embeddings, lm_head) are this layout's
    shape_keys = SHAPE_KEYS
    defaults_of = "transformers' Mamba2Config"

    def stated_dtype(self, d: dict) -> tuple[str, str] | None:
        return stated_dtype(d)


FAMILY = register(Mamba2Family())
expected_shapes = FAMILY.expected_shapes
build = FAMILY.build
