"""One causal LM over layer kinds: embedding, pre-norm blocks ``residual += mixer(norm(residual))``,
final norm, lm_head. Every forward, the trainer's and the sampler's, is an ``advance`` of some slots
(docs/design.md, "The one idea"); a family only maps its checkpoint onto this."""

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
    """What the generic model needs of a family's config: vocab_size (the embedding's and lm_head's
    rows), hidden_size, residual_in_fp32 (else the model dtype), tie_word_embeddings."""

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
    """Per-layer states for ``num_slots`` sequences: ``states[i]`` block i's mixer's (None if
    stateless), ``tensors[i]`` its ``StateSpec`` tensors (an engine may own them); ``max_len``: the
    most tokens a slot holds where a layer keeps a row per token, else None; ``pages``: a paged
    cache's ``KVPages``, else None."""

    def __init__(self, states: list[Any], tensors: list[dict[str, torch.Tensor] | None], num_slots: int,
                 max_len: int | None = None, pages: Any = None) -> None:
        self.states = states
        self.tensors = tensors
        self.num_slots = num_slots
        self.max_len = max_len
        self.pages = pages

    def reset(self, slots: list[int] | torch.Tensor) -> None:
        """Empty ``slots`` in every layer (a fill per tensor on the device; paged slots give pages back)."""
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
    """A causal LM on the shared ops under one contract, built by a family (``models.build_model``);
    ``max_len``: a cache's default maximum length where a layer keeps a row per token. Under ``tp``
    each rank holds a vocabulary shard of ``embedding`` and ``lm_head`` [V / k, hidden] and returns
    the full logits rows, the same bits at every degree dividing ``row_parallel_slices``."""

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

    @property
    def uncapturable(self) -> str | None:
        """Why a decode step of this model cannot be captured in a CUDA graph (None where it can): an all-gather
        through the host, or a layer's own reason (its ``uncapturable``, where it has one)."""
        if not self.tp.capturable:
            return "this model's tensor-parallel all-gather goes through the host (gloo)"
        return next((why for b in self.blocks if (why := getattr(b.mixer, "uncapturable", None))), None)

    def new_cache(self, num_slots: int, max_len: int | None = None, *, page_size: int | None = None,
                  num_pages: int | None = None) -> Cache:
        """Zeroed states for ``num_slots`` sequences; ``max_len`` (default the model's): the most tokens
        a sequence reaches, for layers that keep a row per token; with ``page_size`` those rows are in
        ``num_pages`` shared pages (``KVPages``; default: enough for every slot at ``max_len``)."""
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
        """A cache over per-layer tensors an engine owns, one dict per block (sized for ``max_len``)."""
        states = [None if ts is None else b.mixer.state(ts) for b, ts in zip(self.blocks, tensors, strict=True)]
        return Cache(states, tensors, num_slots, max_len)

    def state_bytes_per_sequence(self, max_len: int | None = None) -> int:
        """Resident bytes of state one sequence holds (at ``max_len`` tokens, default the model's)."""
        max_len = (max_len or self.max_len) if self.per_length_state else None
        return sum(spec.bytes_per_slot(max_len) for b in self.blocks if (spec := b.mixer.state_spec()) is not None)

    # -- the one forward ------------------------------------------------------------------------------
    def advance(self, cache: Cache, batch: Step, token_ids: torch.Tensor, logit_rows: torch.Tensor | None = None,
                capture: list | None = None, *, check: bool = True) -> torch.Tensor:
        """Advance the batch's slots by token_ids [T] int64 (packed as ``batch.cu_seqlens``) -> logits
        [rows wanted, vocab] (model dtype); logit_rows [T] bool (default all). ``capture``: a list that
        receives each Mamba2 layer's scan inputs and outputs; ``check``: see ``hidden_states``."""
        return self.logits(self.hidden_states(cache, batch, token_ids, logit_rows, capture, check=check))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden rows [R, hidden_size] -> [R, vocab] (model dtype); under TP the shards' logits
        all-gathered, no sum."""
        local = self.backend.linear(hidden, self.lm_head)
        if self.tp.size == 1:
            return local
        return self.tp.all_gather(local).permute(1, 0, 2).reshape(local.shape[0], local.shape[1] * self.tp.size)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] -> [T, hidden] (model dtype); under TP each row picked from its owner's shard
        (an all-reduce of a row and zeros would turn -0.0 into +0.0)."""
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
        """``advance`` up to the final norm: [rows wanted, hidden_size] (model dtype), for engines that
        call ``logits`` later (vLLM). ``check=False`` skips the token-id range check (a device read),
        for callers that checked on the host (a captured CUDA graph). ValueError for bad token ids.
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
        """The forward around the mixers -> final normed rows [rows wanted, hidden]. ``mix(i, normed,
        rows)`` runs block i's mixer on [T, hidden] (model dtype) -> [rows, hidden]; an engine that runs
        the mixers itself (vLLM) passes its own. Residual adds are fused with the next norm."""
        be, dtype = self.backend, self.dtype
        first = self.blocks[0].norm
        res_dtype = torch.float32 if self.shape.residual_in_fp32 else dtype
        if self.tp.size == 1:
            normed, residual = be.embed_norm(token_ids, self.embedding, first.weight, first.config.eps, dtype,
                                             res_dtype)
        else:  # the same fused norm over the gathered rows (rows[i] for token i)
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
    def forward(self, sequences: Sequence[torch.Tensor], capture: list | None = None, *,
                packed: bool = False) -> list[torch.Tensor] | torch.Tensor:
        """The trainer's logits: one advance from empty slots. sequences: a list of [len_i] int64 token
        ids -> a list of [len_i, vocab] (model dtype), or with ``packed`` the one [sum len_i, vocab] they
        are rows of; anything else is a ValueError saying what it expects.
        """
        self._check_ids(sequences)
        lens = [int(s.numel()) for s in sequences]
        cache = self.new_cache(len(sequences), max_len=max([1, *lens]))
        batch = Step.from_empty(lens)
        logits = self.advance(cache, batch, torch.cat([s.to(torch.int64) for s in sequences]), capture=capture)
        # packed or one sequence: the rows as they are (a split's backward concatenates its gradients into a copy)
        return logits if packed else [logits] if len(lens) == 1 else list(torch.split(logits, lens))

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
