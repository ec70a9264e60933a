"""``aligned-mamba rl`` with tensor-parallel rollout workers (``--sampler-tp``) on a local Ray cluster.

The claim: a Megatron trainer at TP 2 and vLLM rollout workers at TP 2 (each worker's engine two rank
processes inside its Ray actor, rebuilt from every weight push) under a contract of
``row_parallel_slices`` 2 give every sampled token the trainer's logprob, bit for bit, while the
weights move; a stock vLLM worker at TP 2 in the same run differs (the baseline). The engine's rank
processes end with the run, and with a SIGTERM'd command. Slow: each TP 2 vLLM engine is three
processes that start in about a minute on a small machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="aligned-mamba rl needs Ray (pip install -e '.[ray]')")
pytestmark = pytest.mark.engines("own")  # Ray clusters

from processes import assert_all_gone, iterations_done, terminate_when  # noqa: E402

from aligned_mamba.cli import main  # noqa: E402
from aligned_mamba.errors import EXIT_MISMATCH, EXIT_TERMINATED  # noqa: E402
from aligned_mamba.models.mamba2 import make_tiny, save_checkpoint  # noqa: E402

# 4 heads and 2 groups split 2 / 2 (Megatron needs whole groups per rank); out_proj's K of 256 cut in 2
# slices; chunk 32, so prompts of 30..40 tokens + 12 generated cross a chunk boundary
SHAPE = dict(num_hidden_layers=2, hidden_size=128, num_heads=4, head_dim=64, n_groups=2, state_size=32,
             vocab_size=256, chunk_size=32)
SMALL = ["--workers", "2", "--prompt-len", "40", "--gen-len", "12", "--prompts-per-worker", "2"]


def _need(*modules: str) -> None:
    for m in modules:
        pytest.importorskip(m, reason=f"{m} is not installed (its extra)")


def _checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    config, tensors = make_tiny(4, **SHAPE)
    save_checkpoint(path, config, tensors)
    return path


def test_megatron_tp2_and_vllm_workers_at_tp2_bitwise_while_the_weights_move(tmp_path, capsys):
    """``rl --trainer megatron --trainer-tp 2 --engine vllm --sampler-tp 2 --row-parallel-slices 2``, worker 1
    stock vLLM (``--inject no-replay:1``): worker 0 has 0 mismatched tokens in each of 3 iterations whose
    weights all differ, worker 1 differs (so the run fails, exit 1), and every rank process is gone after."""
    _need("vllm", "megatron.core")
    out = tmp_path / "rl.json"
    code = main(["rl", "--model", str(_checkpoint(tmp_path)), "--trainer", "megatron", "--trainer-tp", "2",
                 "--engine", "vllm", "--sampler-tp", "2", "--row-parallel-slices", "2", *SMALL, "--iterations", "3",
                 "--inject", "no-replay:1", "--json", str(out)])
    stdout = capsys.readouterr().out
    assert code == EXIT_MISMATCH, stdout
    r = json.loads(out.read_text())
    assert (r["trainer_tp"], r["sampler_tp"], r["contract"]["row_parallel_slices"]) == (2, 2, 2)
    rows = r["iterations"]
    assert len(rows) == 3 and not r["refused"]
    for x in rows:
        exact, stock = x["per_worker"]["0"], x["per_worker"]["1"]
        assert exact["tokens"] == (12 + 12) and exact["mismatched_tokens"] == 0, x["iteration"]
        assert exact["max_abs_logprob_diff"] == 0 and exact["weights_version"] == x["weights_version"]
        # each engine's two ranks ran in processes of the worker's own
        assert len(exact["child_pids"]) >= 2 and len(stock["child_pids"]) >= 2
        assert x["logprob_shift"] > 0
    assert sum(x["per_worker"]["1"]["mismatched_tokens"] for x in rows) > 0  # stock vLLM at TP 2: the baseline
    assert r["first_mismatch"]["worker"] == 1
    assert len({x["weights_digest"] for x in rows}) == 3  # sampled under three different weights
    assert [x["next_weights_digest"] for x in rows[:-1]] == [x["weights_digest"] for x in rows[1:]]
    ranks = {p for x in rows for w in x["per_worker"].values() for p in w["child_pids"]}
    assert_all_gone(ranks, 30, "rank processes outlived the run")


def test_sigterm_ends_the_vllm_workers_rank_processes(tmp_path):
    """``rl --engine vllm --sampler-tp 2`` SIGTERM'd after its first iteration: exit 143, the report closed
    as terminated, and every process it had (Ray's, the actor's, vLLM's two ranks) gone."""
    _need("vllm")
    out = tmp_path / "rl.json"
    code, err, kids = terminate_when(
        ["rl", "--model", str(_checkpoint(tmp_path)), "--engine", "vllm", "--sampler-tp", "2",
         "--row-parallel-slices", "2", "--workers", "1", "--iterations", "100", "--prompt-len", "40", "--gen-len",
         "8", "--prompts-per-worker", "2", "--json", str(out)], lambda: iterations_done(out) >= 1, tmp_path,
        timeout_s=900, exit_within_s=120)
    assert code == EXIT_TERMINATED, err
    r = json.loads(out.read_text())
    assert r["status"] == "terminated" and len(r["iterations"]) >= 1
    ranks = set(r["iterations"][0]["per_worker"]["0"]["child_pids"])
    assert len(ranks) >= 2 and ranks <= kids  # the ranks were running when the signal came
    assert_all_gone(kids, 60, "processes outlived the command")


def test_reference_workers_at_tp2_and_a_killed_ones_ranks_stop_with_it(tmp_path, capsys):
    """``rl --trainer-tp 2 --sampler-tp 2`` with the reference trainer and engine (their ranks
    ``parallel.Ranks`` processes): the TP 2 trainer's steps move the weights and every batch sampled under
    them matches. Worker 1 is SIGKILLed mid-sampling in iteration 1 (``--inject kill:1@1``): Ray restarts
    it, its new engine gets the weights again and the recomputed batch matches; the killed actor's ranks,
    which nobody told to stop,
    end (here Ray's raylet ends a dead worker's children; without it the ranks' watch on their parent
    does, test_tensor_parallel's test_ranks_end_when_their_parent_is_killed), as do all the others after
    the run."""
    out = tmp_path / "rl.json"
    code = main(["rl", "--model", str(_checkpoint(tmp_path)), "--trainer-tp", "2", "--sampler-tp", "2",
                 "--row-parallel-slices", "2", *SMALL, "--iterations", "2", "--inject", "kill:1@1", "--json",
                 str(out)])
    assert code == 0, capsys.readouterr().out
    r = json.loads(out.read_text())
    assert (r["trainer_tp"], r["sampler_tp"]) == (2, 2) and r["restarts"] == {"0": 0, "1": 1}
    assert all(x["mismatched_tokens"] == 0 and x["tokens"] == 2 * 24 for x in r["iterations"])
    assert all(x["logprob_shift"] > 0 for x in r["iterations"])  # each TP 2 step moved the logprobs
    assert len({x["weights_digest"] for x in r["iterations"]}) == 2  # sampled under two different weights
    before, after = (set(x["per_worker"]["1"]["child_pids"]) for x in r["iterations"])
    assert len(before) >= 2 and not before & after  # the restarted worker started ranks of its own
    ranks = {p for x in r["iterations"] for w in x["per_worker"].values() for p in w["child_pids"]}
    assert_all_gone(ranks, 30, "rank processes outlived their worker")


@pytest.mark.parametrize("args, words", [
    (["--sampler-tp", "2"], "--sampler-tp 2: tensor-parallel size 2 refused: the contract's row_parallel_slices is 1"),
    (["--sampler-tp", "3", "--row-parallel-slices", "4"], "--sampler-tp 3: tensor-parallel size 3 refused: must be a "
                                                          "power of two"),
    (["--sampler-tp", "4", "--row-parallel-slices", "2"], "row_parallel_slices is 2; TP 4 needs"),
])
def test_a_sampler_tp_that_cannot_keep_the_bits_is_refused_in_one_line(args, words, tmp_path, capsys):
    """Refused before Ray starts, by the rules ``check --sampler-tp`` applies (``parallel.check_tp``)."""
    assert main(["rl", "--model", str(_checkpoint(tmp_path)), *SMALL, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aligned-mamba: error:") and words in err[0], err
