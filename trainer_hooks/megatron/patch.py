"""Every megatron.core name the hook replaces, and why; ``uninstall`` puts each back.

``install`` replaces names in place (``replacements``), so a stock script and spec need only the flag;
``apply_to_model`` sets a built module's instance ``forward`` only (``FORWARDS``), so Megatron's classes
stay stock and a GPT model in the same process is untouched.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import forwards
from .norms import AlignedGatedRMSNorm, AlignedRMSNorm
from .refusals import AlignmentRefused

if TYPE_CHECKING:
    from .hook import AlignedMambaHook

STOCK_KERNELS = ("mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined", "causal_conv1d_fn",
                 "causal_conv1d_update", "selective_state_update")
_MISSING = object()

# class name -> (the aligned forward its instances get, why)
FORWARDS: dict[str, tuple[Callable, str]] = {
    "VocabParallelEmbedding": (forwards.embedding_forward, "a row gather in the model dtype, as the core's embedding "
                               "(at TP > 1 the owner's row of the gathered offers)"),
    "ColumnParallelLinear": (forwards.linear_forward, "the backend's row-invariant linear (its vocabulary or "
                             "channel shard at TP > 1, gathered where asked)"),
    "RowParallelLinear": (forwards.linear_forward, "the backend's row-invariant linear; with row_parallel_slices "
                          "> 1 or TP > 1 the contract's sliced tree"),
    "RMSNorm": (forwards.torch_rms_norm_forward, "WrappedTorchNorm's torch RMSNorm on the shared op"),
    "MambaLayer": (forwards.mamba_layer_forward, "the core's layer, its norm given the fp32 residual as kept "
                   "(contract v3; Megatron's rounds it to params_dtype first), the norm and the add reading one "
                   "view of it, so its gradient terms add up in the core's order"),
    "SelfAttention": (forwards.attention_forward, "the core's attention layer over linear_qkv / linear_proj"),
    "MLP": (forwards.mlp_forward, "the core's squared-ReLU MLP over linear_fc1 / linear_fc2"),
    "MoELayer": (forwards.moe_forward, "the core's MoE layer over the router, experts and shared expert"),
}


def replacements(hook: AlignedMambaHook) -> list[tuple[Any, str, Any, str]]:
    """(owner, name, replacement, why) for every name ``install`` replaces, in the order it sets them."""
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.ssm import mamba_block
    from megatron.core.ssm import mamba_mixer as mm

    return [
        (mm.MambaMixer, "__init__", _mixer_init(hook, mm.MambaMixer.__init__),
         "the chunk size is the contract's; a spec passing another is refused, naming both"),
        (mm.MambaMixer, "forward", forwards.mixer_forward,
         "the core's Mamba2Mixer over the layer's own parameters, each sequence's chunk grid at its own start"),
        (mm, "ExtendedRMSNorm", AlignedGatedRMSNorm, "the gated norm on the shared op, the gate in the norm"),
        *((mm, name, refusing_kernel(name), "the aligned forward never calls it; a Megatron path that would "
           "(its own decode) must not run unaligned bits") for name in STOCK_KERNELS),
        (mamba_block, "TENorm", AlignedRMSNorm, "the final norm MambaStack hard-codes, on the shared op"),
        (MambaModel, "__init__", _model_init(hook, MambaModel.__init__),
         "every built model is checked and aligned (AlignedMambaHook.apply_to_model)"),
    ]


def patch(hook: AlignedMambaHook) -> list[tuple[Any, str, Any]]:
    """Set every replacement; returns (owner, name, what was there) for ``restore``."""
    saved: list[tuple[Any, str, Any]] = []
    for owner, name, value, _why in replacements(hook):
        saved.append((owner, name, owner.__dict__.get(name, _MISSING) if isinstance(owner, type)
                      else getattr(owner, name, _MISSING)))
        setattr(owner, name, value)
    return saved


def restore(saved: list[tuple[Any, str, Any]]) -> None:
    """Put back what ``patch`` replaced (last first), emptying ``saved``."""
    for owner, name, value in reversed(saved):
        if value is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, value)
    saved.clear()


def swap(module: torch.nn.Module, hook: AlignedMambaHook) -> None:
    """Give one checked module its aligned forward (``FORWARDS``), bound to ``hook``."""
    module.forward = types.MethodType(FORWARDS[type(module).__name__][0], module)
    module._aligned_mamba_hook = hook


def refusing_kernel(name: str) -> Callable:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AlignmentRefused(f"Megatron reached its stock kernel {name} with --aligned-mamba on (an inference or "
                               "decode path the hook does not cover); refused rather than run unaligned bits")

    refuse.__name__ = f"refused_{name}"
    return refuse


def _mixer_init(hook: AlignedMambaHook, orig_init: Callable) -> Callable:
    signature = inspect.signature(orig_init)

    @functools.wraps(orig_init)
    def mixer_init(mixer: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(mixer, *args, **kwargs)
        given = bound.arguments.get("chunk_size")
        if given is not None and given != hook.contract.chunk_size:
            raise AlignmentRefused(f"MambaMixer built with chunk_size={given} but the contract says chunk_size="
                                   f"{hook.contract.chunk_size}; trainer and sampler must share the chunk grid")
        bound.arguments["chunk_size"] = hook.contract.chunk_size
        _refuse_uneven_mixer(bound.arguments)
        orig_init(*bound.args, **bound.kwargs)

    return mixer_init


def _refuse_uneven_mixer(arguments: dict[str, Any]) -> None:
    """Megatron asserts (a bare AssertionError) that the TP size divides the Mamba heads and groups; say it
    in one line, naming the numbers, before it builds anything."""
    config, pg = arguments.get("config"), arguments.get("pg_collection")
    tp = getattr(pg, "tp", None)
    if config is None or tp is None or tp.size() == 1:
        return
    k = tp.size()
    heads = config.mamba_num_heads
    if heads is None:
        heads = int(arguments.get("expand", 2) * arguments["d_model"]) // config.mamba_head_dim
    uneven = [f"{n} {what}" for n, what in ((heads, "Mamba heads"), (config.mamba_num_groups, "groups")) if n % k]
    if uneven:
        raise AlignmentRefused(f"MambaMixer at tensor parallel size {k}: {' and '.join(uneven)} do not split evenly "
                               "across the ranks (Megatron gives each rank whole heads and groups; n_groups 1 cannot "
                               "be sharded by Megatron)")


def _model_init(hook: AlignedMambaHook, model_init: Callable) -> Callable:
    @functools.wraps(model_init)
    def mamba_model_init(model: Any, *args: Any, **kwargs: Any) -> None:
        model_init(model, *args, **kwargs)
        hook.apply_to_model(model)

    return mamba_model_init
