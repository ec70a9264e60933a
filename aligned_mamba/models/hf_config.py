"""Reading and writing Hugging Face ``config.json`` dicts without transformers, shared by the
families: the storage dtype, ``time_step_limit``, field checks; one-line errors throughout."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

import torch

from ..errors import ModelLoadError

SUPPORTED_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# JSON spellings of +-inf that config.json files carry (json.dump writes Infinity, some tools write strings).
_INF_STRINGS = {"inf": math.inf, "infinity": math.inf, "+inf": math.inf, "+infinity": math.inf,
                "-inf": -math.inf, "-infinity": -math.inf}


def stated_dtype(d: Mapping[str, Any], source: str = "config.json") -> tuple[str, str] | None:
    """(key, dtype name) from ``torch_dtype`` (transformers 4) / ``dtype`` (5), "torch." prefix dropped;
    None when neither is there. ModelLoadError when the two disagree."""
    found = {key: d[key] for key in ("torch_dtype", "dtype") if d.get(key) is not None}
    names = {key: str(value).removeprefix("torch.") for key, value in found.items()}
    if len(set(names.values())) > 1:
        raise ModelLoadError(f"{source}: torch_dtype {found['torch_dtype']!r} and dtype {found['dtype']!r} disagree")
    return next(iter(names.items()), None)


def read_dtype(d: Mapping[str, Any], source: str) -> str:
    """The storage dtype ``torch_dtype`` / ``dtype`` names, else float32 (transformers' default)."""
    stated = stated_dtype(d, source)
    return stated[1] if stated else "float32"


def parse_time_step_limit(value: Any) -> tuple[float, float]:
    """(lo, hi) from a JSON pair (numbers, inf spellings, ``{"__float__": ...}``, hi None = +inf);
    ValueError unless lo <= hi."""
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


def check_fields(config: Any, positive_ints: Iterable[str], bools: Iterable[str]) -> None:
    """ValueError unless each ``positive_ints`` field is a positive int (not a bool), TypeError unless
    each ``bools`` field is a bool."""
    for name in positive_ints:
        value = getattr(config, name)
        if type(value) is not int or value <= 0:  # bool is an int subclass: refuse it too
            raise ValueError(f"{name} must be a positive int, found {value!r}")
    for name in bools:
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be true or false, found {value!r}")


def positive_float(name: str, value: Any) -> float:
    """``value`` as a float; ValueError unless a positive finite number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ValueError(f"{name} must be a positive finite number, found {value!r}")
    return float(value)


def check_dict(d: Any, source: str, model_type: str) -> None:
    """ModelLoadError unless ``d`` is a dict whose ``model_type`` (when present) is ``model_type``."""
    if not isinstance(d, dict):
        raise ModelLoadError(f"{source}: expected a JSON object, found {type(d).__name__}")
    found = d.get("model_type", model_type)
    if found != model_type:
        raise ModelLoadError(f"{source}: model_type is {found!r}, expected {model_type!r}")


def config_kwargs(cls: type, d: Mapping[str, Any], source: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of dataclass ``cls`` that ``d`` holds but ``skip`` (other keys ignored), ``dtype``
    by ``read_dtype``."""
    kwargs = {f.name: d[f.name] for f in fields(cls) if f.name != "dtype" and f.name not in skip and f.name in d}
    kwargs["dtype"] = read_dtype(d, source)
    return kwargs


def construct(cls: type, source: str, **kwargs: Any) -> Any:
    """``cls(**kwargs)``, its TypeError / ValueError as one ModelLoadError line led by ``source``."""
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: {exc}") from None


def hf_dict(config: Any, architecture: str, model_type: str, **tail: Any) -> dict[str, Any]:
    """A config.json dict: architectures, model_type, the fields of ``config`` but ``dtype`` and
    ``time_step_limit``, then ``tail`` (where the family writes those)."""
    out: dict[str, Any] = {"architectures": [architecture], "model_type": model_type}
    out.update({f.name: getattr(config, f.name) for f in fields(config) if f.name not in ("dtype", "time_step_limit")})
    out.update(tail)
    return out


def defaults_of(cls: type, keys: Iterable[str], d: Mapping[str, Any]) -> dict[str, Any]:
    """{key: the dataclass ``cls``'s default} for each of ``keys`` absent from ``d``."""
    defaults = {f.name: f.default for f in fields(cls)}
    return {key: defaults[key] for key in keys if key not in d}
