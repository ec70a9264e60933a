"""Mamba2 in the Hugging Face layout (transformers' ``Mamba2ForCausalLM``): config, weight names,
the embedded default checkpoint, and the build onto the generic causal LM.

transformers is not a dependency: ``Mamba2Config.from_hf_dict`` reads a ``config.json`` dict and
``to_hf_dict`` writes one that transformers accepts. Weight names:
``backbone.embeddings.weight``, ``backbone.layers.{i}.norm.weight``, ``backbone.layers.{i}.mixer.*``
(``layers.mamba2``), ``backbone.norm_f.weight``, ``lm_head.weight`` (absent when tied).
"""

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
# The config.json keys that decide which tensors a checkpoint holds and their shapes. transformers
# fills an absent one with its default (Mamba2Config's), and so does from_hf_dict; the loader names
# the absent ones when the tensors then disagree (see registry.load_checkpoint).
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "state_size", "n_groups",
              "conv_kernel", "expand", "use_bias", "use_conv_bias", "tie_word_embeddings")


@dataclass(frozen=True)
class Mamba2Config:
    """Shape and numerics of a Mamba2 causal LM. Field defaults are Hugging Face's ``Mamba2Config`` defaults.

    ``dtype`` is the checkpoint's storage dtype ("bfloat16" or "float32"); the model casts from it
    to the contract's model dtype. ``load_checkpoint`` sets it to the stored tensors' dtype (a
    config.json ``torch_dtype`` that differs is refused).
    ``time_step_limit`` is (lo, hi) for clamping dt after softplus; (0.0, inf) means no clamp.
    Construction validates every field and raises ``ValueError`` (``TypeError`` for a non-bool flag), one line.
    """

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
        # Normalise (lists from JSON, "Infinity"/None upper limit) before validating; frozen needs object.__setattr__.
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
        """Build a config from a Hugging Face ``config.json`` dict; absent keys take HF defaults.

        Unknown keys are ignored (HF configs carry many that do not change the math). The dtype comes
        from ``torch_dtype`` or ``dtype`` (default float32, transformers' own; ``load_checkpoint``
        replaces it with the stored one). Raises ``ModelLoadError`` (one line, prefixed with
        ``source``) for anything invalid.
        """
        hf.check_dict(d, source, MODEL_TYPE)
        return hf.construct(cls, source, **hf.config_kwargs(cls, d, source))

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict transformers accepts (``models.checkpoint.config_json_text`` writes it)."""
        return hf.hf_dict(self, ARCHITECTURE, MODEL_TYPE, time_step_limit=list(self.time_step_limit),
                          torch_dtype=self.dtype)


def save_checkpoint(path: str | os.PathLike[str], config: Mamba2Config, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``config.json`` (strict JSON, as transformers writes it) and one ``model.safetensors``.

    Tensors are validated as ``load_checkpoint`` does (raising ``ValueError``; their storage dtype
    must be ``config.dtype``), so nothing is written that would not load back; a tied lm_head equal
    to the embedding is dropped (it would only invite drift). They are saved contiguous, in their
    own dtypes.
    """
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
    """The embedded default model: a small Mamba2 with realistic random weights from ``seed``
    (``models.tiny``; bitwise the same on every machine).

    ``overrides`` are any ``Mamba2Config`` fields (e.g. ``n_groups=2, num_heads=16, head_dim=32``);
    inconsistent ones raise ``ValueError`` naming the rule. A_log, D, dt_bias are fp32; all other
    tensors are ``dtype``.
    """
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
