"""The Megatron trainer at tensor-parallel size k on the CPU: k spawned rank processes over gloo, kept alive.

``MegatronTPTrainer`` is the trainer protocol at TP k (``--trainer-tp k``): each rank holds a ``MegatronTrainer``
over its shard (``shards``); every call goes to all ranks and rank 0 answers (whole logits rows, the
step's report, the merged weights). NCCL on GPUs would be the same code with another backend.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch

from aligned_mamba.contract import Contract
from aligned_mamba.train import PackedScoring, check_step_inputs

from .refusals import AlignmentRefused

__all__ = ["MegatronTPTrainer"]

_REPLY_TIMEOUT_S = 1800.0  # a rank's forward on 2 shared cores can take minutes; never wait forever


def _rank_main(rank: int, size: int, port: int, inbox: Any, outbox: Any, config: Any,
               tensors: dict[str, torch.Tensor], contract: Contract, threads: int, hook: bool, lr: float,
               sequence_parallel: bool) -> None:
    """One rank: join the world, build its ``MegatronTrainer``, run each command until None; rank 0 answers."""
    import torch.distributed as dist

    from .trainer import MegatronTrainer

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        trainer = MegatronTrainer(config, tensors, contract, lr=lr, hook=hook, tp=size,
                                  sequence_parallel=sequence_parallel)
        if rank == 0:
            outbox.put(pickle.dumps(("ready", None)))
    except Exception as exc:  # noqa: BLE001 (sent to the parent, which raises it)
        outbox.put(pickle.dumps(("error", f"rank {rank}: {type(exc).__name__}: {exc}")))
        return
    parent = os.getppid()
    while True:
        while inbox.empty():  # a parent killed outright (a Ray actor) leaves no None: stop with it
            if os.getppid() != parent:
                return
            time.sleep(0.01)
        message = inbox.get()
        if message is None:
            break
        kind, args = pickle.loads(message)
        try:
            if kind == "forward":
                value: Any = trainer.forward(args, packed=True)
            elif kind == "step":
                value = trainer.step(*args)
            else:
                value = trainer.export_bytes()
            if rank == 0:
                outbox.put(pickle.dumps((kind, value)))
        except Exception as exc:  # noqa: BLE001 (the replicated loss and norm fail alike on every rank)
            if rank == 0:
                outbox.put(pickle.dumps(("error", f"rank {rank}: {type(exc).__name__}: {exc}")))
    dist.destroy_process_group()


class MegatronTPTrainer(PackedScoring):
    """The hooked Megatron MambaModel in ``tp`` rank processes; ``hook=False``: Megatron's stock forward (the
    baseline). ``close()`` (or the context manager) stops them."""

    def __init__(self, config: Any, tensors: dict[str, torch.Tensor], contract: Contract, tp: int, *,
                 hook: bool = True, lr: float = 1e-4, sequence_parallel: bool = False) -> None:
        import torch.multiprocessing as mp

        from .refusals import tp_problems
        from .shards import tp_problems as shard_problems

        if not isinstance(tp, int) or tp < 1:
            raise AlignmentRefused(f"Megatron trainer at tensor parallel size {tp!r}: must be an int >= 1")
        problems = (tp_problems(tp, contract.row_parallel_slices) if hook else []) + shard_problems(config, tp)
        if problems:
            raise AlignmentRefused(f"Megatron trainer at tensor parallel size {tp}: " + "; ".join(problems))
        self.config, self.contract, self.tp, self.version = config, contract, tp, 0
        ctx = mp.get_context("spawn")
        self._inboxes = [ctx.SimpleQueue() for _ in range(tp)]
        self._outbox = ctx.Queue()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        threads = max(1, (os.cpu_count() or 1) // tp)
        self._procs = [ctx.Process(target=_rank_main, args=(r, tp, port, self._inboxes[r], self._outbox, config,
                                                             tensors, contract, threads, hook, lr,
                                                             sequence_parallel), daemon=True)
                       for r in range(tp)]
        for p in self._procs:
            p.start()
        try:
            self._reply("ready")
        except BaseException:
            self.close()
            raise

    def _reply(self, kind: str) -> Any:
        try:
            got, value = pickle.loads(self._outbox.get(timeout=_REPLY_TIMEOUT_S))
        except queue.Empty:
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            raise AlignmentRefused(f"the Megatron TP {self.tp} ranks did not answer in {_REPLY_TIMEOUT_S:.0f} s "
                                   f"(ranks exited: {dead})") from None
        if got == "error":
            raise AlignmentRefused(f"Megatron at TP {self.tp} failed on {value}")
        if got != kind:
            raise AlignmentRefused(f"the Megatron TP ranks answered {got!r}, expected {kind!r}")
        return value

    def _run(self, kind: str, args: Any) -> Any:
        message = pickle.dumps((kind, args))
        for inbox in self._inboxes:
            inbox.put(message)
        return self._reply(kind)

    def forward(self, sequences: Sequence[torch.Tensor], *, packed: bool = False) -> list[torch.Tensor] | torch.Tensor:
        """Raw logits of whole sequences in one packed pass at TP k: [len_i, vocab] each (whole rows; ``packed``: the
        one [sum len_i, vocab])."""
        seqs = [s.to(torch.int64).cpu() for s in sequences]
        logits = self._run("forward", seqs)
        return logits if packed else list(torch.split(logits, [int(s.numel()) for s in seqs]))

    def step(self, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int],
             advantages: Sequence[float]) -> dict[str, Any]:
        """One REINFORCE step on every rank (``MegatronTrainer.step`` over its shard); returns rank 0's report."""
        check_step_inputs(sequences, prompt_lens, advantages)
        seqs = [s.to(torch.int64).cpu() for s in sequences]
        out = self._run("step", (seqs, list(prompt_lens), list(advantages)))
        self.version = out["weights_version"]
        return out

    def export_bytes(self) -> tuple[bytes, str]:
        """The ranks' shards merged to the checkpoint's HF names and dtypes: safetensors bytes and their digest."""
        return self._run("export", None)

    def close(self) -> None:
        """Stop the rank processes (idempotent)."""
        for inbox, p in zip(self._inboxes, self._procs):
            if p.is_alive():
                inbox.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        self._procs = []
        self._inboxes = []

    def __enter__(self) -> MegatronTPTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_procs", None):
            self.close()
