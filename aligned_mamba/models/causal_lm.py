"""One causal LM over layer kinds: embedding, pre-norm residual blocks, final norm, lm_head.

Every forward is an ``advance`` of some slots: the trainer's whole-sequence forward is one advance
from empty slots, the sampler's prefill, decode and recompute are advances of its own slots. Each
block is ``residual += mixer(norm(residual))`` with the mixer any layer kind (``layers/``), and
every op comes from the contract's backend, so the logits row of a token is the same function of
the same inputs on both sides. A model family (``models/<family>.py``) only maps its checkpoint's
names and config onto this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..contract import Contract
from ..layers.base import Layer
from ..layers.norm import RMSNorm
from ..ops.backend import Backend
from ..ops.step import Step
from ..parallel import TPGroup


@dataclass(frozen=True)
class LMShape:
    """What the generic model needs of a family's config.

    vocab_size: rows of the embedding and the lm_head; hidden_size; residual_in_fp32: the residual
    stream is kept in fp32 (else in the model dtype); tie_word_embeddings: the lm_head is the
    embedding.
    """

    vocab_size: int
    hidden_size: int
    residual_in_fp32: bool = True
    tie_word_embeddings: bool = False


@dataclass
class Block:
    """A pre-norm residual block: ``residual + mixer(norm(residual))``."""

    norm: RMSNorm
    mixer: Layer


class Cache:
    """Per-layer, slot-indexed states for ``num_slots`` sequences (None for a stateless layer).

    ``states[i]`` is what block i's mixer keeps; ``tensors[i]`` its named tensors (the
    ``StateSpec`` fields), which an engine may own (views into its memory). ``max_len``: the most
    tokens a slot can hold when a layer keeps a row per token (attention), else None (no limit).
    ``pages``: a paged cache's page table (``layers.attention.KVPages``), shared by the layers whose
    state holds it (their tensors are pages, not slot-indexed), else None.
    """

    def __init__(self, states: list[Any], tensors: list[dict[str, torch.Tensor] | None], num_slots: int,
                 max_len: int | None = None, pages: Any = None) -> None:
        self.states = states
        self.tensors = tensors
        self.num_slots = num_slots
        self.max_len = max_len
        self.pages = pages

    def reset(self, slots: list[int] | torch.Tensor) -> None:
        """Empty ``slots`` in every layer (one fill per slot-indexed tensor on the device; a paged
        layer's slots give their pages back)."""
        idx = torch.as_tensor(slots, dtype=torch.int64)
        for st, ts in zip(self.states, self.tensors, strict=True):
            if getattr(st, "pages", None) is not None:
                continue
            for t in (ts or {}).values():
                t.index_fill_(0, idx.to(t.device), 0)
        if self.pages is not None:
            self.pages.release(idx.cpu().numpy())

    def bytes_per_slot(self) -> int:
        """Resident bytes one sequence holds across all layers."""
        return sum(t[0].numel() * t.element_size() for ts in self.tensors for t in (ts or {}).values())


class CausalLM:
    """A causal LM on the shared ops under one contract (chunk size, backend, configs, dtype).

    Built by a model family (``models.build_model`` / ``load_model``): ``family`` names it and
    ``config`` is the family's own config; ``shape`` is what the generic forward reads; ``max_len``:
    the default maximum sequence length of a sampler's cache when a layer keeps a row per token
    (attention's keys and values; the family's max_position_embeddings), unused otherwise.

    ``tp``: the tensor-parallel group this rank belongs to (default: one process). Each rank holds a
    vocabulary shard of ``embedding`` and ``lm_head`` [V / k, hidden] and its part of every layer;
    every rank returns the same full logits rows, the same bits at every degree dividing the
    contract's ``row_parallel_slices``.
    """

    def __init__(self, *, family: str, config: Any, shape: LMShape, contract: Contract, backend: Backend,
                 embedding: torch.Tensor, blocks: list[Block], norm_f: RMSNorm, lm_head: torch.Tensor,
                 max_len: int | None = None, tp: TPGroup | None = None) -> None:
        self.tp = tp or TPGroup.single()
        self.family = family
        self.config = config
        self.shape = shape
        self.contract = contract
        self.backend = backend
        self.device = backend.device
        self.dtype: torch.dtype = getattr(torch, contract.model_dtype)
        self.embedding = embedding
        self.blocks = blocks
        self.norm_f = norm_f
        self.lm_head = lm_head
        self.max_len = max_len

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    # -- state --------------------------------------------------------------------------------------
    @property
    def per_length_state(self) -> bool:
        """Whether a layer keeps a row per token (its cache then needs a maximum sequence length)."""
        return any(spec.per_length for b in self.blocks if (spec := b.mixer.state_spec()) is not None)

    def new_cache(self, num_slots: int, max_len: int | None = None, *, page_size: int | None = None,
                  num_pages: int | None = None) -> Cache:
        """Zeroed states for ``num_slots`` sequences on the model's device; ``max_len``: the most tokens
        a sequence may reach, for layers that keep a row per token (default: the model's ``max_len``).

        ``page_size``: those layers keep their rows in pages of ``page_size`` tokens (a paged KV cache,
        ``layers.attention.KVPages``), ``num_pages`` of them shared by the slots (default: enough for
        every slot at ``max_len``), handed out as sequences grow and given back by ``reset``.
        """
        max_len = (max_len or self.max_len) if self.per_length_state else None
        pages = None
        if page_size is not None and self.per_length_state:
            from ..layers.attention import KVPages

            num_pages = num_pages or num_slots * -(-max_len // page_size)
            pages = KVPages(num_slots, max_len, page_size, num_pages, self.device)
        tensors, states = [], []
        for b in self.blocks:
            spec = b.mixer.state_spec()
            paged = pages is not None and spec is not None and spec.per_length
            ts = None if spec is None else (spec.allocate(num_pages, self.device, page_size) if paged
                                            else spec.allocate(num_slots, self.device, max_len))
            tensors.append(ts)
            states.append(None if ts is None else b.mixer.state(ts, pages) if paged else b.mixer.state(ts))
        return Cache(states, tensors, num_slots, max_len, pages)

    def cache_over(self, tensors: list[dict[str, torch.Tensor] | None], num_slots: int,
                   max_len: int | None = None) -> Cache:
        """A cache over per-layer tensors someone else owns (an engine's memory), one dict per block
        (``max_len``: as ``new_cache``'s, what the tensors were sized for)."""
        states = [None if ts is None else b.mixer.state(ts) for b, ts in zip(self.blocks, tensors, strict=True)]
        return Cache(states, tensors, num_slots, max_len)

    def state_bytes_per_sequence(self, max_len: int | None = None) -> int:
        """Resident bytes of state one sequence holds across all layers (at ``max_len`` tokens, default
        the model's, for layers that keep a row per token)."""
        max_len = (max_len or self.max_len) if self.per_length_state else None
        return sum(spec.bytes_per_slot(max_len) for b in self.blocks if (spec := b.mixer.state_spec()) is not None)

    # -- the one forward ------------------------------------------------------------------------------
    def advance(self, cache: Cache, batch: Step, token_ids: torch.Tensor, logit_rows: torch.Tensor | None = None,
                capture: list | None = None, *, check: bool = True) -> torch.Tensor:
        """Advance the batch's slots by their new tokens and return logits for ``logit_rows``.

        token_ids [T] int64 packed as ``batch.cu_seqlens`` says; logit_rows [T] bool (default all).
        Returns [rows wanted, vocab] in the model dtype. ``capture``, if a list, receives per Mamba2
        layer a dict of the scan's inputs and outputs (for accuracy reports); ``check``: see
        ``hidden_states``.
        """
        return self.logits(self.hidden_states(cache, batch, token_ids, logit_rows, capture, check=check))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over final hidden rows [R, hidden_size] -> [R, vocab] in the model dtype (under tensor
        parallelism each rank's vocabulary shard, the rows all-gathered: a logit is one output of the
        column-parallel GEMM, whichever rank computes it)."""
        local = self.backend.linear(hidden, self.lm_head)
        if self.tp.size == 1:
            return local
        return self.tp.all_gather(local).permute(1, 0, 2).reshape(local.shape[0], local.shape[1] * self.tp.size)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of token_ids [T] -> [T, hidden] (model dtype). Under tensor parallelism
        the owner's row of each token, picked from the all-gathered shards (a choice: exact, where an
        all-reduce of a row and zeros would turn -0.0 into +0.0)."""
        if self.tp.size == 1:
            return self.embedding[token_ids]
        v = self.embedding.shape[0]
        local = (token_ids - self.tp.rank * v).clamp(0, v - 1)
        rows = self.tp.all_gather(self.embedding[local])  # [k, T, hidden]
        owner = torch.div(token_ids, v, rounding_mode="floor")
        return rows[owner, torch.arange(token_ids.numel(), device=token_ids.device)]

    def hidden_states(self, cache: Cache, batch: Step, token_ids: torch.Tensor,
                      logit_rows: torch.Tensor | None = None, capture: list | None = None, *,
                      check: bool = True) -> torch.Tensor:
        """``advance`` up to the final norm: the normed hidden rows [rows wanted, hidden_size] (model
        dtype) that ``logits`` maps to logits. Engines that compute logits for a subset of rows later
        (vLLM's compute_logits) call this and ``logits`` separately. ``check=False`` skips the token-id
        range check (a device read): for callers that checked on the host, e.g. a captured CUDA graph.
        """
        if token_ids.numel() != batch.num_tokens:
            raise ValueError(f"{token_ids.numel()} token ids for a batch of {batch.num_tokens} tokens")
        V = self.shape.vocab_size
        if check and token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= V):
            raise ValueError(f"token ids must lie in [0, {V})")
        token_ids = token_ids.to(self.device)
        if logit_rows is not None:
            logit_rows = logit_rows.to(self.device)

        def mix(i: int, normed: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
            return self.blocks[i].mixer.advance(cache.states[i], batch, normed, rows, capture)

        return self.run_blocks(token_ids, mix, logit_rows)

    def run_blocks(self, token_ids: torch.Tensor, mix: Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor],
                   logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The forward around the mixers: ``mix(i, normed, rows)`` runs block i's mixer on its normed
        input [T, hidden] (model dtype), returning [rows, hidden]. Each block's residual add is fused
        with the next block's norm (``Backend.add_norm``; the final norm after the last block), the
        embedding gather with the first norm. Returns the final normed rows [rows wanted, hidden].
        An engine that runs each mixer itself (vLLM's layers, from their own metadata) passes its own
        ``mix``; ``hidden_states`` passes the mixers' advance over a cache."""
        be, dtype = self.backend, self.dtype
        first = self.blocks[0].norm
        res_dtype = torch.float32 if self.shape.residual_in_fp32 else dtype
        if self.tp.size == 1:
            normed, residual = be.embed_norm(token_ids, self.embedding, first.weight, first.config.eps, dtype,
                                             res_dtype)
        else:  # the gathered rows, then the same fused norm over them (rows[i] for token i)
            rows = self.embed(token_ids)
            normed, residual = be.embed_norm(torch.arange(rows.shape[0], device=rows.device), rows, first.weight,
                                             first.config.eps, dtype, res_dtype)
        norms = [b.norm for b in self.blocks[1:]] + [self.norm_f]
        last = len(self.blocks) - 1
        for i, nxt in enumerate(norms):
            rows = logit_rows if i == last else None
            out = mix(i, normed, rows)
            if rows is not None:
                residual = residual[rows]
            normed, residual = be.add_norm(out, residual, nxt.weight, nxt.config.eps, dtype)
        return normed

    # -- the trainer's side ------------------------------------------------------------------------
    def forward(self, sequences: Sequence[torch.Tensor], capture: list | None = None) -> list[torch.Tensor]:
        """Score whole sequences in one packed varlen pass: one advance from empty slots.

        sequences: list of [len_i] int64 token ids. Returns a list of [len_i, vocab] logits (model dtype).
        Anything else (float or bool ids, ids outside [0, vocab), a bare or 2-D tensor, a list of
        ints, an empty list) is refused with a ValueError that says what it expects.
        """
        self._check_ids(sequences)
        lens = [int(s.numel()) for s in sequences]
        cache = self.new_cache(len(sequences), max_len=max([1, *lens]))
        batch = Step.from_empty(lens)
        logits = self.advance(cache, batch, torch.cat([s.to(torch.int64) for s in sequences]), capture=capture)
        return list(torch.split(logits, lens))

    def _check_ids(self, sequences: Any) -> None:
        vocab = self.shape.vocab_size
        expects = f"forward() expects a list of 1-D integer token-id tensors (values 0..{vocab - 1})"
        if isinstance(sequences, torch.Tensor):
            raise ValueError(f"{expects}, got a bare tensor of shape {list(sequences.shape)} (wrap it: [ids])")
        if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence):
            raise ValueError(f"{expects}, got {type(sequences).__name__}")
        if not sequences:
            raise ValueError(f"{expects}, got an empty list")
        for i, s in enumerate(sequences):
            if not isinstance(s, torch.Tensor):
                hint = " (a list of ints: wrap it in torch.tensor)" if isinstance(s, int) else ""
                raise ValueError(f"{expects}; sequences[{i}] is {type(s).__name__}{hint}")
            if s.dim() != 1:
                raise ValueError(f"{expects}; sequences[{i}] has shape {list(s.shape)}")
            if s.dtype == torch.bool or s.is_floating_point() or s.is_complex():
                raise ValueError(f"{expects}; sequences[{i}] is {str(s.dtype).replace('torch.', '')} "
                                 "(token ids are never rounded)")
            if s.numel() and (int(s.min()) < 0 or int(s.max()) >= vocab):
                raise ValueError(f"{expects}; sequences[{i}] holds ids {int(s.min())}..{int(s.max())}")

    def __repr__(self) -> str:
        return (f"CausalLM({self.family}, {len(self.blocks)} layers, hidden {self.shape.hidden_size}, vocab "
                f"{self.shape.vocab_size}, {self.contract})")
