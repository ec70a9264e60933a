"""Load, validate, save and synthesise Mamba2 checkpoints in the Hugging Face layout.

Parameter names are transformers' ``Mamba2ForCausalLM`` names. Loading is strict: every expected tensor
must be present with its exact shape, a supported dtype and finite values, and nothing else may be
there, because a silently ignored or mis-read tensor would break the bitwise promise in ways that
are hard to trace. Every problem raises ``ModelLoadError`` with a one-line message.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from aligned_mamba.errors import ModelLoadError
from aligned_mamba.model.config import Mamba2Config

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
EMBEDDING = "backbone.embeddings.weight"
LM_HEAD = "lm_head.weight"

# fp16 is refused on purpose: its range and rounding differ from bf16, and casting it to bf16 is lossy.
_LOADABLE_DTYPES = (torch.bfloat16, torch.float32)
_MAX_NAMED = 5  # how many names an error message lists before "..."


def expected_shapes(config: Mamba2Config) -> dict[str, tuple[int, ...]]:
    """Every parameter name of the HF layout with its shape, in a fixed order (lm_head omitted when tied)."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {EMBEDDING: (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"backbone.layers.{i}."
        shapes[p + "norm.weight"] = (c.hidden_size,)
        shapes[p + "mixer.in_proj.weight"] = (c.in_proj_size, c.hidden_size)
        if c.use_bias:
            shapes[p + "mixer.in_proj.bias"] = (c.in_proj_size,)
        shapes[p + "mixer.conv1d.weight"] = (c.conv_dim, 1, c.conv_kernel)
        if c.use_conv_bias:
            shapes[p + "mixer.conv1d.bias"] = (c.conv_dim,)
        shapes[p + "mixer.dt_bias"] = (c.num_heads,)
        shapes[p + "mixer.A_log"] = (c.num_heads,)
        shapes[p + "mixer.D"] = (c.num_heads,)
        shapes[p + "mixer.norm.weight"] = (c.intermediate_size,)
        shapes[p + "mixer.out_proj.weight"] = (c.hidden_size, c.intermediate_size)
        if c.use_bias:
            shapes[p + "mixer.out_proj.bias"] = (c.hidden_size,)
    shapes["backbone.norm_f.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes[LM_HEAD] = (c.vocab_size, c.hidden_size)
    return shapes


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[Mamba2Config, dict[str, torch.Tensor]]:
    """Load and validate a HF-layout Mamba2 checkpoint directory.

    ``path`` holds ``config.json`` and either ``model.safetensors`` or ``model.safetensors.index.json``
    with its shards. Returns the config and the tensors as stored (bf16 or fp32; the model casts); the
    dict's keys are exactly ``expected_shapes(config)``'s, so with tied embeddings it has no lm_head
    (an lm_head stored alongside must then equal the embedding). Raises ``ModelLoadError``.
    """
    root = Path(path)
    if not root.exists():
        raise ModelLoadError(f"checkpoint path {str(root)!r} does not exist")
    if not root.is_dir():
        raise ModelLoadError(f"checkpoint path {str(root)!r} is not a directory")
    config = Mamba2Config.from_hf_dict(_read_json(root / CONFIG_FILE, "config"), source=str(root / CONFIG_FILE))
    tensors, origin = _read_tensors(root)
    if config.tie_word_embeddings and LM_HEAD in tensors:
        if EMBEDDING in tensors and not torch.equal(tensors[LM_HEAD], tensors[EMBEDDING]):
            raise ModelLoadError(
                f"{origin[LM_HEAD]}: {LM_HEAD} differs from {EMBEDDING} but tie_word_embeddings is true"
            )
        del tensors[LM_HEAD]
    _validate(config, tensors, origin, ModelLoadError)
    return config, tensors


def save_checkpoint(
    path: str | os.PathLike[str], config: Mamba2Config, tensors: Mapping[str, torch.Tensor]
) -> None:
    """Write ``config.json`` and a single ``model.safetensors`` (metadata {"format": "pt"}) under ``path``.

    Creates the directory. Tensors are validated like ``load_checkpoint`` does (raising ``ValueError``)
    so that nothing is written that would not load back; they are saved contiguous, in their own dtype.
    """
    tensors = dict(tensors)
    if config.tie_word_embeddings and LM_HEAD in tensors:
        if EMBEDDING in tensors and not torch.equal(tensors[LM_HEAD], tensors[EMBEDDING]):
            raise ValueError(f"{LM_HEAD} differs from {EMBEDDING} but tie_word_embeddings is true")
        del tensors[LM_HEAD]  # tied: the embedding is the head; storing it twice would only invite drift
    _validate(config, tensors, {name: "tensors" for name in tensors}, ValueError)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors that share storage, so give each its own contiguous copy when needed.
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    # Write to temporary names then rename, so a crash never leaves a half-written checkpoint behind.
    tmp_weights, tmp_config = root / (WEIGHTS_FILE + ".tmp"), root / (CONFIG_FILE + ".tmp")
    save_file(out, str(tmp_weights), metadata={"format": "pt"})
    tmp_config.write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    os.replace(tmp_weights, root / WEIGHTS_FILE)
    os.replace(tmp_config, root / CONFIG_FILE)


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


def make_tiny(
    seed: int = 0, *, dtype: str = "bfloat16", **overrides: Any
) -> tuple[Mamba2Config, dict[str, torch.Tensor]]:
    """The embedded default model: a small Mamba2 with realistic random weights from ``seed``.

    ``overrides`` are any ``Mamba2Config`` fields (e.g. ``n_groups=2, num_heads=16, head_dim=32``);
    inconsistent ones raise ``ValueError`` naming the rule. A_log, D, dt_bias are fp32; all other
    tensors are ``dtype``. Bitwise reproducible on every machine: values come from ``torch.rand``
    (exact multiples of 2**-24 from a seeded CPU ``torch.Generator``), combined only with correctly
    rounded float64 arithmetic (and libm for the per-head scalars) before one rounding to the output dtype.
    Gaussian-like draws are Irwin-Hall sums of 12 uniforms, which torch sums exactly in float64,
    avoiding torch's ISA-dependent vectorised log/cos in ``randn``.
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
    tensors: dict[str, torch.Tensor] = {}
    # One generator, consumed in expected_shapes' fixed order, so each tensor depends only on seed and config.
    for name, shape in expected_shapes(config).items():
        tensors[name] = _init_tensor(name, shape, config, gen)
    return config, tensors


def _init_tensor(name: str, shape: tuple[int, ...], config: Mamba2Config, gen: torch.Generator) -> torch.Tensor:
    """The initial value of parameter ``name``: fp32 for A_log / dt_bias / D, else ``config.torch_dtype``."""
    # A_log, dt_bias, D are fp32 whatever the dtype: they feed exp/softplus in the fp32 SSM math.
    if name.endswith(".A_log"):  # A ~ U[1, 16], stored as log(A) so that A = -exp(A_log) lies in [-16, -1]
        return _per_head(lambda u: math.log(1.0 + 15.0 * u), shape, gen)
    if name.endswith(".dt_bias"):  # dt log-uniform in [1e-3, 1e-1]; dt_bias = softplus^-1(dt) = dt + log(-expm1(-dt))
        lo, hi = math.log(1e-3), math.log(1e-1)
        return _per_head(lambda u: _inv_softplus(math.exp(lo + (hi - lo) * u)), shape, gen)
    if name.endswith(".D"):
        return torch.ones(shape, dtype=torch.float32)
    if name.endswith("conv1d.weight"):
        bound = 1.0 / math.sqrt(config.conv_kernel)
        values = _uniform(shape, -bound, bound, gen)
    elif name.endswith("conv1d.bias"):
        values = _uniform(shape, -0.1, 0.1, gen)
    elif name.endswith(("norm.weight", "norm_f.weight")):  # ones + noise, so a norm bug cannot hide behind all-ones
        values = 1.0 + 0.05 * _normal(shape, gen)
    elif name == EMBEDDING:
        values = _normal(shape, gen)
    elif name.endswith(".weight"):  # in_proj, out_proj, lm_head: shape [out, in]
        values = _normal(shape, gen) / math.sqrt(shape[1])
    elif name.endswith(".bias"):  # in_proj / out_proj biases (use_bias)
        values = 0.02 * _normal(shape, gen)
    else:
        raise AssertionError(f"no initialiser for {name}")
    # Round once to fp32, then to the storage dtype: a bf16 model is exactly the fp32 model cast.
    return values.to(torch.float32).to(config.torch_dtype)


def _uniform(shape: tuple[int, ...], lo: float, hi: float, gen: torch.Generator) -> torch.Tensor:
    """float64 U[lo, hi) from float32 torch.rand (exact k * 2**-24 values)."""
    return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float32).to(torch.float64)


def _normal(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """float64 approximately N(0, 1): sum of 12 U[0, 1) minus 6 (exact in float64, bounded to [-6, 6])."""
    u = torch.rand((12, *shape), generator=gen, dtype=torch.float32).to(torch.float64)
    return u.sum(dim=0) - 6.0


def _per_head(fn: Any, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """fp32 tensor of ``fn(u)`` for u ~ U[0, 1), evaluated per element in Python float64 (libm, no SIMD)."""
    u = torch.rand(shape, generator=gen, dtype=torch.float32).tolist()
    return torch.tensor([fn(x) for x in u], dtype=torch.float64).to(torch.float32)


def _inv_softplus(y: float) -> float:
    """x with softplus(x) = y, for y > 0."""
    return y + math.log(-math.expm1(-y))


def _read_json(file: Path, what: str) -> Any:
    """Parse a JSON file, turning every failure into a one-line ModelLoadError."""
    if not file.is_file():
        raise ModelLoadError(f"{what} file {str(file)!r} is missing")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{what} file {str(file)!r} is not valid JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read {what} file {str(file)!r}: {_one_line(exc)}") from None


def _read_tensors(root: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of the single file or of the index's shards, plus each tensor's source file."""
    single, index = root / WEIGHTS_FILE, root / INDEX_FILE
    if single.is_file():
        files: dict[Path, set[str] | None] = {single: None}
    elif index.is_file():
        files = {**_shards_from_index(root, index)}
    else:
        raise ModelLoadError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {str(root)!r}")
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for file, listed in files.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
                if listed is not None and not listed <= set(names):
                    absent = sorted(listed - set(names))
                    raise ModelLoadError(f"{str(file)!r} lacks {len(absent)} tensor(s) its index lists: {_few(absent)}")
                for name in names:
                    if name in tensors:
                        raise ModelLoadError(f"tensor {name!r} is stored twice: in {origin[name]!r} and {str(file)!r}")
                    tensors[name] = f.get_tensor(name)
                    origin[name] = str(file)
        except ModelLoadError:
            raise
        except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as exc:  # what a bad file raises
            raise ModelLoadError(f"cannot read safetensors file {str(file)!r}: {_one_line(exc)}") from None
    return tensors, origin


def _shards_from_index(root: Path, index: Path) -> dict[Path, set[str]]:
    """shard file -> tensor names the index assigns to it."""
    data = _read_json(index, "safetensors index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"safetensors index {str(index)!r} has no 'weight_map' object")
    shards: dict[Path, set[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise ModelLoadError(f"safetensors index {str(index)!r} maps {name!r} to an invalid file name {shard!r}")
        file = root / shard
        if not file.is_file():
            raise ModelLoadError(f"shard {str(file)!r} listed in {str(index)!r} is missing")
        shards.setdefault(file, set()).add(name)
    return shards


def _validate(
    config: Mamba2Config, tensors: Mapping[str, torch.Tensor], origin: Mapping[str, str], error: type[Exception]
) -> None:
    """Names, shapes, dtypes and finiteness against ``config``; raises ``error`` with a one-line message."""
    shapes = expected_shapes(config)
    extra = [name for name in tensors if name not in shapes]
    if extra:
        raise error(f"{len(extra)} unexpected tensor(s) in {_where(origin, extra)}: {_few(extra)}")
    missing = [name for name in shapes if name not in tensors]
    if missing:
        raise error(f"{len(missing)} missing tensor(s): {_few(missing)}")
    for name, shape in shapes.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise error(f"{name!r} in {origin[name]!r} is a {type(t).__name__}, not a torch.Tensor")
        if tuple(t.shape) != shape:
            raise error(f"tensor {name!r} in {origin[name]!r}: expected shape {list(shape)}, found {list(t.shape)}")
        if t.dtype == torch.float16:
            raise error(
                f"tensor {name!r} in {origin[name]!r} is float16, which is refused: its range and rounding differ "
                "from bfloat16; convert the checkpoint to bfloat16 or float32"
            )
        if t.dtype not in _LOADABLE_DTYPES:
            raise error(
                f"tensor {name!r} in {origin[name]!r} has dtype {t.dtype}; only bfloat16 and float32 are supported"
            )
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise error(f"tensor {name!r} in {origin[name]!r} has {bad} non-finite value(s) (NaN or Inf)")


def _few(names: list[str]) -> str:
    """The first few names, then '...' if there are more."""
    shown = ", ".join(repr(n) for n in names[:_MAX_NAMED])
    return shown + (", ..." if len(names) > _MAX_NAMED else "")


def _where(origin: Mapping[str, str], names: list[str]) -> str:
    """The distinct source files of ``names``, for messages."""
    return ", ".join(repr(f) for f in dict.fromkeys(origin[n] for n in names))


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(exc).split()) or type(exc).__name__
