"""The hook: ``install(contract)`` patches megatron.core (``patch``) and ``apply_to_model`` checks a built
MambaModel module by module and gives the ones it covers their aligned forwards."""

from __future__ import annotations

import functools
from typing import Any

import torch

from aligned_mamba.contract import Contract
from aligned_mamba.ops.backend import Backend, resolve
from aligned_mamba.ops.step import Step
from aligned_mamba.parallel import TPGroup, gather_rows, scatter_rows

from . import current, patch
from .norms import AlignedRMSNorm
from .refusals import (
    AlignmentRefused,
    check_attention,
    check_layer_types,
    check_megatron_version,
    check_mixer,
    check_mlp,
    check_moe,
    check_transformer_layer,
    config_problems,
    refuse_problems,
)

installed = current.installed


class _AllGather(torch.autograd.Function):
    """The group's all-gather, differentiable: every rank repeats what follows it (the same loss), so x's
    gradient is this rank's own slot of the gathered one, with no communication."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.rank = group.rank
        return group.all_gather(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[ctx.rank], None


def _gather(group: TPGroup, x: torch.Tensor) -> torch.Tensor:
    return _AllGather.apply(x, group)


def _process_group(module: Any) -> Any:
    """A Megatron module's tensor-parallel process group (``tp_group``, ``pg_collection.tp``, else the global)."""
    pg = getattr(module, "tp_group", None)
    if pg is None:
        pg = getattr(getattr(module, "pg_collection", None), "tp", None)
    if pg is None:
        from megatron.core import parallel_state

        pg = parallel_state.get_tensor_model_parallel_group()
    return pg


def install(contract: Contract) -> AlignedMambaHook:
    """Patch megatron.core's Mamba2 path for ``contract`` (idempotent for the same contract; another
    contract while one is installed is refused, naming both). Returns the hook (``uninstall()`` undoes it)."""
    current_hook = current.installed()
    if current_hook is not None:
        if current_hook.contract != contract:
            raise AlignmentRefused(f"the hook is installed with contract {current_hook.contract}; refused to switch "
                                   f"to {contract} in the same process (uninstall first)")
        return current_hook
    check_megatron_version()
    hook = AlignedMambaHook(contract)
    hook._saved = patch.patch(hook)
    current.set_installed(hook)
    return hook


class AlignedMambaHook:
    """The installed patches for one contract. ``apply_to_model`` checks and aligns a built model."""

    def __init__(self, contract: Contract) -> None:
        self.contract = contract
        self.dtype: torch.dtype = getattr(torch, contract.model_dtype)
        self._saved: list[tuple[Any, str, Any]] = []
        self._batch: tuple[tuple[int, ...], Step] | None = None
        self._groups: dict[int, tuple[Any, TPGroup, TPGroup]] = {}

    @property
    def slices(self) -> int:
        """The contract's row-parallel slice count S (1: the plain linear layers)."""
        return self.contract.row_parallel_slices

    def _group(self, module: Any) -> tuple[TPGroup, TPGroup] | None:
        """(plain, differentiable) ``TPGroup`` over the module's TP process group, None at TP 1."""
        pg = _process_group(module)
        if pg.size() == 1:
            return None
        cached = self._groups.get(id(pg))
        if cached is None or cached[0] is not pg:
            plain = TPGroup.from_torch(pg)
            cached = (pg, plain, TPGroup(plain.rank, plain.size, functools.partial(_gather, plain)))
            self._groups[id(pg)] = cached
        return cached[1], cached[2]

    def tp(self, module: Any) -> TPGroup | None:
        """The ``TPGroup`` over the module's TP process group (``_process_group``), None at TP 1; its
        differentiable all-gather is the aligned forwards' only collective (an all-reduce's order is the library's)."""
        groups = self._group(module)
        return None if groups is None else groups[1]

    def sequence_group(self, module: Any) -> TPGroup | None:
        """The plain ``TPGroup`` where ``module`` takes and gives sequence-parallel rows (its ``sequence_parallel``,
        an embedding's ``reduce_scatter_embeddings``, else its config's, at TP > 1), else None."""
        on = getattr(module, "reduce_scatter_embeddings", None)
        if on is None:
            on = getattr(module, "sequence_parallel", None)
        if on is None:
            on = getattr(getattr(module, "config", None), "sequence_parallel", False)
        groups = self._group(module) if on else None
        return None if groups is None else groups[0]

    def replicated_input(self, x: torch.Tensor, module: Any) -> torch.Tensor:
        """x, the same on every rank, entering a layer of this rank's shard: in the backward the ranks' partial
        gradients are summed (Megatron's copy to the TP region). At TP 1 or without grad: x."""
        pg = _process_group(module)
        if pg.size() == 1 or not torch.is_grad_enabled():
            return x
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        return copy_to_tensor_model_parallel_region(x, pg)

    def layer_input(self, hidden_states: torch.Tensor, module: Any) -> torch.Tensor:
        """A layer's input [s(/k), ...] -> the whole [s, ...], the same on every rank, whose gradient sums the
        ranks' partial ones: sequence-parallel rows gathered (``parallel.gather_rows``, the sum in rank order),
        else ``replicated_input``."""
        group = self.sequence_group(module)
        if group is None:
            return self.replicated_input(hidden_states, module)
        return gather_rows(group, hidden_states)

    def layer_output(self, y: torch.Tensor, module: Any) -> torch.Tensor:
        """A layer's whole output [s, ...] -> this rank's sequence-parallel rows [s / k, ...] where the module
        runs sequence-parallel (``parallel.scatter_rows``), else y."""
        group = self.sequence_group(module)
        return y if group is None else scatter_rows(group, y)

    def backend(self, device: torch.device) -> Backend:
        """The contract's ops on ``device`` (the very object the core's models resolve)."""
        return resolve(self.contract, device)

    def batch_for(self, lens: list[int]) -> Step:
        """The ``Step`` of a forward over ``lens`` from empty states, shared by the forward's layers (a Step never
        changes), so the Triton backend plans it once per forward."""
        key = tuple(lens)
        if self._batch is None or self._batch[0] != key:
            self._batch = (key, Step.from_empty(lens))
        return self._batch[1]

    def uninstall(self) -> None:
        """Restore every patched name (models keep their aligned per-module forwards)."""
        patch.restore(self._saved)
        if current.installed() is self:
            current.set_installed(None)

    def __enter__(self) -> AlignedMambaHook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def apply_to_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Check every module of a built MambaModel (wrappers unwrapped) against what the hook covers and give
        the covered ones aligned forwards; refuses anything else, naming its path and class. Returns ``model``."""
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
        refuse_problems(config_problems(inner.config, self.contract))
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
                check_layer_types(m, where, {"M": MambaLayer, "*": TransformerLayer, "-": MLPLayer,
                                              "E": TransformerLayer})
            elif kind is MambaLayer:
                if type(m.norm) not in (AlignedRMSNorm, torch.nn.RMSNorm):
                    raise AlignmentRefused(f"{where}: its pre-mixer norm is {type(m.norm).__name__}, not an RMSNorm "
                                           "the hook covers (a Transformer Engine spec fuses it into in_proj; use "
                                           "local_mamba_stack_spec)")
                patch.swap(m, self)
            elif kind is MambaMixer:
                check_mixer(m, where, self.contract)
                covered.add(id(m.norm))  # the gated norm: the aligned mixer forward reads its weight and eps
            elif kind is TransformerLayer or kind is MLPLayer:
                moe = type(getattr(m, "mlp", None)) is MoELayer
                covered.update(check_transformer_layer(m, where, attention=kind is TransformerLayer and not moe,
                                                       moe=moe))
            elif kind is MoELayer:
                check_moe(m, where, self.contract)
                patch.swap(m, self)
                covered.update(id(x) for x in m.modules() if x is not m)
            elif kind is SelfAttention:
                check_attention(m, where, self.contract)
                patch.swap(m, self)
                covered.update(id(x) for x in m.modules() if x is not m)
            elif kind is MLP:
                check_mlp(m, where, self.contract)
                patch.swap(m, self)
                covered.update(id(x) for x in m.modules() if x is not m)
            elif kind is LanguageModelEmbedding:
                if m.add_position_embedding or m.tokentype_embeddings is not None:
                    raise AlignmentRefused(f"{where}: position or token-type embeddings are not part of Mamba2")
            elif kind is VocabParallelEmbedding:
                patch.swap(m, self)
            elif kind is ColumnParallelLinear or kind is RowParallelLinear:
                if kind is RowParallelLinear and not m.input_is_parallel:
                    raise AlignmentRefused(f"{where}: input_is_parallel=False is not covered")
                # the output layer rounds its weight to the model dtype first, as the core's lm_head
                patch.swap(m, self)
                m._aligned_mamba_round_weight = path == "output_layer"
            elif kind is torch.nn.RMSNorm:
                if m.eps is None or tuple(m.normalized_shape) != (m.weight.shape[0],):
                    raise AlignmentRefused(f"{where}: an RMSNorm needs an explicit eps and a 1-d weight")
                patch.swap(m, self)
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
