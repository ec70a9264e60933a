"""The exact-replay Mamba2ForCausalLM for vLLM: vLLM schedules, the core computes.

vLLM keeps doing what it is good at (requests, scheduling, chunked prefill, continuous batching,
preemption, sampling, the state memory pool); every op on the path from token to logit is the
core's. Each Mamba layer is a ``ReplayMambaLayer`` (a ``MambaBase``, as vLLM's own MambaMixer2):
it declares the core layer's per-slot state (``layers.mamba2.state_spec``) so vLLM's memory planner
sizes the cache for it, receives the bound views as ``kv_cache``, and in the forward runs its own
mixer (``Mamba2Mixer.advance``) from its own attention metadata, as a core ``Batch``
(derived once per step: the layers of one KV-cache group share the metadata object). The trainer's
forward runs the same blocks, so its logits rows equal the ones vLLM sampled from.
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
from aligned_mamba.layers import mamba2 as mamba2_layer
from aligned_mamba.models import CausalLM, build_model
from aligned_mamba.models.causal_lm import Block
from aligned_mamba.models.mamba2 import LM_HEAD, Mamba2Config, expected_shapes
from aligned_mamba.replay import Batch

from .vllm_plugin import ExactReplayRefused, check_engine, engine_contract, refuse

logger = init_logger(__name__)
_BATCH_ATTR = "_aligned_mamba_batch"  # the core Batch of a metadata object, made by the first layer that reads it


def core_config(vllm_config: VllmConfig) -> Mamba2Config:
    """The core's ``Mamba2Config`` from vLLM's HF config (hf_overrides included)."""
    hf = vllm_config.model_config.hf_config
    try:
        return Mamba2Config.from_hf_dict(hf.to_dict(), source="vLLM hf_config")
    except ModelLoadError as e:
        raise ExactReplayRefused(f"aligned-mamba exact replay refused: {e}") from None


def replay_layout(config: Mamba2Config, contract: Contract) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """One Mamba2 layer's state as vLLM state entries: (field, per-slot shape, dtype).

    fp32 fields first, so every field's byte offset inside a slot's page is a multiple of its
    element size (the page is one int8 buffer that ``MambaBase.bind_kv_cache`` slices and views).
    """
    spec = mamba2_layer.state_spec(config.mixer_config(), contract.chunk_size, getattr(torch, contract.model_dtype))
    entries = sorted(spec.fields, key=lambda e: -e[2].itemsize)  # stable: field order within a dtype size
    total = sum(math.prod(s) * dt.itemsize for _, s, dt in entries)
    if total % 4:  # pad the page so the next slot's fp32 fields stay 4-byte aligned
        entries.append(("_pad", (4 - total % 4,), torch.uint8))
    return entries


def batch_from_metadata(md: Any, positions: torch.Tensor) -> Batch:
    """The core's ``Batch`` for one vLLM step.

    md: a ``Mamba2AttentionMetadata``: decode rows first (one token each, slot in
    ``state_indices_tensor_d[:, 0]``), then prefill rows (slots ``state_indices_tensor_p``, token
    offsets ``query_start_loc_p``). positions [>= T] int64: each token's absolute position, so a
    sequence's first new token gives its start position (tokens already in its state).
    """
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
        # The positions and the scheduler's lengths disagree: a schedule this code does not
        # understand. Stop rather than advance a state from the wrong position.
        raise RuntimeError(f"aligned-mamba: positions {start.tolist()} + query lengths {lens_t.tolist()} != "
                           f"seq_lens {seq_lens.tolist()}")
    if slots_t.unique().numel() != slots_t.numel():
        raise RuntimeError(f"aligned-mamba: a state slot appears twice in one step: {slots_t.tolist()}")
    return Batch(slots=slots_t, start_pos=start, cu_seqlens=cu)


def step_batch(md: Any, positions: torch.Tensor) -> Batch:
    """``batch_from_metadata``, once per metadata object (vLLM builds one per step and KV-cache group)."""
    batch = getattr(md, _BATCH_ATTR, None)
    if batch is None:
        batch = batch_from_metadata(md, positions)
        setattr(md, _BATCH_ATTR, batch)
    return batch


class ReplayMambaLayer(MambaBase, nn.Module):
    """One Mamba2 block over its slot of vLLM's Mamba cache (the core layer's state per request).

    ``block`` (the core's norm + ``Mamba2Mixer``) is set when the weights are loaded; the forward
    advances the step's slots through its mixer from this layer's own metadata and state views (the
    model fuses each residual add with the next norm, as the core's forward does).
    """

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

    def batch(self, positions: torch.Tensor) -> Batch | None:
        """This step's core Batch from this layer's metadata (None in a profiling / dummy run)."""
        md = get_forward_context().attn_metadata
        if md is None:
            return None
        if not isinstance(md, dict):
            refuse("micro-batched (ubatch) steps are not covered")
        return step_batch(md[self.prefix], positions)

    def forward(self, normed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The mixer over the step's new tokens: normed [T, hidden] (the block's norm of the residual,
        the step's real tokens) -> [T, hidden] in the model dtype; the model adds it to the residual."""
        assert self.block is not None, "weights not loaded"
        batch = self.batch(positions)
        assert batch is not None, "a layer's forward without attention metadata"
        mixer = self.block.mixer
        state = mixer.state(self.state_tensors())
        fresh = batch.slots[batch.start_pos == 0]
        if fresh.numel():
            state.reset(fresh)  # vLLM reuses slots: a new or recomputed request starts from zero state
        return mixer.advance(state, batch, normed)


class ExactReplayMamba2ForCausalLM(nn.Module):
    """Mamba2ForCausalLM on the core's layers (registered under that name when the switch is on).

    The weights are the checkpoint's tensors as the core's ``build_model`` takes them, so every cast
    (A = -exp(A_log) in fp32, the linear weights as the backend wants them, ...) is the trainer's own
    code.
    """

    # vLLM's model interfaces (HasInnerState, IsAttentionFree), declared as flags
    has_inner_state: ClassVar[Literal[True]] = True
    is_attention_free: ClassVar[Literal[True]] = True
    supports_mamba_prefix_caching: ClassVar[Literal[False]] = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        check_engine(vllm_config, resolved=True)
        self.vllm_config = vllm_config
        self.contract = engine_contract(vllm_config)
        self.config = core_config(vllm_config)
        self.layout = replay_layout(self.config, self.contract)
        base = f"{prefix}." if prefix else ""
        self.layers = nn.ModuleList(ReplayMambaLayer(f"{base}backbone.layers.{i}.mixer", self.layout)
                                    for i in range(self.config.num_hidden_layers))
        self.core: CausalLM | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        self._device = vllm_config.device_config.device
        logger.info("aligned-mamba exact replay: %s; %d bytes of replay state per sequence", self.contract,
                    self.state_bytes_per_sequence())

    # -- vLLM's state declaration, from the config alone (hybrid page sizing) ---------------------
    @classmethod
    def _layout_from_config(cls, vllm_config: VllmConfig) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return replay_layout(core_config(vllm_config), engine_contract(vllm_config))

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        return tuple(s for _, s, _ in cls._layout_from_config(vllm_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return tuple(d for _, _, d in cls._layout_from_config(vllm_config))

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple:
        # Only prefix caching (align mode) and speculative decoding copy states; both are refused.
        refuse("copying replay states between blocks (prefix caching / speculative decoding) is not covered")

    @classmethod
    def get_mamba_state_copy_funcs(cls, mamba_types: set) -> dict:
        return {t: cls.get_mamba_state_copy_func() for t in mamba_types}

    def state_bytes_per_sequence(self) -> int:
        return len(self.layers) * sum(math.prod(s) * d.itemsize for _, s, d in self.layout)

    # -- weights -----------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Collect HF-named tensors and (re)build the core model from them.

        A later call (vLLM's reload_weights, an RL weight update) may carry a subset: it replaces
        those tensors and rebuilds. Names outside the checkpoint layout are refused.
        """
        shapes = expected_shapes(self.config)
        got: set[str] = set()
        for name, t in weights:
            if name == LM_HEAD and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head (the core reads it from there)
            if name not in shapes:
                raise ModelLoadError(f"aligned-mamba: unexpected tensor {name!r} for a Mamba2 checkpoint")
            if tuple(t.shape) != shapes[name]:
                raise ModelLoadError(f"aligned-mamba: tensor {name!r} has shape {list(t.shape)}, "
                                     f"expected {list(shapes[name])}")
            self._tensors[name] = t.detach().to("cpu").clone()
            got.add(name)
        missing = [n for n in shapes if n not in self._tensors]
        if missing:
            raise ModelLoadError(f"aligned-mamba: {len(missing)} missing tensor(s), e.g. {missing[:3]}")
        self.core = build_model(self.config, self._tensors, self.contract, device=self._device)
        for layer, block in zip(self.layers, self.core.blocks, strict=True):
            layer.block = block
        if self.config.tie_word_embeddings:
            got.add(LM_HEAD)
        return got

    # -- the forward -------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.core is not None
        return self.core.embedding[input_ids]

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        """One engine step: every layer advances the scheduled requests' slots by their new tokens.

        input_ids / positions [T_padded]; returns the final normed hidden rows [T_padded, hidden]
        (model dtype; rows past the real tokens are zero) for ``compute_logits``.
        """
        if input_ids is None or inputs_embeds is not None:
            refuse("prompt embeddings are not covered (the core starts from token ids)")
        core = self.core
        assert core is not None, "weights not loaded"
        out = torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=core.dtype, device=input_ids.device)
        batch = self.layers[0].batch(positions)
        if batch is None:  # profiling / dummy run without a cache: nothing to advance
            return out
        n = batch.num_tokens
        # the core's forward, each block's mixer run by its own layer from its own metadata
        out[:n] = core.run_blocks(input_ids[:n], lambda i, normed, rows: self.layers[i](normed, positions))
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The core's row-invariant lm_head: [R, hidden] -> [R, vocab] (model dtype)."""
        assert self.core is not None
        return self.core.logits(hidden_states)
