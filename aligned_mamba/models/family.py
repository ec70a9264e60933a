"""``Family``: one checkpoint layout on the generic causal LM, with the defaults most layouts share.

To add a family, subclass ``Family`` in a file of ``models/``, set its names and override only what
differs, and ``registry.register`` an instance. The base reads the config's ``lm_shape()``,
``mixer_config()``, ``dtype``, ``num_hidden_layers``, ``to_hf_dict()`` and ``from_hf_dict(d,
source=...)``, and builds ``layer_kinds(config)`` ("M" Mamba2 per layer by default) as pre-norm
blocks ``backbone.layers.{i}.norm`` + ``.mixer``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from ..contract import Contract
from ..layers import mamba2 as mamba2_layer
from ..layers.base import Layer
from ..layers.mamba2 import Mamba2Mixer
from ..layers.norm import RMSNorm, RMSNormConfig
from ..ops.backend import Backend
from ..parallel import TPGroup, shard
from . import hf_config
from .causal_lm import Block, CausalLM

MAMBA = "M"
LAYERS = "backbone.layers."


class Family:
    """One checkpoint layout. architectures / model_types: the config.json values it answers to;
    head / embedding: the weight names a tied checkpoint may store twice; tie_flag: the key tying
    them; torch_bin: pytorch_model.bin accepted; free_dtype: name suffixes that may be fp32 besides
    the storage dtype; shape_keys: shape-deciding keys named with their ``defaults_of`` defaults
    when absent and the tensors disagree."""

    name: str
    config_type: type
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    head: str = "lm_head.weight"
    embedding: str = "backbone.embeddings.weight"
    torch_bin: bool = False
    tie_flag: str = "tie_word_embeddings"
    free_dtype: tuple[str, ...] = (".A_log", ".D", ".dt_bias")
    shape_keys: tuple[str, ...] = ()
    defaults_of: str = "the family's"

    # -- the config.json dict ------------------------------------------------------------------------------------
    def matches(self, d: dict) -> bool:
        """Whether a config dict without ``architectures`` / ``model_type`` is this layout."""
        return False

    def read_config(self, d: dict, source: str) -> Any:
        return self.config_type.from_hf_dict(d, source=source)

    def hf_dict(self, config: Any) -> dict:
        """The config as a dict (``Contract.from_hf_config`` reads chunk_size from it)."""
        return config.to_hf_dict()

    def stated_dtype(self, d: dict) -> tuple[str, str] | None:
        """(key, dtype name) of the storage dtype the config.json dict states, None when it states none."""
        return None

    def defaults_taken(self, d: Mapping[str, Any]) -> dict[str, Any]:
        """{key: default} for each ``shape_keys`` key absent from the config.json dict ``d``."""
        return hf_config.defaults_of(self.config_type, self.shape_keys, d)

    # -- the config --------------------------------------------------------------------------------------------
    def tied(self, config: Any) -> bool:
        return config.lm_shape().tie_word_embeddings

    def config_dtype(self, config: Any) -> str:
        """The storage dtype the config states."""
        return config.dtype

    def num_layers(self, config: Any) -> int:
        return config.num_hidden_layers

    def finish(self, config: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
        """The config completed from the stored tensors."""
        return config

    def with_dtype(self, config: Any, dtype: str) -> Any:
        """The config with ``dtype`` the stored one (a dataclass with a ``dtype`` field; others unchanged)."""
        if dataclasses.is_dataclass(config) and any(f.name == "dtype" for f in dataclasses.fields(config)):
            return dataclasses.replace(config, dtype=dtype)
        return config

    # -- the stack ---------------------------------------------------------------------------------------------
    def layer_kinds(self, config: Any) -> str:
        """One character per layer (``nemotron_h``'s pattern letters); all Mamba2 by default."""
        return MAMBA * self.num_layers(config)

    def block_shapes(self, config: Any, kind: str) -> dict[str, tuple[int, ...]]:
        """A block's weights under ``backbone.layers.{i}.`` in the layout's order: norm, then mixer."""
        hidden = config.lm_shape().hidden_size
        mixer = config.mixer_config().weight_shapes()
        return {"norm.weight": (hidden,), **{"mixer." + name: shape for name, shape in mixer.items()}}

    def mixer(self, config: Any, kind: str, tensors: Mapping[str, torch.Tensor], prefix: str, backend: Backend,
              dtype: torch.dtype, contract: Contract, tp: TPGroup | None = None) -> Layer:
        """The mixer of a layer of ``kind`` over the full checkpoint's weights under ``prefix`` (cut for ``tp``)."""
        m = config.mixer_config()
        if tp is not None and tp.size > 1:
            tensors = mamba2_layer.shard_weights(m, tensors, prefix, tp)
        return Mamba2Mixer(m, tensors, prefix, backend=backend, dtype=dtype, chunk_size=contract.chunk_size,
                           tp=tp, slices=contract.row_parallel_slices)

    def norm_eps(self, config: Any) -> float:
        """The block norms' (and final norm's) epsilon."""
        return config.layer_norm_epsilon

    def max_len(self, config: Any) -> int | None:
        """The longest sequence the model takes (None: no limit of its own)."""
        return None

    def expected_shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """Every weight a checkpoint must hold with its shape, in a fixed order (no lm_head when tied)."""
        shape = config.lm_shape()
        shapes: dict[str, tuple[int, ...]] = {self.embedding: (shape.vocab_size, shape.hidden_size)}
        for i, kind in enumerate(self.layer_kinds(config)):
            shapes.update({f"{LAYERS}{i}.{name}": s for name, s in self.block_shapes(config, kind).items()})
        shapes["backbone.norm_f.weight"] = (shape.hidden_size,)
        if not self.tied(config):
            shapes[self.head] = (shape.vocab_size, shape.hidden_size)
        return shapes

    def build(self, config: Any, tensors: Mapping[str, torch.Tensor], contract: Contract,
              backend: Backend, tp: TPGroup | None = None) -> CausalLM:
        """The causal LM over ``tensors`` (``expected_shapes``) under ``contract``, in its model dtype;
        under ``tp`` each rank cuts its part of the full tensors itself."""
        from ..parallel import check_tp

        tp = tp or TPGroup.single()
        check_tp(contract, config, tp.size)
        dtype = getattr(torch, contract.model_dtype)
        dev = backend.device
        norm = RMSNormConfig(config.lm_shape().hidden_size, self.norm_eps(config))
        blocks = [Block(norm=RMSNorm.from_state_dict(tensors, f"{LAYERS}{i}.norm.", norm, backend, dtype),
                        mixer=self.mixer(config, kind, tensors, f"{LAYERS}{i}.mixer.", backend, dtype, contract,
                                         tp=tp))
                  for i, kind in enumerate(self.layer_kinds(config))]
        head = tensors[self.head] if self.head in tensors else tensors[self.embedding]
        embedding = tensors[self.embedding]
        if tp.size > 1:  # a vocabulary shard each (CausalLM.embed, CausalLM.logits)
            vocab = shard(config.lm_shape().vocab_size, tp)
            head, embedding = head[vocab], embedding[vocab]
        return CausalLM(family=self.name, config=config, shape=config.lm_shape(), contract=contract, backend=backend,
                        embedding=embedding.to(device=dev, dtype=dtype), blocks=blocks,
                        norm_f=RMSNorm.from_state_dict(tensors, "backbone.norm_f.", norm, backend, dtype),
                        lm_head=backend.linear_weight(head.to(device=dev, dtype=dtype)), max_len=self.max_len(config),
                        tp=tp)
