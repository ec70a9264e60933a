"""Model families on one generic causal LM.

``load_model(path, contract=None)`` loads a checkpoint directory of any registered family;
``build_model(config, tensors, contract)`` builds one from memory; ``load_source("tiny" | DIR)``
is the CLI's model argument (the embedded default or a directory). Families, one file each:

- ``mamba2``: Hugging Face's ``Mamba2ForCausalLM`` layout (the embedded default's);
- ``mamba_ssm``: mamba_ssm's ``MambaLMHeadModel`` layout (state-spaces/mamba2-* as published);
- ``nemotron_h``: Hugging Face's ``NemotronHForCausalLM`` layout, hybrid Mamba2 / attention / MLP
  layers (``nemotron_h.make_tiny_hybrid`` makes small ones).
"""

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
    """The CLI's ``--model``: "tiny" is the embedded default (``mamba2.make_tiny(0)``, bf16 unless
    ``dtype``), anything else a checkpoint directory of a registered family (``dtype`` unused: the
    contract's model dtype decides what the model computes in)."""
    if model == TINY:
        return mamba2.make_tiny(0, dtype=dtype or "bfloat16")
    return load_checkpoint(model)


__all__ = ["FAMILIES", "TINY", "Block", "Cache", "CausalLM", "Family", "LMShape", "build_model", "contract_for",
           "describe", "family_for_config", "family_of", "load_checkpoint", "load_model", "load_source", "register"]
