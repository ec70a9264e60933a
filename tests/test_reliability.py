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
from aligned_mamba.errors import EXIT_BAD_INPUT, EXIT_RUNTIME, EXIT_TERMINATED, AlignedMambaError
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


# -- 2: the native library: private directory, verified before it is loaded ------------------------------------

_OP = """
import sys, torch
from aligned_mamba.ops import native
x = torch.linspace(-5, 5, 1000)
y = native.unary("exp", x)
print(native.status(), native.library_path(), sep="|")
torch.save(y, sys.argv[1]) if y is not None else None
"""


def run_op(tmp_path: Path, out: str, **env: str) -> subprocess.CompletedProcess:
    e = env_here(XDG_CACHE_HOME=str(tmp_path / "cache"), TMPDIR=str(tmp_path / "tmp"), **env)
    e.pop("ALIGNED_MAMBA_NATIVE", None)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-c", _OP, str(tmp_path / out)], capture_output=True, text=True, env=e,
                          cwd=REPO, timeout=300)


def test_a_truncated_cached_library_is_rebuilt_not_mapped(tmp_path):
    first = run_op(tmp_path, "a.pt")
    assert first.returncode == 0, first.stderr
    status, path = first.stdout.strip().split("|")
    assert status == "on" and Path(path).parent == tmp_path / "cache" / "aligned_mamba"
    assert stat.S_IMODE(os.stat(Path(path).parent).st_mode) == 0o700
    so = Path(path)
    size = so.stat().st_size
    with open(so, "r+b") as f:  # mapping this file's missing pages would raise SIGBUS
        f.truncate(size // 3)
    again = run_op(tmp_path, "b.pt")
    assert again.returncode == 0, (again.returncode, again.stderr)
    assert again.stdout.strip() == first.stdout.strip()
    assert so.stat().st_size == size
    assert torch.equal(torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt"))


def test_a_library_without_the_expected_symbols_is_rebuilt(tmp_path):
    first = run_op(tmp_path, "a.pt")
    so = Path(first.stdout.strip().split("|")[1])
    # a valid shared object with a matching record but none of the symbols
    src = tmp_path / "empty.c"
    src.write_text("int am_nothing(void) { return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    meta = json.loads(so.with_suffix(".json").read_text())
    import hashlib

    meta.update(size=so.stat().st_size, sha256=hashlib.sha256(so.read_bytes()).hexdigest())
    so.with_suffix(".json").write_text(json.dumps(meta))
    again = run_op(tmp_path, "b.pt")
    assert again.returncode == 0, again.stderr
    status = again.stdout.strip().split("|")[0]
    assert status.startswith("unavailable") and "lacks am_unary" in status  # refused, then the torch forms
    assert again.stderr.strip().count("\n") == 0 and "native CPU ops unavailable" in again.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="planting another user's files needs root")
def test_a_directory_or_library_another_user_owns_is_never_used(tmp_path):
    other = 65534  # nobody
    first = run_op(tmp_path, "a.pt")
    so = Path(first.stdout.strip().split("|")[1])
    d = so.parent
    # the cache directory now belongs to someone else and is world-writable: its library is not loaded,
    # the private temp directory is used instead
    os.chown(d, other, other)
    os.chmod(d, 0o777)
    again = run_op(tmp_path, "b.pt")
    assert again.returncode == 0, again.stderr
    status, path = again.stdout.strip().split("|")
    assert status == "on" and Path(path).parent == tmp_path / "tmp" / f"aligned_mamba-{os.getuid()}"
    # a planted library (another owner) in the temp directory: rebuilt, never loaded as it is
    planted = Path(path)
    os.chown(planted, other, other)
    third = run_op(tmp_path, "c.pt")
    assert third.returncode == 0, third.stderr
    assert os.stat(planted).st_uid == os.getuid()  # replaced by this user's build
    # the temp directory itself planted by another user: refused too; the torch forms run, one line
    os.chown(planted.parent, other, other)
    fourth = run_op(tmp_path, "d.pt")
    assert fourth.returncode == 0
    assert fourth.stdout.startswith("unavailable") and "owned by uid 65534" in fourth.stdout
    assert fourth.stderr.strip().count("\n") == 0
    for name in ("b.pt", "c.pt"):
        assert torch.equal(torch.load(tmp_path / "a.pt"), torch.load(tmp_path / name))


# -- 3: SIGTERM is handled like SIGINT: report closed, children ended, exit 143 ---------------------------------


def descendants(pid: int) -> set[int]:
    from aligned_mamba.cli import _children_of

    return set(_children_of(pid))


def alive(pids: set[int]) -> set[int]:
    left = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    left.add(p)
        except OSError:
            pass
    return left


def terminate_when(cmd: list[str], ready: str, tmp_path: Path, settle_s: float = 2.0, timeout_s: float = 240
                   ) -> tuple[int, str, set[int]]:
    """Start the CLI, wait for ``ready`` on its stderr, note its descendants, SIGTERM it; return
    (exit status, stderr, the descendants it had)."""
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "aligned_mamba.cli", *cmd], stdout=subprocess.DEVNULL,
                                stderr=err, env=env_here(), cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while ready not in err_path.read_text():
            assert proc.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.2)
        time.sleep(settle_s)
        kids = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return code, err_path.read_text(), kids


def assert_all_gone(kids: set[int], within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while alive(kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(kids), f"still running: {alive(kids)}"


def test_sigterm_during_check_with_worker_processes(tmp_path):
    out = tmp_path / "r.json"
    code, err, kids = terminate_when(["check", "--prompt-len", "500", "--gen-len", "300", "--requests", "2",
                                      "--jobs", "2", "--json", str(out)], "sampling 5 cases", tmp_path)
    assert code == EXIT_TERMINATED, err
    assert err.strip().splitlines()[-1] == "aligned-mamba: terminated (SIGTERM); worker processes ended"
    assert json.loads(out.read_text())["status"] == "terminated"
    assert len(kids) >= 2  # the sampler workers (and the resource tracker) were running
    assert_all_gone(kids)


def test_sigterm_during_rl_closes_the_report_and_shuts_ray_down(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "rl.json"
    code, err, kids = terminate_when(["rl", "--workers", "1", "--iterations", "200", "--prompt-len", "40",
                                      "--gen-len", "8", "--prompts-per-worker", "2", "--json", str(out)],
                                     "actors ready", tmp_path, settle_s=3.0)
    assert code == EXIT_TERMINATED, err
    assert err.strip().splitlines()[-1] == "aligned-mamba: terminated (SIGTERM); worker processes ended"
    r = json.loads(out.read_text())
    assert r["status"] == "terminated" and len(r["iterations"]) >= 1  # what finished is kept
    assert len(kids) >= 3  # the local cluster's processes and the actors
    assert_all_gone(kids, within_s=30)
