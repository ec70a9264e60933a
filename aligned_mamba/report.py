"""A JSON report that survives: checked before any work, rewritten as results come, always closed.

``JsonReport(path)`` refuses an unwritable path before any work; each ``update`` rewrites the whole file
atomically (temporary file, fsync, ``os.replace``). Only a regular file or a new path is written (the rename
would replace a device, FIFO, socket or link), checked before every rewrite.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from .errors import AlignedMambaError, RuntimeFailure

log = logging.getLogger("aligned_mamba")

SCHEMA_VERSION = 2  # 2: schema_version, version, commit; statuses "terminated" and "no-control"
STATUSES = ("running", "ok", "mismatch", "no-control", "refused", "failed", "interrupted", "terminated")


def _finite(v: Any) -> Any:
    """Strict JSON: non-finite floats become None (json.dumps would write NaN / Infinity)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


@functools.cache
def package_commit() -> str | None:
    """The git commit the package's source is at (``-dirty`` when it has changes), None outside a checkout."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def provenance() -> dict[str, Any]:
    """``schema_version``, the package ``version`` and the git ``commit`` (None outside a checkout)."""
    from . import __version__

    return {"schema_version": SCHEMA_VERSION, "version": __version__, "commit": package_commit()}


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def check_target(p: Path) -> None:
    """Refuse (one line) a path that exists and is not a regular file: it would be replaced."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    except OSError as e:
        raise AlignedMambaError(f"--json {p}: cannot be examined ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise AlignedMambaError(f"--json {p}: is {_kind(st.st_mode)}; a report is written only to a regular file "
                                "or a new path")


class JsonReport:
    """The ``--json PATH`` of a command (``path=None``: no-op). A failed rewrite (disk full) is logged once
    and the run goes on; ``close`` then raises ``RuntimeFailure``, so the command exits 3."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = None if path is None else Path(path)
        self.result: dict[str, Any] = {}
        self.write_error: str | None = None
        if self.path is None:
            return
        p = self.path
        check_target(p)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            self._write({"status": "running"})
        except OSError as e:
            raise AlignedMambaError(f"--json {p}: cannot be written ({e.strerror or e})") from None

    def update(self, result: dict[str, Any], status: str = "running") -> None:
        """Rewrite the report with ``result`` (JSON-ready) and ``status``."""
        self.result = dict(result)
        if self.path is not None:
            self._try_write({**self.result, "status": status})

    def close(self, status: str, error: str | None = None, *, strict: bool = True, **extra: Any) -> None:
        """The final write: the last result with ``status`` (and ``error``, one line). ``strict``: raise
        ``RuntimeFailure`` if unwritten (False for a command already ending on another error)."""
        if status not in STATUSES:
            raise ValueError(f"unknown report status {status!r}")
        final = {**self.result, **extra, "status": status}
        if error is not None:
            final["error"] = error
        self.result = final
        if self.path is None:
            return
        self._try_write(final)
        if strict and self.write_error is not None:
            raise RuntimeFailure(f"--json {self.path}: the report could not be written ({self.write_error}); "
                                 "the results are only in the output above")

    def _try_write(self, data: dict[str, Any]) -> None:
        try:
            self._write(data)
        except (OSError, AlignedMambaError) as e:
            why = (e.strerror or str(e)) if isinstance(e, OSError) else str(e)
            if self.write_error is None:
                log.warning("--json %s: cannot be rewritten (%s); the run goes on", self.path, why)
            self.write_error = why
        else:
            self.write_error = None

    def _write(self, data: dict[str, Any]) -> None:
        assert self.path is not None
        check_target(self.path)  # it may have been replaced since the last write
        text = json.dumps(_finite({**data, **provenance()}), indent=2, allow_nan=False) + "\n"
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
