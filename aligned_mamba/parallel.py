"""Tensor parallelism that keeps every bit: the rank group, the shards, the refusals, the launcher.

Why the one collective is ``TPGroup.all_gather``: docs/design.md, "How the bits are kept" (Tensor
parallelism); an all-reduce would also turn -0.0 + 0.0 into +0.0. Ranks run as threads (``threads``, tests)
or spawned CPU processes over gloo (``Ranks``; ``launch``); on GPUs pass ``TPGroup.from_torch()``.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .errors import AlignedMambaError, ModelLoadError

if TYPE_CHECKING:
    from .contract import Contract

Tensor = torch.Tensor


@dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel group as the layers see it: this process's ``rank`` of ``size``, and
    ``all_gather``: x [*s] -> [size, *s] (every rank's x, in rank order; x's dtype and device).
    ``capturable``: whether ``all_gather`` may run inside a CUDA graph capture (not through the host).
    ``all_to_all``: parts [size, *s] (part j for rank j) -> [size, *s] (rank i's part for this rank, in rank
    order); None: ``exchange`` takes it from the all-gather, size times the bytes."""

    rank: int
    size: int
    all_gather: Callable[[Tensor], Tensor]
    capturable: bool = True
    all_to_all: Callable[[Tensor], Tensor] | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1 and isinstance(self.rank, int)
                and 0 <= self.rank < self.size):
            raise AlignedMambaError(f"tensor-parallel rank {self.rank!r} of size {self.size!r} refused: expected "
                                    "0 <= rank < size")

    @staticmethod
    def single() -> TPGroup:
        """The group of one process (TP 1): its all-gather is x [None]."""
        return TPGroup(0, 1, lambda x: x.unsqueeze(0), all_to_all=lambda parts: parts)

    def exchange(self, parts: Tensor) -> Tensor:
        """parts [size, *s], part j for rank j -> [size, *s]: every rank's part for this one, in rank order."""
        if parts.shape[0] != self.size:
            raise AlignedMambaError(f"exchange takes one part per rank: {parts.shape[0]} parts for {self.size} ranks")
        if self.all_to_all is not None:
            return self.all_to_all(parts)
        return self.all_gather(parts.contiguous())[:, self.rank]

    @staticmethod
    def from_torch(group: Any = None) -> TPGroup:
        """Over a ``torch.distributed`` process group (default: the world), initialised by the caller:
        gloo on the CPU (CUDA tensors pass through the host), NCCL on GPUs. The all-gather is
        ``all_gather_into_tensor``, the all-to-all ``all_to_all_single``."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise AlignedMambaError("TPGroup.from_torch needs torch.distributed initialised "
                                    "(torch.distributed.init_process_group) first")
        size, rank = dist.get_world_size(group), dist.get_rank(group)

        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        # gloo gathers host tensors: a CUDA tensor (ranks sharing one GPU, say) goes through the host
        host = dist.get_backend(group) == "gloo"

        def raw(x: Tensor) -> Tensor:
            # moved as raw bytes: every dtype on every backend, the bits as they are
            b = x.contiguous().view(-1).view(torch.uint8)
            return b.cpu() if host else b

        def all_gather(x: Tensor) -> Tensor:
            b = raw(x)
            out = torch.empty(size * b.numel(), dtype=torch.uint8, device=b.device)
            gather(out, b, group=group)
            return out.to(x.device).view(x.dtype).view(size, *x.shape)

        def all_to_all(parts: Tensor) -> Tensor:
            b = raw(parts)
            out = torch.empty_like(b)
            dist.all_to_all_single(out, b, group=group)  # equal splits: part j of every rank to rank j
            return out.to(parts.device).view(parts.dtype).view(parts.shape)

        return TPGroup(rank, size, all_gather, capturable=not host, all_to_all=all_to_all)


class _Gather(torch.autograd.Function):
    """``group.all_gather``, x [*s] -> [size, *s], whose backward gives this rank's x the sum, in rank order,
    of every rank's gradient of it. Where every rank computes the same loss from gathered tensors, each rank's
    gradients are then those of size x the loss (``merge_gradients`` sums them over ranks and divides)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: TPGroup) -> Tensor:
        ctx.group = group
        return group.all_gather(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        group = ctx.group
        return _sum_in_order(group.exchange(g)), None  # [size: whose loss, *s]


def _sum_in_order(parts: Tensor) -> Tensor:
    """parts [n, *s] -> [*s], added left to right (the same bits on every rank)."""
    total = parts[0]
    for i in range(1, parts.shape[0]):
        total = total + parts[i]
    return total


def differentiable(group: TPGroup) -> TPGroup:
    """``group`` with ``_Gather`` as its all-gather (the forward's bits unchanged)."""
    return TPGroup(group.rank, group.size, lambda x: _Gather.apply(x, group), capturable=group.capturable)


def merge_gradients(group: TPGroup, params: list[Tensor], *, mean: bool = True) -> None:
    """After a backward through ``differentiable(group)`` with the same loss on every rank: each parameter's
    gradient (whole tensors on every rank; a sharded one's non-zero only in this rank's part) summed over the
    ranks in rank order and divided by the size, in place, so every rank holds the same gradients.
    ``mean=False``: the sum alone (each rank's gradient a part of the whole, as a parameter applied to
    sequence-parallel rows has)."""
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    total = _sum_in_order(group.all_gather(flat))
    if mean:
        total = total / group.size
    for p, g in zip(params, total.split([p.numel() for p in params])):
        p.grad = g.view_as(p).clone()


class _GatherRows(torch.autograd.Function):
    """x [n, *s] -> [size * n, *s]: the ranks' rows in rank order (entering a layer from sequence-parallel rows).
    Backward, ``summed``: every rank's gradient of this rank's n rows, exchanged (an all-to-all) and summed in
    rank order (a reduce-scatter whose order is fixed); else this rank's n rows of its own gradient (what
    follows the gather is replicated, so each rank's gradient is already whole)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: TPGroup, summed: bool) -> Tensor:
        ctx.group, ctx.summed, ctx.n = group, summed, x.shape[0]
        return group.all_gather(x).reshape(group.size * x.shape[0], *x.shape[1:])

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        group, n = ctx.group, ctx.n
        rows = slice(group.rank * n, (group.rank + 1) * n)
        if not ctx.summed:
            return g[rows], None, None
        return _sum_in_order(group.exchange(g.reshape(group.size, n, *g.shape[1:]))), None, None


class _ScatterRows(torch.autograd.Function):
    """x [size * n, *s], the same on every rank -> this rank's n rows (leaving a layer for sequence-parallel
    rows). Backward: the ranks' gradients of their rows gathered in rank order (each whole on its rank)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: TPGroup) -> Tensor:
        ctx.group = group
        n = x.shape[0] // group.size
        return x[group.rank * n:(group.rank + 1) * n].clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return ctx.group.all_gather(g.contiguous()).reshape(-1, *g.shape[1:]), None


def gather_rows(group: TPGroup, x: Tensor, *, summed: bool = True) -> Tensor:
    """This rank's rows x [n, *s] -> every rank's [size * n, *s] in rank order, differentiable (``_GatherRows``:
    ``summed`` where each rank's part of the work after the gather gives a partial gradient, as a column-parallel
    layer's; False where the work after it is replicated)."""
    return _GatherRows.apply(x, group, summed)


def scatter_rows(group: TPGroup, x: Tensor) -> Tensor:
    """x [size * n, *s], the same on every rank -> this rank's rows [n, *s], differentiable (``_ScatterRows``).
    Refuses a first dimension the size does not divide."""
    if x.shape[0] % group.size:
        raise AlignedMambaError(f"{x.shape[0]} rows cannot be split into {group.size} equal sequence-parallel shards")
    return _ScatterRows.apply(x, group)


def shard(n: int, group: TPGroup) -> slice:
    """This rank's contiguous part of a dimension of ``n`` (``group.size`` equal parts, rank order)."""
    if n % group.size:
        raise AlignedMambaError(f"a dimension of {n} cannot be split into {group.size} equal tensor-parallel shards")
    k = n // group.size
    return slice(group.rank * k, (group.rank + 1) * k)


def shared(n: int, group: TPGroup, what: str) -> range:
    """The shared items (B/C groups, KV heads) of ``n`` this rank holds: n / k, or for n < k the one its heads
    share (replicated, as vLLM splits n_groups 1 at TP 2). ``what`` names them in the refusal."""
    k, r = group.size, group.rank
    if n % k == 0:
        return range(r * n // k, (r + 1) * n // k)
    if k % n:
        raise ModelLoadError(f"{what} {n} cannot be split across {k} tensor-parallel ranks")
    g = r // (k // n)
    return range(g, g + 1)


def _pow2(n: int) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


def check_tp(contract: Contract, config: Any, size: int) -> None:
    """Refuse (AlignedMambaError, one line) a model (``config``: a family's) that cannot keep its bits at TP
    ``size`` under ``contract``. Always: row-parallel K and gated-norm groups cut into S =
    ``row_parallel_slices`` slices. At size > 1: a power of two dividing S; heads, groups, KV heads (fewer than
    ranks replicate), MLP width, expert widths and vocabulary (whole log-softmax slices) split evenly (each MoE
    expert is cut by channels, the router whole on every rank: the core's MoE layer, which the vLLM plugin and
    the Megatron hook run)."""
    from .models.registry import family_for_config
    from .ops.logprobs.sliced import VOCAB_SLICES

    s = contract.row_parallel_slices
    if not _pow2(size):
        raise AlignedMambaError(f"tensor-parallel size {size!r} refused: must be a power of two (the fixed reduction "
                                "trees split into whole subtrees only then)")
    if size > 1 and s % size:
        raise AlignedMambaError(f"tensor-parallel size {size} refused: the contract's row_parallel_slices is {s}; "
                                f"TP {size} needs a contract with row_parallel_slices >= {size} (a power of two)")

    def split(what: str, n: int, by: int, why: str) -> None:
        if n % by:
            raise AlignedMambaError(f"{what} {n} refused at tensor-parallel size {size} with row_parallel_slices "
                                    f"{s}: not a multiple of {by} ({why})")

    family = family_for_config(config)
    kinds = set(family.layer_kinds(config))
    shape = config.lm_shape()
    if size > 1:
        if VOCAB_SLICES % size:
            raise AlignedMambaError(f"tensor-parallel size {size} refused: the vocabulary's log-softmax has "
                                    f"{VOCAB_SLICES} fixed slices, and a TP degree must divide them")
        split("vocab_size", shape.vocab_size, VOCAB_SLICES, "the vocabulary shards must hold whole log-softmax slices")
    if "M" in kinds:
        m = config.mixer_config()
        split("Mamba2 intermediate size", m.intermediate_size, s, "out_proj's K in equal slices")
        g = m.intermediate_size // m.n_groups
        split("Mamba2 group width (intermediate / n_groups)", g, s, "the gated norm's sum of squares in equal slices")
        if size > 1:
            split("Mamba2 num_heads", m.num_heads, size, "heads are split across ranks")
            if m.n_groups % size and (not _pow2(m.n_groups) or size % m.n_groups):
                raise AlignedMambaError(f"Mamba2 n_groups {m.n_groups} refused at tensor-parallel size {size}: "
                                        "groups must split evenly across ranks or evenly replicate")
    if "*" in kinds:
        a = config.attention_config()
        split("attention o_proj K (heads * head_dim)", a.num_heads * a.head_dim, s, "o_proj's K in equal slices")
        if size > 1:
            split("num_attention_heads", a.num_heads, size, "query heads are split across ranks")
            if a.num_kv_heads % size and size % a.num_kv_heads:
                raise AlignedMambaError(f"num_key_value_heads {a.num_kv_heads} refused at tensor-parallel size "
                                        f"{size}: key/value heads must split evenly across ranks or evenly replicate")
    if "-" in kinds:
        split("MLP intermediate_size", config.mlp_config().intermediate_size, s, "the down projection's K in equal "
              "slices")
    if "E" in kinds:
        e = config.moe_config()
        split("MoE moe_intermediate_size", e.moe_intermediate_size, s, "each expert's down projection's K in equal "
              "slices")
        split("MoE moe_shared_expert_intermediate_size", e.moe_shared_expert_intermediate_size, s,
              "the shared expert's down projection's K in equal slices")


def threads(fn: Callable[..., Any], size: int, *args: Any) -> list[Any]:
    """``fn(group, *args)`` for ``size`` ranks as threads of this process (``launch`` without its start-up,
    for tests); every rank's result, in rank order."""
    import threading

    barrier = threading.Barrier(size)
    posted: dict[tuple[int, int], Tensor] = {}
    out: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        calls = [0]

        def all_gather(x: Tensor) -> Tensor:
            k = calls[0]
            calls[0] += 1
            posted[(k, rank)] = x.clone()
            barrier.wait()
            got = torch.stack([posted[(k, r)] for r in range(size)])
            barrier.wait()
            return got

        try:
            out[rank] = fn(TPGroup(rank, size, all_gather), *args)
        except BaseException as e:  # raised below, the barrier broken so that no rank waits forever
            errors.append(e)
            barrier.abort()

    workers = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if errors:  # the rank that failed, not the others' broken barrier
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return out


# -- launch: ranks as CPU processes over gloo (tests and the CLI) ------------------------------------------


def _rendezvous() -> str:
    """A file store in a fresh private folder: a free TCP port could be taken before rank 0 listens."""
    return os.path.join(tempfile.mkdtemp(prefix="aligned-mamba-tp-"), "store")


_STATE: dict[str, Any] = {}


def rank_state() -> dict[str, Any]:
    """What a ``Ranks`` process keeps between calls (a model built once, say): one dict per process."""
    return _STATE


def _serve(rank: int, size: int, store: str, threads: int, inbox: Any, outbox: Any, parent: int) -> None:
    """A rank's loop: run each (fn, args) sent; report (rank, ok, rank 0's pickled result or the error)."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    group = TPGroup.from_torch()
    try:
        while (msg := _next(inbox, parent)) is not None:
            try:
                fn, args = pickle.loads(msg)
                result = fn(group, *args)
                # plain pickled bytes: a tensor shared by file descriptor would die with its process
                outbox.put((rank, True, pickle.dumps(result) if rank == 0 else None))
            except Exception as e:  # reported to the caller, who ends every rank
                outbox.put((rank, False, f"{type(e).__name__}: {' '.join(str(e).split())}"))
    finally:
        dist.destroy_process_group()


def _next(inbox: Any, parent: int) -> Any:
    """The next message, or None once ``parent`` is gone (a SIGKILLed parent sends no None). ``parent`` is
    passed in: the parent may die before the rank reads its own ppid."""
    import queue

    while True:
        try:
            return inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return None


class Ranks:
    """``size`` spawned CPU processes in one gloo group, kept alive: ``call(fn, *args)`` runs ``fn(group,
    *args)`` on every rank and returns rank 0's result. ``fn`` and args must pickle; a rank's exception
    ends every rank and is raised as ``RuntimeFailure``. A context manager."""

    def __init__(self, size: int) -> None:
        import multiprocessing

        if not _pow2(size):
            raise AlignedMambaError(f"tensor-parallel size {size!r} refused: must be a power of two")
        self.size = size
        ctx = multiprocessing.get_context("spawn")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(size)]
        threads = max(1, (os.cpu_count() or 1) // size)
        self._store = _rendezvous()
        args = (size, self._store, threads)
        self._procs = [ctx.Process(target=_serve, args=(r, *args, self._inboxes[r], self._outbox, os.getpid()),
                                   daemon=True) for r in range(size)]
        for p in self._procs:
            p.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        import queue

        from .errors import RuntimeFailure

        if not self._procs:
            raise RuntimeFailure("these tensor-parallel ranks are closed")
        msg = pickle.dumps((fn, args))
        for box in self._inboxes:
            box.put(msg)
        result, pending = None, set(range(self.size))
        while pending:  # read while the ranks run: a large result must not fill the pipe unread
            try:
                rank, ok, payload = self._outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r in pending if not self._procs[r].is_alive()]
                if dead:
                    code = self._procs[dead[0]].exitcode
                    self.close()
                    raise RuntimeFailure(f"tensor-parallel rank {dead[0]} of {self.size} died (exit code {code})"
                                         ) from None
                continue
            if not ok:
                self.close()
                raise RuntimeFailure(f"tensor-parallel rank {rank} of {self.size} failed: {payload}")
            pending.discard(rank)
            if rank == 0:
                result = pickle.loads(payload)
        return result

    def close(self) -> None:
        """End every rank (a clean stop where they are idle; killed after a few seconds otherwise)."""
        procs, self._procs = self._procs, []
        for box, p in zip(self._inboxes, procs):
            if p.is_alive():
                box.put(None)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if procs:
            shutil.rmtree(os.path.dirname(self._store), ignore_errors=True)

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch(fn: Callable[..., Any], size: int, *args: Any) -> Any:
    """``Ranks`` for one call: ``fn(group, *args)`` in ``size`` spawned processes; rank 0's result."""
    with Ranks(size) as ranks:
        return ranks.call(fn, *args)


__all__ = ["Ranks", "TPGroup", "check_tp", "differentiable", "gather_rows", "launch", "merge_gradients", "rank_state",
           "scatter_rows", "shard", "threads"]
