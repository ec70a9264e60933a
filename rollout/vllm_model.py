"""The exact-replay Mamba2ForCausalLM and NemotronHForCausalLM for vLLM: vLLM schedules, the core computes.

A Mamba layer (``ReplayMambaLayer``) declares the core layer's per-slot state, so vLLM's planner sizes its
Mamba cache, and advances it as a core ``Step`` built from its own metadata; an attention layer
(``PagedAttentionLayer``) declares a vLLM ``Attention`` for its paged KV cache and runs the core's
``advance_paged`` over those pages (vLLM's attention kernel is never called). Why: docs/vllm.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from aligned_mamba.contract import Contract
from aligned_mamba.errors import ModelLoadError
from aligned_mamba.layers import attention as attention_layer
from aligned_mamba.layers import mamba2 as mamba2_layer
from aligned_mamba.layers.attention import Attention as CoreAttention
from aligned_mamba.layers.attention import PagedTables, paged_tables
from aligned_mamba.models import CausalLM, build_model
from aligned_mamba.models.causal_lm import Block
from aligned_mamba.models.registry import family_for_config
from aligned_mamba.ops.step import Step
from aligned_mamba.parallel import TPGroup

from .vllm_plugin import ExactReplayRefused, check_engine, core_config, engine_contract, refuse

logger = init_logger(__name__)
_BATCH_ATTR = "_aligned_mamba_batch"  # the core Step of a metadata object, made by the first layer that reads it


def _shape_group(size: int) -> TPGroup:
    """A group of ``size`` for shapes only (every rank's shard has the same shape): no collective."""
    def no_gather(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("aligned-mamba: a shape-only tensor-parallel group cannot all-gather")

    return TPGroup(0, size, no_gather)


def replay_layout(config: Any, contract: Contract, tp_size: int = 1) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """One Mamba2 layer's state as vLLM state entries (field, per-slot shape, dtype), at one TP rank's heads
    and groups; ``config`` has ``mixer_config()``. fp32 fields first: ``MambaBase.bind_kv_cache`` slices a
    slot's page out of one int8 buffer, so each field's offset must be a multiple of its element size."""
    mixer = config.mixer_config()
    if tp_size > 1:
        mixer = mamba2_layer.local_config(mixer, _shape_group(tp_size))
    dtype = getattr(torch, contract.model_dtype)
    spec = mamba2_layer.state_spec(mixer, contract.chunk_size, dtype,
                                   bf16_copy=contract.kernel_configs.bf16_state_copy(dtype))
    entries = sorted(spec.fields, key=lambda e: -e[2].itemsize)  # stable: field order within a dtype size
    total = sum(math.prod(s) * dt.itemsize for _, s, dt in entries)
    if total % 4:  # pad the page so the next slot's fp32 fields stay 4-byte aligned
        entries.append(("_pad", (4 - total % 4,), torch.uint8))
    return entries


def batch_from_metadata(md: Any, positions: torch.Tensor) -> Step:
    """The core's ``Step`` for one vLLM step. md: ``Mamba2AttentionMetadata`` (decode rows first, one token
    each, slots ``state_indices_tensor_d[:, 0]``; then prefill rows, slots ``state_indices_tensor_p``,
    offsets ``query_start_loc_p``); positions [>= T] int64 (a sequence's first new token gives its start)."""
    nd, npf = int(md.num_decodes), int(md.num_prefills)
    if int(md.num_decode_tokens) != nd:
        raise ExactReplayRefused("aligned-mamba exact replay refused: a decode row carries more than one token "
                                 "(speculative decoding is not covered)")
    slots, lens = [], []
    if nd:
        slots.append(md.state_indices_tensor_d[:nd, 0].to("cpu", torch.int64))
        lens.append(torch.ones(nd, dtype=torch.int64))
    if npf:
        slots.append(md.state_indices_tensor_p[:npf].to("cpu", torch.int64))
        lens.append(torch.diff(md.query_start_loc_p[: npf + 1].to("cpu", torch.int64)))
    slots_t, lens_t = torch.cat(slots), torch.cat(lens)
    cu = torch.zeros(nd + npf + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens_t, 0)
    start = positions[cu[:-1].to(positions.device)].to("cpu", torch.int64)
    seq_lens = md.seq_lens[: nd + npf].to("cpu", torch.int64)
    if not torch.equal(start + lens_t, seq_lens):
        # a schedule this code does not understand: stop rather than advance from the wrong position
        raise RuntimeError(f"aligned-mamba: positions {start.tolist()} + query lengths {lens_t.tolist()} != "
                           f"seq_lens {seq_lens.tolist()}")
    if slots_t.unique().numel() != slots_t.numel():
        raise RuntimeError(f"aligned-mamba: a state slot appears twice in one step: {slots_t.tolist()}")
    return Step(slots=slots_t, start_pos=start, cu_seqlens=cu)


def step_batch(md: Any, positions: torch.Tensor) -> Step:
    """``batch_from_metadata``, once per metadata object (vLLM builds one per step and KV-cache group)."""
    batch = getattr(md, _BATCH_ATTR, None)
    if batch is None:
        batch = batch_from_metadata(md, positions)
        setattr(md, _BATCH_ATTR, batch)
    return batch


class ReplayMambaLayer(MambaBase, nn.Module):
    """One Mamba2 block over its slot of vLLM's Mamba cache; ``block`` (norm + ``Mamba2Mixer``) is set at
    weight load, and the forward advances the step's slots from this layer's metadata and state views."""

    def __init__(self, prefix: str, layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        super().__init__()
        self.prefix = prefix
        self.layout = layout
        self.kv_cache = tuple(torch.tensor([]) for _ in layout)
        self.block: Block | None = None
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"Duplicate layer name: {prefix}")
        ctx[prefix] = self

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return tuple(shape for _, shape, _ in self.layout)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return tuple(dt for _, _, dt in self.layout)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.MAMBA2  # the Mamba2 metadata (decodes first, slots, query starts)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The bound cache as the core layer's named state tensors, each [num_slots, *shape] (views)."""
        return {name: t for (name, _, _), t in zip(self.layout, self.kv_cache) if not name.startswith("_")}

    def batch(self, positions: torch.Tensor) -> Step | None:
        """This step's core Step from this layer's metadata (None in a profiling / dummy run)."""
        md = get_forward_context().attn_metadata
        if md is None:
            return None
        if not isinstance(md, dict):
            refuse("micro-batched (ubatch) steps are not covered")
        return step_batch(md[self.prefix], positions)

    def num_tokens(self, positions: torch.Tensor) -> int:
        """The step's real tokens (the rest of input_ids is padding)."""
        batch = self.batch(positions)
        assert batch is not None, "no attention metadata"
        return batch.num_tokens

    def forward(self, normed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The mixer over the step's new tokens: normed [T, hidden] (real tokens only) -> [T, hidden]."""
        assert self.block is not None, "weights not loaded"
        batch = self.batch(positions)
        assert batch is not None, "a layer's forward without attention metadata"
        mixer = self.block.mixer
        state = mixer.state(self.state_tensors())
        fresh = batch.slots[batch.start_pos == 0]
        if fresh.numel():
            state.reset(fresh)  # vLLM reuses slots: a new or recomputed request starts from zero state
        return mixer.advance(state, batch, normed)


_PAGED_ATTR = "_aligned_mamba_paged"  # an attention metadata object's PagedTables, by (H // G, block size)


def tables_from_metadata(md: Any, positions: torch.Tensor, rep: int, block_size: int,
                         device: torch.device) -> PagedTables:
    """The core's paged tables for one vLLM step of one KV-cache group. md: ``CPUAttentionMetadata``
    (``query_start_loc`` [R+1], ``seq_lens`` [R] after the step, ``block_table`` [R, max_blocks]: ids of the
    cache tensor's blocks, ``slot_mapping`` [T]: where vLLM would store each new token); positions [>= T]
    int64. Both are cross-checked, so an unknown layout stops the engine instead of reading the wrong keys."""
    seq_lens = md.seq_lens.to("cpu", torch.int64)
    R = seq_lens.numel()
    cu = md.query_start_loc[: R + 1].to("cpu", torch.int64)
    T = int(cu[-1])
    if T != int(md.num_actual_tokens):
        raise RuntimeError(f"aligned-mamba: query_start_loc ends at {T}, the step has {int(md.num_actual_tokens)} "
                           "tokens")
    if not getattr(md, "causal", True) or getattr(md, "dynamic_causal", None) is not None:
        refuse("non-causal attention metadata (encoder or prefix-LM attention) is not covered")
    start = positions[cu[:-1].to(positions.device)].to("cpu", torch.int64)
    if not torch.equal(start + cu.diff(), seq_lens):
        raise RuntimeError(f"aligned-mamba: positions {start.tolist()} + query lengths {cu.diff().tolist()} != "
                           f"seq_lens {seq_lens.tolist()}")
    tables = paged_tables(cu, seq_lens, md.block_table[:R], block_size, rep, device)
    slots = (tables.write_block * block_size + tables.write_off).to("cpu")
    if not torch.equal(slots, md.slot_mapping[:T].to("cpu", torch.int64)):
        raise RuntimeError("aligned-mamba: the block table and vLLM's slot mapping disagree on where the new "
                           "tokens' keys go (a KV-cache layout this code does not understand)")
    return tables


class PagedAttentionLayer(nn.Module):
    """One attention block over vLLM's paged KV cache. ``attn`` (a vLLM ``Attention``) is declared only for its
    KV-cache spec, bound ``kv_cache`` and per-step metadata, never run: the core's ``Attention``
    (``block.mixer``, set at weight load) writes and reads the pages."""

    def __init__(self, prefix: str, num_heads: int, num_kv_heads: int, head_dim: int, cache_config: Any) -> None:
        """num_heads / num_kv_heads: this rank's (``layers.attention.local_config`` under tensor parallelism)."""
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        self.num_kv_heads, self.head_dim, self.rep = num_kv_heads, head_dim, num_heads // num_kv_heads
        self.attn = Attention(num_heads, head_dim, head_dim ** -0.5, num_kv_heads=num_kv_heads,
                              cache_config=cache_config, prefix=f"{prefix}.attn")
        self.block: Block | None = None

    def pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values), each [num_blocks, G, block_size, D] views of the bound cache, as the CPU
        backend lays a page out ([num_blocks, G, block_size, 2 D]: per head, the block's keys, then its values)."""
        kv = self.attn.kv_cache
        G, D = self.num_kv_heads, self.head_dim
        if kv.dim() != 4 or kv.shape[1] != G or kv.shape[3] != 2 * D:
            refuse(f"a KV-cache page layout {list(kv.shape)} other than the CPU backend's "
                   f"[blocks, {G}, block_size, {2 * D}] is not covered")
        nb, _, bs, _ = kv.shape
        k, v = kv.view(nb, G, 2 * bs, D).chunk(2, dim=2)
        return k, v

    def tables(self, positions: torch.Tensor) -> PagedTables:
        """This step's tables from this layer's metadata (one build per metadata object and shape)."""
        md = get_forward_context().attn_metadata
        if not isinstance(md, dict):
            refuse("micro-batched (ubatch) steps are not covered")
        m = md[self.attn.layer_name]
        bs = self.attn.kv_cache.shape[2]
        cache = m.__dict__.setdefault(_PAGED_ATTR, {})
        key = (self.rep, bs)
        if key not in cache:
            cache[key] = tables_from_metadata(m, positions, self.rep, bs, positions.device)
        return cache[key]

    def num_tokens(self, positions: torch.Tensor) -> int:
        return int(self.tables(positions).cu_seqlens_q[-1])

    def forward(self, normed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """normed [T, hidden] (model dtype) -> [T, hidden]: the core attention over the pages."""
        assert self.block is not None, "weights not loaded"
        mixer = self.block.mixer
        assert isinstance(mixer, CoreAttention)
        k, v = self.pages()
        return mixer.advance_paged(k, v, self.tables(positions), normed)


class StatelessLayer(nn.Module):
    """A block that keeps nothing per request (Nemotron-H's MLP): the core mixer on the step's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.block: Block | None = None

    def forward(self, normed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.block is not None, "weights not loaded"
        return self.block.mixer.advance(None, None, normed)  # type: ignore[arg-type]  # stateless: no batch


def tp_group(vllm_config: VllmConfig) -> TPGroup:
    """This worker's rank of vLLM's tensor-parallel group as the core's ``TPGroup`` (its device group:
    gloo on the CPU, where vLLM's TP workers are processes); one process at TP 1."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return TPGroup.single()
    from vllm.distributed.parallel_state import get_tp_group

    group = TPGroup.from_torch(get_tp_group().device_group)
    if group.size != vllm_config.parallel_config.tensor_parallel_size:
        raise RuntimeError(f"aligned-mamba: vLLM's tensor-parallel group has {group.size} ranks, the config "
                           f"{vllm_config.parallel_config.tensor_parallel_size}")
    return group


class _ExactReplayLM(nn.Module):
    """What both exact-replay models share: the core model from the checkpoint's tensors, the forward over
    vLLM's per-layer metadata, the core's logits; subclasses build ``self.layers``, one per core block."""

    has_inner_state: ClassVar[Literal[True]] = True
    supports_mamba_prefix_caching: ClassVar[Literal[False]] = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        check_engine(vllm_config, resolved=True)
        self.vllm_config = vllm_config
        self.contract = engine_contract(vllm_config)
        self.config = core_config(vllm_config)
        self.family = family_for_config(self.config)
        self.tp = tp_group(vllm_config)
        self.layout = replay_layout(self.config, self.contract, self.tp.size)
        self.core: CausalLM | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        self._device = vllm_config.device_config.device
        self.layers = nn.ModuleList(self.make_layers(vllm_config, f"{prefix}." if prefix else ""))

    def make_layers(self, vllm_config: VllmConfig, base: str) -> list[nn.Module]:
        """One vLLM module per decoder layer (each family's subclass says which kinds)."""
        raise TypeError(f"{type(self).__name__} is an abstract base: use a family's subclass")

    # vLLM sizes a hybrid's pages from the config alone, before the model exists
    @classmethod
    def _layout_from_config(cls, vllm_config: VllmConfig) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return replay_layout(core_config(vllm_config), engine_contract(vllm_config),
                             vllm_config.parallel_config.tensor_parallel_size)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        return tuple(s for _, s, _ in cls._layout_from_config(vllm_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return tuple(d for _, _, d in cls._layout_from_config(vllm_config))

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple:
        # only prefix caching (align mode) and speculative decoding copy states; both are refused
        refuse("copying replay states between blocks (prefix caching / speculative decoding) is not covered")

    @classmethod
    def get_mamba_state_copy_funcs(cls, mamba_types: set) -> dict:
        return {t: cls.get_mamba_state_copy_func() for t in mamba_types}

    def state_bytes_per_sequence(self) -> int:
        """Bytes of Mamba replay state one request holds (attention pages grow with its length)."""
        per_layer = sum(math.prod(s) * d.itemsize for _, s, d in self.layout)
        return per_layer * sum(isinstance(layer, ReplayMambaLayer) for layer in self.layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Collect HF-named tensors and (re)build the core model; a later call (reload_weights, an RL weight
        update) may carry a subset, replacing those tensors. Names outside the checkpoint layout are refused."""
        family, config = self.family, self.config
        shapes = family.expected_shapes(config)
        tied = family.tied(config)
        got: set[str] = set()
        for name, t in weights:
            if name == family.head and tied:
                continue  # tied: the embedding is the head (the core reads it from there)
            if name not in shapes:
                raise ModelLoadError(f"aligned-mamba: unexpected tensor {name!r} for a {family.name} checkpoint")
            if tuple(t.shape) != shapes[name]:
                raise ModelLoadError(f"aligned-mamba: tensor {name!r} has shape {list(t.shape)}, "
                                     f"expected {list(shapes[name])}")
            self._tensors[name] = t.detach().to("cpu").clone()
            got.add(name)
        missing = [n for n in shapes if n not in self._tensors]
        if missing:
            raise ModelLoadError(f"aligned-mamba: {len(missing)} missing tensor(s), e.g. {missing[:3]}")
        # every rank keeps the full tensors and cuts its own shard (heads, groups, channels, vocabulary)
        self.core = build_model(config, self._tensors, self.contract, device=self._device,
                                tp=self.tp if self.tp.size > 1 else None)
        for layer, block in zip(self.layers, self.core.blocks, strict=True):
            layer.block = block
        if tied:
            got.add(family.head)
        # the vLLM Attention layers' own buffers (kv scales): not checkpoint tensors, nothing reads them
        got.update(name for name, _ in self.named_parameters())
        return got

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.core is not None
        return self.core.embed(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        """One engine step: input_ids / positions [T_padded] -> the final normed hidden rows [T_padded, hidden]
        (model dtype; rows past the real tokens zero) for ``compute_logits``."""
        if input_ids is None or inputs_embeds is not None:
            refuse("prompt embeddings are not covered (the core starts from token ids)")
        core = self.core
        assert core is not None, "weights not loaded"
        out = torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=core.dtype, device=input_ids.device)
        if get_forward_context().attn_metadata is None:  # profiling / dummy run without a cache
            return out
        first = next(layer for layer in self.layers if not isinstance(layer, StatelessLayer))
        n = first.num_tokens(positions)
        # the core's forward, each block's mixer run by its own layer from its own metadata
        out[:n] = core.run_blocks(input_ids[:n], lambda i, normed, rows: self.layers[i](normed, positions))
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The core's row-invariant lm_head: [R, hidden] -> [R, vocab] (model dtype); under TP every rank returns
        full rows (vocabulary shards all-gathered), so the sampler sees what a TP 1 engine sees."""
        assert self.core is not None
        return self.core.logits(hidden_states)


class ExactReplayMamba2ForCausalLM(_ExactReplayLM):
    """Mamba2ForCausalLM on the core's layers; the weights go through the core's ``build_model``, so every
    cast (A = -exp(A_log) in fp32, ...) is the trainer's own code."""

    # vLLM's model interfaces (HasInnerState, IsAttentionFree), declared as flags
    is_attention_free: ClassVar[Literal[True]] = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        logger.info("aligned-mamba exact replay: %s; %d bytes of replay state per sequence", self.contract,
                    self.state_bytes_per_sequence())

    def make_layers(self, vllm_config: VllmConfig, base: str) -> list[nn.Module]:
        return [ReplayMambaLayer(f"{base}backbone.layers.{i}.mixer", self.layout)
                for i in range(self.config.num_hidden_layers)]


class ExactReplayNemotronHForCausalLM(_ExactReplayLM):
    """NemotronHForCausalLM on the core's layers: Mamba2 state in vLLM's Mamba cache, attention keys and
    values in its paged KV cache, MLP layers stateless; HF-named tensors (``nemotron_h.expected_shapes``)."""

    # vLLM's model interfaces (HasInnerState, IsHybrid), declared as flags
    is_hybrid: ClassVar[Literal[True]] = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        logger.info("aligned-mamba exact replay (hybrid %s): %s; %d bytes of Mamba replay state per sequence",
                    self.config.hybrid_override_pattern, self.contract, self.state_bytes_per_sequence())

    def make_layers(self, vllm_config: VllmConfig, base: str) -> list[nn.Module]:
        from aligned_mamba.models.nemotron_h import ATTENTION, MAMBA

        c = self.config
        out: list[nn.Module] = []
        for i, kind in enumerate(c.hybrid_override_pattern):
            prefix = f"{base}backbone.layers.{i}.mixer"
            if kind == MAMBA:
                out.append(ReplayMambaLayer(prefix, self.layout))
            elif kind == ATTENTION:
                a = c.attention_config()
                if self.tp.size > 1:
                    a = attention_layer.local_config(a, self.tp)
                out.append(PagedAttentionLayer(prefix, a.num_heads, a.num_kv_heads, a.head_dim,
                                               vllm_config.cache_config))
            else:
                out.append(StatelessLayer())
        return out
