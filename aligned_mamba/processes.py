"""The processes this one started: listed from Linux's /proc, and ended on the way out.

The CLI ends them on SIGINT/SIGTERM and at exit (engine worker processes and theirs, a local Ray
cluster that outlived its shutdown); the rollout actors report them with each batch, so a test can
see that a tensor-parallel worker's ranks end with it.
"""

from __future__ import annotations

import os
import signal
import time


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc; [] elsewhere), zombies left out."""
    parent: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parent[int(e)] = int(fields[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def end_children(grace_s: float = 5.0) -> None:
    """End every process this one started (engine worker processes and theirs, a local Ray cluster
    that outlived its shutdown): SIGTERM, ``grace_s`` to exit, then SIGKILL. multiprocessing's
    resource tracker, which ignores SIGTERM and exits when its pipe closes, is closed last."""
    import multiprocessing
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    pids = [p for p in descendants(os.getpid()) if p != tracker]
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        multiprocessing.active_children()  # reaps the pool workers that exited
        pids = [p for p in pids if p in set(descendants(os.getpid()))]
        if not pids:
            break
        time.sleep(0.05)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    multiprocessing.active_children()
