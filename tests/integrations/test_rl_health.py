"""``aligned-mamba rl`` without a cluster: refused settings, what Ray's failures become, and a
report that keeps the finished iterations when the run is interrupted."""

from __future__ import annotations

import json

import pytest

from aligned_mamba.cli import main
from aligned_mamba.errors import AlignedMambaError, RuntimeFailure, TrainingDiverged

rl = pytest.importorskip("rollout.rl")
pytestmark = pytest.mark.engines("own")  # Ray start-ups and bounded-time waits


@pytest.mark.parametrize("lr", ["nan", "inf", "0", "-1e-3"])
def test_a_learning_rate_that_is_not_a_finite_positive_number_is_refused(lr, capsys):
    assert main(["rl", f"--lr={lr}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"aligned-mamba: error: --lr must be a finite number > 0, got {float(lr)}"]


def test_an_unreachable_cluster_is_a_runtime_failure_in_one_line(monkeypatch):
    ray = pytest.importorskip("ray")

    def refuse(*a, **k):
        raise ConnectionError("\x1b[31mCould not find any running Ray instance.\x1b[0m\nmore detail\n")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(rl, "_reachable", lambda address: None)  # as if the port answered
    with pytest.raises(RuntimeFailure) as e:
        rl._connect("10.0.0.1:6379")
    assert str(e.value) == "cannot reach the Ray cluster at 10.0.0.1:6379: Could not find any running Ray instance."


@pytest.mark.parametrize("address, words", [("127.0.0.1:1", "Connection refused"),
                                            ("no-such-host.invalid:6379", "cannot resolve 'no-such-host.invalid'"),
                                            ("ray://127.0.0.1:1", "Connection refused")])
def test_an_unreachable_address_exits_3_in_one_line_within_bounded_time(address, words, capsys):
    import time

    pytest.importorskip("ray")
    t0 = time.monotonic()
    assert main(["rl", "--address", address, "--iterations", "1"]) == 3
    assert time.monotonic() - t0 < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"aligned-mamba: runtime failure: cannot reach the Ray cluster at {address}: ")
    assert words in err[-1]
    assert not [ln for ln in err if "Ray" in ln and ln != err[-1] and "starting" not in ln]


def test_the_exception_of_an_actors_init_is_read_from_rays_text():
    class Died(Exception):
        actor_init_failed = True

    text = ("The actor died because of an error raised in its creation task, \x1b[36mray::RolloutWorker.__init__()"
            "\x1b[39m (pid=1, ip=10.0.0.1)\n           ^^^^^^^^\n  File \"/x/actors.py\", line 9, in __init__\n"
            "    self.engine = build_engine(engine, spec)\n              ^^^^^^^^^^^^^\n"
            "RuntimeError: CPU KV cache space too small\nsecond line")
    e = rl._one_line(Died(text))
    assert isinstance(e, RuntimeFailure)
    assert str(e) == "an actor failed to start: RuntimeError: CPU KV cache space too small"


class _RayError(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"\x1b[36mray::TrainerScorer.step()\x1b[39m (pid=1)\n  File ...\n{cause}")
        self.cause = cause


def test_an_actors_failure_keeps_its_meaning():
    assert type(rl._one_line(_RayError(TrainingDiverged("training step 4 diverged: loss nan")))) is TrainingDiverged
    refused = rl._one_line(_RayError(ValueError("bad prompt")))
    assert type(refused) is AlignedMambaError and str(refused) == "bad prompt"
    crash = rl._one_line(_RayError(KeyError("w")))
    assert isinstance(crash, RuntimeFailure) and str(crash) == "KeyError: 'w'"


def test_an_interrupted_run_leaves_the_iterations_it_finished(tmp_path, monkeypatch):
    def run(opts, progress, line, on_iteration):
        on_iteration({"iterations": [{"iteration": 0, "tokens": 36, "mismatched_tokens": 0}], "ok": True})
        raise KeyboardInterrupt

    monkeypatch.setattr(rl, "run_rl", run)
    out = tmp_path / "rl.json"
    assert main(["rl", "--json", str(out)]) == 130
    r = json.loads(out.read_text())
    assert r["status"] == "interrupted" and [i["iteration"] for i in r["iterations"]] == [0]


def test_a_diverged_run_exits_3_and_says_where(tmp_path, monkeypatch, capsys):
    def run(opts, progress, line, on_iteration):
        on_iteration({"iterations": [{"iteration": 0}], "ok": True})
        raise TrainingDiverged("training step 2 diverged: loss nan, grad norm nan; not applied, weights v1 kept")

    monkeypatch.setattr(rl, "run_rl", run)
    out = tmp_path / "rl.json"
    assert main(["rl", "--json", str(out)]) == 3
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "aligned-mamba: runtime failure: training step 2 diverged: loss nan, grad norm nan; not applied, weights v1 "
        "kept")
    r = json.loads(out.read_text())
    assert r["status"] == "failed" and r["error"].startswith("training step 2 diverged") and len(r["iterations"]) == 1


def test_a_missing_extra_is_refused_before_ray_starts(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "megatron.core" else real(name, *a))
    assert main(["rl", "--trainer", "megatron"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--trainer megatron needs the 'megatron' extra" in err[0] and "pip install" in err[0]
