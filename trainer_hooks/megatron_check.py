"""``aligned-mamba check --trainer megatron``: a real Megatron-Core MambaModel, hook applied, as the trainer.

``build_trainer`` (the ``aligned_mamba.trainers`` entry point) builds a MambaModel from Megatron's own
non-TE modules (``local_mamba_stack_spec``) with the hook installed for the check's contract, loads the
checkpoint through ``megatron_weights.hf_to_megatron`` and scores sequences in one packed (THD) pass.
On a CPU-only machine it applies ``megatron_cpu``'s shims first and starts a one-rank world.

``build_mamba_model`` and ``load_hf_weights`` are also what the tests use, with the hook on or off;
``build_hooked_model`` (process set up, hook installed, model built and loaded) is shared with the RL
trainer ``trainer_hooks.megatron_rl``.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import torch

from aligned_mamba.contract import Contract
from aligned_mamba.errors import ModelLoadError
from aligned_mamba.model.config import Mamba2Config

from . import megatron as hook_module
from .megatron_weights import hf_to_megatron

__all__ = ["MegatronScorer", "build_hooked_model", "build_mamba_model", "build_trainer", "load_hf_weights",
           "megatron_packed_logits", "megatron_transformer_config", "prepare_process"]

# MambaMixer hard-codes its gated norm's eps; a checkpoint with another eps is not Megatron-representable
MEGATRON_GATED_NORM_EPS = 1e-5


def prepare_process() -> None:
    """One-rank torch.distributed + model-parallel groups; on a CPU-only machine also the CPU shims."""
    from . import megatron_cpu

    if not torch.cuda.is_available():
        megatron_cpu.setup()
    megatron_cpu.init_single_process()


def megatron_transformer_config(config: Mamba2Config, dtype: str) -> Any:
    """The TransformerConfig of a pure Mamba2 model with ``config``'s shapes, params in ``dtype``.

    Refuses (ModelLoadError) what Megatron's MambaMixer cannot represent: biases on in/out_proj, no conv bias, a
    time_step_limit (Megatron does not clamp dt), a layer_norm_epsilon other than the gated norm's 1e-5.
    """
    from megatron.core.transformer import TransformerConfig

    if config.use_bias:
        raise ModelLoadError("use_bias=True: Megatron's MambaMixer has no in_proj/out_proj bias")
    if not config.use_conv_bias:  # MambaMixer.__init__ tags conv1d.bias unconditionally (0.16.1)
        raise ModelLoadError("use_conv_bias=False: megatron-core 0.16's MambaMixer cannot be built without a conv bias")
    if tuple(config.time_step_limit) != (0.0, math.inf):
        raise ModelLoadError(f"time_step_limit {config.time_step_limit}: Megatron's MambaMixer does not clamp dt")
    if config.layer_norm_epsilon != MEGATRON_GATED_NORM_EPS:
        raise ModelLoadError(f"layer_norm_epsilon {config.layer_norm_epsilon}: Megatron's MambaMixer hard-codes "
                             f"{MEGATRON_GATED_NORM_EPS} for its gated norm")
    return TransformerConfig(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_attention_heads=1,
        mamba_state_dim=config.state_size, mamba_head_dim=config.head_dim, mamba_num_groups=config.n_groups,
        mamba_num_heads=config.num_heads, params_dtype=getattr(torch, dtype), bf16=dtype == "bfloat16",
        layernorm_epsilon=config.layer_norm_epsilon, normalization="RMSNorm", hidden_dropout=0.0,
        attention_dropout=0.0, fp32_residual_connection=config.residual_in_fp32,
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=False, add_bias_linear=False)


def build_mamba_model(config: Mamba2Config, dtype: str, *, chunk_size: int | None = None) -> Any:
    """A Megatron MambaModel of ``config``'s shape (weights uninitialised: load them). With the hook installed
    it is aligned on construction; ``chunk_size`` (only without the hook, or equal to the contract's) is
    passed to every MambaMixer explicitly."""
    from megatron.core.models.mamba.mamba_model import MambaModel

    spec = hook_module.local_mamba_stack_spec(config.layer_norm_epsilon, conv_bias=config.use_conv_bias)
    if chunk_size is not None:
        spec.submodules.mamba_layer.submodules.mixer.params["chunk_size"] = chunk_size
    return MambaModel(megatron_transformer_config(config, dtype), spec, vocab_size=config.vocab_size,
                      max_sequence_length=1 << 20, share_embeddings_and_output_weights=config.tie_word_embeddings,
                      position_embedding_type="none")


def load_hf_weights(model: Any, config: Mamba2Config, tensors: dict[str, torch.Tensor]) -> None:
    """Load HF-named tensors into ``model`` (renamed by ``hf_to_megatron``), each parameter first switched to
    the stored tensor's dtype (in place: the same Parameter objects, which MambaMixer's context-parallel
    helper also holds), so values are copied exactly, never cast into Megatron's params dtype. The forward
    casts as Mamba2LM does (e.g. fp32 A_log / D / dt_bias stay fp32, as make_tiny stores them)."""
    sd = hf_to_megatron(tensors, config)
    params = dict(model.named_parameters())
    for name, value in sd.items():
        param = params.get(name)
        if param is not None and param.dtype != value.dtype:
            param.data = param.data.to(value.dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ModelLoadError(f"Megatron model and checkpoint differ: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")


class MegatronScorer:
    """The trainer side of a check: ``forward(sequences)`` -> per sequence [len_i, vocab] logits (model dtype),
    one packed THD pass through the Megatron model."""

    def __init__(self, model: Any, contract: Contract) -> None:
        self.model = model
        self.contract = contract

    def forward(self, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
        """sequences: list of [len_i] int64 token ids."""
        logits = megatron_packed_logits(self.model, sequences)
        return list(torch.split(logits, [int(s.numel()) for s in sequences]))


def megatron_packed_logits(model: Any, sequences: list[torch.Tensor]) -> torch.Tensor:
    """One THD forward of MambaModel over the packed sequences -> [sum len_i, vocab] logits (grad follows
    torch's grad mode; the model is left in the mode it is in)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = [int(s.numel()) for s in sequences]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.cat([s.to(torch.int64) for s in sequences])[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                             max_seqlen_kv=max(lens))
    return model(ids, pos, attention_mask=None, packed_seq_params=params)[0]


def build_hooked_model(config: Mamba2Config, tensors: dict[str, torch.Tensor], contract: Contract) -> Any:
    """A MambaModel with the hook installed for ``contract`` (the process prepared first: one-rank world, CPU
    shims without CUDA), loaded from HF-named ``tensors`` (each parameter in its tensor's dtype), left in the
    mode a freshly built module is in (train)."""
    prepare_process()
    hook_module.install(contract)
    model = build_mamba_model(config, contract.model_dtype)
    load_hf_weights(model, config, tensors)
    return model


def build_trainer(*, config: Mamba2Config, tensors: dict[str, torch.Tensor], contract: Contract) -> MegatronScorer:
    """Entry point of ``aligned-mamba check --trainer megatron``: the hook installed for ``contract``, a
    MambaModel built and loaded from the checkpoint, in eval mode. ``ALIGNED_MAMBA_MEGATRON_HOOK=off`` builds
    Megatron's stock forward instead (the "hook off" demonstration: its rows differ)."""
    prepare_process()
    if os.environ.get("ALIGNED_MAMBA_MEGATRON_HOOK", "on") == "off":
        # A demonstration only: Megatron's stock forward at the contract's chunk size, to show that it
        # differs from the sampler; it does not run under the contract it reports.
        print("aligned-mamba: ALIGNED_MAMBA_MEGATRON_HOOK=off: Megatron's stock forward (expect differing rows)",
              file=sys.stderr)
        model = build_mamba_model(config, contract.model_dtype, chunk_size=contract.chunk_size)
        load_hf_weights(model, config, tensors)
    else:
        model = build_hooked_model(config, tensors, contract)
    model.eval()
    return MegatronScorer(model, contract)
