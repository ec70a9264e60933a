"""The logprobs vLLM reports (``SamplingParams(logprobs=k)``, ``prompt_logprobs=k``) with the plugin on,
against the trainer: ``aligned_mamba.token_logprobs`` of the reference model's one-pass logits rows.

What RL frameworks read (verl: ``logprobs=0`` under ``logprobs_mode="processed_logprobs"``) must be
the contract's function of the trainer's row, bit for bit, at temperature 1.0 and 0.7, for a Mamba2
and a hybrid (Nemotron-H) checkpoint, several unaligned requests under a small token budget; vLLM's
own float32 log-softmax on the same rows is the baseline that differs. Engines run in spawned
processes (rollout.vllm_runner), one per checkpoint, shared with test_vllm_plugin and test_vllm_hybrid
(tests/integrations/engines.py), plus a multiprocess engine (EngineCore and worker processes)
switched on by ``additional_config`` alone, and the refusal with the switch at 0.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

pytestmark = [pytest.mark.engines,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install -e '.[vllm]')")]

from engines import stated  # noqa: E402

import aligned_mamba  # noqa: E402
from aligned_mamba.hardware import hardware_class  # noqa: E402
from rollout.vllm_runner import LLMSpec, LogprobJob, spawn, try_start  # noqa: E402

# Unaligned prompts around the Mamba2 fixture's 256-token chunk and the hybrid's pages; a 37-token
# budget splits every prefill at odd offsets.
PROMPT_LENS = (263, 226, 150, 71)
GEN = 32
BUDGET = 37
KS = (0, 5)
TEMPS = (1.0, 0.7)
CHECKPOINTS = ("mamba2", "hybrid")
PLUGIN_CLASSES = {"mamba2": "rollout.vllm_model.ExactReplayMamba2ForCausalLM",
                  "hybrid": "rollout.vllm_model.ExactReplayNemotronHForCausalLM"}
LOG_LINE = re.compile(r"aligned-mamba exact replay on \(pid (\d+)\): contract (\w+), hardware (\S+)")


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _jobs(prompts: list[list[int]]) -> list[LogprobJob]:
    base = dict(max_tokens=GEN, ignore_eos=True)
    jobs = [LogprobJob(f"k{k}_t{t}", prompts, dict(base, logprobs=k, prompt_logprobs=k, temperature=t), BUDGET,
                       "processed_logprobs") for k in KS for t in TEMPS]
    # raw_logprobs: the logprob of the raw logits whatever the temperature (vLLM's definition)
    jobs.append(LogprobJob("raw_k5_t0.7", prompts, dict(base, logprobs=5, temperature=0.7), BUDGET, "raw_logprobs"))
    # greedy requests (T = 0): vLLM's processed logprobs are those of T = 1
    jobs.append(LogprobJob("greedy_k5", prompts, dict(base, logprobs=5, temperature=0.0), BUDGET,
                           "processed_logprobs"))
    # processed_logits: the contract's fp32 logits / T
    jobs.append(LogprobJob("plogits_k5_t0.7", prompts, dict(base, logprobs=5, temperature=0.7), BUDGET,
                           "processed_logits"))
    # request-time refusals (the engine started under processed_logprobs)
    for name, extra in (("top_p", {"top_p": 0.9}), ("repetition_penalty", {"repetition_penalty": 1.1}),
                        ("min_p", {"min_p": 0.05})):
        jobs.append(LogprobJob(f"refuse_{name}", prompts[:1], dict(base, max_tokens=2, logprobs=0, **extra),
                               logprobs_mode="processed_logprobs"))
    return jobs


@pytest.fixture(scope="module")
def setup(engines):
    """The session's shared engines (tests/integrations/engines.py) run this module's jobs: the default
    Mamba2 switched on by additional_config alone (the variable unset), and the hybrid; the refusal
    with the switch at 0 needs a process of its own (vLLM loads its plugins once per process)."""
    contract = engines.mamba2_contract
    mamba2, hybrid = engines.checkpoint("mamba2"), engines.checkpoint("hybrid")
    models = {"mamba2": aligned_mamba.load_model(mamba2), "hybrid": aligned_mamba.load_model(hybrid)}
    prompts = {k: _prompts(m.shape.vocab_size) for k, m in models.items()}
    base = dict(max_model_len=512, max_num_batched_tokens=1024, max_num_seqs=8, logprobs_mode="processed_logprobs")
    refusal = spawn(try_start, [LLMSpec(model_dir=str(mamba2), exact_replay=False, **base,
                                        llm_kwargs=stated(contract))])
    work = {"mamba2": lambda: engines.get("mamba2/exact").logprobs(_jobs(prompts["mamba2"])),
            "hybrid": lambda: engines.get("hybrid/exact").logprobs(_jobs(prompts["hybrid"])),
            "refusal": lambda: _result(refusal)}
    cache: dict = {}

    def get(key: str):
        if key not in cache:
            cache[key] = work[key]()
        return cache[key]

    yield {"get": get, "models": models, "logs": {"mamba2": str(engines.log("mamba2/exact"))}, "contract": contract,
           "root": engines.root, "prompts": prompts["mamba2"]}
    refusal[0].shutdown(wait=True, cancel_futures=True)


def _result(proc):
    pool, fut = proc
    try:
        return fut.result(timeout=900)
    finally:
        pool.shutdown(wait=True)


def _compare(model, res, temperature: float, prompt: bool) -> tuple[int, int, int]:
    """(logprobs compared, differing from the contract's function of the trainer's row, sampled tokens
    whose stock vLLM logprob (float32 log_softmax of the same row / T) differs from the contract's)."""
    n = bad = stock_diff = 0
    logits = model.forward([torch.tensor(t) for t in res.tokens])
    for i, rows in enumerate(logits):
        p = res.prompt_len[i]
        pairs = ([(rows[q - 1], e, 1.0) for q, e in enumerate(res.prompt[i]) if q >= 1] if prompt else
                 [(rows[p - 1 + j], e, temperature) for j, e in enumerate(res.sampled[i])])
        if not prompt:
            assert len(pairs) == GEN and all(res.tokens[i][p + j] in e for j, (_, e, _) in enumerate(pairs))
        for j, (row, entry, t) in enumerate(pairs):
            ids = torch.tensor(list(entry))
            got = torch.tensor(list(entry.values()), dtype=torch.float32)
            want = aligned_mamba.token_logprobs(row.expand(len(ids), -1), ids, t)
            n += len(ids)
            bad += int((got != want).sum())
            if not prompt:
                tok = torch.tensor([res.tokens[i][p + j]])
                stock = (row.float() / torch.tensor(t)).log_softmax(-1, dtype=torch.float32)[tok]
                stock_diff += not torch.equal(stock, aligned_mamba.token_logprobs(row[None], tok, t))
    return n, bad, stock_diff


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_sampled_logprobs_equal_trainer(setup, ckpt):
    out = setup["get"](ckpt)
    assert out["model_class"] == PLUGIN_CLASSES[ckpt]
    total = tokens = stock = 0
    for k in KS:
        for t in TEMPS:
            res = out["results"][f"k{k}_t{t}"]
            assert res.error is None, res.error
            n, bad, s = _compare(setup["models"][ckpt], res, t, prompt=False)
            print(f"\n{ckpt} processed_logprobs logprobs={k} T={t}: {bad}/{n} reported logprobs differ from the "
                  f"trainer's; stock vLLM's log_softmax differs on {s} sampled tokens")
            assert bad == 0 and n >= len(PROMPT_LENS) * GEN * max(k, 1)
            total, tokens, stock = total + n, tokens + len(PROMPT_LENS) * GEN, stock + s
    assert tokens >= 500
    assert stock > 0, "the baseline (vLLM's own log_softmax on the same rows) never differs: the test cannot fail"


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_raw_logprobs_equal_trainer(setup, ckpt):
    res = setup["get"](ckpt)["results"]["raw_k5_t0.7"]
    assert res.error is None, res.error
    n, bad, _ = _compare(setup["models"][ckpt], res, 1.0, prompt=False)  # raw: the logits before / T
    print(f"\n{ckpt} raw_logprobs logprobs=5 T=0.7: {bad}/{n} differ")
    assert bad == 0 and n >= len(PROMPT_LENS) * GEN * 5


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_greedy_and_processed_logits_equal_trainer(setup, ckpt):
    from aligned_mamba.ops.logprobs import scale

    out = setup["get"](ckpt)
    res = out["results"]["greedy_k5"]
    n, bad, _ = _compare(setup["models"][ckpt], res, 1.0, prompt=False)
    res = out["results"]["plogits_k5_t0.7"]
    logits = setup["models"][ckpt].forward([torch.tensor(t) for t in res.tokens])
    m = bad_logits = 0
    for i, rows in enumerate(logits):
        p = res.prompt_len[i]
        for j, e in enumerate(res.sampled[i]):
            want = scale(rows[p - 1 + j], 0.7)[torch.tensor(list(e))]
            m += len(e)
            bad_logits += int((torch.tensor(list(e.values()), dtype=torch.float32) != want).sum())
    print(f"\n{ckpt} greedy logprobs=5: {bad}/{n} differ; processed_logits T=0.7: {bad_logits}/{m} differ")
    assert bad == 0 and n >= len(PROMPT_LENS) * GEN * 5 and bad_logits == 0 and m >= len(PROMPT_LENS) * GEN * 5


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_prompt_logprobs_equal_trainer(setup, ckpt):
    out = setup["get"](ckpt)
    for k in KS:
        res = out["results"][f"k{k}_t1.0"]
        n, bad, _ = _compare(setup["models"][ckpt], res, 1.0, prompt=True)
        print(f"\n{ckpt} prompt_logprobs={k}: {bad}/{n} differ")
        assert bad == 0 and n >= sum(PROMPT_LENS) - len(PROMPT_LENS)


@pytest.mark.parametrize("name", ["top_p", "repetition_penalty", "min_p"])
def test_processed_logprobs_refuse_logit_changes(setup, name):
    err = setup["get"]("mamba2")["results"][f"refuse_{name}"].error
    print(f"\n{name}: {err}")
    assert err is not None and "aligned-mamba exact replay refused:" in err and name in err


def test_log_line_in_process(setup):
    out = setup["get"]("mamba2")
    text = open(setup["logs"]["mamba2"]).read()
    lines = LOG_LINE.findall(text)
    print(f"\n{lines}")
    assert lines == [(str(out["pid"]), setup["contract"].fingerprint, str(hardware_class("cpu")))]


# The README's lines as a user runs them: multiprocess vLLM (EngineCore and worker processes), the
# variable unset, additional_config alone.
README_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], enforce_eager=True, enable_prefix_caching=False, skip_tokenizer_init=True,
              max_num_batched_tokens=64, additional_config={"aligned_mamba": {}})
    out = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                       SamplingParams(max_tokens=8, logprobs=0, temperature=0.7))
    print("RESULT", json.dumps([[list(o.outputs[0].token_ids), [{str(i): lp.logprob for i, lp in e.items()}
                                for e in o.outputs[0].logprobs]] for o in out]), flush=True)
"""


def test_additional_config_switches_on_every_process(setup, tmp_path):
    """The plugin switches on in the engine processes vLLM spawns (their log lines), and the
    reported logprobs are the contract's."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "readme.py"
    script.write_text(README_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("ALIGNED_MAMBA_EXACT_REPLAY", "TRITON_INTERPRET",
                                                              "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    prompts = setup["prompts"][2:]
    run = subprocess.run([sys.executable, str(script), str(setup["root"] / "mamba2"), json.dumps(prompts)],
                         env=env, capture_output=True, text=True, timeout=600)
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-3000:]
    lines = LOG_LINE.findall(text)
    pids = {pid for pid, _, _ in lines}
    print(f"\nlog lines from {len(pids)} processes: {lines}")
    assert len(pids) >= 2 and {fp for _, fp, _ in lines} == {setup["contract"].fingerprint}
    (result,) = [json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    n = bad = 0
    logits = setup["models"]["mamba2"].forward([torch.tensor(p + gen) for p, (gen, _) in zip(prompts, result)])
    for p, (gen, entries), rows in zip(prompts, result, logits):
        for j, (tok, e) in enumerate(zip(gen, entries)):
            n += 1
            # vLLM's default logprobs_mode, raw_logprobs: the logits before / T
            want = aligned_mamba.token_logprobs(rows[len(p) - 1 + j], torch.tensor(tok))
            bad += not torch.equal(torch.tensor(e[str(tok)], dtype=torch.float32), want)
    print(f"multiprocess engine, raw_logprobs, logprobs=0 T=0.7: {bad}/{n} differ from the trainer's")
    assert n == 8 * len(prompts) and bad == 0


def test_switch_at_zero_refuses_additional_config(setup):
    (message,) = setup["get"]("refusal")
    print(f"\n{message}")
    assert message is not None and message.startswith("ExactReplayRefused: aligned-mamba exact replay refused:")
    assert "ALIGNED_MAMBA_EXACT_REPLAY='0' switches it off" in message
