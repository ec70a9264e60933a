"""A JSON report that survives: checked before any work, rewritten as results come, always closed.

A command that takes minutes (``check`` with vLLM, an ``rl`` run) must not lose what it finished
because the path was bad, the run failed or the user pressed Ctrl-C. ``JsonReport(path)`` refuses a
path it cannot write (one line, before any work), writes ``{"status": "running"}`` at once, and
``update(result)`` rewrites the whole file atomically (a temporary file in the same directory, then
``os.replace``) so a reader never sees half a file. ``close(status, ...)`` writes the final status:
"ok", "mismatch", "refused", "failed" (with ``error``) or "interrupted".
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import AlignedMambaError

STATUSES = ("running", "ok", "mismatch", "refused", "failed", "interrupted")


def _finite(v: Any) -> Any:
    """Strict JSON: non-finite floats become None (json.dumps would write NaN / Infinity)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


class JsonReport:
    """The ``--json PATH`` of a command. ``path=None``: every call is a no-op."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = None if path is None else Path(path)
        self.result: dict[str, Any] = {}
        if self.path is None:
            return
        p = self.path
        if p.is_dir():
            raise AlignedMambaError(f"--json {p}: is a directory (give a file path)")
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            self._write({"status": "running"})
        except OSError as e:
            raise AlignedMambaError(f"--json {p}: cannot be written ({e.strerror or e})") from None

    def update(self, result: dict[str, Any], status: str = "running") -> None:
        """Rewrite the report with ``result`` (JSON-ready) and ``status``."""
        self.result = dict(result)
        if self.path is not None:
            self._write({**self.result, "status": status})

    def close(self, status: str, error: str | None = None, **extra: Any) -> None:
        """The final write: the last result with ``status`` (and ``error``, one line, for failures)."""
        if status not in STATUSES:
            raise ValueError(f"unknown report status {status!r}")
        final = {**self.result, **extra, "status": status}
        if error is not None:
            final["error"] = error
        self.result = final
        if self.path is not None:
            self._write(final)

    def _write(self, data: dict[str, Any]) -> None:
        assert self.path is not None
        text = json.dumps(_finite(data), indent=2, allow_nan=False) + "\n"
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
