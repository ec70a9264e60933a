"""The flags (``--aligned-mamba``, ``--aligned-mamba-contract``) and the entry points that install the hook."""

from __future__ import annotations

import argparse
from typing import Any

from aligned_mamba.contract import Contract

from .hook import AlignedMambaHook, install
from .refusals import config_problems, parallel_problems, refuse_problems


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider``: adds the two flags; returns the parser (Megatron-LM reassigns it)."""
    group = parser.add_argument_group("aligned-mamba", "bitwise train/inference alignment of the Mamba2 forward")
    group.add_argument("--aligned-mamba", action="store_true",
                       help="run Megatron's Mamba2 forward on aligned_mamba's shared kernels and contract, so trainer "
                            "logits equal the sampler's bit for bit")
    group.add_argument("--aligned-mamba-contract", default="default", metavar="NAME_OR_PATH",
                       help="contract name (aligned_mamba configs/contracts) or YAML path (default: 'default'); "
                            "the sampler must run the same one")
    return parser


def apply_from_args(args: argparse.Namespace) -> AlignedMambaHook | None:
    """Install the hook when ``args.aligned_mamba`` is set (Megatron-LM's parsed args), else None; first refuses,
    in one line, what it cannot align (``refusals``, fp16, the TE implementation, another params dtype)."""
    if not getattr(args, "aligned_mamba", False):
        return None
    contract = Contract.from_yaml(getattr(args, "aligned_mamba_contract", None) or "default")
    problems = parallel_problems(
        tp=getattr(args, "tensor_model_parallel_size", 1), pp=getattr(args, "pipeline_model_parallel_size", 1),
        cp=getattr(args, "context_parallel_size", 1), fp8=getattr(args, "fp8", None),
        hidden_dropout=getattr(args, "hidden_dropout", 0.0), slices=contract.row_parallel_slices)
    if getattr(args, "fp16", False):
        problems.append("--fp16 (fp16 is not a contract model dtype)")
    params_dtype = getattr(args, "params_dtype", None)  # Megatron-LM sets it from --bf16 / --fp16 in validation
    dtype = str(params_dtype).removeprefix("torch.") if params_dtype is not None else \
        ("bfloat16" if getattr(args, "bf16", False) else "float32")
    if dtype != contract.model_dtype:
        problems.append(f"params dtype {dtype} (contract model_dtype {contract.model_dtype})")
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        problems.append("--transformer-impl transformer_engine (TE layers are not covered; use 'local' and "
                        "trainer_hooks.megatron.local_mamba_stack_spec)")
    refuse_problems(problems)
    return install(contract)


def apply_from_config(config: Any, contract: Contract | str) -> AlignedMambaHook:
    """Install the hook for a framework that builds Megatron models from a ``TransformerConfig``; ``contract``:
    a Contract, name or YAML path. Refuses what ``apply_from_args`` refuses."""
    if not isinstance(contract, Contract):
        contract = Contract.from_yaml(contract)
    refuse_problems(config_problems(config, contract))
    return install(contract)
