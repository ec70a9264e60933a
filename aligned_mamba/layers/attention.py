"""Causal grouped-query self-attention: q/k/v projections, the backend's attention, o_proj.

The per-slot state is the k_proj / v_proj outputs of every token consumed ([MAX_LEN, G, D], model
dtype), in a slot cache or in pages (``KVPages``); ``advance_paged`` serves an engine that owns the
pages. Why every schedule gives the same bits, paging and split keys: docs/design.md, "How the bits
are kept" (Attention). Weights as transformers' ``NemotronHAttention``: q_proj.weight [H*D, hidden],
k_proj / v_proj.weight [G*D, hidden], o_proj.weight [hidden, H*D]; no biases, no rotary, scale D^-0.5.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..errors import ModelLoadError, RuntimeFailure
from ..ops.attention import KV_BLOCK, ROW_TILE, BlockedPlan, blocked_plan
from ..ops.attention.blocked import CacheTables as StepTables  # noqa: F401  (the old names)
from ..ops.attention.blocked import cache_tables as step_tables  # noqa: F401
from ..ops.backend import Backend
from ..ops.linear.sliced import row_parallel_linear, row_parallel_weight
from ..ops.step import Step
from ..parallel import TPGroup, shared
from .base import MAX_LEN, StateSpec, take


@dataclass(frozen=True)
class AttentionConfig:
    """hidden_size; num_heads (H) query heads and num_kv_heads (G) key/value heads of head_dim (D)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight under the layer's prefix with its shape, in a fixed order."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj.weight": (h, q)}


class KVPages:
    """Which of ``num_pages`` pages of ``page_size`` keys each of ``num_slots`` slots holds, shared by
    a model's attention layers (each layer's k/v: [num_pages, page_size, G, D]).

    ``table`` [num_slots, max_blocks] int32 on ``device``: key p of slot s in page ``table[s, p //
    page_size]``, row ``p % page_size``; entries past a slot's pages are stale, never read. ``ensure``
    allocates on the host before a step's launches; the changed entries reach ``table`` by an async
    copy on the current stream, so kernels and graph replays enqueued after it read the new table.
    """

    def __init__(self, num_slots: int, max_len: int, page_size: int, num_pages: int,
                 device: torch.device | str) -> None:
        if min(num_slots, max_len, page_size, num_pages) < 1:
            raise ValueError(f"a paged KV cache needs >= 1 slot, token, key per page and page; got {num_slots}, "
                             f"{max_len}, {page_size}, {num_pages}")
        self.num_slots, self.max_len, self.page_size, self.num_pages = num_slots, max_len, page_size, num_pages
        self.device = torch.device(device)
        self.max_blocks = -(-max_len // page_size)
        self.host = np.zeros((num_slots, self.max_blocks), dtype=np.int32)
        self.held = np.zeros(num_slots, dtype=np.int64)  # pages each slot holds
        self.free = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
        self.table = torch.zeros(num_slots, self.max_blocks, dtype=torch.int32, device=self.device)
        self._last: Step | None = None

    def ensure(self, slots: np.ndarray | list[int], ends: np.ndarray | list[int]) -> None:
        """Give each slot ``slots[i]`` the pages for ``ends[i]`` tokens (it keeps those it holds)."""
        slots, ends = np.asarray(slots, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        if slots.size and int(ends.max()) > self.max_len:
            raise ValueError(f"a sequence reaches {int(ends.max())} tokens but the paged KV cache holds "
                             f"{self.max_len} per sequence")
        need = -(-ends // self.page_size)
        grow = need > self.held[slots]
        if not grow.any():
            return
        if int((need - self.held[slots])[grow].sum()) > len(self.free):
            raise RuntimeFailure(f"the paged KV cache is out of pages: {len(self.free)} of {self.num_pages} free, "
                                 f"{int((need - self.held[slots])[grow].sum())} needed")
        upd = []
        for s, n in zip(slots[grow].tolist(), need[grow].tolist()):
            for b in range(int(self.held[s]), n):
                page = self.free.pop()
                self.host[s, b] = page
                upd.append((s, b, page))
            self.held[s] = n
        u = torch.tensor(upd, dtype=torch.int64).T
        if self.device.type == "cuda":
            u = u.pin_memory().to(self.device, non_blocking=True)  # the caching host allocator keeps it alive
        self.table[u[0], u[1]] = u[2].to(torch.int32)

    def ensure_step(self, batch: Step) -> None:
        """``ensure`` for a step's slots, once per step; nothing for a captured step (``decode_graph``
        allocates before each replay)."""
        if batch is self._last or any(plan.sealed for plan in batch.plans.values()):
            return
        self.ensure(batch.slots.numpy(), (batch.start_pos + batch.lengths).numpy())
        self._last = batch

    def release(self, slots: list[int] | np.ndarray) -> None:
        """Return the slots' pages to the free list (the slots are then empty)."""
        for s in np.asarray(slots, dtype=np.int64).reshape(-1).tolist():
            self.free.extend(self.host[s, :self.held[s]][::-1].tolist())
            self.held[s] = 0
        self._last = None

    @property
    def pages_free(self) -> int:
        return len(self.free)


@dataclass
class AttentionState:
    """One layer's keys and values: k_cache, v_cache [slots, max_len, G, D] (model dtype), or with
    ``pages`` pages [num_pages, page_size, G, D]."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    pages: KVPages | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"k_cache": self.k_cache, "v_cache": self.v_cache}

    @property
    def max_len(self) -> int:
        return self.k_cache.shape[1] if self.pages is None else self.pages.max_len


def state_spec(config: AttentionConfig, dtype: torch.dtype) -> StateSpec:
    """What one sequence slot holds in an attention layer: k_cache, v_cache [MAX_LEN, G, D]."""
    shape = (MAX_LEN, config.num_kv_heads, config.head_dim)
    return StateSpec((("k_cache", shape, dtype), ("v_cache", shape, dtype)))


@dataclass(frozen=True)
class PagedTables:
    """One step's tables over an engine's paged KV cache: write_block, write_off [T] int64 (each new
    token's page and offset); read_block, read_off [Tk] (the keys each sequence attends to, packed in
    batch order); cu_seqlens_q, cu_seqlens_k [S+1] int64 (CPU); plan: the blocked tables (device)."""

    write_block: torch.Tensor
    write_off: torch.Tensor
    read_block: torch.Tensor
    read_off: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    plan: BlockedPlan


def paged_tables(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int,
                 rep: int, device: torch.device) -> PagedTables:
    """The tables of one step over a paged cache, for H // G = ``rep``, built on the host, moved once.

    cu_seqlens_q [S+1]: the new tokens' offsets; seq_lens [S]: lengths after the step (the new tokens
    last); block_table [S, max_blocks]: each sequence's pages in order. ValueError on bad lengths.
    """
    cu_q = cu_seqlens_q.to("cpu", torch.int64)
    end = seq_lens.to("cpu", torch.int64)
    bt = block_table.to("cpu", torch.int64)
    n = cu_q.diff()
    if bool((n > end).any()) or bool((n < 0).any()):
        raise ValueError("every sequence needs 0 <= new tokens <= its length")
    S = n.numel()
    need = (end + block_size - 1) // block_size
    if S and int(need.max()) > bt.shape[1]:
        raise ValueError(f"a sequence of {int(end.max())} tokens needs {int(need.max())} pages of {block_size}; "
                         f"its block table lists {bt.shape[1]}")
    seq_t = torch.repeat_interleave(torch.arange(S), n)
    write_pos = (end - n)[seq_t] + torch.arange(int(cu_q[-1])) - cu_q[:-1][seq_t]
    cu_k = torch.zeros(S + 1, dtype=torch.int64)
    cu_k[1:] = torch.cumsum(end, 0)
    seq_k = torch.repeat_interleave(torch.arange(S), end)
    read_pos = torch.arange(int(cu_k[-1])) - cu_k[:-1][seq_k]
    plan = blocked_plan(cu_q, cu_k, rep, kv_block=KV_BLOCK, row_tile=ROW_TILE).to(device)

    def page(seq: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return bt[seq, pos // block_size].to(device), (pos % block_size).to(device)

    wb, wo = page(seq_t, write_pos)
    rb, ro = page(seq_k, read_pos)
    return PagedTables(wb, wo, rb, ro, cu_q, cu_k, plan)


def _kv_heads(config: AttentionConfig, group: TPGroup) -> range:
    """The key/value heads rank ``group.rank`` holds (``parallel.shared``)."""
    return shared(config.num_kv_heads, group, "num_key_value_heads")


def local_config(config: AttentionConfig, group: TPGroup) -> AttentionConfig:
    """The attention one rank runs: num_heads / k query heads and its key/value heads."""
    if group.size == 1:  # the full layer, without a copy (models are built every training step)
        return config
    if config.num_heads % group.size:
        raise ModelLoadError(f"num_attention_heads {config.num_heads} cannot be split across {group.size} "
                             "tensor-parallel ranks")
    return replace(config, num_heads=config.num_heads // group.size,
                   num_kv_heads=len(_kv_heads(config, group)))


def shard_weights(config: AttentionConfig, tensors: Mapping[str, torch.Tensor], prefix: str,
                  group: TPGroup) -> dict[str, torch.Tensor]:
    """Rank ``group.rank``'s cut of a full checkpoint: q/k/v_proj's rows of its heads, o_proj's columns."""
    D, H, k, r = config.head_dim, config.num_heads, group.size, group.rank
    q = slice(r * H // k * D, (r + 1) * H // k * D)
    kv_heads = _kv_heads(config, group)
    kv = slice(kv_heads.start * D, kv_heads.stop * D)
    t = {n: take(tensors, prefix, f"{n}_proj.weight") for n in "qkvo"}
    return {prefix + "q_proj.weight": t["q"][q], prefix + "k_proj.weight": t["k"][kv],
            prefix + "v_proj.weight": t["v"][kv], prefix + "o_proj.weight": t["o"][:, q]}


class Attention:
    """Causal grouped-query self-attention on a backend, in a model dtype; every cast is
    differentiable, so a trainer can build it from its parameters on each forward. With ``tp``:
    ``config`` the full layer's, ``tensors`` this rank's (``shard_weights``), o_proj the row-parallel
    GEMM over ``slices``. ModelLoadError on a CUDA device without the triton backend."""

    kind = "attention"
    #: the row-parallel GEMM (``baseline.stock_tp_model`` puts stock tensor parallelism's in its place)
    row_parallel = staticmethod(row_parallel_linear)

    def __init__(self, config: AttentionConfig, tensors: Mapping[str, torch.Tensor], prefix: str, *,
                 backend: Backend, dtype: torch.dtype, tp: TPGroup | None = None, slices: int = 1) -> None:
        self.tp = tp
        self.slices = slices
        self.sliced = slices > 1 or (tp is not None and tp.size > 1)
        if tp is not None:
            config = local_config(config, tp)
        c = config
        if backend.device.type == "cuda" and backend.name != "triton":
            raise ModelLoadError("attention layers on a CUDA device need the triton backend: the torch form's "
                                 "batched GEMMs go to cuBLAS there, whose rows change with the call's shape")
        if c.num_heads % c.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {c.num_heads} is not a multiple of num_key_value_heads "
                                 f"{c.num_kv_heads}")
        self.config = config
        self.backend = backend
        self.dtype = dtype
        lw = backend.linear_weight

        def get(name: str) -> torch.Tensor:
            return lw(take(tensors, prefix, name).to(device=backend.device, dtype=dtype))

        self.q_w, self.k_w, self.v_w, self.o_w = (get(f"{n}_proj.weight") for n in "qkvo")
        if self.sliced:
            if backend.linear_partial is None:
                raise ModelLoadError(f"row_parallel_slices {slices} refused on the {backend.name} backend: its "
                                     "sliced tree GEMM is not implemented yet")
            raw = take(tensors, prefix, "o_proj.weight")
            self.o_slices = row_parallel_weight(backend, self.o_w, lambda: raw.to(device=backend.device, dtype=dtype),
                                                slices, 1 if tp is None else tp.size)

    # -- state ------------------------------------------------------------------------------------
    def state_spec(self) -> StateSpec:
        """k_cache, v_cache [MAX_LEN, G, D] in the model dtype."""
        return state_spec(self.config, self.dtype)

    def state(self, tensors: Mapping[str, torch.Tensor], pages: KVPages | None = None) -> AttentionState:
        """The state over the tensors of ``state_spec`` (views kept), or with ``pages`` over pages
        (``state_spec`` allocated for ``num_pages`` slots of ``page_size`` tokens)."""
        if pages is not None and tensors["k_cache"].shape[:2] != (pages.num_pages, pages.page_size):
            raise ValueError(f"pages {tuple(tensors['k_cache'].shape[:2])} are not the paged cache's "
                             f"[{pages.num_pages}, {pages.page_size}]")
        block = getattr(self.backend.configs, "attn_block_n", None)  # the kernel's key block (triton)
        if pages is not None and block is not None and pages.page_size % block:
            raise ValueError(f"a KV page of {pages.page_size} keys refused: the attention key block (attn_block_n "
                             f"{block}) must divide the page size")
        return AttentionState(tensors["k_cache"], tensors["v_cache"], pages)

    # -- the one forward ---------------------------------------------------------------------------
    def advance(self, state: AttentionState, batch: Step, hidden: torch.Tensor, rows: torch.Tensor | None = None,
                capture: list | None = None) -> torch.Tensor:
        """hidden [T, hidden_size] (model dtype, normed) -> [rows wanted, hidden_size]; rows [T] bool
        (default all). Stores the new keys and values; ``capture`` is unused."""
        c = self.config
        end = int((batch.start_pos + batch.lengths).max()) if batch.slots.numel() else 0
        if end > state.max_len:
            raise ValueError(f"a sequence reaches {end} tokens but the attention cache holds {state.max_len} "
                             "per sequence")
        q, k, v = self.project(hidden)
        paged = {}
        if state.pages is not None:
            state.pages.ensure_step(batch)  # host work, before this step's first launch that reads the table
            paged["block_table"] = state.pages.table
        o = self.backend.attention(q, k, v, state.k_cache, state.v_cache, batch, scale=c.scale, **paged)
        return self.output(o, rows)

    def advance_paged(self, key_pages: torch.Tensor, value_pages: torch.Tensor, tables: PagedTables,
                      hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``advance`` over pages an engine owns (vLLM's block manager): key_pages, value_pages
        [num_blocks, G, block_size, D] (model dtype, written in place), ``tables`` from ``paged_tables``;
        the keys are gathered back into ``advance``'s packed layout, so the rows are its bits."""
        if key_pages.dtype != self.dtype or value_pages.dtype != self.dtype:
            raise ValueError(f"the paged KV cache holds {key_pages.dtype}, the model computes in {self.dtype}: "
                             "keys would be rounded")
        c = self.config
        q, k, v = self.project(hidden)
        key_pages[tables.write_block, :, tables.write_off] = k
        value_pages[tables.write_block, :, tables.write_off] = v
        o = self.backend.attention_packed(q, key_pages[tables.read_block, :, tables.read_off],
                                          value_pages[tables.read_block, :, tables.read_off], tables.cu_seqlens_q,
                                          tables.cu_seqlens_k, tables.plan, scale=c.scale)
        return self.output(o, rows)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, G, D] (model dtype) of normed rows [T, hidden_size]."""
        c, be, T = self.config, self.backend, hidden.shape[0]
        q = be.linear(hidden, self.q_w).view(T, c.num_heads, c.head_dim)
        k = be.linear(hidden, self.k_w).view(T, c.num_kv_heads, c.head_dim)
        v = be.linear(hidden, self.v_w).view(T, c.num_kv_heads, c.head_dim)
        return q, k, v

    def output(self, o: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """o_proj of the attention rows o [T, H, D] (those ``rows`` picks) -> [rows, hidden_size]."""
        o = o.flatten(1)  # [T, H * D], zero rows included
        if rows is not None:
            o = o[rows]
        if self.sliced:
            return self.row_parallel(o, self.o_slices, None, slices=self.slices, group=self.tp or TPGroup.single(),
                                     partial=self.backend.linear_partial, tree=self.backend.linear_tree)
        return self.backend.linear(o, self.o_w)
