"""Hostile input and signals: nothing destroyed, no foreign library loaded, no OK that could not fail.

Each test shows the failure it prevents: a device node replaced by a report, a truncated cached
library that killed the process, a SIGTERM that left workers behind and the report "running".
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import assert_all_gone, iterations_done, terminate_when

from aligned_mamba.cli import main
from aligned_mamba.errors import EXIT_BAD_INPUT, EXIT_NO_CONTROL, EXIT_RUNTIME, EXIT_TERMINATED, AlignedMambaError
from aligned_mamba.report import SCHEMA_VERSION, JsonReport

REPO = Path(__file__).resolve().parents[2]


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
from aligned_mamba.ops.elementwise import cpu
x = torch.linspace(-5, 5, 1000)
y = cpu.unary("exp", x)
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


@pytest.mark.engines("own")  # signals sent on a timer
def test_sigterm_during_check_with_worker_processes(tmp_path):
    out = tmp_path / "r.json"
    code, err, kids = terminate_when(["check", "--prompt-len", "500", "--gen-len", "300", "--requests", "2",
                                      "--jobs", "2", "--json", str(out)], "sampling 5 cases", tmp_path,
                                     settle_s=2.0)
    assert code == EXIT_TERMINATED, err
    assert err.strip().splitlines()[-1] == "aligned-mamba: terminated (SIGTERM); worker processes ended"
    assert json.loads(out.read_text())["status"] == "terminated"
    assert len(kids) >= 2  # the sampler workers (and the resource tracker) were running
    assert_all_gone(kids)


@pytest.mark.engines("own")
def test_sigterm_during_rl_closes_the_report_and_shuts_ray_down(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "rl.json"
    code, err, kids = terminate_when(["rl", "--workers", "1", "--iterations", "200", "--prompt-len", "40",
                                      "--gen-len", "8", "--prompts-per-worker", "2", "--json", str(out)],
                                     lambda: iterations_done(out) >= 1, tmp_path, settle_s=0.5)
    assert code == EXIT_TERMINATED, err
    assert err.strip().splitlines()[-1] == "aligned-mamba: terminated (SIGTERM); worker processes ended"
    r = json.loads(out.read_text())
    assert r["status"] == "terminated" and len(r["iterations"]) >= 1  # what finished is kept
    assert len(kids) >= 3  # the local cluster's processes and the actors
    assert_all_gone(kids, within_s=30)


# -- 8: forward and load_model say what they expect -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from aligned_mamba.models.mamba2 import make_tiny, save_checkpoint

    path = tmp_path_factory.mktemp("tiny") / "m"
    cfg, tensors = make_tiny(1, num_hidden_layers=1, hidden_size=64, num_heads=4, head_dim=32, state_size=16,
                             chunk_size=32, vocab_size=128)
    save_checkpoint(path, cfg, tensors)
    return path


@pytest.mark.parametrize("seqs, words", [
    ([torch.tensor([1.7, 2.2])], "is float32 (token ids are never rounded)"),
    ([torch.tensor([True, False])], "is bool"),
    ([torch.tensor([127.9])], "is float32"),
    ([torch.tensor([1, 128])], "holds ids 1..128"),
    ([torch.tensor([-1, 3])], "holds ids -1..3"),
    ([torch.tensor([[1, 2], [3, 4]])], "has shape [2, 2]"),
    ([1, 2, 3], "sequences[0] is int (a list of ints: wrap it in torch.tensor)"),
    (torch.tensor([1, 2, 3]), "got a bare tensor of shape [3] (wrap it: [ids])"),
    ([], "got an empty list"),
])
def test_forward_refuses_what_is_not_token_ids_in_one_line(tiny_dir, seqs, words):
    import aligned_mamba

    model = aligned_mamba.load_model(tiny_dir)
    with pytest.raises(ValueError) as e:
        model.forward(seqs)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("forward() expects a list of 1-D integer token-id tensors (values 0..127)")
    assert words in msg
    assert model.forward([torch.tensor([1, 127], dtype=torch.int32)])[0].shape == (2, 128)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_load_model_on_cuda_without_cuda_is_one_line(tiny_dir):
    import aligned_mamba
    from aligned_mamba.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"^device 'cuda' refused: .*; load on the CPU"):
        aligned_mamba.load_model(tiny_dir, device="cuda")


def test_load_model_takes_a_contract_by_name_or_dict_and_refuses_other_things(tiny_dir):
    import aligned_mamba
    from aligned_mamba.contract import Contract

    want = Contract(chunk_size=128, model_dtype="float32")
    assert aligned_mamba.load_model(tiny_dir, "chunk128", cast=True).contract == Contract.from_yaml("chunk128")
    assert aligned_mamba.load_model(tiny_dir, want.to_dict(), cast=True).contract == want
    with pytest.raises(aligned_mamba.ContractError, match="expected a Contract, a contract name or YAML path"):
        aligned_mamba.load_model(tiny_dir, 128)


# -- 6: a check whose control could not fail is not OK -----------------------------------------------------------


def test_a_check_whose_baseline_never_differed_is_not_ok(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["check", "--prompt-len", "40", "--gen-len", "10", "--requests", "2", "--jobs", "1",
                 "--json", str(out)])
    cap = capsys.readouterr()
    assert code == EXIT_NO_CONTROL
    assert "OK" not in cap.out.splitlines()[-1]
    assert cap.out.splitlines()[-1].startswith("NO CONTROL: every row agreed, but so did the baseline: no sequence "
                                               "crossed a chunk boundary (prompt-len + gen-len = 50 <= chunk size 256)")
    r = json.loads(out.read_text())
    assert r["status"] == "no-control" and r["control"]["could_fail"] is False
    assert r["control"]["baseline_mismatched_rows"] == 0 and r["ok"]  # no exact-replay row differed either


# -- Low: --jobs beyond the engines a check starts, --seed out of range -----------------------------------------


def test_many_jobs_are_estimated_as_the_engines_that_run(monkeypatch):
    import aligned_mamba.memory as memory
    from aligned_mamba.cli import _check_memory, build_parser
    from aligned_mamba.contract import Contract
    from aligned_mamba.models import load_source

    monkeypatch.setattr(memory, "available_bytes", lambda: 4 << 30)
    config, _ = load_source("tiny")
    args = build_parser().parse_args(["check"])
    # two engines (exact replay on, off) run whatever --jobs says: 64 costs what 2 cost
    _check_memory(config, Contract(chunk_size=256), args, jobs=64)
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 30)
    with pytest.raises(AlignedMambaError, match="lower --prompt-len, --gen-len or --requests$"):
        _check_memory(config, Contract(chunk_size=256), args, jobs=1)


@pytest.mark.parametrize("seed", [str(2**70), "-1", "x"])
def test_a_seed_out_of_range_names_the_flag_and_range(seed, capsys, no_model):
    with pytest.raises(SystemExit) as e:
        main(["check", "--seed", seed])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("aligned-mamba check: error: argument --seed: --seed") and (
        "outside 0..2**63-1" in err or "not an integer" in err)


def test_help_shows_defaults_and_every_flag_has_help_and_a_version(capsys):
    from aligned_mamba import __version__
    from aligned_mamba.cli import build_parser

    p = build_parser()
    for name, sub in p._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings} has no help"
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 600)" in text and "(default: tiny)" in text
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith(f"aligned-mamba {__version__}")


def test_state_dtype_aliases_agree_with_a_contract(capsys, no_model, monkeypatch):
    from aligned_mamba.cli import build_contract
    from aligned_mamba.contract import Contract

    got = build_contract(None, "chunk128", "torch", None, "fp32", backend_flag="torch")
    assert got == Contract.from_yaml("chunk128")
    with pytest.raises(AlignedMambaError, match="--state-dtype bfloat16 contradicts"):
        build_contract(None, "chunk128", "torch", None, "bf16", backend_flag="torch")


def test_a_missing_extra_is_refused_with_the_install_command(monkeypatch, capsys, no_model):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert main(["check", "--engine", "vllm"]) == EXIT_BAD_INPUT
    line = one_line(capsys)
    assert "--engine vllm needs the 'vllm' extra" in line and "pip install" in line
