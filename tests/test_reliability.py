"""Hostile input and signals: nothing destroyed, no foreign library loaded, no OK that could not fail.

Each test shows the failure it prevents: a device node replaced by a report, a truncated cached
library that killed the process, a SIGTERM that left workers behind and the report "running".
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from aligned_mamba.cli import main
from aligned_mamba.errors import EXIT_BAD_INPUT, EXIT_NO_CONTROL, EXIT_RUNTIME, EXIT_TERMINATED, AlignedMambaError
from aligned_mamba.report import SCHEMA_VERSION, JsonReport

REPO = Path(__file__).resolve().parents[1]


def env_here(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if the command got as far as loading a model."""
    import aligned_mamba.models as models

    monkeypatch.setattr(models, "load_source", lambda *a, **k: pytest.fail("the run started"))


# -- 1: reports only to regular files, atomically ----------------------------------------------------------------


def _char_device(path: Path) -> Path:
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 7))  # a private node: the "full" device's numbers
    except PermissionError:
        pytest.skip("mknod needs root")
    return path


@pytest.mark.parametrize("kind", ["char_device", "fifo", "symlink", "dangling_symlink"])
def test_a_report_never_replaces_a_device_fifo_or_symlink(kind, tmp_path, capsys, no_model):
    target = tmp_path / kind
    kept = tmp_path / "kept.json"
    kept.write_text("precious\n")
    if kind == "char_device":
        _char_device(target)
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "symlink":
        target.symlink_to(kept)
    else:
        target.symlink_to(tmp_path / "nowhere.json")
    before = os.lstat(target)
    assert main(["check", "--json", str(target)]) == EXIT_BAD_INPUT
    line = one_line(capsys)
    assert f"--json {target}: is a" in line and "regular file" in line
    after = os.lstat(target)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev)
    assert kept.read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({kind, "kept.json"})  # no temp file left


def test_a_report_is_written_to_a_new_path_or_a_regular_file_with_provenance(tmp_path):
    for p in (tmp_path / "new" / "r.json", tmp_path / "old.json"):
        if p.name == "old.json":
            p.write_text("{}")
        rep = JsonReport(p)
        assert json.loads(p.read_text())["status"] == "running"
        rep.update({"cases": [1]})
        rep.close("ok")
        r = json.loads(p.read_text())
        assert r["status"] == "ok" and r["cases"] == [1]
        assert r["schema_version"] == SCHEMA_VERSION and r["version"] and "commit" in r
        assert stat.S_ISREG(os.lstat(p).st_mode)


def test_a_report_replaced_by_a_device_mid_run_is_not_overwritten(tmp_path):
    p = tmp_path / "r.json"
    rep = JsonReport(p)
    p.unlink()
    os.mkfifo(p)
    rep.update({"cases": []})  # logged, the run goes on
    with pytest.raises(AlignedMambaError, match="could not be written"):
        rep.close("ok")
    assert stat.S_ISFIFO(os.lstat(p).st_mode)


def test_disk_full_names_the_report_keeps_the_results_and_exits_3(tmp_path, capsys, monkeypatch):
    import aligned_mamba.report as report

    out = tmp_path / "r.json"
    real_fsync = os.fsync
    calls = {"n": 0}

    def fsync(fd):
        calls["n"] += 1
        if calls["n"] > 1:  # the check before the run succeeds; every rewrite after it finds the disk full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(report.os, "fsync", fsync)
    code = main(["check", "--prompt-len", "20", "--gen-len", "4", "--requests", "1", "--jobs", "1",
                 "--json", str(out)])
    cap = capsys.readouterr()
    assert code == EXIT_RUNTIME
    assert "baseline_recurrent_decode" in cap.out  # the results reached the terminal
    last = cap.err.strip().splitlines()[-1]
    assert f"--json {out}" in last and "No space left on device" in last
    assert f"--json {out}: cannot be rewritten" in cap.err  # said once, when it happened
    assert not [p for p in tmp_path.iterdir() if p.name != "r.json"]  # no temp file left behind
