"""Mamba2 model configuration, mirroring the fields of transformers' ``Mamba2Config`` that matter.

transformers is not a dependency: ``from_hf_dict`` reads a Hugging Face ``config.json`` dict and
``to_hf_dict`` writes one that transformers would accept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from aligned_mamba.errors import ModelLoadError

SUPPORTED_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}

_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_heads",
    "head_dim",
    "state_size",
    "n_groups",
    "conv_kernel",
    "expand",
    "chunk_size",
)
_BOOLS = ("use_bias", "use_conv_bias", "residual_in_fp32", "tie_word_embeddings")
# JSON spellings of +-inf that config.json files carry (json.dump writes Infinity, some tools write strings).
_INF_STRINGS = {"inf": math.inf, "infinity": math.inf, "+inf": math.inf, "+infinity": math.inf,
                "-inf": -math.inf, "-infinity": -math.inf}


@dataclass(frozen=True)
class Mamba2Config:
    """Shape and numerics of a Mamba2 causal LM. Field defaults are Hugging Face's ``Mamba2Config`` defaults.

    ``dtype`` is the checkpoint's storage dtype ("bfloat16" or "float32"); the model casts from it.
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
        """Channels of the depthwise conv over xBC: intermediate_size + 2 * n_groups * state_size."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        """Output rows of in_proj, laid out as [z: intermediate_size | xBC: conv_dim | dt: num_heads]."""
        return self.intermediate_size + self.conv_dim + self.num_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a torch dtype (torch.bfloat16 or torch.float32)."""
        return SUPPORTED_DTYPES[self.dtype]

    @classmethod
    def from_hf_dict(cls, d: Any, *, source: str = "config.json") -> Mamba2Config:
        """Build a config from a Hugging Face ``config.json`` dict; absent keys take HF defaults.

        Unknown keys are ignored (HF configs carry many that do not change the math). The dtype comes
        from ``torch_dtype`` or ``dtype`` (default float32). Raises ``ModelLoadError`` (one line, prefixed
        with ``source``) for anything invalid.
        """
        if not isinstance(d, dict):
            raise ModelLoadError(f"{source}: expected a JSON object, found {type(d).__name__}")
        model_type = d.get("model_type", "mamba2")
        if model_type != "mamba2":
            raise ModelLoadError(f"{source}: model_type is {model_type!r}, expected 'mamba2'")
        kwargs = {f.name: d[f.name] for f in fields(cls) if f.name != "dtype" and f.name in d}
        kwargs["dtype"] = _read_dtype(d, source)
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict transformers accepts. An infinite time_step_limit bound stays ``float('inf')``,
        which ``json.dump`` writes as ``Infinity`` and ``json.load`` / ``from_hf_dict`` read back exactly."""
        out: dict[str, Any] = {"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2"}
        for f in fields(self):
            if f.name not in ("dtype", "time_step_limit"):
                out[f.name] = getattr(self, f.name)
        out["time_step_limit"] = list(self.time_step_limit)
        out["torch_dtype"] = self.dtype
        return out


def _read_dtype(d: dict[str, Any], source: str) -> str:
    """The storage dtype named by ``torch_dtype`` / ``dtype`` (either may be "torch.bfloat16")."""
    found = {key: d[key] for key in ("torch_dtype", "dtype") if d.get(key) is not None}
    names = {key: str(value).removeprefix("torch.") for key, value in found.items()}
    if len(set(names.values())) > 1:
        raise ModelLoadError(f"{source}: torch_dtype {found['torch_dtype']!r} and dtype {found['dtype']!r} disagree")
    return next(iter(names.values()), "float32")


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
    if isinstance(x, str):
        return _INF_STRINGS.get(x.strip().lower())
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)
