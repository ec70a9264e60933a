"""``aligned-mamba check``: sample with the engine, score with the trainer, compare raw logits.

Every case samples requests with the sampler engine under one schedule, scores the same tokens
with the trainer's one-pass forward, and compares the logits rows the sampler produced with the
trainer's rows at the same positions (``verify``: torch.equal per row). Exact-replay cases must
show 0 differing rows; the baseline (exact replay off: recurrent decode, as engines run today)
shows what they prevent.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .contract import Contract, check_compatible
from .errors import AlignedMambaError
from .model.engine import Request, SamplerEngine
from .model.lm import Mamba2LM
from .ops.ssd import recurrent_step, ssd_naive
from .verify import verify


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


def make_prompts(vocab: int, prompt_len: int, requests: int, seed: int) -> list[list[int]]:
    """Random token prompts of distinct lengths (prompt_len, prompt_len - 37, ...), at least 1."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (max(1, prompt_len - 37 * i),), generator=g).tolist() for i in range(requests)]


def run_case(spec: CaseSpec, sampler: Mamba2LM, prompts: list[list[int]], gen_len: int, max_batch_tokens: int,
             seed: int) -> tuple[list[Request], SamplerEngine]:
    """Run all requests of one case through a fresh engine."""
    engine = SamplerEngine(sampler, num_slots=len(prompts), max_batch_tokens=max_batch_tokens if spec.budget else None,
                           exact_replay=spec.exact_replay, seed=seed)
    if not spec.stagger:
        reqs = [engine.add_request(p, gen_len, emit_all_rows=spec.emit_all_rows) for p in prompts]
    else:
        reqs = []
    pending = list(prompts)
    # Preempt each request twice, at generation counts that land inside and across chunks.
    marks = sorted({max(1, gen_len // 3) + 7, max(1, (2 * gen_len) // 3) + 3}) if spec.preempt else []
    done_marks: dict[int, set[int]] = {}
    step = 0
    while pending and spec.stagger or engine.has_work():
        if spec.stagger and pending and step % max(1, gen_len // (len(prompts) + 1)) == 0:
            reqs.append(engine.add_request(pending.pop(0), gen_len, emit_all_rows=spec.emit_all_rows))
        engine.step()
        step += 1
        for req in list(engine.running):
            seen = done_marks.setdefault(req.req_id, set())
            for m in marks:
                if len(req.generated) >= m and m not in seen and not req.finished:
                    seen.add(m)
                    engine.preempt(req)
                    break
    return reqs, engine


def compare(rows: list, trainer_logits: list[torch.Tensor], trainer: Contract, sampler: Contract) -> Any:
    """verify() over every logits row the sampler emitted, against the trainer's rows.

    rows: per request, its Request or its list of (position, logits row).
    """
    t_rows, s_rows = [], []
    for req, lg in zip(rows, trainer_logits):
        for pos, row in (req.rows if isinstance(req, Request) else req):
            t_rows.append(lg[pos])
            s_rows.append(row.to(lg.device))
    return verify(torch.stack(t_rows), torch.stack(s_rows), trainer_contract=trainer, sampler_contract=sampler)


def scan_accuracy(trainer: Mamba2LM, seq: torch.Tensor, layers: int = 3) -> dict[str, Any]:
    """The scan's error against the fp64 reference, next to the rounding floor of the model dtype.

    For a few layers, the trainer's own scan inputs are run through the fp64 sequential
    reference; reported as mean |err| / mean |ref| over the layer outputs: the shared chunked scan,
    the recurrent update (fp32 state), and the floor (the fp64 result rounded to the model dtype).
    """
    capture: list[dict] = []
    trainer.forward([seq], capture=capture)
    pick = sorted({0, len(capture) // 2, len(capture) - 1})[:layers]
    num = {"chunked_scan": 0.0, "recurrent_update": 0.0, "rounding_floor": 0.0}
    den = 0.0
    for i in pick:
        c = capture[i]
        ref, _ = ssd_naive(c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"], c["cu_seqlens"],
                           dt_limit=trainer.dt_limit)
        state = torch.zeros(1, *ref.shape[1:], c["B"].shape[-1], device=ref.device)
        rec = torch.stack([
            recurrent_step(state, c["x"][t:t + 1], c["dt"][t:t + 1], c["A"], c["B"][t:t + 1], c["C"][t:t + 1], c["D"],
                           c["dt_bias"], trainer.dt_limit)[0]
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


@dataclass(frozen=True)
class ModelSource:
    """How any process builds the sampler model: the --model argument, dtype and contract (JSON).

    Picklable, so sampler engines can run in worker processes: the bits they produce are then
    compared with a trainer in another process, as in a real RL job.
    """

    model: str
    dtype: str | None
    contract_json: str

    def build(self) -> Mamba2LM:
        key = (self.model, self.dtype, self.contract_json)
        if key not in _MODELS:
            from .model.checkpoint import load_checkpoint, make_tiny

            config, tensors = make_tiny(0, dtype=self.dtype or "bfloat16") if self.model == "tiny" \
                else load_checkpoint(self.model)
            _MODELS.clear()
            _MODELS[key] = Mamba2LM(config, tensors, Contract.from_dict(json.loads(self.contract_json)))
        return _MODELS[key]


_MODELS: dict[tuple, Mamba2LM] = {}


@dataclass
class SampledCase:
    """What a sampler run returns: each request's tokens and the logits rows it emitted."""

    name: str
    tokens: list[list[int]]
    rows: list[list[tuple[int, torch.Tensor]]]
    steps: int
    preemptions: int
    seconds: float
    pid: int


def sample_case(source: ModelSource, name: str, prompts: list[list[int]], gen_len: int, budget: int,
                seed: int, threads: int | None = None) -> SampledCase:
    """Run one case's sampler engine (in this process or a worker)."""
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    spec = next(c for c in CASES if c.name == name)
    reqs, engine = run_case(spec, source.build(), prompts, gen_len, budget, seed)
    return SampledCase(name, [r.tokens for r in reqs], [[(p, row.cpu()) for p, row in r.rows] for r in reqs],
                       engine.steps, sum(r.preemptions for r in reqs), time.perf_counter() - t0, os.getpid())


def sample_cases_reference(source: ModelSource, cases: Sequence[CaseSpec], prompts: list[list[int]], gen_len: int,
                           budget: int, seed: int, jobs: int = 1) -> Iterator[SampledCase]:
    """The reference engine's sampler output for each case, in order; on ``jobs`` worker
    processes when jobs > 1. This is the ``reference`` entry of ``SAMPLERS``: another engine
    (``--engine vllm``) provides a function of the same signature."""
    args = (prompts, gen_len, budget, seed)
    if jobs <= 1:
        for spec in cases:
            yield sample_case(source, spec.name, *args)
        return
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(sample_case, source, spec.name, *args, 1) for spec in cases]
        for fut in futures:
            yield fut.result()


class Scorer(Protocol):
    """The trainer side of a check: scores whole sequences in one pass.

    ``forward(sequences)``: a list of [len_i] int64 token ids -> a list of [len_i, vocab] logits,
    the rows to compare bitwise with the sampler's. ``contract``: what the trainer runs under.
    """

    contract: Contract

    def forward(self, sequences: list[torch.Tensor]) -> list[torch.Tensor]: ...


SampleCases = Callable[..., Iterator[SampledCase]]

# --engine / --trainer names outside the core, found through entry points (the core never imports
# vLLM or Megatron): group -> (name -> what to pip install when it is missing)
ENGINE_GROUP, TRAINER_GROUP = "aligned_mamba.engines", "aligned_mamba.trainers"
EXTRAS = {"vllm": "vllm", "megatron": "megatron"}


def load_entry_point(group: str, name: str, *, missing: str, broken: str = "") -> Any:
    """The object a package registered as ``name`` in the entry-point group ``group``.

    AlignedMambaError(``missing``) when none is registered; one line naming the import error (and
    ``broken``, a hint) when it fails to import. Shared by ``--engine``/``--trainer`` here and the
    RL loop's engines and trainers.
    """
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=group) if ep.name == name]
    if not found:
        raise AlignedMambaError(missing)
    try:
        return found[0].load()
    except ImportError as e:
        raise AlignedMambaError(f"{name!r} could not be imported ({e}){broken}") from e


def load_plugin(group: str, name: str) -> Any:
    """An engine's ``sample_cases`` or a trainer's builder, registered under ``group``/``name``."""
    pip = f"pip install -e '.[{EXTRAS.get(name, name)}]'"
    return load_entry_point(group, name, missing=f"no {group.split('.')[-1][:-1]} named {name!r} is installed ({pip})",
                            broken=f"; {pip}")


def run_check(trainer: Scorer, sampler: ModelSource, *, prompt_len: int, gen_len: int, requests: int,
              max_batch_tokens: int | None, seed: int, jobs: int = 1,
              progress: Callable[[str], None] = lambda s: None, sample_cases: SampleCases = sample_cases_reference,
              reference: Mamba2LM | None = None) -> dict[str, Any]:
    """Run every case and return the JSON-ready result (see ``cli`` for the schema).

    ``sample_cases`` runs the sampler engine from ``sampler`` (the reference engine by default,
    in ``jobs`` worker processes when jobs > 1); the trainer scores every case's tokens in this
    process and ``verify`` compares the rows. ``reference`` (default: the trainer, when it is a
    ``Mamba2LM``) supplies the scan inputs for the fp64 accuracy line.
    """
    reference = reference if reference is not None else trainer
    if not isinstance(reference, Mamba2LM):
        raise TypeError("run_check needs a reference Mamba2LM for the accuracy line")
    sampler_contract = Contract.from_dict(json.loads(sampler.contract_json))
    check_compatible(trainer.contract, sampler_contract)
    t_start = time.perf_counter()
    vocab = reference.config.vocab_size
    budget = max_batch_tokens or _default_budget(sampler_contract.chunk_size)
    prompts = make_prompts(vocab, prompt_len, requests, seed)
    cases, timing = [], {}
    progress(f"sampling {len(CASES)} cases x {requests} requests x ({prompt_len}+{gen_len}) tokens"
             f"{f' on {jobs} worker processes' if jobs > 1 else ''}")
    first_tokens: list[int] = []
    for got in sample_cases(sampler, CASES, prompts, gen_len, budget, seed, jobs):
        spec = next(c for c in CASES if c.name == got.name)
        t1 = time.perf_counter()
        trainer_logits = trainer.forward([torch.tensor(t, dtype=torch.int64) for t in got.tokens])
        t2 = time.perf_counter()
        report = compare(got.rows, trainer_logits, trainer.contract, sampler_contract)
        if spec.name == "decode":
            first_tokens = got.tokens[0]
        cases.append({
            "name": spec.name,
            "exact_replay": spec.exact_replay,
            "rows": report.rows,
            "mismatched_rows": report.mismatched_rows,
            "first_mismatch": report.first_mismatch,
            "max_abs_diff": report.max_abs_diff,
            "max_abs_logprob_diff": report.max_abs_logprob_diff,
            "kl": report.kl,
            "steps": got.steps,
            "preemptions": got.preemptions,
            "sampler_pid_differs": got.pid != os.getpid(),
            "mismatch_map": report.mismatch_map(64),
        })
        timing[spec.name] = {"sampler_s": round(got.seconds, 3), "trainer_s": round(t2 - t1, 3)}
        progress(f"{spec.name}: {report.mismatched_rows}/{report.rows} rows differ "
                 f"(sampler {got.seconds:.1f}s, trainer {t2 - t1:.1f}s)")
    progress("accuracy: fp64 reference on the trainer's scan inputs")
    t0 = time.perf_counter()
    accuracy = scan_accuracy(reference, torch.tensor(first_tokens, dtype=torch.int64))
    timing["accuracy_s"] = round(time.perf_counter() - t0, 3)
    timing["total_s"] = round(time.perf_counter() - t_start, 3)
    c = reference.config
    return {
        "contract": sampler_contract.to_dict(),
        "model": {"layers": c.num_hidden_layers, "heads": c.num_heads, "head_dim": c.head_dim,
                  "n_groups": c.n_groups, "state_size": c.state_size, "vocab": vocab,
                  "replay_bytes_per_sequence": reference.new_cache(1).bytes_per_slot()},
        "params": {"prompt_len": prompt_len, "gen_len": gen_len, "requests": requests,
                   "max_batch_tokens": budget, "seed": seed, "jobs": jobs},
        "cases": cases,
        "accuracy": accuracy,
        "timing": timing,
        "ok": all(c["mismatched_rows"] == 0 for c in cases if c["exact_replay"]),
    }


def _default_budget(chunk_size: int) -> int:
    """100 tokens a step (as in the RFC's measurement), nudged off any multiple of the chunk size."""
    return 101 if 100 % chunk_size == 0 else 100
