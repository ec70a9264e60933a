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
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..contract import Contract
from ..errors import ModelLoadError
from ..layers.mamba2 import Mamba2Mixer, Mamba2MixerConfig
from ..layers.norm import RMSNorm, RMSNormConfig
from ..ops.backend import Backend
from . import checkpoint as ckpt
from .causal_lm import Block, CausalLM, LMShape
from .registry import Family, register
from .tiny import init_tensor

ARCHITECTURE = "Mamba2ForCausalLM"
MODEL_TYPE = "mamba2"
EMBEDDING = "backbone.embeddings.weight"
LM_HEAD = "lm_head.weight"
SUPPORTED_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}

_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "state_size", "n_groups",
                  "conv_kernel", "expand", "chunk_size")
_BOOLS = ("use_bias", "use_conv_bias", "residual_in_fp32", "tie_word_embeddings")
# The config.json keys that decide which tensors a checkpoint holds and their shapes. transformers
# fills an absent one with its default (Mamba2Config's), and so does from_hf_dict; the loader names
# the absent ones when the tensors then disagree (see registry.load_checkpoint).
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "state_size", "n_groups",
              "conv_kernel", "expand", "use_bias", "use_conv_bias", "tie_word_embeddings")
# JSON spellings of +-inf that config.json files carry (json.dump writes Infinity, some tools write strings).
_INF_STRINGS = {"inf": math.inf, "infinity": math.inf, "+inf": math.inf, "+infinity": math.inf,
                "-inf": -math.inf, "-infinity": -math.inf}


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
        object.__setattr__(self, "time_step_limit", _parse_time_step_limit(self.time_step_limit))
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if type(value) is not int or value <= 0:  # bool is an int subclass: refuse it too
                raise ValueError(f"{name} must be a positive int, found {value!r}")
        for name in _BOOLS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be true or false, found {value!r}")
        eps = self.layer_norm_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < math.inf):
            raise ValueError(f"layer_norm_epsilon must be a positive finite number, found {eps!r}")
        object.__setattr__(self, "layer_norm_epsilon", float(eps))
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
        if not isinstance(d, dict):
            raise ModelLoadError(f"{source}: expected a JSON object, found {type(d).__name__}")
        model_type = d.get("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ModelLoadError(f"{source}: model_type is {model_type!r}, expected {MODEL_TYPE!r}")
        kwargs = {f.name: d[f.name] for f in fields(cls) if f.name != "dtype" and f.name in d}
        kwargs["dtype"] = _read_dtype(d, source)
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict transformers accepts (``models.checkpoint.config_json_text`` writes it)."""
        out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        for f in fields(self):
            if f.name not in ("dtype", "time_step_limit"):
                out[f.name] = getattr(self, f.name)
        out["time_step_limit"] = list(self.time_step_limit)
        out["torch_dtype"] = self.dtype
        return out


def expected_shapes(config: Mamba2Config) -> dict[str, tuple[int, ...]]:
    """Every parameter name of the HF layout with its shape, in a fixed order (lm_head omitted when tied)."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {EMBEDDING: (c.vocab_size, c.hidden_size)}
    mixer = c.mixer_config().weight_shapes()
    for i in range(c.num_hidden_layers):
        p = f"backbone.layers.{i}."
        shapes[p + "norm.weight"] = (c.hidden_size,)
        shapes.update({p + "mixer." + name: shape for name, shape in mixer.items()})
    shapes["backbone.norm_f.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes[LM_HEAD] = (c.vocab_size, c.hidden_size)
    return shapes


def build(config: Mamba2Config, tensors: Mapping[str, torch.Tensor], contract: Contract,
          backend: Backend) -> CausalLM:
    """The generic causal LM over HF-named ``tensors`` (``expected_shapes``), under ``contract``."""
    dtype = getattr(torch, contract.model_dtype)
    dev = backend.device
    norm = RMSNormConfig(config.hidden_size, config.layer_norm_epsilon)
    mixer = config.mixer_config()
    blocks = [Block(norm=RMSNorm.from_state_dict(tensors, f"backbone.layers.{i}.norm.", norm, backend, dtype),
                    mixer=Mamba2Mixer(mixer, tensors, f"backbone.layers.{i}.mixer.", backend=backend, dtype=dtype,
                                      chunk_size=contract.chunk_size))
              for i in range(config.num_hidden_layers)]
    embedding = tensors[EMBEDDING].to(device=dev, dtype=dtype)
    head = tensors[LM_HEAD] if LM_HEAD in tensors else tensors[EMBEDDING]
    return CausalLM(family=MODEL_TYPE, config=config, shape=config.lm_shape(), contract=contract, backend=backend,
                    embedding=embedding, blocks=blocks,
                    norm_f=RMSNorm.from_state_dict(tensors, "backbone.norm_f.", norm, backend, dtype),
                    lm_head=backend.linear_weight(head.to(device=dev, dtype=dtype)))


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
    unknown = sorted(set(overrides) - {f for f in Mamba2Config.__dataclass_fields__ if f != "dtype"})
    if unknown:
        raise TypeError(f"make_tiny() got unknown config fields: {', '.join(unknown)}")
    try:
        config = Mamba2Config(**{**_TINY_DEFAULTS, **overrides, "dtype": dtype})
    except (TypeError, ValueError) as exc:
        hint = "; override num_heads, head_dim, hidden_size and expand together" if "head_dim" in str(exc) else ""
        raise type(exc)(f"make_tiny(): {exc}{hint}") from None
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tensors = {name: init_tensor(name, shape, config.torch_dtype, gen, conv_kernel=config.conv_kernel)
               for name, shape in expected_shapes(config).items()}
    return config, tensors


def stated_dtype(d: Mapping[str, Any], source: str = "config.json") -> tuple[str, str] | None:
    """(key, dtype name) of the storage dtype ``torch_dtype`` / ``dtype`` name (either may be
    "torch.bfloat16"; transformers 5 writes ``dtype``, older versions ``torch_dtype``), None when
    neither is there. ModelLoadError when the two disagree."""
    found = {key: d[key] for key in ("torch_dtype", "dtype") if d.get(key) is not None}
    names = {key: str(value).removeprefix("torch.") for key, value in found.items()}
    if len(set(names.values())) > 1:
        raise ModelLoadError(f"{source}: torch_dtype {found['torch_dtype']!r} and dtype {found['dtype']!r} disagree")
    return next(iter(names.items()), None)


def _read_dtype(d: dict[str, Any], source: str) -> str:
    """The storage dtype named by ``torch_dtype`` / ``dtype``, float32 (transformers' default) when
    neither is there (models.nemotron_h reads its config with this too)."""
    stated = stated_dtype(d, source)
    return stated[1] if stated else "float32"


def defaults_taken(d: Mapping[str, Any]) -> dict[str, Any]:
    """{key: transformers' default} for each ``SHAPE_KEYS`` key absent from the config.json dict ``d``."""
    defaults = {f.name: f.default for f in fields(Mamba2Config)}
    return {key: defaults[key] for key in SHAPE_KEYS if key not in d}


def _parse_time_step_limit(value: Any) -> tuple[float, float]:
    """(lo, hi) as floats; ``None`` or "Infinity" for hi means +inf. Raises ValueError if not two numbers lo <= hi."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"time_step_limit must be two numbers [lo, hi], found {value!r}")
    lo = _as_float(value[0], allow_none=False)
    hi = _as_float(value[1], allow_none=True)
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"time_step_limit must be two numbers [lo, hi] with lo <= hi, found {value!r}")
    return (lo, hi)


def _as_float(x: Any, *, allow_none: bool) -> float | None:
    """A JSON number, inf spelling, or (if allowed) null-as-inf as a float; None when it is none of these."""
    if x is None:
        return math.inf if allow_none else None
    if isinstance(x, dict) and set(x) == {"__float__"}:  # transformers' encoding of non-finite floats
        x = x["__float__"]
    if isinstance(x, str):
        return _INF_STRINGS.get(x.strip().lower())
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


FAMILY = register(Family(
    name=MODEL_TYPE, config_type=Mamba2Config, architectures=(ARCHITECTURE,), model_types=(MODEL_TYPE,),
    read_config=lambda d, source: Mamba2Config.from_hf_dict(d, source=source), expected_shapes=expected_shapes,
    build=build, head=LM_HEAD, embedding=EMBEDDING, tied=lambda c: c.tie_word_embeddings,
    config_dtype=lambda c: c.dtype, hf_dict=lambda c: c.to_hf_dict(), stated_dtype=stated_dtype,
    defaults_taken=defaults_taken, defaults_of="transformers' Mamba2Config"))
