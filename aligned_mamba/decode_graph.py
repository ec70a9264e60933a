"""A decode step as one CUDA graph per batch-size bucket.

A decode step advances B sequences by one token each. On the triton backend every launch of the
step reads its tables (slots, positions, the conv's offsets) from the device and none reads
anything back, so the whole step (embedding, every layer's GEMMs, conv, scan, attention and norms,
the lm_head) can be captured once per bucket and replayed. Before a replay the step's tables and token
ids are copied into the graph's static buffers (one copy from pinned memory); a bucket larger
than the step is filled with padding entries that decode into a spare slot of the cache, which no
sequence owns (their rows are computed and dropped: every row is a fixed function of its own
inputs, so they change nothing in the others). Chunk completions run inside the graph: the
completion kernels check every entry's position on the device. A paged KV cache (``Cache.pages``)
gets its pages on the host before the copy (``KVPages.ensure``: new entries of the block table go
to the device on the same stream), and the graph reads the table from its fixed buffer.

The graph runs the very kernels of an eager step with the same arguments, so its rows are the
eager step's, and by the decode kernels' contract the single-pass prefill's
(tests/core/test_decode_graph.py checks both on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .models.causal_lm import Cache, CausalLM
from .ops.ssd.plan import host_ints
from .ops.step import Step, StepPlan

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeGraphs:
    """Decode steps of ``model`` over ``cache`` as CUDA graphs, one per bucket, captured on first use.

    ``spare_slot``: a slot of ``cache`` that no sequence owns (allocate one more than the engine
    hands out); padding entries decode there. Refuses (ValueError) a model that cannot be captured:
    the triton backend on a CUDA device is required.
    """

    def __init__(self, model: CausalLM, cache: Cache, *, spare_slot: int, buckets: Sequence[int] = BUCKETS) -> None:
        be = model.backend
        if be.name != "triton" or model.device.type != "cuda":
            raise ValueError(f"a decode step can be captured on the triton backend on a CUDA device, not {be!r}")
        if not 0 <= spare_slot < cache.num_slots:
            raise ValueError(f"spare slot {spare_slot} outside the cache's {cache.num_slots} slots")
        self.model, self.cache, self.spare = model, cache, spare_slot
        # a paged KV cache: pages are handed out on the host before each replay; the graph reads the
        # block table (a fixed device buffer); the spare slot keeps one page for the padding entries
        self.pages = cache.pages
        if self.pages is not None:
            self.pages.ensure([spare_slot], [1])
        self.buckets = tuple(sorted(buckets))
        self._graphs: dict[int, _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle()  # one memory pool for every bucket's graph

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"a decode step of {n} sequences exceeds the largest bucket {self.buckets[-1]}")

    def step(self, slots: Sequence[int] | torch.Tensor, positions: Sequence[int] | torch.Tensor,
             token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """One decode step: sequence i (in ``slots[i]``, ``positions[i]`` tokens already consumed)
        takes ``token_ids[i]``. Returns its logits rows [B, vocab] in the model dtype: a view of the
        graph's static output, valid until the next step of this bucket (clone what you keep)."""
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
            # the table's changed entries are copied on this stream, ahead of the replay that reads them
            self.pages.ensure(slots, positions + 1)
        b = self.bucket(n)
        c = self._graphs.get(b) or self._capture(b)
        c.copied.synchronize()  # the previous step's copy out of ``host`` has run: it may be rewritten
        h = c.host_np
        h[0, :n], h[1, :n], h[2, :n] = slots, positions, token_ids
        h[0, n:], h[1:, n:] = self.spare, 0
        c.tables.copy_(c.host, non_blocking=True)  # pinned: ordered on the stream, no wait for the device
        c.copied.record()
        c.graph.replay()
        return c.logits[:n]

    def capture(self, buckets: Sequence[int] | None = None) -> None:
        """Capture the graphs of ``buckets`` (default: all) now rather than at their first step
        (an engine does this at start-up; each capture decodes into the spare slot only)."""
        for b in self.buckets if buckets is None else buckets:
            if b not in self.buckets:
                raise ValueError(f"{b} is not a bucket of {self.buckets}")
            if b not in self._graphs:
                self._capture(b)

    @property
    def captured(self) -> tuple[int, ...]:
        """The buckets whose graphs are captured, ascending."""
        return tuple(sorted(self._graphs))

    def graph(self, n: int) -> torch.cuda.CUDAGraph:
        """The captured graph that decodes a step of ``n`` sequences (for profiling the replay alone:
        a replay repeats the bucket's last step, writing its states again). KeyError if not captured."""
        return self._graphs[self.bucket(n)].graph

    def _capture(self, b: int) -> _Captured:
        # the device as the layers' tensors name it (cuda:0): the key of the step's plan
        dev = next((t.device for ts in self.cache.tensors if ts for t in ts.values()), self.model.device)
        tables = torch.empty(3, b, dtype=torch.int64, device=dev)
        host = torch.empty(3, b, dtype=torch.int64).pin_memory()
        tables[0].fill_(self.spare)
        tables[1:].zero_()
        batch = self._batch(b, tables)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # compile every kernel (decoding into the spare slot) before capture
            self.model.advance(self.cache, batch, tables[2], check=False)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.model.advance(self.cache, batch, tables[2], check=False)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(dev))
        # the batch holds device tables made before the capture (the conv's offsets): the graph reads
        # their memory at every replay, so they live as long as the graph
        self._graphs[b] = _Captured(graph, tables, host, host.numpy(), logits, copied, batch)
        return self._graphs[b]

    def _batch(self, b: int, tables: torch.Tensor) -> Step:
        """A Step of b one-token sequences whose plan on the device holds the static buffers, sealed:
        asking for any other table raises, so nothing is ever built from the host fields (which
        only say: b sequences of one token) inside the graph."""
        batch = Step.make(list(range(b)), [0] * b, [1] * b)
        dev = tables.device
        plan = StepPlan(dev, torch.arange(b + 1, dtype=torch.int64, device=dev), tables[0], sealed=True)
        for state in self.cache.states:
            L = getattr(getattr(state, "ssd", None), "chunk_size", None)
            if L is not None:
                # every entry is checked for a completing chunk on the device (completes=True)
                plan.ssd_decode_tables[L] = (tables[0], tables[1], True)
        if any(hasattr(state, "k_cache") for state in self.cache.states):
            from .ops.attention.triton import decode_step_tables

            # attention reads its slot cache (or a paged cache's block table row) at the step's slots and
            # positions (one tile per entry)
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
