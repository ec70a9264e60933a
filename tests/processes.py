"""Starting the CLI in a process of its own, ending it with SIGTERM, and waiting for what it started to end:
for the tests that check nothing outlives a command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def alive(pids: set[int]) -> set[int]:
    """The pids still running (zombies, whose parent has not reaped them, count as ended)."""
    left = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    left.add(p)
        except OSError:
            pass
    return left


def assert_all_gone(pids: set[int], within_s: float = 15.0, what: str = "still running") -> None:
    """Wait up to ``within_s`` for every pid to end; fail with ``what`` and the ones left."""
    deadline = time.monotonic() + within_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = alive(pids)
    assert not left, f"{what}: {sorted(left)}"


def iterations_done(report: Path) -> int:
    """How many iterations an ``rl`` JSON report holds so far (0 while it is missing or being replaced)."""
    try:
        return len(json.loads(report.read_text()).get("iterations", []))
    except (OSError, ValueError):
        return 0


def terminate_when(cmd: list[str], ready: str | Callable[[], bool], cwd: Path, settle_s: float = 0.0,
                   timeout_s: float = 240, exit_within_s: float = 60) -> tuple[int, str, set[int]]:
    """Start ``python -m aligned_mamba.cli *cmd`` in ``cwd`` (this checkout first on PYTHONPATH), wait for
    ``ready`` on its stderr (or for ``ready()`` to hold) and ``settle_s`` more, note its descendants,
    SIGTERM it; return (exit status, stderr, the descendants it had)."""
    from aligned_mamba.processes import descendants

    err_path = cwd / "stderr.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "aligned_mamba.cli", *cmd], stdout=subprocess.DEVNULL,
                                stderr=err, env=env, cwd=cwd, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not (ready() if callable(ready) else ready in err_path.read_text()):
            assert proc.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.2)
        time.sleep(settle_s)
        kids = set(descendants(proc.pid))
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=exit_within_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return code, err_path.read_text(), kids
