"""Checkpoint files: config.json, safetensors (single or sharded), PyTorch ``.bin`` state dicts.

Loading is strict (exactly the expected tensors, shapes, one storage dtype, finite values): a
silently ignored or mis-read tensor would break the promise untraceably. Every problem is a one-line
``ModelLoadError``. config.json's non-finite floats are transformers' ``{"__float__": "Infinity"}``.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import ModelLoadError

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"

# fp16 refused: its range and rounding differ from bf16's, so casting it is lossy
LOADABLE_DTYPES = (torch.bfloat16, torch.float32)
_MAX_NAMED = 5  # how many names an error message lists before "..."
_FLOAT_TAG = "__float__"
_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


# -- config.json ---------------------------------------------------------------------------------------


def _decode_floats(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_FLOAT_TAG} and obj[_FLOAT_TAG] in _FLOAT_TAGS:
            return _FLOAT_TAGS[obj[_FLOAT_TAG]]
        return {k: _decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_floats(v) for v in obj]
    return obj


def _encode_floats(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return {_FLOAT_TAG: "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")}
    if isinstance(obj, dict):
        return {k: _encode_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode_floats(v) for v in obj]
    return obj


def read_json(file: Path, what: str = "config") -> Any:
    """A JSON file, non-finite float tags decoded; ModelLoadError (one line) naming the file."""
    if not is_file(file, f"{what} file"):
        raise ModelLoadError(f"{what} file {str(file)!r} is missing")
    try:
        return _decode_floats(json.loads(file.read_text()))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{what} file {str(file)!r} is not valid JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read {what} file {str(file)!r}: {one_line(exc)}") from None


def config_json_text(config: Mapping[str, Any]) -> str:
    """config.json text as transformers writes it: strict JSON, non-finite floats tagged."""
    return json.dumps(_encode_floats(dict(config)), indent=2, sort_keys=False, allow_nan=False) + "\n"


# -- paths ---------------------------------------------------------------------------------------------


def probe(path: Path, what: str) -> os.stat_result | None:
    """``path``'s stat (links followed), None when nothing is there; ModelLoadError for a symlink loop,
    a broken symlink or an unreadable path (``Path.exists`` would call them "missing")."""
    try:
        return os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ModelLoadError(f"{what} {str(path)!r} is a symlink loop (too many levels of symbolic "
                                 "links)") from None
        if os.path.islink(path):
            raise ModelLoadError(f"{what} {str(path)!r} is a broken symlink: its target {os.readlink(path)!r} "
                                 "does not exist") from None
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise ModelLoadError(f"cannot read {what} {str(path)!r}: {one_line(exc)}") from None


def is_file(path: Path, what: str) -> bool:
    """Whether a regular file is at ``path`` (links followed); ModelLoadError as ``probe`` or for a folder."""
    st = probe(path, what)
    if st is None:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise ModelLoadError(f"{what} {str(path)!r} is not a regular file")
    return True


# -- tensors -------------------------------------------------------------------------------------------


def read_tensors(root: Path, *, allow_torch_bin: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, each one's file) of ``model.safetensors``, the shards of its index, or with
    ``allow_torch_bin`` ``pytorch_model.bin`` (``torch.load(weights_only=True)``: no pickled code)."""
    single, index, torch_bin = root / SAFETENSORS_FILE, root / SAFETENSORS_INDEX, root / TORCH_FILE
    if is_file(single, "safetensors file"):
        return _read_safetensors({single: None})
    if is_file(index, "safetensors index"):
        return _read_safetensors(_shards_from_index(root, index))
    if allow_torch_bin and is_file(torch_bin, "PyTorch weights"):
        return _read_torch_bin(torch_bin)
    names = f"{SAFETENSORS_FILE}, {SAFETENSORS_INDEX}" + (f" or {TORCH_FILE}" if allow_torch_bin else "")
    raise ModelLoadError(f"no weights ({names}) in {str(root)!r}")


def _read_safetensors(files: Mapping[Path, set[str] | None]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for file, listed in files.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
                if listed is not None and not listed <= set(names):
                    absent = sorted(listed - set(names))
                    raise ModelLoadError(f"{str(file)!r} lacks {len(absent)} tensor(s) its index lists: {few(absent)}")
                for name in names:
                    if name in tensors:
                        raise ModelLoadError(f"tensor {name!r} is stored twice: in {origin[name]!r} and {str(file)!r}")
                    tensors[name] = f.get_tensor(name)
                    origin[name] = str(file)
        except ModelLoadError:
            raise
        except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as exc:  # what a bad file raises
            raise ModelLoadError(f"cannot read safetensors file {str(file)!r}: {one_line(exc)}") from None
    return tensors, origin


def _read_torch_bin(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        sd = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- torch.load raises many kinds for a bad or unsafe file
        raise ModelLoadError(f"cannot read PyTorch weights {str(file)!r}: {one_line(exc)}") from None
    if not isinstance(sd, Mapping) or not all(isinstance(k, str) for k in sd):
        raise ModelLoadError(f"{str(file)!r} does not hold a state dict (name -> tensor)")
    return dict(sd), {name: str(file) for name in sd}


def _shards_from_index(root: Path, index: Path) -> dict[Path, set[str]]:
    """shard file -> tensor names the index assigns to it."""
    data = read_json(index, "safetensors index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"safetensors index {str(index)!r} has no 'weight_map' object")
    shards: dict[Path, set[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise ModelLoadError(f"safetensors index {str(index)!r} maps {name!r} to an invalid file name {shard!r}")
        file = root / shard
        if not is_file(file, "shard"):
            raise ModelLoadError(f"shard {str(file)!r} listed in {str(index)!r} is missing")
        shards.setdefault(file, set()).add(name)
    return shards


def validate(shapes: Mapping[str, tuple[int, ...]], tensors: Mapping[str, torch.Tensor],
             origin: Mapping[str, str], error: type[Exception] = ModelLoadError) -> None:
    """Names, shapes, dtypes and finiteness against ``shapes``; raises ``error`` with a one-line message."""
    check_shapes(shapes, tensors, origin, error)
    check_values(tensors, origin, error)


def check_shapes(shapes: Mapping[str, tuple[int, ...]], tensors: Mapping[str, torch.Tensor],
                 origin: Mapping[str, str], error: type[Exception] = ModelLoadError) -> None:
    """Exactly the names of ``shapes``, each a tensor of its shape (what the config decides)."""
    extra = [name for name in tensors if name not in shapes]
    if extra:
        raise error(f"{len(extra)} unexpected tensor(s) in {_where(origin, extra)}: {few(extra)}")
    missing = [name for name in shapes if name not in tensors]
    if missing:
        raise error(f"{len(missing)} missing tensor(s): {few(missing)}")
    for name, shape in shapes.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise error(f"{name!r} in {origin[name]!r} is a {type(t).__name__}, not a torch.Tensor")
        if tuple(t.shape) != tuple(shape):
            raise error(f"tensor {name!r} in {origin[name]!r}: expected shape {list(shape)}, found {list(t.shape)}")


def check_values(tensors: Mapping[str, torch.Tensor], origin: Mapping[str, str],
                 error: type[Exception] = ModelLoadError) -> None:
    """Each tensor's dtype (bf16 or fp32) and finiteness (what the weights decide)."""
    for name, t in tensors.items():
        if t.dtype == torch.float16:
            raise error(
                f"tensor {name!r} in {origin[name]!r} is float16, which is refused: its range and rounding differ "
                "from bfloat16; convert the checkpoint to bfloat16 or float32"
            )
        if t.dtype not in LOADABLE_DTYPES:
            raise error(f"tensor {name!r} in {origin[name]!r} has dtype {t.dtype}; only bfloat16 and float32 are "
                        "supported")
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise error(f"tensor {name!r} in {origin[name]!r} has {bad} non-finite value(s) (NaN or Inf)")


def storage_dtype(tensors: Mapping[str, torch.Tensor], origin: Mapping[str, str], free: tuple[str, ...] = (),
                  error: type[Exception] = ModelLoadError) -> str:
    """The one dtype ("bfloat16" or "float32") the validated tensors are stored in; names ending in
    ``free`` (parameters the model computes with in fp32) may be either. ``error`` (one line) for mixed
    dtypes, since a model dtype would silently round or widen some."""
    first: dict[torch.dtype, str] = {}
    for name, t in tensors.items():
        if not name.endswith(free):
            first.setdefault(t.dtype, name)
    if len(first) > 1:
        (d1, n1), (d2, n2) = list(first.items())[:2]
        raise error(f"mixed storage dtypes: {n1!r} in {origin.get(n1, 'tensors')!r} is {_name(d1)} but {n2!r} in "
                    f"{origin.get(n2, 'tensors')!r} is {_name(d2)}; a checkpoint holds one dtype (only "
                    f"{', '.join(f.lstrip('.') for f in free) or 'none'}, which the model computes with in float32, "
                    "may be float32 besides)")
    if not first:
        raise error("no tensors to read a storage dtype from")
    return _name(next(iter(first)))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def untie(tensors: dict[str, torch.Tensor], head: str, embedding: str, tied: bool, origin: Mapping[str, str],
          error: type[Exception] = ModelLoadError, flag: str = "tie_word_embeddings") -> dict[str, torch.Tensor]:
    """With tied embeddings (the config's ``flag``), drop a stored ``head`` equal to ``embedding``
    (refuse one that differs)."""
    if tied and head in tensors:
        if embedding in tensors and not torch.equal(tensors[head], tensors[embedding]):
            raise error(f"{origin.get(head, 'tensors')}: {head} differs from {embedding} but {flag} is true")
        tensors = {k: v for k, v in tensors.items() if k != head}
    return tensors


# -- writing ---------------------------------------------------------------------------------------------


def save_files(root: str | os.PathLike[str], config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], *,
               weights_file: str = SAFETENSORS_FILE) -> None:
    """Write ``config.json`` and the tensors (contiguous, own dtypes) under ``root``, as safetensors or a
    ".bin" state dict; via temporary names and a rename, so a crash leaves no half-written file."""
    out_dir = Path(root)
    out_dir.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors that share storage
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    tmp_weights, tmp_config = out_dir / (weights_file + ".tmp"), out_dir / (CONFIG_FILE + ".tmp")
    if weights_file.endswith(".bin"):
        torch.save(out, str(tmp_weights))
    else:
        save_file(out, str(tmp_weights), metadata={"format": "pt"})
    tmp_config.write_text(config_json_text(config))
    os.replace(tmp_weights, out_dir / weights_file)
    os.replace(tmp_config, out_dir / CONFIG_FILE)


# -- messages ----------------------------------------------------------------------------------------------


def few(names: list[str]) -> str:
    """The first few names, then '...' if there are more."""
    shown = ", ".join(repr(n) for n in names[:_MAX_NAMED])
    return shown + (", ..." if len(names) > _MAX_NAMED else "")


def _where(origin: Mapping[str, str], names: list[str]) -> str:
    """The distinct source files of ``names``, for messages."""
    return ", ".join(repr(f) for f in dict.fromkeys(origin.get(n, "tensors") for n in names))


def one_line(exc: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(exc).split()) or type(exc).__name__
