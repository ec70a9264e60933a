"""``aligned-mamba check --engine vllm``: the check's cases sampled by real vLLM engines.

The exact-replay cases run on one vLLM engine with the plugin on (its contract stated through
``additional_config``, so a mismatch with the trainer's is refused at start); the baseline case
runs on stock vLLM (plugin off) in another process. Each returns its requests' tokens and the
raw logits rows vLLM sampled from; the check scores the tokens with the trainer and compares.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from aligned_mamba.check import CaseSpec, ModelSource, SampledCase
from aligned_mamba.contract import Contract
from aligned_mamba.errors import AlignedMambaError

from .vllm_runner import EngineSpec, Scenario, ScenarioResult, run_engines


def model_dir(source: ModelSource, root: str | Path) -> str:
    """A directory vLLM can load: the HF directory itself, or 'tiny' saved under ``root``."""
    if source.model != "tiny":
        return source.model
    from aligned_mamba.model.checkpoint import make_tiny, save_checkpoint

    path = Path(root) / "tiny"
    if not (path / "config.json").exists():
        config, tensors = make_tiny(0, dtype=source.dtype or "bfloat16")
        save_checkpoint(path, config, tensors)
    return str(path)


def preempt_marks(gen_len: int) -> tuple[int, ...]:
    """Generated-token counts at which requests are preempted (the reference engine's marks)."""
    return tuple(sorted({max(1, gen_len // 3) + 7, max(1, (2 * gen_len) // 3) + 3}))


def scenario_for(spec: CaseSpec, prompts: list[list[int]], gen_len: int, budget: int) -> Scenario:
    return Scenario(spec.name, prompts, gen_len, budget=budget if spec.budget else None,
                    prompt_rows=spec.emit_all_rows, preempt_marks=preempt_marks(gen_len) if spec.preempt else (),
                    stagger=spec.stagger)


def engine_spec(path: str, contract: Contract, exact_replay: bool, prompts: list[list[int]], gen_len: int,
                budget: int, seed: int) -> EngineSpec:
    """One engine for all cases of a kind: room for every prompt in one step (the unbudgeted
    cases), as many sequences as requests (as the reference engine's slots)."""
    longest = max(len(p) for p in prompts) + gen_len
    kwargs: dict[str, Any] = {"dtype": contract.model_dtype}
    if exact_replay:
        kwargs["additional_config"] = {"aligned_mamba": {"contract": contract.to_dict()}}
    return EngineSpec(model_dir=path, exact_replay=exact_replay, max_model_len=max(longest + 16, 256),
                      max_num_batched_tokens=max(sum(len(p) for p in prompts), budget, 256),
                      max_num_seqs=max(len(prompts), 1), seed=seed, llm_kwargs=kwargs)


def to_sampled(res: ScenarioResult, dtype: torch.dtype, exact: bool) -> SampledCase:
    """Rows in the model dtype (vLLM hands out fp32 copies of model-dtype logits: exact)."""
    rows = []
    for req in res.rows:
        out = []
        for pos, row in req:
            cast = row.to(dtype)
            if exact and not torch.equal(cast.to(torch.float32), row):
                raise AlignedMambaError(f"{res.name}: a logits row is not representable in {dtype} (engine output "
                                        "dtype differs from the contract's model dtype)")
            out.append((pos, cast))
        rows.append(out)
    return SampledCase(res.name, res.tokens, rows, res.steps, res.preemptions, res.seconds, res.pid)


def sample_cases(source: ModelSource, cases: Sequence[CaseSpec], prompts: list[list[int]], gen_len: int,
                 budget: int, seed: int, jobs: int = 1) -> Iterator[SampledCase]:
    """The check's sampler on vLLM: one SampledCase per case, in order (see ``sample_cases_reference``).

    Exact-replay cases share one engine with the plugin on; the others (the baseline) one stock
    engine; with jobs > 1 the two engines run at the same time.
    """
    contract = Contract.from_dict(json.loads(source.contract_json))
    dtype = getattr(torch, contract.model_dtype)
    with tempfile.TemporaryDirectory(prefix="aligned_mamba_vllm_") as tmp:
        path = model_dir(source, tmp)
        groups = {flag: [c for c in cases if c.exact_replay == flag] for flag in (True, False)}
        jobs_list = [(engine_spec(path, contract, flag, prompts, gen_len, budget, seed),
                      [scenario_for(c, prompts, gen_len, budget) for c in group])
                     for flag, group in groups.items() if group]
        results: dict[str, SampledCase] = {}
        for (spec, _), got in zip(jobs_list, run_engines(jobs_list, parallel=min(max(jobs, 1), 2))):
            if isinstance(got, str):
                raise AlignedMambaError(f"vLLM engine ({'exact replay' if spec.exact_replay else 'stock'}) did not "
                                        f"start: {got}")
            for res in got:
                results[res.name] = to_sampled(res, dtype, spec.exact_replay)
    for c in cases:
        yield results[c.name]
