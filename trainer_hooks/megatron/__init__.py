"""``--aligned-mamba``: Megatron-Core's Mamba2 forward on the shared kernels and contract.

With the hook on, Megatron's MambaModel computes each logits row with the very functions the
sampler runs (the core's Mamba2 layer, ``aligned_mamba.layers.mamba2.Mamba2Mixer``, and the ops of
the contract's backend), under the contract's chunk size, backend and kernel configs, so trainer
logits equal the sampler's bit for bit.

Supported: megatron-core 0.16.x (``SUPPORTED_MEGATRON_CORE``), a pure Mamba2 ``MambaModel`` or a
hybrid one (Nemotron-H: ``hybrid_override_pattern`` of M, *, - and E layers) at tensor, pipeline,
context and expert parallel size 1, built from Megatron's own non-Transformer-Engine modules
(``local_mamba_stack_spec``), params dtype = the contract's model dtype, no dropout. Rotary or
learned position embeddings, sliding-window attention, query/key norms, output gates, softmax
offsets, other scales, gated or non-squared-ReLU MLPs, MoE routers other than Nemotron-H's (sigmoid,
group-limited top-k, expert bias), MoE aux losses, latent projections and padding masks are refused,
by name.

Use (Megatron-LM)::

    pretrain(..., extra_args_provider=trainer_hooks.megatron.add_arguments)
    # in model_provider, before building the MambaModel:
    hook = trainer_hooks.megatron.apply_from_args(get_args())   # None without --aligned-mamba

Frameworks that build Megatron models themselves call ``apply_from_config(transformer_config,
contract)`` (or ``install(contract)``) before building the model, or ``hook.apply_to_model(model)``.

The pieces, one module each: ``arguments`` (the flags and ``apply_from_*``), ``hook`` (``install``
and ``AlignedMambaHook.apply_to_model``), ``patch`` (every Megatron name replaced, and why),
``forwards`` and ``norms`` (the aligned forwards over a Megatron module's own parameters),
``refusals`` (what is refused, one line each), ``spec`` (the ModuleSpecs the hook covers).

What ``install`` patches, in place (``uninstall`` restores it):

- ``megatron.core.ssm.mamba_mixer``: ``MambaMixer.forward`` runs the core's ``Mamba2Mixer`` over
  the layer's own parameters: in_proj and out_proj as the backend's row-invariant linear, conv1d + SiLU, the chunked
  scan with every sequence's chunk grid anchored at its own start (THD packing through
  ``packed_seq_params.cu_seqlens_q(_padded)``, or each row of an [s, b] batch), an fp32 SSM state,
  and the gate in the grouped RMSNorm after the scan. ``MambaMixer.__init__`` takes its chunk size
  from the contract (a spec passing another one is refused, naming both). ``ExtendedRMSNorm`` (the
  gated norm) becomes ``AlignedGatedRMSNorm``; the stock kernel names (``mamba_chunk_scan_combined``,
  ``mamba_split_conv1d_scan_combined``, ``causal_conv1d_fn``, ``causal_conv1d_update``,
  ``selective_state_update``) become stubs that refuse: the aligned forward never calls them, and
  a Megatron path that would (its own inference/decode) must not run unaligned bits.
- ``megatron.core.ssm.mamba_block.TENorm`` (the final norm MambaStack hard-codes) becomes
  ``AlignedRMSNorm``.
- ``MambaModel.__init__`` ends with ``apply_to_model``: every module of the model is checked against
  what the hook covers (anything else, e.g. a Transformer Engine layer or a MoE layer, is refused with
  its path and class or the feature), and the embedding, per-layer norms and output layer get
  forwards on the shared ops. Hybrid layers get per-instance forwards (Megatron's classes are left
  alone, so a GPT model in the same process is untouched): each ``SelfAttention`` runs the core's
  attention layer (``aligned_mamba.layers.attention.Attention``: q/k/v taken apart from linear_qkv's
  per-group rows, the blocked causal attention per sequence from its own position 0, THD packing or
  each row of an [s, b] batch), each ``MLP`` the core's ``layers.mlp.MLP`` (squared ReLU), each
  ``MoELayer`` the core's ``layers.moe.MoE`` over its router, experts and shared expert (Megatron's
  token dispatcher is not used; the router's token counts for its expert-bias update are kept).
"""

from __future__ import annotations

from .arguments import add_arguments, apply_from_args, apply_from_config
from .hook import AlignedMambaHook, install, installed
from .norms import AlignedGatedRMSNorm, AlignedRMSNorm
from .refusals import SUPPORTED_MEGATRON_CORE, AlignmentRefused
from .spec import aligned_mamba_stack_spec, local_mamba_stack_spec

__all__ = ["SUPPORTED_MEGATRON_CORE", "AlignedGatedRMSNorm", "AlignedMambaHook", "AlignedRMSNorm",
           "AlignmentRefused", "add_arguments", "aligned_mamba_stack_spec", "apply_from_args", "apply_from_config",
           "install", "installed", "local_mamba_stack_spec"]
