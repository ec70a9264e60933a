"""Tensor parallelism that keeps every bit: the rank group, the shards, the refusals, the launcher.

The contract fixes every reduction's tree (``Contract.row_parallel_slices``); a tensor-parallel
degree only decides which rank computes which leaves. Column- and head-parallel pieces (in_proj,
the conv, the scan, attention's heads, the MLP's up projection, the output layer's vocabulary
shard) reduce nothing; the row-parallel GEMMs (``ops.linear.sliced``), Mamba2's gated norm where a
group spans ranks, and the vocabulary's log-softmax (``ops.logprobs``) sum fixed slices by a fixed
pairwise tree over all-gathered partials. The one collective is ``TPGroup.all_gather`` (never an
all-reduce, whose order is the library's; an all-reduce of a row and zeros would also turn -0.0
into +0.0).

Ranks run as threads of one process (``threads``: tests), or as spawned CPU processes over gloo
(``Ranks``, kept alive between calls; ``launch``, one call): what tests and the CLI use. On GPUs a
caller initialises NCCL itself and passes ``TPGroup.from_torch()``.
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
    ``all_gather``: x [*s] -> [size, *s] (every rank's x, in rank order; x's dtype and device)."""

    rank: int
    size: int
    all_gather: Callable[[Tensor], Tensor]

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1 and isinstance(self.rank, int)
                and 0 <= self.rank < self.size):
            raise AlignedMambaError(f"tensor-parallel rank {self.rank!r} of size {self.size!r} refused: expected "
                                    "0 <= rank < size")

    @staticmethod
    def single() -> TPGroup:
        """The group of one process (TP 1): its all-gather is x [None]."""
        return TPGroup(0, 1, lambda x: x.unsqueeze(0))

    @staticmethod
    def from_torch(group: Any = None) -> TPGroup:
        """Over a ``torch.distributed`` process group (default: the world), initialised by the caller:
        gloo on the CPU, NCCL on GPUs. The all-gather is ``all_gather_into_tensor``."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise AlignedMambaError("TPGroup.from_torch needs torch.distributed initialised "
                                    "(torch.distributed.init_process_group) first")
        size, rank = dist.get_world_size(group), dist.get_rank(group)

        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def all_gather(x: Tensor) -> Tensor:
            # moved as raw bytes: every dtype on every backend, the bits as they are
            raw = x.contiguous().view(-1).view(torch.uint8)
            out = torch.empty(size * raw.numel(), dtype=torch.uint8, device=x.device)
            gather(out, raw, group=group)
            return out.view(x.dtype).view(size, *x.shape)

        return TPGroup(rank, size, all_gather)


def shard(n: int, group: TPGroup) -> slice:
    """This rank's contiguous part of a dimension of ``n`` (``group.size`` equal parts, rank order)."""
    if n % group.size:
        raise AlignedMambaError(f"a dimension of {n} cannot be split into {group.size} equal tensor-parallel shards")
    k = n // group.size
    return slice(group.rank * k, (group.rank + 1) * k)


def shared(n: int, group: TPGroup, what: str) -> range:
    """The items of ``n`` shared ones (B/C groups, key/value heads) rank ``group.rank`` holds: n / k
    of them, or with n < k the one its heads share (replicated over k / n ranks, as vLLM splits
    n_groups 1 at TP 2). ``what`` names them in the refusal."""
    k, r = group.size, group.rank
    if n % k == 0:
        return range(r * n // k, (r + 1) * n // k)
    if k % n:
        raise ModelLoadError(f"{what} {n} cannot be split across {k} tensor-parallel ranks")
    g = r // (k // n)
    return range(g, g + 1)


def _pow2(n: int) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


def check_tp(contract: Contract, config: Any, size: int, *, sharded_moe: bool = False) -> None:
    """Refuse (AlignedMambaError, one line: what and why) a model that cannot keep its bits at
    tensor-parallel degree ``size`` under ``contract``. ``config``: a model family's config.

    Checked at every size (S = ``contract.row_parallel_slices``): the row-parallel GEMMs' K and the
    gated norm's groups cut into S equal slices. At size > 1: a power of two dividing S (so a TP run
    needs S >= size), heads and groups (Mamba2), query and key/value heads
    (attention; fewer KV heads than ranks are replicated), the MLP's width and the vocabulary
    (a multiple of its log-softmax slices) split evenly. MoE layers at size > 1 only where the
    caller runs the core's sharded MoE layer (``sharded_moe``: the reference trainer and engine);
    vLLM's and Megatron's are refused for now.
    """
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
        if "E" in kinds and not sharded_moe:
            raise AlignedMambaError(f"tensor-parallel size {size} refused: MoE layers are not sharded yet (expert "
                                    "parallelism and a TP-invariant router are future work)")
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
    """Run ``fn(group, *args)`` for every rank of a group of ``size`` at once, each in a thread of this
    process, the all-gather handing every rank's tensor to every rank (what ``launch``'s gloo
    processes do, without their start-up: for tests). Returns every rank's result, in rank order."""
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


# ------------------------------------------------------------------------------------------------
# launch: ranks as CPU processes over gloo (tests and the CLI)
# ------------------------------------------------------------------------------------------------


def _rendezvous() -> str:
    """A fresh file store for one group's start. A free TCP port found here could be taken by another
    process before rank 0 listens on it (EADDRINUSE under a parallel test run); a file in a fresh
    private folder cannot."""
    return os.path.join(tempfile.mkdtemp(prefix="aligned-mamba-tp-"), "store")


_STATE: dict[str, Any] = {}


def rank_state() -> dict[str, Any]:
    """What a ``Ranks`` process keeps between calls (a model built once, say): one dict per process."""
    return _STATE


def _serve(rank: int, size: int, store: str, threads: int, inbox: Any, outbox: Any, parent: int) -> None:
    """A rank's loop: run each (fn, args) it is sent as fn(group, *args); report (rank, ok, payload),
    the payload rank 0's pickled result or a rank's one-line error."""
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
    """The next message, or None once the parent (its pid as the parent passed it: it may die before the
    rank reads its own ppid) is gone: a parent killed outright (a Ray actor's SIGKILL) sends no None,
    and a rank that waited on would outlive it."""
    import queue

    while True:
        try:
            return inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return None


class Ranks:
    """``size`` CPU processes (spawned) joined in one gloo group (a file store's rendezvous), kept
    alive between calls: ``call(fn, *args)`` runs ``fn(group, *args)`` on every rank at once and
    returns rank 0's result (``rank_state()`` keeps what a rank builds once). ``fn`` and the
    arguments must pickle (a module-level function). A rank's exception ends every rank and is
    raised here as ``RuntimeFailure`` naming it. Use as a context manager, or ``close()``."""

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
    """Run ``fn(group, *args)`` in ``size`` CPU processes (spawned; one gloo group)
    and return rank 0's result: ``Ranks`` for one call. ``fn`` and the arguments must pickle (a
    module-level function); a rank's exception is raised here as ``RuntimeFailure`` naming it."""
    with Ranks(size) as ranks:
        return ranks.call(fn, *args)


__all__ = ["Ranks", "TPGroup", "check_tp", "launch", "rank_state", "shard", "threads"]
