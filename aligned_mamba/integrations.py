"""The Engine and Trainer protocols that ``aligned-mamba check`` and ``rl`` share, and their lookup.

"reference" is built in; other frameworks register a factory under an entry-point group (``rollout/``
the vLLM engine, ``trainer_hooks/`` the Megatron trainer), so the core imports neither. Imports no
torch at import time: the CLI builds its parser through this module.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .errors import AlignedMambaError

if TYPE_CHECKING:
    import torch

    from .contract import Contract

ENGINE_GROUP = "aligned_mamba.engines"
TRAINER_GROUP = "aligned_mamba.trainers"
COMMAND_GROUP = "aligned_mamba.commands"
# what to pip install when a named engine or trainer is missing
EXTRAS = {"vllm": "vllm", "megatron": "megatron"}


@dataclass(frozen=True)
class Scenario:
    """One schedule of requests. prompts: token ids per request; gen_len: tokens sampled per request;
    budget: per-step token budget (None: unbounded); rows: "sampled" (the rows sampled from), "all"
    (prompt positions too) or "none"; preempt_marks: generated-token counts at which running requests
    are preempted (later recomputed); stagger: requests join one after another; seed: sampling seed."""

    name: str
    prompts: list[list[int]]
    gen_len: int
    budget: int | None = None
    rows: str = "sampled"
    preempt_marks: tuple[int, ...] = ()
    stagger: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rows not in ("sampled", "all", "none"):
            raise ValueError(f"rows {self.rows!r}: expected 'sampled', 'all' or 'none'")


@dataclass
class ScenarioResult:
    """What an engine returns. tokens: per request, prompt + generated ids; rows: per request,
    (position, logits [vocab] in the model dtype), the row computed at that position; sampled_logprobs:
    per request, the float32 logprob reported per sampled token (the trainer's must equal it); info."""

    name: str
    tokens: list[list[int]]
    rows: list[list[tuple[int, torch.Tensor]]]
    sampled_logprobs: list[list[float]]
    steps: int
    preemptions: int
    seconds: float
    pid: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineSpec:
    """How to build an engine (picklable). model: "tiny" or a checkpoint directory; dtype: the tiny
    model's dtype; contract: ``Contract.to_dict()``; exact_replay: False runs the stock decode (the
    baseline); max_model_len / max_num_seqs / max_batch_tokens: capacity; threads: torch intra-op
    threads; tp: tensor-parallel degree (ranks as gloo processes on the CPU)."""

    model: str
    contract: dict[str, Any]
    dtype: str | None = None
    exact_replay: bool = True
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_batch_tokens: int = 4096
    threads: int = 1
    tp: int = 1


class Engine(Protocol):
    """A sampler engine, built by an ``aligned_mamba.engines`` factory ``make(spec: EngineSpec)``. The
    factory may set ``own_process = True`` (never share a process: vLLM loads its plugins once per
    process) and ``per_scenario = True`` (cheap to build: one engine per scenario)."""

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Serve these weights (the checkpoint's names and dtypes), replacing every tensor."""

    def run(self, scenario: Scenario, on_step: Callable[[int], None] | None = None) -> ScenarioResult:
        """Run every request to completion; ``on_step(steps_done)`` after each step where possible."""

    def close(self) -> None:
        """Release the engine."""


class Trainer(Protocol):
    """Built by an ``aligned_mamba.trainers`` factory ``make(*, config, tensors, contract, lr)``."""

    contract: Contract
    version: int

    def forward(self, sequences: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Logits of whole sequences in one pass: [len_i] int64 -> [len_i, vocab] (model dtype)."""

    def token_logprobs(self, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int]) -> list[torch.Tensor]:
        """float32 logprob of each generated token under the one-pass logits."""

    def step(self, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int],
             advantages: Sequence[float]) -> dict[str, Any]:
        """One policy-gradient step; ``version`` += 1."""

    def export_bytes(self) -> tuple[bytes, str]:
        """The served weights as safetensors bytes (metadata "weights_version") and their digest."""


# -- finding engines and trainers ---------------------------------------------------------------------------


def load_entry_point(group: str, name: str, *, missing: str, broken: str = "") -> Any:
    """The entry point ``name`` of ``group``; AlignedMambaError(``missing``) if none, (import error +
    ``broken``) if it fails to import."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=group) if ep.name == name]
    if not found:
        raise AlignedMambaError(missing)
    try:
        return found[0].load()
    except ImportError as e:
        raise AlignedMambaError(f"{name!r} could not be imported ({e}){broken}") from e


def _plugin(group: str, name: str, what: str) -> Any:
    pip = f"pip install -e '.[{EXTRAS.get(name, name)}]'"
    return load_entry_point(group, name, missing=f"no {what} named {name!r} is installed (entry-point group {group}; "
                                                 f"{pip})", broken=f"; {pip}")


def engine_factory(name: str) -> Callable[[EngineSpec], Engine]:
    """The factory: "reference" (built in) or an entry point."""
    if name == "reference":
        from .engine import make_engine

        return make_engine
    return _plugin(ENGINE_GROUP, name, "engine")


def trainer_factory(name: str) -> Callable[..., Trainer]:
    """The factory: "reference" (built in) or an entry point."""
    if name == "reference":
        from .train import make_trainer

        return make_trainer
    return _plugin(TRAINER_GROUP, name, "trainer")


def build_engine(name: str, spec: EngineSpec) -> Engine:
    return engine_factory(name)(spec)


def check_trainer_sp(name: str, tp: int, sequence_parallel: bool) -> None:
    """Refuse, in one line, ``--trainer-sp`` where it cannot run: it is Megatron's sequence parallelism, which
    shards the sequence over the trainer's TP ranks."""
    if sequence_parallel and (name != "megatron" or tp < 2):
        raise AlignedMambaError(f"--trainer-sp refused for the {name} trainer at TP {tp}: sequence parallelism shards "
                                "the sequence over Megatron's TP ranks (--trainer megatron --trainer-tp K, K > 1)")


def check_parallel(config: Any, *, trainer: str, trainer_tp: int, trainer_sp: bool, trainer_contract: Contract,
                   engine: str, sampler_tp: int, sampler_contract: Contract) -> None:
    """Refuse, in one line naming the flag, tensor-parallel degrees that ``check`` and ``rl`` cannot run: a trainer
    or engine without tensor parallelism at TP > 1, ``--trainer-sp`` where it cannot run, and any degree the model
    cannot keep its bits at under that side's contract (``parallel.check_tp``)."""
    from .parallel import check_tp

    check_trainer_sp(trainer, trainer_tp, trainer_sp)
    for flag, name, size, contract, covered, kind in (
            ("--trainer-tp", trainer, trainer_tp, trainer_contract, ("reference", "megatron"), "trainers"),
            ("--sampler-tp", engine, sampler_tp, sampler_contract, ("reference", "vllm"), "engines")):
        if size != 1 and name not in covered:
            raise AlignedMambaError(f"{flag} {size} refused: tensor parallelism runs on the {' and '.join(covered)} "
                                    f"{kind} for now, not {name}")
        try:
            check_tp(contract, config, size)
        except AlignedMambaError as e:
            raise AlignedMambaError(f"{flag} {size}: {e}") from None


def build_trainer(name: str, *, config: Any, tensors: dict[str, torch.Tensor], contract: Contract,
                  lr: float = 1e-4, tp: int = 1, sequence_parallel: bool = False) -> Trainer:
    """``tp`` and ``sequence_parallel`` are passed only when set, so factories without them keep working."""
    check_trainer_sp(name, tp, sequence_parallel)
    extra: dict[str, Any] = {} if tp == 1 else {"tp": tp}
    if sequence_parallel:
        extra["sequence_parallel"] = True
    return trainer_factory(name)(config=config, tensors=tensors, contract=contract, lr=lr, **extra)


# -- running scenarios, in worker processes where asked --------------------------------------------------------


def run_scenarios_here(name: str, spec: EngineSpec, scenarios: Sequence[Scenario], *,
                       worker: bool = False) -> list[ScenarioResult]:
    """Build the engine here and run the scenarios in order (a ``worker`` takes the spec's threads)."""
    if worker:
        import torch

        torch.set_num_threads(max(1, spec.threads))
    from .hardware import hardware_class

    engine = build_engine(name, spec)
    try:
        results = [engine.run(sc) for sc in scenarios]
    finally:
        engine.close()
    # as this process sees it: a worker may run with other ISA settings than its parent
    hw = hardware_class("cuda" if spec.contract.get("backend") == "triton" else "cpu").to_dict()
    for res in results:
        res.info.setdefault("hardware", hw)
    return results


def run_scenarios(name: str, jobs: Sequence[tuple[EngineSpec, Scenario]], parallel: int = 1
                  ) -> Iterator[ScenarioResult]:
    """The results of each (spec, scenario), in order. Equal specs share an engine (unless
    ``per_scenario``); engines run in spawned workers, ``parallel`` at a time, when ``parallel`` > 1 or
    ``own_process``."""
    factory = engine_factory(name)
    per_scenario = bool(getattr(factory, "per_scenario", False))
    groups: list[tuple[EngineSpec, list[int]]] = []
    for i, (spec, _) in enumerate(jobs):
        group = None if per_scenario else next((g for g in groups if g[0] == spec), None)
        if group is None:
            groups.append((spec, [i]))
        else:
            group[1].append(i)
    spawned = parallel > 1 or bool(getattr(factory, "own_process", False))
    results: dict[int, ScenarioResult] = {}
    if not spawned:
        for spec, idx in groups:
            for i, res in zip(idx, run_scenarios_here(name, spec, [jobs[i][1] for i in idx])):
                results[i] = res
        for i in range(len(jobs)):
            yield results.pop(i)
        return
    ctx = multiprocessing.get_context("spawn")
    tasks = [(idx, spec) for spec, idx in groups]

    def submit(pool: ProcessPoolExecutor, idx: list[int], spec: EngineSpec) -> Future:
        return pool.submit(run_scenarios_here, name, spec, [jobs[i][1] for i in idx], worker=True)

    nxt = 0
    if not getattr(factory, "own_process", False):  # one pool of ``parallel`` workers for every job
        with ProcessPoolExecutor(max_workers=max(1, parallel), mp_context=ctx) as pool:
            futures = [(idx, submit(pool, idx, spec)) for idx, spec in tasks]
            for idx, fut in futures:
                for i, res in zip(idx, fut.result()):
                    results[i] = res
                while nxt in results:
                    yield results.pop(nxt)
                    nxt += 1
        return
    # shut a worker down only after reading its results: torch's shared tensors need the sender alive
    running: list[tuple[list[int], ProcessPoolExecutor, Future]] = []
    try:
        while tasks or running:
            while tasks and len(running) < max(1, parallel):
                idx, spec = tasks.pop(0)
                pool = ProcessPoolExecutor(max_workers=1, mp_context=ctx)
                running.append((idx, pool, submit(pool, idx, spec)))
            idx, pool, fut = running.pop(0)
            try:
                for i, res in zip(idx, fut.result()):
                    results[i] = res
            finally:
                pool.shutdown(wait=True)
            while nxt in results:
                yield results.pop(nxt)
                nxt += 1
    finally:
        for _, pool, _ in running:
            pool.shutdown(wait=True, cancel_futures=True)
