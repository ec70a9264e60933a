"""Drive real vLLM engines through the check's schedules, each engine in a spawned process of its own.

vLLM loads its plugins once per process, so exact replay and stock vLLM (the baseline) never share one. The
engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the driver can step it, add requests while
others run and preempt them. Rows are vLLM's own output (``logprobs_mode="raw_logits"``, full-vocabulary
logprobs), never read out of the model. vLLM is imported only inside the engine process.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from aligned_mamba.integrations import Scenario, ScenarioResult

# What every engine process sets before importing vLLM: one in-process engine (the driver steps it).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# Overridable: a 1 GiB state pool, no torch.compile of the sampler (minutes on the CPU, same outputs), no OpenMP
# pinning (vLLM's auto binding pins every engine process to the same core, so engines started together queue).
ENGINE_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
# Set by the project's test setup for the core's Triton tests on the CPU; vLLM must not see it.
DROPPED_ENV = ("TRITON_INTERPRET",)


@dataclass(frozen=True)
class LLMSpec:
    """How to start one vLLM engine (picklable). ``llm_kwargs`` go to ``vllm.LLM`` last."""

    model_dir: str
    exact_replay: bool | None  # None: ALIGNED_MAMBA_EXACT_REPLAY unset (additional_config decides)
    max_model_len: int = 2048
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 16
    seed: int = 0
    logprobs_mode: str = "raw_logits"
    llm_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Run:
    """A core ``Scenario`` with a vLLM run's options: ``logprobs_mode`` raw_logits (rows are logits) or raw_logprobs;
    ``reprefill``: score prompt + generated again in one prefill (``info["reprefill_rows"]``); ``logprobs``:
    with ``rows="none"``, ``SamplingParams(logprobs=...)``."""

    scenario: Scenario
    logprobs_mode: str = "raw_logits"
    reprefill: bool = False
    logprobs: int | None = None


def run_in_engine(spec: LLMSpec, runs: Sequence[Run | Scenario]) -> list[ScenarioResult] | str:
    """Start the engine (in this process) and run the scenarios in order. Returns the results,
    or the one-line message of the exception that stopped the engine from starting."""
    llm = start_llm(spec)
    if isinstance(llm, str):
        return llm
    out = []
    for r in runs:
        r = r if isinstance(r, Run) else Run(r)
        out.append(drive(llm, r.scenario, logprobs_mode=r.logprobs_mode, reprefill=r.reprefill, logprobs=r.logprobs))
    return out


def start_llm(spec: LLMSpec) -> Any:
    """Set this process's environment for ``spec`` and start its engine: the ``vllm.LLM``, or the
    one-line message of the exception that stopped it from starting (a refusal, or any failure)."""
    _engine_env()
    _set_switch(spec)
    try:
        return build_llm(spec)
    except Exception as e:
        return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _set_switch(spec: LLMSpec) -> None:
    if spec.exact_replay is None:
        os.environ.pop("ALIGNED_MAMBA_EXACT_REPLAY", None)
    else:
        os.environ["ALIGNED_MAMBA_EXACT_REPLAY"] = "1" if spec.exact_replay else "0"


def _engine_env() -> None:
    for k in DROPPED_ENV:
        os.environ.pop(k, None)
    os.environ.update(ENGINE_ENV)
    for k, v in ENGINE_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


def build_llm(spec: LLMSpec) -> Any:
    """``vllm.LLM`` for ``spec`` (in-process engine, no tokenizer, eager, no prefix caching)."""
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=spec.model_dir, skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=False,
        max_model_len=spec.max_model_len, max_num_batched_tokens=spec.max_num_batched_tokens,
        max_num_seqs=spec.max_num_seqs, seed=spec.seed, logprobs_mode=spec.logprobs_mode, max_logprobs=-1,
        enable_chunked_prefill=True)
    kwargs.update(spec.llm_kwargs)
    return LLM(**kwargs)


def _worker_logprobs_mode(worker: Any, mode: str) -> None:
    runner = worker.model_runner
    runner.sampler.logprobs_mode = mode
    runner.sampler.topk_topp_sampler.logprobs_mode = mode
    runner.model_config.logprobs_mode = mode


def _set_logprobs_mode(llm: Any, mode: str) -> None:
    """Switch logprobs_mode between scenarios without a new engine: the attributes ``LLM(logprobs_mode=...)`` sets
    (sampler, its top-k/top-p sampler, model config for prompt logprobs), in every worker process."""
    llm.collective_rpc(_worker_logprobs_mode, args=(mode,))
    llm.llm_engine.model_config.logprobs_mode = mode


def _worker_seed(worker: Any, seed: int) -> None:
    torch.manual_seed(seed)


def _seed(llm: Any, seed: int) -> None:
    """Seed the torch RNG the sampler draws from: this process's (the in-process TP 1 worker) and, under
    tensor parallelism, every worker process's (each rank samples; vLLM keeps rank 0's tokens)."""
    torch.manual_seed(seed)
    if llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size > 1:
        llm.collective_rpc(_worker_seed, args=(seed,))


def _worker_info(worker: Any) -> dict[str, Any]:
    runner = worker.model_runner
    spec = runner.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    return {"model_class": f"{type(runner.model).__module__}.{type(runner.model).__qualname__}",
            "page_size_bytes": int(spec.page_size_bytes), "num_blocks": int(runner.kv_cache_config.num_blocks)}


def worker_info(llm: Any) -> list[dict[str, Any]]:
    """Each worker's model class, its state page per layer and its number of pages, in rank order."""
    return llm.collective_rpc(_worker_info)


def _row(entry: Any, vocab: int) -> torch.Tensor:
    row = torch.full((vocab,), float("nan"), dtype=torch.float32)
    ids = list(entry.keys())
    row[ids] = torch.tensor([entry[i].logprob for i in ids], dtype=torch.float32)
    return row


def drive(llm: Any, sc: Scenario, *, logprobs_mode: str = "raw_logits", reprefill: bool = False,
          logprobs: int | None = None) -> ScenarioResult:
    """Run one scenario on a started in-process engine by stepping it: the rows as vLLM hands them out (float32
    copies, see ``Run``; ``sampled_logprobs`` left empty). ``info``: ``sampled_values`` (the sampled tokens'
    values in their rows; with ``rows="none"`` and ``logprobs``, their reported logprobs), ``decode_tokens`` and
    ``decode_seconds`` (steps where every request decodes), ``model_class``, ``page_size_bytes`` (one request's
    state per layer), ``num_blocks``, ``vllm_preemptions`` (``Request.num_preemptions``: the scheduler's own
    under memory pressure as well as those ``preempt_marks`` forces)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    vocab = llm.llm_engine.model_config.get_vocab_size()
    _set_logprobs_mode(llm, logprobs_mode)
    full_budget = scheduler.max_num_scheduled_tokens
    # the scheduler's budget (what max_num_batched_tokens sets); the runner's buffers stay sized for the larger one
    scheduler.max_num_scheduled_tokens = sc.budget or full_budget
    rows_on = sc.rows != "none"
    prompt_rows_on = sc.rows == "all"
    _seed(llm, sc.seed)
    params = SamplingParams(max_tokens=sc.gen_len, ignore_eos=True, temperature=1.0,
                            logprobs=-1 if rows_on else logprobs, prompt_logprobs=-1 if prompt_rows_on else None,
                            output_kind=RequestOutputKind.DELTA)
    n = len(sc.prompts)
    gen: list[list[int]] = [[] for _ in range(n)]
    sample_rows: list[list[Any]] = [[] for _ in range(n)]
    prompt_rows: list[list[Any]] = [[] for _ in range(n)]
    pending = list(range(n))
    every = max(1, sc.gen_len // (n + 1))
    done_marks: set[tuple[int, int]] = set()
    steps = preemptions = decode_tokens = 0
    decode_seconds = 0.0
    added: set[int] = set()
    seen_preemptions: dict[str, int] = {}
    t0 = time.perf_counter()
    try:
        while pending or engine.has_unfinished_requests():
            if pending and (not sc.stagger or steps % every == 0):
                batch = [pending.pop(0)] if sc.stagger else [pending.pop(0) for _ in range(len(pending))]
                for i in batch:
                    engine.add_request(f"{sc.name}-{i}", {"prompt_token_ids": sc.prompts[i]}, params)
                    added.add(i)
            active = [i for i in added if len(gen[i]) < sc.gen_len]
            decoding = bool(active) and all(len(gen[i]) >= 1 for i in active) and not scheduler.waiting
            before = sum(len(g) for g in gen)
            t_step = time.perf_counter()
            outputs = engine.step()
            for rid, req in scheduler.requests.items():
                if rid.startswith(f"{sc.name}-"):
                    seen_preemptions[rid] = max(seen_preemptions.get(rid, 0), req.num_preemptions)
            for out in outputs:
                i = int(out.request_id.rsplit("-", 1)[1])
                c = out.outputs[0]
                gen[i].extend(c.token_ids)
                sample_rows[i].extend(c.logprobs or [])
                if out.prompt_logprobs:
                    prompt_rows[i].extend(out.prompt_logprobs)
            if decoding:
                decode_seconds += time.perf_counter() - t_step
                decode_tokens += sum(len(g) for g in gen) - before
            steps += 1
            marks = [(i, m) for i in range(n) for m in sc.preempt_marks
                     if len(gen[i]) >= m and (i, m) not in done_marks and len(gen[i]) < sc.gen_len]
            if marks:
                done_marks.update(marks)
                running = len(scheduler.running)
                # vLLM's preemption: every running request loses its slot and is recomputed (a pure Mamba
                # model holds its slot from admission, so memory pressure makes new requests wait, never preempts)
                engine.reset_prefix_cache(True)
                preemptions += running
    finally:
        scheduler.max_num_scheduled_tokens = full_budget
    seconds = time.perf_counter() - t0
    workers = worker_info(llm)
    info: dict[str, Any] = {**workers[0], "decode_tokens": decode_tokens, "decode_seconds": decode_seconds,
                            "logprobs_mode": logprobs_mode, "vllm_preemptions": sum(seen_preemptions.values()),
                            "workers": workers}
    if not rows_on:
        if logprobs is not None:
            info["sampled_values"] = [[float(e[t].logprob) for e, t in zip(sample_rows[i], gen[i])]
                                      for i in range(n)]
        return ScenarioResult(sc.name, [list(p) + g for p, g in zip(sc.prompts, gen)], [], [], steps, preemptions,
                              seconds, os.getpid(), info)
    tokens, rows, sampled = [], [], []
    for i, prompt in enumerate(sc.prompts):
        if len(gen[i]) != sc.gen_len or len(sample_rows[i]) != sc.gen_len:
            raise RuntimeError(f"request {i}: {len(gen[i])} tokens, {len(sample_rows[i])} logprob rows, "
                               f"expected {sc.gen_len}")
        r: list[tuple[int, torch.Tensor]] = []
        if prompt_rows_on:
            # prompt_logprobs[p] scores prompt token p, from the row at position p - 1
            if len(prompt_rows[i]) != len(prompt) or prompt_rows[i][0] is not None:
                raise RuntimeError(f"request {i}: {len(prompt_rows[i])} prompt logprob entries for {len(prompt)}")
            r.extend((p - 1, _row(prompt_rows[i][p], vocab)) for p in range(1, len(prompt)))
        # generated token j (position len(prompt) + j) was sampled from the row at position len(prompt) - 1 + j
        r.extend((len(prompt) - 1 + j, _row(e, vocab)) for j, e in enumerate(sample_rows[i]))
        tokens.append(list(prompt) + gen[i])
        rows.append(r)
        sampled.append([float(e[t].logprob) for e, t in zip(sample_rows[i], gen[i])])
    info["sampled_values"] = sampled
    res = ScenarioResult(sc.name, tokens, rows, [], steps, preemptions, seconds, os.getpid(), info)
    if reprefill:
        # vLLM's decode-vs-prefill logprob property: score prompt + generated in one more prefill
        again = drive(llm, Scenario(f"{sc.name}-again", tokens, 1, budget=sc.budget, rows="all", seed=sc.seed),
                      logprobs_mode=logprobs_mode)
        info["reprefill_rows"] = [r[:-1] for r in again.rows]  # drop the row of the extra sampled token
    return res


def try_start(specs: Sequence[LLMSpec]) -> list[str | None]:
    """Start each engine in turn (this process): its failure message, or None when it started.
    All specs must agree on ``exact_replay``."""
    if len({s.exact_replay for s in specs}) > 1:
        raise ValueError("vLLM loads its plugins once per process: start these specs in separate processes")
    _engine_env()
    out: list[str | None] = []
    for spec in specs:
        _set_switch(spec)
        try:
            llm = build_llm(spec)
        except Exception as e:
            out.append(f"{type(e).__name__}: {' '.join(str(e).split())}")
        else:
            out.append(None)
            del llm
    return out


def spawn(fn: Any, *args: Any) -> tuple[ProcessPoolExecutor, Future]:
    """Run ``fn(*args)`` (``run_in_engine`` or ``try_start``) in a fresh spawned process: (pool, future). Shut
    the pool down after reading the future; the process, and its engine, then exit."""
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    return pool, pool.submit(fn, *args)


def run_engines(jobs: Sequence[tuple[LLMSpec, Sequence[Run | Scenario]]], parallel: int = 1
                ) -> Iterator[list[ScenarioResult] | str]:
    """Run each (engine, scenarios) job in its own process, ``parallel`` at a time; yields in order."""
    queue = list(jobs)
    running: list[tuple[ProcessPoolExecutor, Future]] = []
    try:
        while queue or running:
            while queue and len(running) < max(1, parallel):
                spec, scenarios = queue.pop(0)
                running.append(spawn(run_in_engine, spec, list(scenarios)))
            pool, fut = running.pop(0)
            try:
                yield fut.result()
            finally:
                pool.shutdown(wait=True)
    finally:
        for pool, _ in running:
            pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class LogprobJob:
    """Requests sent together with one ``SamplingParams`` (``params``: its keyword arguments), under
    a per-step token ``budget`` (in-process engines only) and the engine's ``logprobs_mode``."""

    name: str
    prompts: list[list[int]]
    params: dict[str, Any]
    budget: int | None = None
    logprobs_mode: str | None = None


@dataclass
class LogprobResult:
    """What vLLM reported for one job, per request: ``tokens`` (prompt + generated), ``prompt_len``, ``sampled[j]``
    / ``prompt[p]`` ({token id: logprob} of generated token j / prompt token p >= 1: the chosen one and the
    top-k; ``prompt`` None when not asked); ``error``: the one-line message when vLLM refused the request."""

    tokens: list[list[int]] = field(default_factory=list)
    prompt_len: list[int] = field(default_factory=list)
    sampled: list[list[dict[int, float]]] = field(default_factory=list)
    prompt: list[list[dict[int, float]] | None] = field(default_factory=list)
    error: str | None = None


def generate_logprobs(spec: LLMSpec, jobs: Sequence[LogprobJob], capture: str | None = None,
                      multiprocess: bool = False) -> dict[str, Any] | str:
    """Start the engine and run ``jobs`` through ``LLM.generate`` as a framework would. ``capture``: a file taking
    this process's stdout and stderr (and its engine processes'); ``multiprocess``: EngineCore and worker in
    processes of their own (no per-step budget or ``logprobs_mode`` switch). Returns ``report_logprobs``'s
    dict, or the engine's one-line start failure."""
    _engine_env()
    _set_switch(spec)
    if multiprocess:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    if capture:
        fd = os.open(capture, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    try:
        llm = build_llm(spec)
    except Exception as e:
        return f"{type(e).__name__}: {' '.join(str(e).split())}"
    return report_logprobs(llm, jobs)


def report_logprobs(llm: Any, jobs: Sequence[LogprobJob]) -> dict[str, Any]:
    """Run ``jobs`` through ``llm.generate`` on a started engine (an in-process one takes each job's budget and
    ``logprobs_mode``): {"pid", "model_class" (in-process engines), "results": {job name: LogprobResult}}."""
    from vllm import SamplingParams

    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    out: dict[str, Any] = {"pid": os.getpid(), "results": {}}
    if in_process:
        out["model_class"] = worker_info(llm)[0]["model_class"]
    for job in jobs:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler if in_process else None
        full = scheduler.max_num_scheduled_tokens if scheduler else None
        if scheduler and job.budget:
            scheduler.max_num_scheduled_tokens = job.budget
        if in_process and job.logprobs_mode:
            _set_logprobs_mode(llm, job.logprobs_mode)
        res = LogprobResult()
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in job.prompts], SamplingParams(**job.params),
                                   use_tqdm=False)
        except Exception as e:
            res.error = f"{type(e).__name__}: {' '.join(str(e).split())}"
        else:
            for p, o in zip(job.prompts, outputs):
                c = o.outputs[0]
                res.tokens.append(list(p) + list(c.token_ids))
                res.prompt_len.append(len(p))
                res.sampled.append([{i: float(lp.logprob) for i, lp in e.items()} for e in (c.logprobs or [])])
                res.prompt.append(None if o.prompt_logprobs is None else
                                  [None if e is None else {i: float(lp.logprob) for i, lp in e.items()}
                                   for e in o.prompt_logprobs])
        finally:
            if scheduler:
                scheduler.max_num_scheduled_tokens = full
        out["results"][job.name] = res
    return out
