"""``--aligned-mamba``: Megatron-Core's Mamba2 forward on the shared kernels and contract.

With the hook on, Megatron's MambaModel computes each logits row with the very functions the
sampler runs (the core's Mamba2 layer, ``aligned_mamba.layers.mamba2.Mamba2Mixer``, and the ops of
the contract's backend), under the contract's chunk size, backend and kernel configs, so trainer
logits equal the sampler's bit for bit.

Supported: megatron-core 0.16.x (``SUPPORTED_MEGATRON_CORE``), a pure Mamba2 ``MambaModel`` or a
hybrid one (Nemotron-H: ``hybrid_override_pattern`` of M, *, - and E layers) at pipeline, context and
expert parallel size 1, built from Megatron's own non-Transformer-Engine modules
(``local_mamba_stack_spec``), params dtype = the contract's model dtype, no dropout. Rotary or
learned position embeddings, sliding-window attention, query/key norms, output gates, softmax
offsets, other scales, gated or non-squared-ReLU MLPs, MoE routers other than Nemotron-H's (sigmoid,
group-limited top-k, expert bias), MoE aux losses, latent projections and padding masks are refused,
by name.

Tensor parallelism (``--tensor-model-parallel-size`` k, a power of two dividing the contract's
``row_parallel_slices`` S; MoE layers only at k = 1; no sequence parallelism): each rank runs the core's
layers over its own shards with Megatron's TP group as an ``aligned_mamba.parallel.TPGroup``. The
row-parallel GEMMs (out_proj, o_proj, fc2) sum S fixed K slices by one pairwise tree whichever rank
computes them, the embedding picks the owner's row, the output layer gathers its vocabulary shards and
``token_logprobs(vocab_parallel=True)`` runs the sharded log-softmax; the only collective is an
all-gather. So TP 1, 2, 4 ... S give the reference trainer's bits under that contract.
``trainer_hooks.megatron_shards`` cuts a checkpoint per rank as Megatron does. Gradients: each gather's
backward gives a rank its own slot (every rank repeats what follows a gather), a replicated input entering
a rank's shard sums the ranks' partial gradients (Megatron's copy to the TP region), and the vocab-parallel
logprobs have the analytic backward; gradients are right, not bitwise across TP degrees.

Use (Megatron-LM)::

    pretrain(..., extra_args_provider=trainer_hooks.megatron.add_arguments)
    # in model_provider, before building the MambaModel:
    hook = trainer_hooks.megatron.apply_from_args(get_args())   # None without --aligned-mamba

Frameworks that build Megatron models themselves call ``apply_from_config(transformer_config,
contract)`` (or ``install(contract)``) before building the model, or ``hook.apply_to_model(model)``.

The pieces, one module each: ``arguments`` (the flags and ``apply_from_*``), ``hook`` (``install``
and ``AlignedMambaHook.apply_to_model``), ``patch`` (every Megatron name replaced, and why),
``forwards`` and ``norms`` (the aligned forwards over a Megatron module's own parameters),
``refusals`` (what is refused, one line each), ``spec`` (the ModuleSpecs the hook covers),
``logprobs`` (``token_logprobs`` of the output logits, as a loss function reads them).

What is patched (``patch``): in place, by ``install``, the Mamba2 layer's ``MambaMixer.__init__``
(the contract's chunk size) and ``.forward`` (the core's ``Mamba2Mixer`` over the layer's own
parameters, each sequence's chunk grid at its own start, the gate in the norm after the scan), the
gated and final norms, the stock kernels (stubs that refuse) and ``MambaModel.__init__`` (which ends
with ``apply_to_model``); per module of a built model, by ``apply_to_model``, the instance forwards
of the embedding, linears, norms, attention, MLP and MoE layers, so Megatron's classes stay stock.
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
