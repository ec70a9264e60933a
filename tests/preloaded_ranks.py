"""Tensor-parallel ranks for tests whose subject is what runs on the ranks, not how they start.

A spawned rank (``aligned_mamba.parallel.Ranks``) imports torch and Megatron afresh: about 6 s of CPU
per rank, and test_megatron_tp starts 29 of them. Here one forkserver per test process imports them
once and each rank is forked from it, then runs the library's own rank loop (``parallel._serve``) and
``Ranks.call``; only the start differs, and the ranks see the environment the server started with,
not the caller's at each launch (for tests that set no variables for their ranks). The launcher
itself (spawn, parent watch) is tested through ``parallel.launch`` in tests/core/test_tensor_parallel.py.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
from typing import Any

from aligned_mamba import parallel

# imports only: Megatron's CPU stand-ins are patched in by each rank (``prepare_process``), as spawned
PRELOAD = ["torch", "aligned_mamba.parallel", "trainer_hooks.megatron.trainer",
           "megatron.core.models.mamba.mamba_model", "megatron.core.ssm.mamba_mixer"]
_CTX: list[Any] = []


def _context() -> Any:
    if not _CTX:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        # stopped and reaped at exit, so the ranks' CPU time is counted in this process's children
        atexit.register(multiprocessing.forkserver._forkserver._stop)
        _CTX.append(ctx)
    return _CTX[0]


def _serve_forked(rank: int, size: int, store: str, threads: int, inbox: Any, outbox: Any) -> None:
    # a forked rank's parent is the server, which lives as long as the test process
    parallel._serve(rank, size, store, threads, inbox, outbox, os.getppid())


class PreloadedRanks(parallel.Ranks):
    """``parallel.Ranks`` whose processes are forked from the preloaded server."""

    def __init__(self, size: int) -> None:  # Ranks.__init__ with another start
        if size < 1 or size & (size - 1):
            raise ValueError(f"tensor-parallel size {size!r}: must be a power of two")
        ctx = _context()
        self.size = size
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(size)]
        self._store = parallel._rendezvous()
        args = (size, self._store, max(1, (os.cpu_count() or 1) // size))
        self._procs = [ctx.Process(target=_serve_forked, args=(r, *args, self._inboxes[r], self._outbox),
                                   daemon=True) for r in range(size)]
        for p in self._procs:
            p.start()


def launch(fn: Any, size: int, *args: Any) -> Any:
    """``parallel.launch`` over ``PreloadedRanks``: rank 0's result of ``fn(group, *args)``."""
    with PreloadedRanks(size) as ranks:
        return ranks.call(fn, *args)
