"""A decode step as one CUDA graph per batch-size bucket.

On the triton backend a decode step's launches read their tables from the device and none reads back,
so the whole step is captured once per bucket and replayed after one pinned copy of its tables. A
bucket larger than the step is padded with entries that decode into a spare slot (rows dropped; rows
are independent). Each bucket has two graphs: a step where some token completes its chunk replays one with
the completion launches (which entries complete is checked on the device), any other step one without them
(they would do nothing); the positions are on the host, so the choice costs nothing. The completion launches
run on a side stream joined at the step's end (``triton_decode.completions_on``), so the later layers do not
wait for them; ``side_completions=False`` keeps them in order. A paged cache gets its
pages on the host before the copy. The graph runs the eager step's kernels with the same arguments, so
its rows are the eager step's (tests/core/test_decode_graph.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .models.causal_lm import Cache, CausalLM
from .ops.ssd.plan import host_ints
from .ops.ssd.triton_decode import completions_on
from .ops.step import Step, StepPlan

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeGraphs:
    """Decode steps of ``model`` over ``cache`` as CUDA graphs, one per bucket, captured on first use.
    ``spare_slot``: a slot no sequence owns (padding decodes there). ``side_completions``: the chunk-completion
    launches on a side stream (scheduling only: the same rows). ValueError off triton on CUDA."""

    def __init__(self, model: CausalLM, cache: Cache, *, spare_slot: int, buckets: Sequence[int] = BUCKETS,
                 side_completions: bool = True) -> None:
        be = model.backend
        if be.name != "triton" or model.device.type != "cuda":
            raise ValueError(f"a decode step can be captured on the triton backend on a CUDA device, not {be!r}")
        if not 0 <= spare_slot < cache.num_slots:
            raise ValueError(f"spare slot {spare_slot} outside the cache's {cache.num_slots} slots")
        self.model, self.cache, self.spare = model, cache, spare_slot
        # paged: pages are handed out on the host before each replay; the spare slot keeps one for padding
        self.pages = cache.pages
        if self.pages is not None:
            self.pages.ensure([spare_slot], [1])
        self.buckets = tuple(sorted(buckets))
        # the chunk sizes of the SSD states: a position p completes a chunk of L where p % L == L - 1
        self._chunks = sorted({L for state in cache.states
                               if (L := getattr(getattr(state, "ssd", None), "chunk_size", None)) is not None})
        self._graphs: dict[tuple[int, bool], _Captured] = {}
        self._last: dict[int, _Captured] = {}  # each bucket's graph of its latest step
        self._pool = torch.cuda.graph_pool_handle()  # one memory pool for every bucket's graph
        self._side = torch.cuda.Stream(model.device) if side_completions else None

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"a decode step of {n} sequences exceeds the largest bucket {self.buckets[-1]}")

    def step(self, slots: Sequence[int] | torch.Tensor, positions: Sequence[int] | torch.Tensor,
             token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Sequence i (``slots[i]``, ``positions[i]`` tokens consumed) takes ``token_ids[i]``. Returns logits
        [B, vocab] (model dtype), a view of the graph's output valid until the next step."""
        # numpy on the host: the step's host work runs before its copy and replay reach the GPU
        slots, positions, token_ids = (host_ints(t).reshape(-1) for t in (slots, positions, token_ids))
        n = slots.size
        if positions.size != n or token_ids.size != n or n == 0:
            raise ValueError(f"{n} slots, {positions.size} positions, {token_ids.size} tokens")
        V = self.model.shape.vocab_size
        if token_ids.min() < 0 or token_ids.max() >= V:
            raise ValueError(f"token ids must lie in [0, {V})")
        distinct = set(slots.tolist())
        if len(distinct) != n or self.spare in distinct:
            raise ValueError(f"slots must be distinct and not the spare slot {self.spare}: {slots.tolist()}")
        if self.pages is not None:
            # table changes are copied on this stream, ahead of the replay that reads them
            self.pages.ensure(slots, positions + 1)
        b = self.bucket(n)
        completes = any(bool((positions % L == L - 1).any()) for L in self._chunks)
        c = self._graphs.get((b, completes)) or self._capture(b, completes)
        self._last[b] = c
        c.copied.synchronize()  # the previous step's copy out of ``host`` has run: it may be rewritten
        h = c.host_np
        h[0, :n], h[1, :n], h[2, :n] = slots, positions, token_ids
        h[0, n:], h[1:, n:] = self.spare, 0
        c.tables.copy_(c.host, non_blocking=True)  # pinned: ordered on the stream, no wait for the device
        c.copied.record()
        c.graph.replay()
        return c.logits[:n]

    def capture(self, buckets: Sequence[int] | None = None) -> None:
        """Capture ``buckets`` (default: all) now, not at first use, both graphs of each; a capture decodes
        into the spare slot."""
        for b in self.buckets if buckets is None else buckets:
            if b not in self.buckets:
                raise ValueError(f"{b} is not a bucket of {self.buckets}")
            for completes in (False, True) if self._chunks else (False,):
                if (b, completes) not in self._graphs:
                    self._capture(b, completes)

    @property
    def captured(self) -> tuple[int, ...]:
        """The buckets with a graph captured, ascending."""
        return tuple(sorted({b for b, _ in self._graphs}))

    def graph(self, n: int) -> torch.cuda.CUDAGraph:
        """The graph of the latest step of ``n`` sequences' bucket, for profiling (a replay repeats that step).
        KeyError if that bucket has not stepped."""
        return self._last[self.bucket(n)].graph

    def _capture(self, b: int, completes: bool) -> _Captured:
        # the device as the layers' tensors name it (cuda:0): the key of the step's plan
        dev = next((t.device for ts in self.cache.tensors if ts for t in ts.values()), self.model.device)
        tables = torch.empty(3, b, dtype=torch.int64, device=dev)
        host = torch.empty(3, b, dtype=torch.int64).pin_memory()
        tables[0].fill_(self.spare)
        tables[1:].zero_()
        batch = self._batch(b, tables, completes)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream), self._completions():  # compile every kernel (decoding into the spare
            self.model.advance(self.cache, batch, tables[2], check=False)  # slot) before capture
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool), self._completions():
            logits = self.model.advance(self.cache, batch, tables[2], check=False)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(dev))
        # the batch owns device tables the graph reads at every replay (the conv's offsets): keep it
        self._graphs[b, completes] = _Captured(graph, tables, host, host.numpy(), logits, copied, batch)
        return self._graphs[b, completes]

    def _completions(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self._side is None else completions_on(self._side)

    def _batch(self, b: int, tables: torch.Tensor, completes: bool) -> Step:
        """A Step of b one-token sequences whose device plan holds the static buffers, sealed: any other
        table raises, so nothing inside the graph is built from the host fields. ``completes``: whether
        the SSD completion launches are in the step (their entries checked on the device), or none."""
        batch = Step.make(list(range(b)), [0] * b, [1] * b)
        dev = tables.device
        plan = StepPlan(dev, torch.arange(b + 1, dtype=torch.int64, device=dev), tables[0], sealed=True)
        for L in self._chunks:
            plan.ssd_decode_tables[L] = (tables[0], tables[1], completes)
        if any(hasattr(state, "k_cache") for state in self.cache.states):
            from .ops.attention.triton import decode_step_tables

            # one tile per entry, at the step's slots and positions
            plan.attention_tiles[0] = decode_step_tables(tables[0], tables[1])
        batch.plans[dev] = plan
        return batch


@dataclass
class _Captured:
    """One bucket's graph and everything its replays read or write."""

    graph: torch.cuda.CUDAGraph
    tables: torch.Tensor  # [3, b] int64 on the device: slots, positions, token ids
    host: torch.Tensor  # [3, b] pinned: the next step's tables
    host_np: np.ndarray  # a numpy view of ``host``
    logits: torch.Tensor  # [b, vocab]: the graph's output
    copied: torch.cuda.Event  # after the last copy out of ``host``
    batch: Step  # owns the device tables the graph reads
