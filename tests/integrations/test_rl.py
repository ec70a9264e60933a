"""``aligned-mamba rl`` on a real local Ray cluster: bitwise logprobs across weight updates,
a killed worker restarted and recomputed, and injected mismatches caught by the checker."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

import pytest

ray = pytest.importorskip("ray", reason="aligned-mamba rl needs Ray (pip install -e '.[ray]')")
pytestmark = pytest.mark.engines("own")  # Ray clusters

import torch  # noqa: E402

from aligned_mamba.cli import main  # noqa: E402
from aligned_mamba.contract import Contract  # noqa: E402
from aligned_mamba.errors import AlignedMambaError  # noqa: E402
from aligned_mamba.integrations import ENGINE_GROUP, EngineSpec  # noqa: E402
from aligned_mamba.models.mamba2 import make_tiny, save_checkpoint  # noqa: E402
from aligned_mamba.train import PolicyTrainer  # noqa: E402
from rollout.actors import RolloutWorker  # noqa: E402
from rollout.rl import RLOptions, run_rl  # noqa: E402

# small prompts and generations: prefill is still chunked (budget 23) and mixed with decode steps
SMALL = {"workers": 2, "iterations": 3, "prompt_len": 40, "gen_len": 12, "prompts_per_worker": 3}
SMALL_ARGS = ["--workers", "2", "--prompt-len", "40", "--gen-len", "12", "--prompts-per-worker", "3"]


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """One local Ray cluster for the module; ``run_rl`` reuses this process's connection."""
    old = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    tmp = tempfile.mkdtemp(prefix="amrl-test-")
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=512 << 20, _temp_dir=tmp,
             log_to_driver=False, logging_level=logging.WARNING)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        if old is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = old


@pytest.fixture(scope="module")
def baseline() -> dict:
    return run_rl(RLOptions(**SMALL))


def _digests(result: dict) -> list[str]:
    return [r["weights_digest"] for r in result["iterations"]]


def test_three_iterations_bitwise_while_the_weights_move(baseline):
    r = baseline
    rows = r["iterations"]
    assert r["ok"] and not r["stopped_early"] and not r["refused"] and r["first_mismatch"] is None
    assert [x["iteration"] for x in rows] == [0, 1, 2]
    assert [x["weights_version"] for x in rows] == [0, 1, 2]
    for x in rows:
        assert x["tokens"] == 2 * 3 * 12 and x["mismatched_tokens"] == 0
        assert x["max_abs_logprob_diff"] == 0 and x["kl"] == 0
        assert x["restarts"] == {"0": 0, "1": 0}
        # both workers served the version the trainer scored with, in distinct processes
        assert {w["weights_version"] for w in x["per_worker"].values()} == {x["weights_version"]}
        assert x["per_worker"]["0"]["pid"] != x["per_worker"]["1"]["pid"] != os.getpid()
        assert x["logprob_shift"] > 0  # the step moved the logprobs of the tokens it trained on
    # every update is a new digest, and the weights the workers sampled with next are the ones the step made
    assert len(set(_digests(r))) == 3
    assert [x["next_weights_digest"] for x in rows[:-1]] == _digests(r)[1:]
    assert len({x["mean_logprob"] for x in rows}) == 3
    keys = {"iteration", "weights_version", "tokens", "mismatched_tokens", "max_abs_logprob_diff", "mean_logprob"}
    assert keys <= set(json.loads(json.dumps(r))["iterations"][0])


def test_another_shape_from_a_checkpoint_via_the_cli(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    cfg, tensors = make_tiny(3, num_hidden_layers=2, hidden_size=128, num_heads=4, head_dim=64, n_groups=2,
                             state_size=32, vocab_size=256, chunk_size=64)
    save_checkpoint(ckpt, cfg, tensors)
    out = tmp_path / "rl.json"
    # prompts 70..53 tokens + 16 generated: prefill and decode both cross the 64-token chunk boundary
    code = main(["rl", "--model", str(ckpt), "--workers", "2", "--iterations", "3", "--prompt-len", "70",
                 "--gen-len", "16", "--prompts-per-worker", "3", "--json", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    r = json.loads(out.read_text())
    assert r["contract"]["chunk_size"] == 64 and r["model"]["n_groups"] == 2
    assert [x["mismatched_tokens"] for x in r["iterations"]] == [0, 0, 0]
    assert all(x["tokens"] == 2 * 3 * 16 for x in r["iterations"])
    assert len(set(_digests(r))) == 3 and all(x["logprob_shift"] > 0 for x in r["iterations"])
    assert stdout.count("iteration ") >= 3 and "OK: 3 iterations" in stdout


def test_a_killed_worker_is_restarted_and_its_requests_recomputed_bitwise(baseline):
    r = run_rl(RLOptions(**SMALL, inject=["kill:1@1"]))
    assert r["ok"], r["first_mismatch"]
    assert r["restarts"] == {"0": 0, "1": 1}
    assert [x["restarts"]["1"] for x in r["iterations"]] == [0, 1, 0]
    (ev,) = r["restart_events"]
    assert ev["iteration"] == 1 and ev["worker"] == 1 and ev["recomputed_requests"] == 3
    assert ev["new_pid"] != ev["old_pid"] and ev["weights_version_pushed"] == 1
    assert r["iterations"][1]["per_worker"]["1"]["pid"] == ev["new_pid"]  # the batch came from the new process
    # recomputed under the re-pushed weights: the very same tokens and logprobs, hence the same updates
    for got, want in zip(r["iterations"], baseline["iterations"]):
        for key in ("weights_digest", "tokens", "mean_logprob", "next_weights_digest", "reward"):
            assert got[key] == want[key], key


def test_a_stale_worker_is_refused_and_fail_fast_stops(capsys):
    r = run_rl(RLOptions(**SMALL, inject=["stale-weights:1"], fail_fast=True))
    assert not r["ok"] and r["stopped_early"]
    rows = r["iterations"]
    assert len(rows) == 2 and rows[0]["mismatched_tokens"] == 0 and not rows[0]["refused"]
    (ref,) = r["refused"]
    assert (ref["iteration"], ref["worker"], ref["expected_version"], ref["served_version"]) == (1, 1, 1, 0)
    assert "worker 1 served weights version 0" in ref["reason"] and "trainer is at version 1" in ref["reason"]
    m = r["first_mismatch"]
    assert (m["iteration"], m["worker"]) == (1, 1) and m["trainer_logprob"] != m["sampler_logprob"]
    assert 0 <= m["request"] < 3 and m["position"] >= 40 - 7 * 2 - 3
    assert rows[1]["per_worker"]["0"]["mismatched_tokens"] == 0  # the up-to-date worker still matches
    assert "next_weights_version" not in rows[1]  # no step on a failed iteration under --fail-fast
    assert "REFUSED iteration 1: worker 1" in capsys.readouterr().out


def test_exact_replay_off_on_one_worker_is_caught(tmp_path, capsys):
    out = tmp_path / "rl.json"
    code = main(["rl", "--workers", "2", "--prompt-len", "40", "--gen-len", "32", "--prompts-per-worker", "3",
                 "--iterations", "2", "--inject", "no-replay:0", "--json", str(out)])
    stdout = capsys.readouterr().out
    assert code == 1, stdout
    r = json.loads(out.read_text())
    assert not r["refused"]  # right weights, wrong arithmetic: only the bits can tell
    m = r["first_mismatch"]
    assert m["worker"] == 0 and m["position"] >= 40 - 7 * 2 and m["trainer_logprob"] != m["sampler_logprob"]
    assert m["iteration"] == min(i for i, x in enumerate(r["iterations"]) if x["mismatched_tokens"])
    assert f"MISMATCH iteration {m['iteration']}, worker 0, request {m['request']}, position {m['position']}" in stdout
    assert "FAIL:" in stdout
    for x in r["iterations"]:
        assert x["per_worker"]["1"]["mismatched_tokens"] == 0
    assert sum(x["per_worker"]["0"]["mismatched_tokens"] for x in r["iterations"]) > 0


@pytest.mark.parametrize("kind, group", [("engine", "aligned_mamba.engines"),
                                         ("trainer", "aligned_mamba.trainers")])
def test_an_unregistered_engine_or_trainer_is_refused_in_one_line(kind, group):
    """What --engine vllm / --trainer megatron say where the extra is not installed: the name is
    looked up in its entry-point group (the same as the check's) and refused before any actor starts."""
    from rollout.actors import check_plugin

    want = rf"no {kind} named 'absent' is installed \(entry-point group {group}"
    with pytest.raises(AlignedMambaError, match=want):
        check_plugin(kind, "absent")


@pytest.mark.parametrize("args, words", [
    (["--inject", "kill:1"], "expected stale-weights:WORKER"),
    (["--inject", "no-replay:2"], "worker 2 outside 0..1"),
    (["--inject", "kill:0@3"], "iteration 3 outside 0..2"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--model", "/nonexistent/ckpt"], "does not exist"),
])
def test_refused_input_is_one_line_and_exit_2(args, words, capsys):
    assert main(["rl", *SMALL_ARGS, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aligned-mamba: error:") and words in err[0], err


def test_a_worker_refuses_bytes_that_are_not_what_they_claim(tmp_path):
    cfg, t = make_tiny(0, num_hidden_layers=1, hidden_size=128, num_heads=4, vocab_size=64, state_size=32,
                       chunk_size=32)
    save_checkpoint(tmp_path, cfg, t)
    c = Contract.from_hf_config(cfg.to_hf_dict(), backend="torch", model_dtype="bfloat16")
    w = RolloutWorker(0, "reference", EngineSpec(str(tmp_path), c.to_dict()), 23)
    with pytest.raises(AlignedMambaError, match="no weights loaded"):
        w.sample(0, [[1, 2, 3]], 4, 0)
    tr = PolicyTrainer(cfg, t, c)
    blob, digest = tr.export_bytes()
    with pytest.raises(AlignedMambaError, match="bytes say version 0, pushed as version 1"):
        w.load_weights(blob, 1, digest)
    with pytest.raises(AlignedMambaError, match="digest"):
        w.load_weights(blob, 0, "0" * 64)
    assert w.load_weights(blob, 0, digest)["weights_version"] == 0
    b = w.sample(0, [[1, 2, 3], [4, 5]], 5, 7)
    assert b.weights_digest == digest and b.tokens == 10
    seqs = [torch.tensor(s) for s in b.sequences]
    for a, s in zip(tr.token_logprobs(seqs, b.prompt_lens), b.logprobs):
        assert torch.equal(a, s)


def test_an_engine_registered_by_name_is_built_through_its_entry_point(monkeypatch):
    from importlib import metadata

    from aligned_mamba.engine import ReferenceEngine
    from rollout.actors import check_plugin

    real = metadata.entry_points
    fake = metadata.EntryPoint("fake", "aligned_mamba.engine:make_engine", ENGINE_GROUP)
    monkeypatch.setattr(metadata, "entry_points",
                        lambda **kw: [fake] if kw.get("group") == ENGINE_GROUP else real(**kw))
    assert check_plugin("engine", "fake") == {}
    cfg, _ = make_tiny(0, num_hidden_layers=1, hidden_size=128, num_heads=4, vocab_size=64, state_size=32)
    c = Contract.from_hf_config(cfg.to_hf_dict(), backend="torch", model_dtype="bfloat16")
    assert isinstance(RolloutWorker(0, "fake", EngineSpec("tiny", c.to_dict()), 23).engine, ReferenceEngine)
    with pytest.raises(AlignedMambaError, match="no engine named 'other'"):
        RolloutWorker(0, "other", EngineSpec("tiny", c.to_dict()), 23)


def test_the_megatron_trainer_scores_and_steps_with_the_same_bits(baseline):
    """The RL loop with Megatron (hook on) as the trainer: 0 mismatched tokens, and every weights
    version it exports is the reference trainer's, digest for digest."""
    pytest.importorskip("megatron.core", reason="the megatron trainer needs megatron-core (extra 'megatron')")
    r = run_rl(RLOptions(**SMALL, trainer="megatron"))
    assert r["ok"] and all(x["mismatched_tokens"] == 0 for x in r["iterations"])
    assert _digests(r) == _digests(baseline)
    nxt = lambda res: [x["next_weights_digest"] for x in res["iterations"]]
    assert nxt(r) == nxt(baseline)


def test_vllm_workers_and_the_megatron_trainer_on_another_shape(tmp_path):
    """Real vLLM engines (plugin on) as rollout workers and Megatron (hook on) as the trainer, on a
    checkpoint with 2 groups and chunk 64: every sampled token's logprob equals the trainer's while
    the weights move; prompts of 70..54 tokens and 14 generated cross the chunk boundary."""
    pytest.importorskip("vllm", reason="the vllm engine needs vllm (extra 'vllm')")
    pytest.importorskip("megatron.core", reason="the megatron trainer needs megatron-core (extra 'megatron')")
    ckpt = tmp_path / "ckpt"
    cfg, tensors = make_tiny(4, num_hidden_layers=2, hidden_size=128, num_heads=4, head_dim=64, n_groups=2,
                             state_size=32, vocab_size=256, chunk_size=64)
    save_checkpoint(ckpt, cfg, tensors)
    r = run_rl(RLOptions(model=str(ckpt), engine="vllm", trainer="megatron", workers=2, iterations=3, prompt_len=70,
                         gen_len=14, prompts_per_worker=3))
    assert r["ok"] and r["engine"] == "vllm" and r["trainer"] == "megatron"
    assert [x["mismatched_tokens"] for x in r["iterations"]] == [0, 0, 0]
    assert all(x["tokens"] == 2 * 3 * 14 for x in r["iterations"])
    assert len(set(_digests(r))) == 3 and all(x["logprob_shift"] > 0 for x in r["iterations"])


def test_a_hybrid_with_vllm_workers_and_the_megatron_trainer(tmp_path):
    """A Nemotron-H hybrid (Mamba2, attention with 4 query heads per key/value head, MLP) through the
    loop with real vLLM workers (attention keys in vLLM's paged cache) and the Megatron trainer:
    every sampled logprob equals the trainer's while the weights move; a stock vLLM worker on the
    same checkpoint is caught."""
    pytest.importorskip("vllm", reason="the vllm engine needs vllm (extra 'vllm')")
    pytest.importorskip("megatron.core", reason="the megatron trainer needs megatron-core (extra 'megatron')")
    from aligned_mamba.models.nemotron_h import make_tiny_hybrid
    from aligned_mamba.models.nemotron_h import save_checkpoint as save_hybrid

    ckpt = tmp_path / "hybrid"
    cfg, tensors = make_tiny_hybrid(3, pattern="M*-M", num_attention_heads=8, num_key_value_heads=2)
    save_hybrid(ckpt, cfg, tensors)
    opts = {"model": str(ckpt), "engine": "vllm", "workers": 2, "prompt_len": 70, "gen_len": 14,
            "prompts_per_worker": 3}
    r = run_rl(RLOptions(**opts, trainer="megatron", iterations=2))
    assert r["ok"] and [x["mismatched_tokens"] for x in r["iterations"]] == [0, 0]
    assert len(set(_digests(r))) == 2 and all(x["logprob_shift"] > 0 for x in r["iterations"])
    stock = run_rl(RLOptions(**opts, iterations=1, inject=["no-replay:1"]))
    per = stock["iterations"][0]["per_worker"]
    assert not stock["ok"] and per["0"]["mismatched_tokens"] == 0 and per["1"]["mismatched_tokens"] > 0


def test_a_stock_vllm_worker_is_caught(capsys):
    """The same loop with exact replay off on one vLLM worker (stock vLLM): the checker reports the
    iteration, the worker and the first differing token; the exact-replay worker has none."""
    pytest.importorskip("vllm", reason="the vllm engine needs vllm (extra 'vllm')")
    r = run_rl(RLOptions(engine="vllm", workers=2, iterations=1, prompt_len=60, gen_len=12, prompts_per_worker=3,
                         inject=["no-replay:1"]))
    assert not r["ok"]
    first = r["first_mismatch"]
    assert first["iteration"] == 0 and first["worker"] == 1
    per = r["iterations"][0]["per_worker"]
    assert per["0"]["mismatched_tokens"] == 0 and per["1"]["mismatched_tokens"] > 0


def test_an_actors_init_error_reaches_the_user_by_cause():
    from aligned_mamba.errors import ContractError
    from rollout.actors import deferring_init
    from rollout.rl import _one_line

    spec = EngineSpec("tiny", {"chunk_size": 48, "state_dtype": "bfloat16"})  # refused by Contract in __init__
    # as Ray reports it without deferral: an ActorDiedError holding only text, read back to its last line
    plain = ray.remote(RolloutWorker).options(num_cpus=0, max_restarts=0).remote(0, "reference", spec, 23)
    with pytest.raises(ray.exceptions.RayActorError) as died:
        ray.get(plain.info.remote())
    text = str(_one_line(died.value))
    assert text.startswith("an actor failed to start: ContractError: ") and "\n" not in text
    # deferred: the exception itself, with its meaning (refused input: exit 2)
    actor = ray.remote(deferring_init(RolloutWorker)).options(num_cpus=0, max_restarts=0).remote(0, "reference",
                                                                                                 spec, 23)
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        ray.get(actor.info.remote())
    assert isinstance(e.value.cause, ContractError)
    refused = _one_line(e.value)
    assert type(refused) is AlignedMambaError and str(refused) == str(e.value.cause).splitlines()[0]
    assert "chunk_size 48 refused" in str(refused)
    ray.kill(actor)
