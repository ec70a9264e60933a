"""Model families on one generic causal LM: ``load_model(path, contract=None)`` loads a checkpoint
directory, ``build_model(config, tensors, contract)`` builds from memory. Families, one file each:
``mamba2`` (Hugging Face's Mamba2ForCausalLM), ``mamba_ssm`` (MambaLMHeadModel), ``nemotron_h``
(Hugging Face's NemotronHForCausalLM, hybrid)."""

from __future__ import annotations

from typing import Any

import torch

from . import mamba2, mamba_ssm, nemotron_h  # noqa: F401 (each registers its family)
from .causal_lm import Block, Cache, CausalLM, LMShape
from .registry import (
    FAMILIES,
    Family,
    build_model,
    contract_for,
    describe,
    family_for_config,
    family_of,
    load_checkpoint,
    load_model,
    register,
)

TINY = "tiny"


def load_source(model: str, dtype: str | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """The CLI's ``--model``: "tiny" (``mamba2.make_tiny(0)``, bf16 unless ``dtype``) or a checkpoint
    directory (``dtype`` unused: the contract's model dtype decides). ModelLoadError from loading."""
    if model == TINY:
        return mamba2.make_tiny(0, dtype=dtype or "bfloat16")
    return load_checkpoint(model)


__all__ = ["FAMILIES", "TINY", "Block", "Cache", "CausalLM", "Family", "LMShape", "build_model", "contract_for",
           "describe", "family_for_config", "family_of", "load_checkpoint", "load_model", "load_source", "register"]
