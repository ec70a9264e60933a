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

import argparse
import functools
import inspect
import math
import types
from collections.abc import Callable
from typing import Any

import torch

from aligned_mamba.contract import Contract
from aligned_mamba.errors import AlignedMambaError, ModelLoadError
from aligned_mamba.layers.attention import Attention, AttentionConfig
from aligned_mamba.layers.mamba2 import Mamba2Mixer, Mamba2MixerConfig
from aligned_mamba.layers.mlp import MLP as CoreMLP
from aligned_mamba.layers.mlp import MLPConfig
from aligned_mamba.layers.moe import MoE as CoreMoE
from aligned_mamba.layers.moe import MoEConfig
from aligned_mamba.ops.backend import Backend, resolve
from aligned_mamba.replay import Batch

__all__ = ["SUPPORTED_MEGATRON_CORE", "AlignedGatedRMSNorm", "AlignedMambaHook", "AlignedRMSNorm",
           "AlignmentRefused", "add_arguments", "apply_from_args", "apply_from_config", "install",
           "installed", "local_mamba_stack_spec"]

SUPPORTED_MEGATRON_CORE = ">=0.16.1,<0.17"
_STOCK_KERNELS = ("mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined", "causal_conv1d_fn",
                  "causal_conv1d_update", "selective_state_update")


class AlignmentRefused(AlignedMambaError):
    """Megatron would run something the hook cannot align (or under another contract); one line says what."""


# -- flags ---------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider``: adds ``--aligned-mamba`` and ``--aligned-mamba-contract``.

    Returns the parser (Megatron-LM's ``parse_args`` does ``parser = extra_args_provider(parser)``)."""
    group = parser.add_argument_group("aligned-mamba", "bitwise train/inference alignment of the Mamba2 forward")
    group.add_argument("--aligned-mamba", action="store_true",
                       help="run Megatron's Mamba2 forward on aligned_mamba's shared kernels and contract, so trainer "
                            "logits equal the sampler's bit for bit")
    group.add_argument("--aligned-mamba-contract", default="default", metavar="NAME_OR_PATH",
                       help="contract name (aligned_mamba configs/contracts) or YAML path (default: 'default'); "
                            "the sampler must run the same one")
    return parser


def apply_from_args(args: argparse.Namespace) -> AlignedMambaHook | None:
    """Install the hook when ``args.aligned_mamba`` is set (Megatron-LM's parsed args); else None.

    Refuses settings the hook cannot align before anything is built: tensor/pipeline/context
    parallel > 1, sequence parallel, fp8, fp16, dropout, the Transformer Engine implementation, and
    a params dtype other than the contract's model dtype.
    """
    if not getattr(args, "aligned_mamba", False):
        return None
    contract = Contract.from_yaml(getattr(args, "aligned_mamba_contract", None) or "default")
    problems = _parallel_problems(
        tp=getattr(args, "tensor_model_parallel_size", 1), pp=getattr(args, "pipeline_model_parallel_size", 1),
        cp=getattr(args, "context_parallel_size", 1), sequence_parallel=getattr(args, "sequence_parallel", False),
        fp8=getattr(args, "fp8", None), hidden_dropout=getattr(args, "hidden_dropout", 0.0))
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
    _refuse_problems(problems)
    return install(contract)


def apply_from_config(config: Any, contract: Contract | str) -> AlignedMambaHook:
    """Install the hook for a framework that builds Megatron models itself from a ``TransformerConfig``.

    ``contract``: a Contract, or a contract name / YAML path. Refuses what ``apply_from_args`` refuses.
    """
    if not isinstance(contract, Contract):
        contract = Contract.from_yaml(contract)
    _refuse_problems(_config_problems(config, contract))
    return install(contract)


def _parallel_problems(*, tp: int, pp: int, cp: int, sequence_parallel: bool, fp8: Any,
                       hidden_dropout: float) -> list[str]:
    out = []
    for name, size in (("tensor", tp), ("pipeline", pp), ("context", cp)):
        if (size or 1) > 1:
            out.append(f"{name} model parallel size {size} (only 1 is covered: each shard would be its own GEMM)")
    if sequence_parallel:
        out.append("sequence parallel")
    if fp8:
        out.append(f"fp8 ({fp8})")
    if hidden_dropout:
        out.append(f"hidden dropout {hidden_dropout} (random masks give other bits than the sampler; set it to 0)")
    return out


def _config_problems(config: Any, contract: Contract) -> list[str]:
    out = _parallel_problems(tp=config.tensor_model_parallel_size, pp=config.pipeline_model_parallel_size,
                             cp=config.context_parallel_size, sequence_parallel=config.sequence_parallel,
                             fp8=config.fp8, hidden_dropout=config.hidden_dropout)
    dtype = str(config.params_dtype).removeprefix("torch.")
    if dtype != contract.model_dtype:
        out.append(f"params_dtype {dtype} (contract model_dtype {contract.model_dtype})")
    if config.normalization != "RMSNorm":
        out.append(f"normalization {config.normalization!r} (Mamba2 norms are RMSNorm)")
    return out


def _refuse_problems(problems: list[str]) -> None:
    if problems:
        raise AlignmentRefused("--aligned-mamba cannot align this run: " + "; ".join(problems))


# -- aligned modules -----------------------------------------------------------------------------------


def _init_device(config: Any) -> torch.device | str | int:
    return "cpu" if config.use_cpu_initialization else torch.cuda.current_device()


class AlignedRMSNorm(torch.nn.Module):
    """RMSNorm on the shared op: the input rounded to the params dtype, normalised in fp32 by a fixed
    tree, times the weight, in the params dtype (what the core model does for layer and final norms).
    Constructor-compatible with Megatron's ``TENorm(config, hidden_size, eps)``; weight [hidden_size]."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype,
                                                    device=_init_device(config)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] any float dtype -> [..., hidden] in the params dtype."""
        return _aligned_rms_norm(_hook_for(self).backend(x.device), x, self.weight, self.eps, self.config.params_dtype)


def _aligned_rms_norm(backend: Backend, x: torch.Tensor, weight: torch.Tensor, eps: float,
                      dtype: torch.dtype) -> torch.Tensor:
    shape = x.shape
    return backend.rms_norm(x.reshape(-1, shape[-1]).to(dtype), weight, eps, dtype).reshape(shape)


class AlignedGatedRMSNorm(torch.nn.Module):
    """Mamba2's gated RMSNorm on the shared op: norm_g(y * silu(z)) * weight, the gate in the norm after
    the scan. Constructor-compatible with mamba_ssm's ``RMSNormGated`` as MambaMixer builds it."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = False, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if norm_before_gate:
            raise AlignmentRefused("gated norm with norm_before_gate=True: Mamba2 (HF, vLLM) gates before the norm")
        self.eps = eps
        self.group_size = group_size or hidden_size
        if hidden_size % self.group_size:
            raise AlignmentRefused(f"gated norm: hidden size {hidden_size} is not a multiple of group size "
                                   f"{self.group_size}")
        self.norm_before_gate = False
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, y: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """y, z [..., hidden] -> [..., hidden] in y's dtype."""
        if z is None:
            raise AlignmentRefused("gated norm called without z: the gate would have been applied inside the scan "
                                   "(Megatron's fused training path); the aligned forward gates in the norm")
        shape = y.shape
        d = shape[-1]
        backend = _hook_for(self).backend(y.device)
        out = backend.gated_rms_norm(y.reshape(-1, d), z.reshape(-1, d), self.weight.to(y.dtype), self.eps,
                                     d // self.group_size)
        return out.reshape(shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        """Distributed checkpointing: the weight sharded along dim 0 over the TP group (as ExtendedRMSNorm)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=(metadata or {}).get("dp_cp_group"))


def local_mamba_stack_spec(eps: float = 1e-5, *, conv_bias: bool = True, norm: Any = None,
                           moe_experts: int | None = None) -> Any:
    """A MambaStack spec from Megatron's own modules, no Transformer Engine, for pure and hybrid stacks.

    Mamba layers (``M``): the layer norm is ``WrappedTorchNorm`` (torch RMSNorm with
    ``normalization="RMSNorm"``; ``norm`` overrides), the mixer's in_proj / out_proj are
    ``ColumnParallelLinear`` / ``RowParallelLinear``. Attention layers (``*``): a ``TransformerLayer`` with
    ``input_layernorm=WrappedTorchNorm`` and a causal ``SelfAttention`` (linear_qkv ColumnParallelLinear,
    core_attention DotProductAttention, linear_proj RowParallelLinear). MLP layers (``-``): an ``MLPLayer``
    with ``pre_mlp_layernorm=WrappedTorchNorm`` and an ``MLP`` (linear_fc1 / linear_fc2). MoE layers (``E``,
    with ``moe_experts`` routed experts): a ``TransformerLayer`` with ``pre_mlp_layernorm=WrappedTorchNorm`` and
    Megatron's local ``MoELayer`` (``get_moe_module_spec(use_te=False)``: a ``TopKRouter``, a ``SequentialMLP``
    of ``MLP`` experts, a ``SharedExpertMLP``); without ``moe_experts`` none. The hook covers exactly these (it
    refuses the TE spec, whose layer norms are fused into the following linear). The mixer's chunk size is
    left to the hook (the contract's) or MambaMixer's default without it; attention, MLP and MoE layers take
    ``layernorm_epsilon`` from the TransformerConfig."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    mixer = ModuleSpec(module=MambaMixer, params={"conv_bias": conv_bias},
                       submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear))
    layer = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=ModuleSpec(module=norm or WrappedTorchNorm, params={"eps": eps}), mixer=mixer,
        mamba_bda=get_bias_dropout_add))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                                     core_attention=DotProductAttention,
                                                                     linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=WrappedTorchNorm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add))
    moe: dict[str, Any] = {}
    if moe_experts is not None:
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

        moe["moe_layer"] = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=get_moe_module_spec(use_te=False, num_experts=moe_experts, moe_grouped_gemm=False),
            mlp_bda=get_bias_dropout_add))
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(mamba_layer=layer, attention_layer=attention,
                                                                         mlp_layer=mlp, **moe))


# -- the hook ------------------------------------------------------------------------------------------

_INSTALLED: AlignedMambaHook | None = None


def installed() -> AlignedMambaHook | None:
    """The installed hook, or None."""
    return _INSTALLED


def install(contract: Contract) -> AlignedMambaHook:
    """Patch megatron.core's Mamba2 path for ``contract`` (idempotent for the same contract; another
    contract while one is installed is refused, naming both). Returns the hook (``uninstall()`` undoes it)."""
    global _INSTALLED
    if _INSTALLED is not None:
        if _INSTALLED.contract != contract:
            raise AlignmentRefused(f"the hook is installed with contract {_INSTALLED.contract}; refused to switch to "
                                   f"{contract} in the same process (uninstall first)")
        return _INSTALLED
    _check_megatron_version()
    hook = AlignedMambaHook(contract)
    hook._patch()
    _INSTALLED = hook
    return hook


def _check_megatron_version() -> None:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    try:
        found = version("megatron-core")
    except PackageNotFoundError:
        return  # a source checkout (Megatron-LM): megatron.core imported, version unknown; the names are checked
    if found not in SpecifierSet(SUPPORTED_MEGATRON_CORE):
        raise AlignmentRefused(f"megatron-core {found} is not supported by the hook (supported: "
                               f"{SUPPORTED_MEGATRON_CORE}); its Mamba2 path may differ")


class AlignedMambaHook:
    """The installed patches for one contract. ``apply_to_model`` checks and aligns a built model."""

    def __init__(self, contract: Contract) -> None:
        self.contract = contract
        self.dtype: torch.dtype = getattr(torch, contract.model_dtype)
        self._saved: list[tuple[Any, str, Any]] = []
        self._batch: tuple[tuple[int, ...], Batch] | None = None

    def backend(self, device: torch.device) -> Backend:
        """The contract's ops on ``device`` (the very object the core's models resolve)."""
        return resolve(self.contract, device)

    def batch_for(self, lens: list[int]) -> Batch:
        """The ``Batch`` of a forward over sequences of ``lens`` from empty states. Every mixer of a
        forward sees the same lengths, so they share one (a Batch never changes once built), and the
        Triton backend plans the step once per forward instead of once per layer (``Batch.derived``)."""
        key = tuple(lens)
        if self._batch is None or self._batch[0] != key:
            self._batch = (key, Batch.from_empty(lens))
        return self._batch[1]

    # -- patching --
    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING) if isinstance(owner, type)
                            else getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def _patch(self) -> None:
        from megatron.core.models.mamba.mamba_model import MambaModel
        from megatron.core.ssm import mamba_block
        from megatron.core.ssm import mamba_mixer as mm

        hook = self
        orig_init = mm.MambaMixer.__init__
        signature = inspect.signature(orig_init)

        @functools.wraps(orig_init)
        def mixer_init(mixer: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(mixer, *args, **kwargs)
            given = bound.arguments.get("chunk_size")
            if given is not None and given != hook.contract.chunk_size:
                raise AlignmentRefused(f"MambaMixer built with chunk_size={given} but the contract says chunk_size="
                                       f"{hook.contract.chunk_size}; trainer and sampler must share the chunk grid")
            bound.arguments["chunk_size"] = hook.contract.chunk_size
            orig_init(*bound.args, **bound.kwargs)

        model_init = MambaModel.__init__

        @functools.wraps(model_init)
        def mamba_model_init(model: Any, *args: Any, **kwargs: Any) -> None:
            model_init(model, *args, **kwargs)
            hook.apply_to_model(model)

        self._set(mm.MambaMixer, "__init__", mixer_init)
        self._set(mm.MambaMixer, "forward", _aligned_mixer_forward)
        self._set(mm, "ExtendedRMSNorm", AlignedGatedRMSNorm)
        for name in _STOCK_KERNELS:
            self._set(mm, name, _refusing_kernel(name))
        self._set(mamba_block, "TENorm", AlignedRMSNorm)
        self._set(MambaModel, "__init__", mamba_model_init)

    def uninstall(self) -> None:
        """Restore every patched name (models keep their aligned per-module forwards)."""
        global _INSTALLED
        for owner, name, value in reversed(self._saved):
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved.clear()
        if _INSTALLED is self:
            _INSTALLED = None

    def __enter__(self) -> AlignedMambaHook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -- models --
    def apply_to_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Check every module of a built MambaModel (DDP / Float16Module wrappers are unwrapped) against
        what the hook covers, and give the embedding, the norms, the linear layers, the attention layers
        (``SelfAttention``) and the MLPs aligned forwards. Refuses (``AlignmentRefused``, naming the module
        path and class, or the feature) anything else. Returns ``model``."""
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
        from megatron.core.models.mamba.mamba_model import MambaModel
        from megatron.core.ssm.mamba_block import MambaStack
        from megatron.core.ssm.mamba_layer import MambaLayer
        from megatron.core.ssm.mamba_mixer import MambaMixer
        from megatron.core.ssm.mlp_layer import MLPLayer
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
        from megatron.core.transformer.attention import SelfAttention
        from megatron.core.transformer.mlp import MLP
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.transformer_layer import TransformerLayer

        inner = model
        while not isinstance(inner, MambaModel) and isinstance(getattr(inner, "module", None), torch.nn.Module):
            inner = inner.module
        if not isinstance(inner, MambaModel):
            raise AlignmentRefused(f"{type(model).__name__} is not a Megatron MambaModel (or a wrapper of one)")
        _refuse_problems(_config_problems(inner.config, self.contract))
        if getattr(inner, "position_embedding_type", "none") != "none":
            raise AlignmentRefused(f"position_embedding_type {inner.position_embedding_type!r}: position embeddings "
                                   "(rotary or learned) are not covered (Mamba2 and Nemotron-H's attention have none)")
        # modules the aligned forwards of their parents read (or that compute nothing): not visited themselves
        covered: set[int] = set()
        for path, m in inner.named_modules():
            where = f"{path or '<model>'} ({type(m).__module__}.{type(m).__qualname__})"
            kind = type(m)
            if kind in (MambaModel, torch.nn.ModuleList, torch.nn.SiLU, torch.nn.Conv1d) or id(m) in covered:
                continue  # containers, and modules whose weights an aligned forward reads itself
            if kind is MambaStack:
                _check_layer_types(m, where, {"M": MambaLayer, "*": TransformerLayer, "-": MLPLayer,
                                              "E": TransformerLayer})
            elif kind is MambaLayer:
                if type(m.norm) not in (AlignedRMSNorm, torch.nn.RMSNorm):
                    raise AlignmentRefused(f"{where}: its pre-mixer norm is {type(m.norm).__name__}, not an RMSNorm "
                                           "the hook covers (a Transformer Engine spec fuses it into in_proj; use "
                                           "local_mamba_stack_spec)")
            elif kind is MambaMixer:
                self._check_mixer(m, where)
                covered.add(id(m.norm))  # the gated norm: the aligned mixer forward reads its weight and eps
            elif kind is TransformerLayer or kind is MLPLayer:
                moe = type(getattr(m, "mlp", None)) is MoELayer
                covered.update(_check_transformer_layer(m, where, attention=kind is TransformerLayer and not moe,
                                                        moe=moe))
            elif kind is MoELayer:
                _check_moe(m, where)
                self._swap(m, _aligned_moe_forward)
                covered.update(id(x) for x in m.modules() if x is not m)
            elif kind is SelfAttention:
                _check_attention(m, where)
                self._swap(m, _aligned_attention_forward)
                covered.update(id(x) for x in m.modules() if x is not m)
            elif kind is MLP:
                _check_mlp(m, where)
                self._swap(m, _aligned_mlp_forward)
                covered.update(id(x) for x in m.modules() if x is not m)
            elif kind is LanguageModelEmbedding:
                if m.add_position_embedding or m.tokentype_embeddings is not None:
                    raise AlignmentRefused(f"{where}: position or token-type embeddings are not part of Mamba2")
            elif kind is VocabParallelEmbedding:
                self._swap(m, _aligned_embedding_forward)
            elif kind is ColumnParallelLinear or kind is RowParallelLinear:
                if kind is RowParallelLinear and not m.input_is_parallel:
                    raise AlignmentRefused(f"{where}: input_is_parallel=False is not covered")
                # the output layer rounds its weight to the model dtype first, as the core's lm_head
                self._swap(m, _aligned_linear_forward)
                m._aligned_mamba_round_weight = path == "output_layer"
            elif kind is torch.nn.RMSNorm:
                if m.eps is None or tuple(m.normalized_shape) != (m.weight.shape[0],):
                    raise AlignmentRefused(f"{where}: an RMSNorm needs an explicit eps and a 1-d weight")
                self._swap(m, _aligned_torch_rms_norm_forward)
            elif kind is AlignedRMSNorm:
                pass
            elif kind is torch.nn.Dropout:
                if m.p:
                    raise AlignmentRefused(f"{where}: dropout p={m.p} gives other bits than the sampler; set it to 0")
            else:
                raise AlignmentRefused(f"{where} is not covered by --aligned-mamba (e.g. a Transformer Engine layer it "
                                       "has not been taught); refused rather than train on unaligned bits")
        inner._aligned_mamba_contract = self.contract
        return model

    def _swap(self, module: torch.nn.Module, forward: Callable) -> None:
        module.forward = types.MethodType(forward, module)
        module._aligned_mamba_hook = self

    def _check_mixer(self, m: Any, where: str) -> None:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        c = self.contract
        if m.chunk_size != c.chunk_size:
            raise AlignmentRefused(f"{where}: built with chunk_size={m.chunk_size} but the contract says chunk_size="
                                   f"{c.chunk_size} (install the hook before building the model)")
        problems = []
        if not m.rmsnorm:
            problems.append("rmsnorm=False (the gate would go inside the scan)")
        if m.norm_before_gate:
            problems.append("norm_before_gate=True")
        if m.D_has_hdim:
            problems.append("D_has_hdim=True (Mamba2 checkpoints have one D per head)")
        if m.cp.cp_size != 1 or m.pg_collection.tp.size() != 1:
            problems.append("tensor/context parallel > 1")
        if m.d_state % 4:
            problems.append(f"d_state {m.d_state} not a multiple of 4 (row bits could depend on alignment)")
        if m.d_inner % m.d_model:
            problems.append(f"d_inner {m.d_inner} is not a whole multiple of d_model {m.d_model}")
        if type(m.in_proj) is not ColumnParallelLinear or type(m.out_proj) is not RowParallelLinear:
            problems.append(f"in_proj/out_proj are {type(m.in_proj).__name__}/{type(m.out_proj).__name__}, not "
                            "ColumnParallelLinear/RowParallelLinear (e.g. Transformer Engine layers)")
        elif m.in_proj.bias is not None or m.out_proj.bias is not None:
            problems.append("in_proj/out_proj biases")
        norm = m.norm
        if not all(hasattr(norm, a) for a in ("weight", "eps", "group_size")) or getattr(norm, "norm_before_gate", 0):
            problems.append(f"gated norm {type(norm).__name__} is not one the hook covers")
        elif norm.group_size * m.ngroups != m.d_inner:
            problems.append(f"gated norm group size {norm.group_size} != d_inner / ngroups")
        if problems:
            raise AlignmentRefused(f"{where}: " + "; ".join(problems))


def _check_layer_types(stack: Any, where: str, covered: dict[str, type]) -> None:
    """Each layer of a MambaStack is the class the hook covers for its pattern symbol; any other layer class
    is refused, naming the layer, its symbol and the pattern."""
    pattern = "".join(stack.layer_type_list)
    for i, (symbol, layer) in enumerate(zip(stack.layer_type_list, stack.layers)):
        want = covered.get(symbol)
        if want is None or type(layer) is not want:
            raise AlignmentRefused(f"{where}: layer {i} ({symbol!r} in {pattern!r}) is a {type(layer).__name__}, not "
                                   f"the {getattr(want, '__name__', 'layer')} the hook covers (build the stack from "
                                   "local_mamba_stack_spec)")


def _check_transformer_layer(layer: Any, where: str, *, attention: bool, moe: bool = False) -> set[int]:
    """A hybrid attention layer (``TransformerLayer``: norm, self-attention, residual add, nothing else),
    MLP layer (``MLPLayer``: norm, MLP, residual add) or MoE layer (``TransformerLayer``: norm, ``MoELayer``,
    residual add). Returns the ids of its identity slots (visited no further). Refuses any other
    arrangement, e.g. a Transformer Engine spec (its norm fused into the next linear, the norm slot an
    IdentityOp) or a GPT block (attention and MLP in one layer)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    used = ("input_layernorm", "self_attention") if attention else ("pre_mlp_layernorm", "mlp")
    work = SelfAttention if attention else MoELayer if moe else MLP
    identity = [n for n in ("input_layernorm", "self_attention", "pre_cross_attn_layernorm", "cross_attention",
                            "pre_mlp_layernorm", "mlp") if n not in used]
    problems = []
    norm, inner = (getattr(layer, n) for n in used)
    if type(norm) not in (AlignedRMSNorm, torch.nn.RMSNorm):
        problems.append(f"its {used[0]} is {type(norm).__name__}, not an RMSNorm (a Transformer Engine spec fuses it "
                        "into the next linear; use local_mamba_stack_spec)")
    if type(inner) is not work:
        problems.append(f"its {used[1]} is {type(inner).__name__}, not Megatron's {work.__name__}")
    others = [n for n in identity if type(getattr(layer, n)) is not IdentityOp]
    if others:
        problems.append(f"{', '.join(others)} are not identities (one mixer per hybrid layer, as Nemotron-H)")
    bda = layer.self_attn_bda if attention else layer.mlp_bda
    if bda is not get_bias_dropout_add:
        problems.append(f"its residual add is {getattr(bda, '__name__', type(bda).__name__)}, not get_bias_dropout_add")
    if layer.config.apply_residual_connection_post_layernorm:
        problems.append("apply_residual_connection_post_layernorm (the residual would be the normed input)")
    if layer.hidden_dropout:
        problems.append(f"hidden dropout {layer.hidden_dropout}")
    if problems:
        raise AlignmentRefused(f"{where}: " + "; ".join(problems))
    slots = [getattr(layer, n) for n in identity] + [layer.cross_attn_bda, layer.mlp_bda if attention
                                                     else layer.self_attn_bda]
    return {id(x) for x in slots if isinstance(x, (IdentityOp, IdentityFuncOp))}


def _check_attention(m: Any, where: str) -> None:
    """A SelfAttention the core's attention layer computes: causal, grouped-query, no biases, no rotary,
    the default scale, none of the attention features the core lacks (each refused by name)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    cfg = m.config
    head_dim = m.hidden_size_per_attention_head
    problems = []
    if m.attn_mask_type != AttnMaskType.causal:
        problems.append(f"attn_mask_type {m.attn_mask_type.name} (only causal self-attention)")
    if cfg.window_size is not None:
        problems.append(f"sliding-window attention (window_size={cfg.window_size})")
    if cfg.attention_output_gate:
        problems.append("an output gate (attention_output_gate)")
    if cfg.qk_layernorm or m.q_layernorm is not None or m.k_layernorm is not None:
        problems.append("query/key norms (qk_layernorm)")
    if cfg.qk_l2_norm:
        problems.append("query/key L2 norms (qk_l2_norm)")
    if cfg.softmax_type != "vanilla":
        problems.append(f"softmax_type {cfg.softmax_type!r} (a softmax offset)")
    if cfg.softmax_scale is not None and cfg.softmax_scale != head_dim ** -0.5:
        problems.append(f"softmax_scale {cfg.softmax_scale} (the core scales scores by head_dim ** -0.5)")
    if cfg.apply_query_key_layer_scaling:
        problems.append("apply_query_key_layer_scaling")
    if cfg.attention_dropout:
        problems.append(f"attention dropout {cfg.attention_dropout}")
    if cfg.multi_latent_attention or cfg.experimental_attention_variant is not None:
        problems.append(f"attention variant {cfg.experimental_attention_variant or 'multi_latent_attention'}")
    if m.world_size != 1:
        problems.append("tensor parallel > 1")
    if type(m.linear_qkv) is not ColumnParallelLinear or type(m.linear_proj) is not RowParallelLinear:
        problems.append(f"linear_qkv/linear_proj are {type(m.linear_qkv).__name__}/{type(m.linear_proj).__name__}, "
                        "not ColumnParallelLinear/RowParallelLinear (e.g. Transformer Engine layers)")
    elif m.linear_qkv.bias is not None or m.linear_proj.bias is not None:
        problems.append("attention biases (add_bias_linear / add_qkv_bias; Nemotron-H's attention has none)")
    if type(m.core_attention) is not DotProductAttention:
        problems.append(f"core attention {type(m.core_attention).__name__} (only Megatron's DotProductAttention "
                        "slot, which the aligned forward replaces)")
    if problems:
        raise AlignmentRefused(f"{where}: attention with " + "; ".join(problems) + " is not covered")


def _check_mlp(m: Any, where: str) -> None:
    """An MLP the core's MLP layer computes: fc2(relu(fc1 x)^2), no gate, no biases."""
    from megatron.core.activations import squared_relu
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    cfg = m.config
    problems = []
    if cfg.gated_linear_unit:
        problems.append("a gated linear unit (gated_linear_unit; Nemotron-H's MLP has no gate)")
    if m.activation_func is not squared_relu or cfg.use_te_activation_func:
        act = getattr(m.activation_func, "__name__", type(m.activation_func).__name__)
        problems.append(f"activation {act} (only megatron.core.activations.squared_relu, Nemotron-H's relu2)")
    if cfg.activation_func_clamp_value is not None:
        problems.append(f"activation_func_clamp_value {cfg.activation_func_clamp_value}")
    if type(m.linear_fc1) is not ColumnParallelLinear or type(m.linear_fc2) is not RowParallelLinear:
        problems.append(f"linear_fc1/linear_fc2 are {type(m.linear_fc1).__name__}/{type(m.linear_fc2).__name__}, "
                        "not ColumnParallelLinear/RowParallelLinear (e.g. Transformer Engine layers)")
    elif m.linear_fc1.bias is not None or m.linear_fc2.bias is not None:
        problems.append("MLP biases (add_bias_linear)")
    elif m.tp_group.size() != 1:
        problems.append("tensor parallel > 1")
    if problems:
        raise AlignmentRefused(f"{where}: MLP with " + "; ".join(problems) + " is not covered")


def _check_moe(m: Any, where: str) -> None:
    """A MoELayer the core's MoE layer computes (Nemotron-H's): Megatron's TopKRouter with sigmoid scores
    (its expert bias, when enabled, as the score correction bias), group-limited top-k as Nemotron-H scores
    groups, no aux or z loss, no jitter; local ``SequentialMLP`` experts and one ``SharedExpertMLP``, each
    an MLP ``_check_mlp`` covers; no latent projection; expert parallel size 1."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    cfg, r = m.config, m.router
    problems = []
    if type(r) is not TopKRouter:
        problems.append(f"router {type(r).__name__} (only Megatron's TopKRouter)")
    else:
        if cfg.moe_router_score_function != "sigmoid":
            problems.append(f"moe_router_score_function {cfg.moe_router_score_function!r} (Nemotron-H's is sigmoid)")
        if r.bias is not None:
            problems.append("a router bias (add_bias_linear)")
        if r.is_aux_loss_enabled() or cfg.moe_z_loss_coeff or cfg.moe_input_jitter_eps:
            problems.append("an aux loss, z loss or input jitter (the aligned forward computes the layer's output "
                            "only)")
        groups = cfg.moe_router_num_groups or 1
        if groups > 1 and cfg.moe_router_topk // (cfg.moe_router_group_topk or 1) != 2:
            problems.append(f"moe_router_num_groups {groups} with topk {cfg.moe_router_topk} and group_topk "
                            f"{cfg.moe_router_group_topk} (Nemotron-H scores a group by its top 2 experts)")
        if cfg.moe_router_force_load_balancing or cfg.moe_router_fusion:
            problems.append("moe_router_force_load_balancing or moe_router_fusion")
    if cfg.moe_latent_size:
        problems.append(f"a latent projection (moe_latent_size={cfg.moe_latent_size})")
    if type(m.experts) is not SequentialMLP or m.num_local_experts != cfg.num_moe_experts:
        problems.append(f"experts {type(m.experts).__name__} over {m.num_local_experts} of {cfg.num_moe_experts} "
                        "experts (only SequentialMLP, expert parallel size 1)")
    if type(m.shared_experts) is not SharedExpertMLP or m.shared_experts.use_shared_expert_gate:
        problems.append("no shared expert, or a gated one (Nemotron-H's MoE has one ungated shared expert)")
    if problems:
        raise AlignmentRefused(f"{where}: MoE layer with " + "; ".join(problems) + " is not covered")
    for e, expert in enumerate(m.experts.local_experts):
        _check_mlp(expert, f"{where} expert {e}")
    _check_mlp(m.shared_experts, f"{where} shared expert")


_MISSING = object()


def _refusing_kernel(name: str) -> Callable:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AlignmentRefused(f"Megatron reached its stock kernel {name} with --aligned-mamba on (an inference or "
                               "decode path the hook does not cover); refused rather than run unaligned bits")

    refuse.__name__ = f"refused_{name}"
    return refuse


def _hook_for(module: Any) -> AlignedMambaHook:
    hook = getattr(module, "_aligned_mamba_hook", None) or _INSTALLED
    if hook is None:
        raise AlignmentRefused("aligned forward called without an installed hook")
    return hook


def _aligned_embedding_forward(self: Any, input_: torch.Tensor) -> torch.Tensor:
    """VocabParallelEmbedding at TP=1: a row gather, in the model dtype (the core model's embedding rows)."""
    hook = _hook_for(self)
    return torch.nn.functional.embedding(input_, self.weight).to(hook.dtype)


def _aligned_linear_forward(self: Any, input_: torch.Tensor, weight: torch.Tensor | None = None,
                            runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Column/RowParallelLinear at TP=1 on the backend's row-invariant linear: [..., in] -> ([..., out], bias
    or None)."""
    hook = _hook_for(self)
    backend = hook.backend(input_.device)
    w = self.weight if weight is None else weight
    if getattr(self, "_aligned_mamba_round_weight", False):
        w = w.to(hook.dtype)
    bias = getattr(self, "bias", None)
    skip = getattr(self, "skip_bias_add", False)
    shape = input_.shape
    out = backend.linear(input_.reshape(-1, shape[-1]), backend.linear_weight(w), None if skip else bias)
    return out.reshape(*shape[:-1], w.shape[0]), (bias if skip else None)


def _aligned_torch_rms_norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """torch.nn.RMSNorm (WrappedTorchNorm) on the backend's op, in the model dtype."""
    hook = _hook_for(self)
    return _aligned_rms_norm(hook.backend(x.device), x, self.weight, self.eps, hook.dtype)


def _core_mixer(m: Any, hook: AlignedMambaHook, device: torch.device) -> Mamba2Mixer:
    """The core's Mamba2 layer over a MambaMixer's own parameters (differentiable casts, rebuilt per
    forward: the optimizer moves the parameters)."""
    config = Mamba2MixerConfig(hidden_size=m.d_model, num_heads=m.nheads, head_dim=m.headdim, state_size=m.d_state,
                               n_groups=m.ngroups, conv_kernel=m.d_conv, use_bias=False,
                               use_conv_bias=m.conv1d.bias is not None, norm_eps=m.norm.eps, dt_limit=(0.0, math.inf))
    names = {"in_proj.weight": m.in_proj.weight, "conv1d.weight": m.conv1d.weight, "dt_bias": m.dt_bias,
             "A_log": m.A_log, "D": m.D, "norm.weight": m.norm.weight, "out_proj.weight": m.out_proj.weight}
    if m.conv1d.bias is not None:
        names["conv1d.bias"] = m.conv1d.bias
    return Mamba2Mixer(config, names, "", backend=hook.backend(device), dtype=hook.dtype,
                       chunk_size=hook.contract.chunk_size)


def _sequences(hidden_states: torch.Tensor, packed_seq_params: Any) -> tuple[list[int], torch.Tensor]:
    """The sequences of a Megatron layer input: hidden_states [s, b, d] (each batch row one sequence) or,
    with ``packed_seq_params``, THD [T, 1, d] cut at ``cu_seqlens_q(_padded)``. Returns (their lengths,
    the rows [sum lens, d] packed in that order)."""
    s, b, d = hidden_states.shape
    if packed_seq_params is None:
        return [s] * b, hidden_states.transpose(0, 1).reshape(b * s, d)
    if b != 1:
        raise AlignmentRefused(f"packed sequences (THD) need micro-batch size 1, got {b}")
    fmt = getattr(packed_seq_params, "qkv_format", "thd")
    if fmt != "thd":
        raise AlignmentRefused(f"packed_seq_params.qkv_format {fmt!r}: only 'thd' is covered")
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    bounds = [int(v) for v in cu.tolist()]
    if bounds[0] != 0 or any(a > c for a, c in zip(bounds, bounds[1:])) or bounds[-1] > s:
        raise AlignmentRefused(f"cu_seqlens {bounds[:8]}... are not offsets into {s} packed tokens")
    if bounds[-1] < s:  # tokens past the last offset form one more sequence (as Megatron's seq_idx does)
        bounds.append(s)
    return [c - a for a, c in zip(bounds, bounds[1:]) if c > a], hidden_states[:, 0]  # empty ones own no rows


def _layer_output(y: torch.Tensor, hidden_states: torch.Tensor, packed: bool, config: Any) -> torch.Tensor:
    """Rows [sum lens, d] (model dtype) back in the input's layout ([s, b, d], or THD [T, 1, d])."""
    if config.fp32_residual_connection:
        # Megatron's bias-dropout-add casts the residual to the layer output's dtype; the core adds the
        # model-dtype output to an fp32 residual. An fp32 copy of the (rounded) output gives the core's sum.
        y = y.to(torch.float32)
    if packed:
        return y[:, None]
    s, b, d = hidden_states.shape
    return y.reshape(b, s, d).transpose(0, 1)


def _aligned_mixer_forward(self: Any, hidden_states: torch.Tensor, inference_context: Any = None, *,
                           inference_params: Any = None, packed_seq_params: Any = None
                           ) -> tuple[torch.Tensor, None]:
    """MambaMixer.forward under the hook: hidden_states [s, b, d_model] (or THD: [T, 1, d_model] with
    ``packed_seq_params``) -> ([s, b, d_model] in the model dtype, fp32 with ``fp32_residual_connection``;
    None), by the core's ``Mamba2Mixer.advance`` from empty per-sequence states, each sequence's chunk
    grid anchored at its own first token."""
    hook = _hook_for(self)
    if inference_context is not None or inference_params is not None:
        raise AlignmentRefused("Megatron inference (an inference context) with --aligned-mamba: sampling runs in the "
                               "aligned engine (reference or the vLLM plugin), not in Megatron")
    if self.chunk_size != hook.contract.chunk_size:
        raise AlignmentRefused(f"MambaMixer chunk_size={self.chunk_size} but the contract says chunk_size="
                               f"{hook.contract.chunk_size}")
    lens, hidden = _sequences(hidden_states, packed_seq_params)
    mixer = _core_mixer(self, hook, hidden.device)
    state = mixer.state(mixer.state_spec().allocate(len(lens), hidden.device))
    y = mixer.advance(state, hook.batch_for(lens), hidden.to(hook.dtype))
    return _layer_output(y, hidden_states, packed_seq_params is not None, self.config), None


def _core_attention(m: Any, hook: AlignedMambaHook, device: torch.device) -> Attention:
    """The core's attention layer over a SelfAttention's own parameters (rebuilt per forward: the optimizer
    moves them). linear_qkv's rows are per key/value group [q heads of the group | k | v] (Megatron's
    layout); they are taken apart by differentiable views, so gradients reach linear_qkv itself."""
    H, G, D = m.num_attention_heads_per_partition, m.num_query_groups_per_partition, m.hidden_size_per_attention_head
    rep = H // G
    w = m.linear_qkv.weight
    per_group = w.view(G, rep + 2, D, w.shape[-1])
    names = {"q_proj.weight": per_group[:, :rep].reshape(H * D, -1),
             "k_proj.weight": per_group[:, rep].reshape(G * D, -1),
             "v_proj.weight": per_group[:, rep + 1].reshape(G * D, -1), "o_proj.weight": m.linear_proj.weight}
    config = AttentionConfig(hidden_size=w.shape[-1], num_heads=H, num_kv_heads=G, head_dim=D)
    try:
        return Attention(config, names, "", backend=hook.backend(device), dtype=hook.dtype)
    except ModelLoadError as exc:  # e.g. attention on a CUDA device, not yet measured there
        raise AlignmentRefused(str(exc)) from None


def _refuse_uncausal_mask(mask: torch.Tensor | None, s: int) -> None:
    """Only a causal mask (or none) is covered: True above the diagonal of [.., s, s], broadcast over batch
    and heads. A padding or document mask would change which keys a row sees."""
    if mask is None:
        return
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype != torch.bool or mask.shape[-2:] != (s, s) or mask.dim() != 4 or \
            not bool((mask == causal).all()):
        raise AlignmentRefused(f"attention_mask {tuple(mask.shape)} {mask.dtype} is not the causal mask: padding or "
                               "document masks are not covered (pack sequences with packed_seq_params instead)")


def _aligned_attention_forward(self: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                               key_value_states: torch.Tensor | None = None, inference_context: Any = None,
                               rotary_pos_emb: Any = None, rotary_pos_cos: Any = None, rotary_pos_sin: Any = None,
                               rotary_pos_cos_sin: Any = None, attention_bias: Any = None,
                               packed_seq_params: Any = None, sequence_len_offset: Any = None, *,
                               inference_params: Any = None) -> tuple[torch.Tensor, None]:
    """SelfAttention.forward under the hook: hidden_states [s, b, hidden] (normed; or THD [T, 1, hidden]
    with ``packed_seq_params``) -> ([s, b, hidden] in the model dtype, fp32 with
    ``fp32_residual_connection``; None as the bias), by the core's ``Attention.advance`` from empty
    per-sequence key/value states: every row a fixed function of its query and the keys and values of its
    own sequence's positions 0..t (``ops.attention.attention_blocked``), as the sampler computes it."""
    hook = _hook_for(self)
    if inference_context is not None or inference_params is not None:
        raise AlignmentRefused("Megatron inference (an inference context) with --aligned-mamba: sampling runs in the "
                               "aligned engine (reference or the vLLM plugin), not in Megatron")
    extra = {"rotary embeddings (rotary_pos_emb)": rotary_pos_emb is not None or rotary_pos_cos is not None
             or rotary_pos_sin is not None or rotary_pos_cos_sin is not None,
             "an attention bias": attention_bias is not None, "cross-attention": key_value_states is not None,
             "a sequence_len_offset (inference)": sequence_len_offset is not None}
    given = [name for name, on in extra.items() if on]
    if given:
        raise AlignmentRefused(f"attention with {', '.join(given)} is not covered by --aligned-mamba")
    _refuse_uncausal_mask(attention_mask, hidden_states.shape[0])
    lens, hidden = _sequences(hidden_states, packed_seq_params)
    layer = _core_attention(self, hook, hidden.device)
    state = layer.state(layer.state_spec().allocate(len(lens), hidden.device, max([1, *lens])))
    y = layer.advance(state, hook.batch_for(lens), hidden.to(hook.dtype))
    return _layer_output(y, hidden_states, packed_seq_params is not None, self.config), None


def _aligned_mlp_forward(self: Any, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None,
                         **unused: Any) -> tuple[torch.Tensor, None]:
    """MLP.forward under the hook: [..., hidden] (normed) -> ([..., hidden] in the model dtype, fp32 with
    ``fp32_residual_connection``; None as the bias), by the core's MLP layer (squared ReLU between the two
    row-invariant linears). Rows are independent, so the layout does not matter."""
    hook = _hook_for(self)
    if per_token_scale is not None:
        raise AlignmentRefused("MLP with per_token_scale (MoE expert scaling) is not covered by --aligned-mamba")
    shape = hidden_states.shape
    w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
    mlp = CoreMLP(MLPConfig(hidden_size=w1.shape[1], intermediate_size=w1.shape[0]),
                  {"up_proj.weight": w1, "down_proj.weight": w2}, "", backend=hook.backend(hidden_states.device),
                  dtype=hook.dtype)
    y = mlp.advance(None, None, hidden_states.reshape(-1, shape[-1]).to(hook.dtype)).reshape(shape)
    return (y.to(torch.float32) if self.config.fp32_residual_connection else y), None


def _core_moe(m: Any, hook: AlignedMambaHook, device: torch.device) -> CoreMoE:
    """The core's MoE layer over a MoELayer's own parameters (router weight and expert bias, each expert's
    and the shared expert's linear_fc1 / linear_fc2), so gradients reach them."""
    cfg, r = m.config, m.router
    E, k = cfg.num_moe_experts, cfg.moe_router_topk
    bias = r.expert_bias if r.expert_bias is not None else torch.zeros(E, device=r.weight.device)
    tensors = {"gate.weight": r.weight, "gate.e_score_correction_bias": bias}
    for name, mlp in [*((f"experts.{e}.", x) for e, x in enumerate(m.experts.local_experts)),
                      ("shared_experts.", m.shared_experts)]:
        tensors[name + "up_proj.weight"] = mlp.linear_fc1.weight
        tensors[name + "down_proj.weight"] = mlp.linear_fc2.weight
    config = MoEConfig(hidden_size=cfg.hidden_size, n_routed_experts=E, num_experts_per_tok=k,
                       moe_intermediate_size=cfg.moe_ffn_hidden_size,
                       moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
                       n_group=cfg.moe_router_num_groups or 1, topk_group=cfg.moe_router_group_topk or 1,
                       norm_topk_prob=k > 1, routed_scaling_factor=cfg.moe_router_topk_scaling_factor or 1.0)
    return CoreMoE(config, tensors, "", backend=hook.backend(device), dtype=hook.dtype)


def _aligned_moe_forward(self: Any, hidden_states: torch.Tensor, intermediate_tensors: Any = None,
                         padding_mask: torch.Tensor | None = None, **unused: Any) -> tuple[torch.Tensor, None]:
    """MoELayer.forward under the hook: [..., hidden] (normed) -> ([..., hidden] in the model dtype, fp32
    with ``fp32_residual_connection``; None as the bias), by the core's MoE layer (row-invariant routing and
    expert GEMMs). Rows are independent, so the layout does not matter. While training with the expert
    bias enabled, each expert's token count goes into the router's ``local_tokens_per_expert``, as
    Megatron's router counts them, for its aux-loss-free bias update."""
    hook = _hook_for(self)
    if intermediate_tensors is not None or padding_mask is not None:
        raise AlignmentRefused("MoE layer with intermediate tensors or a padding mask is not covered by "
                               "--aligned-mamba")
    shape = hidden_states.shape
    moe = _core_moe(self, hook, hidden_states.device)
    x = hidden_states.reshape(-1, shape[-1]).to(hook.dtype)
    experts, weights = moe.route_rows(x)
    y = moe.experts_out(None, x, experts, weights).reshape(shape)  # MoE.advance's arithmetic, routed once
    r = self.router
    if self.training and torch.is_grad_enabled() and getattr(r, "enable_expert_bias", False):
        with torch.no_grad():
            r.local_tokens_per_expert += torch.bincount(experts.flatten(), minlength=moe.config.n_routed_experts).to(
                r.local_tokens_per_expert.dtype)
    return (y.to(torch.float32) if self.config.fp32_residual_connection else y), None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *,
                   sequence_first: bool | None = None, contract: Any = None) -> torch.Tensor:
    """The contract's per-token logprobs of Megatron's output logits, as a loss function reads them.

    logits: the output layer's [s, b, V] (``sequence_first=True``) or the model's returned [b, s, V]
    (any float dtype); tokens: Megatron's ``labels`` [b, s] (integer, the next token at each position).
    ``sequence_first=None`` infers the layout from the shapes and refuses a square (s == b) one.
    Returns [b, s] float32 ``aligned_mamba.token_logprobs(logits / temperature)`` at the labels: the
    bits the sampler reports for those tokens, differentiable through the logits. ``contract`` (default:
    the installed hook's) picks the backend that computes it, as the sampler's contract does.
    """
    import aligned_mamba

    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or not isinstance(tokens, torch.Tensor) \
            or tokens.dim() != 2:
        raise ValueError("token_logprobs expects logits [s, b, V] or [b, s, V] and labels [b, s] tensors")
    b, s = tokens.shape
    if sequence_first is None:
        if b == s and logits.shape[0] == logits.shape[1] == b:
            raise ValueError(f"logits {list(logits.shape)} with labels [{b}, {s}]: layout ambiguous, pass "
                             "sequence_first=True ([s, b, V]) or False ([b, s, V])")
        sequence_first = tuple(logits.shape[:2]) == (s, b)
    rows = logits.transpose(0, 1) if sequence_first else logits
    if contract is None and (hook := installed()) is not None:
        contract = hook.contract
    return aligned_mamba.token_logprobs(rows, tokens, temperature, contract)
