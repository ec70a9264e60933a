"""The registered model families (each a ``family.Family`` instance a file in ``models/`` registers),
and loading: ``load_checkpoint`` finds a directory's family and reads it strictly, ``build_model``
builds it under a contract, ``load_model`` does both."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..contract import Contract
from ..errors import ModelLoadError
from ..ops.backend import resolve
from ..parallel import TPGroup
from . import checkpoint as ckpt
from .causal_lm import CausalLM
from .family import Family

__all__ = ["FAMILIES", "Family", "build_model", "contract_for", "describe", "family_for_config", "family_named",
           "family_of", "load_checkpoint", "load_model", "register"]

FAMILIES: list[Family] = []


def register(family: Family) -> Family:
    """Add and return ``family`` (a ``Family`` subclass's instance); ValueError if its name or an
    architecture is already registered."""
    for f in FAMILIES:
        clash = {f.name} & {family.name} or set(f.architectures) & set(family.architectures)
        if clash:
            raise ValueError(f"model family {family.name!r} clashes with {f.name!r} over {sorted(clash)}")
    FAMILIES.append(family)
    return family


def family_of(config: Mapping[str, Any], source: str = "config.json") -> Family:
    """The family of a config.json dict: by ``architectures``, else ``model_type``, else the layout's
    keys. ModelLoadError (one line) when none matches or ``architectures`` contradicts ``model_type``."""
    archs = config.get("architectures")
    mt = config.get("model_type")
    by_type = next((f for f in FAMILIES if mt is not None and mt in f.model_types), None)
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ModelLoadError(f"{source}: architectures must be a list of class names, found {archs!r}")
    if archs:
        by_arch = [f for f in FAMILIES if any(a in f.architectures for a in archs)]
        if len(by_arch) == 1 and not all(a in by_arch[0].architectures for a in archs):
            raise ModelLoadError(f"{source}: architectures {archs!r} name classes besides the {by_arch[0].name} "
                                 f"family's {list(by_arch[0].architectures)!r}; a config names one model")
        if len(by_arch) == 1:
            family = by_arch[0]
            if mt is not None and (by_type not in (None, family) or (family.model_types and by_type is None)):
                raise ModelLoadError(f"{source}: architectures {archs!r} ({family.name}) contradict model_type "
                                     f"{mt!r}; a config names one model")
            return family
        if len(by_arch) > 1:
            raise ModelLoadError(f"{source}: architectures {archs!r} name classes of several families "
                                 f"({', '.join(f.name for f in by_arch)}); a config names one model")
        if by_type is not None:
            raise ModelLoadError(f"{source}: architectures {archs!r} contradict model_type {mt!r} (the "
                                 f"{by_type.name} family's architectures are {list(by_type.architectures)!r})")
    elif by_type is not None:
        return by_type
    else:
        for f in FAMILIES:
            if f.matches(dict(config)):
                return f
    known = ", ".join(a for f in FAMILIES for a in f.architectures)
    raise ModelLoadError(f"{source}: no model family for architectures {archs or []!r} / model_type {mt!r} "
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
    pattern = getattr(config, "hybrid_override_pattern", None)
    if pattern:  # a hybrid: its layer kinds, and the attention layers' query / key-value heads
        out.update(pattern=pattern, attention_heads=config.num_attention_heads,
                   kv_heads=config.num_key_value_heads, attention_head_dim=config.head_dim)
        if "E" in pattern:  # MoE layers: routed experts and how many each token takes
            out.update(experts=config.n_routed_experts, experts_per_token=config.num_experts_per_tok)
    return out


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[Any, dict[str, torch.Tensor]]:
    """(config, tensors) of a checkpoint directory of any registered family: ``config.json`` and
    safetensors (single or sharded) or, where the family publishes it, ``pytorch_model.bin``.

    The tensors as stored, exactly the family's ``expected_shapes`` (a tied lm_head dropped);
    ``config.dtype`` is their storage dtype. ModelLoadError (one line) for: no such directory (a
    symlink loop or broken link named as such); no family, or architectures contradicting
    model_type; missing, extra or misshapen tensors (led by the shape-deciding keys config.json lacks
    and their defaults); fp16, mixed dtypes, non-finite values; a torch_dtype / dtype unlike the stored one.
    """
    root = Path(path)
    st = ckpt.probe(root, "checkpoint path")
    if st is None:
        raise ModelLoadError(f"checkpoint path {str(root)!r} does not exist")
    if not stat.S_ISDIR(st.st_mode):
        raise ModelLoadError(f"checkpoint path {str(root)!r} is not a directory")
    source = str(root / ckpt.CONFIG_FILE)
    raw = ckpt.read_json(root / ckpt.CONFIG_FILE, "config")
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{source}: expected a JSON object, found {type(raw).__name__}")
    family = family_of(raw, source)
    taken = family.defaults_taken(raw)
    # only errors the config's values decide are led by the absent keys, not unreadable files
    try:
        config = family.read_config(raw, source)
    except ModelLoadError as exc:
        raise _with_defaults(exc, taken, family, source) from None
    tensors, origin = ckpt.read_tensors(root, allow_torch_bin=family.torch_bin)
    config = family.finish(config, tensors)
    tensors = ckpt.untie(tensors, family.head, family.embedding, family.tied(config), origin, flag=family.tie_flag)
    try:
        ckpt.check_shapes(family.expected_shapes(config), tensors, origin)
    except ModelLoadError as exc:
        raise _with_defaults(exc, taken, family, source) from None
    ckpt.check_values(tensors, origin)
    stored = ckpt.storage_dtype(tensors, origin, family.free_dtype)
    stated = family.stated_dtype(raw)
    if stated is not None and stated[1] != stored:
        example = next(n for n, t in tensors.items() if not n.endswith(family.free_dtype))
        raise ModelLoadError(f"{source}: {stated[0]} is {stated[1]!r} but the weights are stored in {stored} "
                             f"({example!r} in {origin[example]!r}); correct {stated[0]} or convert the weights")
    return family.with_dtype(config, stored), tensors


def _with_defaults(exc: ModelLoadError, taken: Mapping[str, Any], family: Family, source: str) -> ModelLoadError:
    """``exc`` led by the shape-deciding keys config.json lacks (their defaults are the likeliest cause)."""
    if not taken:
        return exc
    detail = str(exc).removeprefix(f"{source}: ")
    keys = ", ".join(f"{k} (default {v!r})" for k, v in taken.items())
    return ModelLoadError(f"{source}: lacks {keys}, so {family.defaults_of} defaults apply, and then: {detail}")


def build_model(config: Any, tensors: Mapping[str, torch.Tensor], contract: Contract,
                device: torch.device | str | None = None, tp: TPGroup | None = None) -> CausalLM:
    """The causal LM of ``config``'s family over ``tensors`` under ``contract``, on ``device`` (default:
    the backend's), computing in ``contract.model_dtype`` whatever the tensors' dtype (an explicit cast;
    ``model.config.dtype`` keeps the stored one). ``tp``: this rank's group; every rank passes the full
    tensors. Raises ModelLoadError for weights the layers refuse, AlignedMambaError for a TP degree
    that cannot keep the bits (``parallel.check_tp``), TypeError for an unknown config class.
    """
    family = family_for_config(config)
    return family.build(config, tensors, contract, resolve(contract, device), tp=tp)


def contract_for(config: Any, *, backend: str = "torch", model_dtype: str | None = None,
                 state_dtype: str = "float32") -> Contract:
    """The contract a checkpoint implies: its chunk size, ``backend``, ``state_dtype`` (ContractError
    unless fp32), ``model_dtype`` (default: the storage dtype)."""
    family = family_for_config(config)
    return Contract.from_hf_config(family.hf_dict(config), backend=backend, state_dtype=state_dtype,
                                   model_dtype=model_dtype or family.config_dtype(config))


def load_model(path: str | os.PathLike[str], contract: Contract | None = None,
               device: torch.device | str | None = None, *, cast: bool = False, tp: TPGroup | None = None) -> CausalLM:
    """A checkpoint directory as a model whose ``forward(sequences)`` ([len_i] int64 token ids each)
    returns the trainer's logits, [len_i, vocab] each. ``contract`` defaults to the checkpoint's own
    (its chunk size, the torch backend, its stored dtype); the sampler must run the same one.

    Raises ModelLoadError as ``load_checkpoint`` does, and for a contract whose ``model_dtype`` is not
    the stored dtype unless ``cast=True`` (``model.dtype`` is then the computed one).
    """
    config, tensors = load_checkpoint(path)
    stored = family_for_config(config).config_dtype(config)
    if contract is not None and contract.model_dtype != stored and not cast:
        raise ModelLoadError(f"{os.fspath(path)!r} stores {stored} weights but the contract's model_dtype is "
                             f"{contract.model_dtype}; aligned_mamba.models.load_model(..., cast=True) computes in "
                             f"{contract.model_dtype} from them, or use a {stored} contract")
    return build_model(config, tensors, contract or contract_for(config), device, tp=tp)
