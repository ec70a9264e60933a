"""``--aligned-mamba``: Megatron-Core's MambaModel (Mamba2, Nemotron-H hybrids) on the core's layers and
contract, so trainer logits equal the sampler's bit for bit.

Covered: megatron-core 0.16.x, Megatron's local modules (``local_mamba_stack_spec``), pipeline, context and
expert parallel size 1, TP a power of two dividing ``row_parallel_slices`` (MoE experts at expert TP = TP); the
rest is refused by name (``refusals``). TP: docs/tensor_parallel.md, "Megatron at TP k: the hook". What is
replaced: ``patch``.

Use (Megatron-LM)::

    pretrain(..., extra_args_provider=trainer_hooks.megatron.add_arguments)
    # in model_provider, before building the MambaModel:
    hook = trainer_hooks.megatron.apply_from_args(get_args())   # None without --aligned-mamba

Frameworks that build models themselves call ``apply_from_config(config, contract)`` (or ``install``) first.
"""

from __future__ import annotations

from .arguments import add_arguments, apply_from_args, apply_from_config
from .hook import AlignedMambaHook, install, installed
from .logprobs import token_logprobs
from .norms import AlignedGatedRMSNorm, AlignedRMSNorm
from .refusals import SUPPORTED_MEGATRON_CORE, AlignmentRefused
from .spec import aligned_mamba_stack_spec, local_mamba_stack_spec

__all__ = ["SUPPORTED_MEGATRON_CORE", "AlignedGatedRMSNorm", "AlignedMambaHook", "AlignedRMSNorm",
           "AlignmentRefused", "add_arguments", "aligned_mamba_stack_spec", "apply_from_args", "apply_from_config",
           "install", "installed", "local_mamba_stack_spec", "token_logprobs"]
