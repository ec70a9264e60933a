"""The model families: which checkpoint layouts load onto the generic causal LM, and how.

A family is one file in ``models/`` plus its entry here: how to recognise its config.json
(``architectures`` / ``model_type``, or the keys of a layout that has neither), how to read the
config, its weight names and shapes, and the build onto ``CausalLM``. ``load_model`` finds the
family of a checkpoint directory, loads and validates it strictly, and builds it under a contract.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..contract import Contract
from ..errors import ModelLoadError
from ..ops.backend import resolve
from . import checkpoint as ckpt
from .causal_lm import CausalLM


@dataclass(frozen=True)
class Family:
    """One checkpoint layout.

    name: the family's name; config_type: its config class; architectures / model_types: the
    config.json values it answers to;
    matches(d): whether a config dict without those keys is this layout; read_config(d, source);
    expected_shapes(config) -> {name: shape} (what a checkpoint must hold, lm_head omitted when tied);
    build(config, tensors, contract, backend) -> CausalLM; head / embedding: the weight names that a
    tied checkpoint may store twice; torch_bin: weights may come as pytorch_model.bin;
    config_dtype(config): the storage dtype the config states; hf_dict(config): the config as a dict
    (``Contract.from_hf_config`` reads chunk_size from it); finish(config, tensors): the config
    completed from the stored tensors (a layout whose config.json states no dtype).
    """

    name: str
    config_type: type
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    read_config: Callable[[dict, str], Any]
    expected_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    build: Callable[..., CausalLM]
    head: str
    embedding: str
    tied: Callable[[Any], bool]
    config_dtype: Callable[[Any], str]
    hf_dict: Callable[[Any], dict]
    matches: Callable[[dict], bool] = lambda d: False
    torch_bin: bool = False
    tie_flag: str = "tie_word_embeddings"
    num_layers: Callable[[Any], int] = lambda config: config.num_hidden_layers
    finish: Callable[[Any, Mapping[str, torch.Tensor]], Any] = lambda config, tensors: config


FAMILIES: list[Family] = []


def register(family: Family) -> Family:
    """Add a family (names, architectures and model types must be new)."""
    for f in FAMILIES:
        clash = {f.name} & {family.name} or set(f.architectures) & set(family.architectures)
        if clash:
            raise ValueError(f"model family {family.name!r} clashes with {f.name!r} over {sorted(clash)}")
    FAMILIES.append(family)
    return family


def family_of(config: Mapping[str, Any], source: str = "config.json") -> Family:
    """The family a config.json dict belongs to: by ``architectures``, else ``model_type``, else the
    layout's own keys. ModelLoadError (one line) when none matches."""
    archs = config.get("architectures") or []
    if isinstance(archs, list):
        for f in FAMILIES:
            if any(a in f.architectures for a in archs):
                return f
    mt = config.get("model_type")
    for f in FAMILIES:
        if mt is not None and mt in f.model_types:
            return f
    for f in FAMILIES:
        if f.matches(dict(config)):
            return f
    known = ", ".join(a for f in FAMILIES for a in f.architectures)
    raise ModelLoadError(f"{source}: no model family for architectures {archs!r} / model_type {mt!r} "
                         f"(covered: {known})")


def family_named(name: str) -> Family:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise ValueError(f"no model family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")


def family_for_config(config: Any) -> Family:
    """The family whose config class ``config`` is."""
    for f in FAMILIES:
        if isinstance(config, f.config_type):
            return f
    raise TypeError(f"no model family builds a {type(config).__name__}")


def describe(config: Any) -> dict[str, Any]:
    """A config's summary for reports: family, layers, vocab, hidden size, and the Mamba2 mixers' shape."""
    family = family_for_config(config)
    shape = config.lm_shape()
    out: dict[str, Any] = {"family": family.name, "layers": family.num_layers(config), "vocab": shape.vocab_size,
                           "hidden_size": shape.hidden_size}
    mixer = getattr(config, "mixer_config", None)
    if mixer is not None:
        m = mixer()
        out.update(heads=m.num_heads, head_dim=m.head_dim, n_groups=m.n_groups, state_size=m.state_size)
    return out


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[Any, dict[str, torch.Tensor]]:
    """Load and validate a checkpoint directory of any registered family.

    ``path`` holds ``config.json`` and the weights (safetensors, sharded safetensors, or for the
    families that publish it, ``pytorch_model.bin``). Returns the family's config and the tensors as
    stored (bf16 or fp32; the model casts); the dict's keys are exactly the family's
    ``expected_shapes``, so with tied embeddings it has no lm_head (a stored one must equal the
    embedding). Raises ``ModelLoadError``.
    """
    root = Path(path)
    if not root.exists():
        raise ModelLoadError(f"checkpoint path {str(root)!r} does not exist")
    if not root.is_dir():
        raise ModelLoadError(f"checkpoint path {str(root)!r} is not a directory")
    source = str(root / ckpt.CONFIG_FILE)
    raw = ckpt.read_json(root / ckpt.CONFIG_FILE, "config")
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{source}: expected a JSON object, found {type(raw).__name__}")
    family = family_of(raw, source)
    config = family.read_config(raw, source)
    tensors, origin = ckpt.read_tensors(root, allow_torch_bin=family.torch_bin)
    config = family.finish(config, tensors)
    tensors = ckpt.untie(tensors, family.head, family.embedding, family.tied(config), origin, flag=family.tie_flag)
    ckpt.validate(family.expected_shapes(config), tensors, origin)
    return config, tensors


def build_model(config: Any, tensors: Mapping[str, torch.Tensor], contract: Contract,
                device: torch.device | str | None = None) -> CausalLM:
    """The generic causal LM of ``config``'s family over ``tensors`` under ``contract`` (on ``device``,
    default: the contract's backend's)."""
    family = family_for_config(config)
    return family.build(config, tensors, contract, resolve(contract, device))


def contract_for(config: Any, *, backend: str = "torch", model_dtype: str | None = None,
                 state_dtype: str = "float32") -> Contract:
    """The contract a checkpoint implies: its chunk size, the state dtype (fp32: anything else is
    refused), ``backend``, and the model dtype (default: the checkpoint's storage dtype)."""
    family = family_for_config(config)
    return Contract.from_hf_config(family.hf_dict(config), backend=backend, state_dtype=state_dtype,
                                   model_dtype=model_dtype or family.config_dtype(config))


def load_model(path: str | os.PathLike[str], contract: Contract | None = None,
               device: torch.device | str | None = None) -> CausalLM:
    """A checkpoint directory of any registered family as a model whose ``forward(sequences)`` (a
    list of [len_i] int64 token-id tensors) returns the trainer's logits, one [len_i, vocab] tensor
    per sequence. ``contract`` defaults to the checkpoint's own (its chunk size, the torch backend,
    its dtype); the sampler must run the same one."""
    config, tensors = load_checkpoint(path)
    return build_model(config, tensors, contract or contract_for(config), device)
