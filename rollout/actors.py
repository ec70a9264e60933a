"""The three actors of the RL loop as plain classes (``rollout.rl`` wraps them with ``ray.remote``; nothing here
imports Ray, so they are tested without a cluster): ``RolloutWorker`` (one sampler engine: loads versioned,
digest-checked weights, samples, returns each sampled token's logprob), ``TrainerScorer`` (scores in one pass,
takes a policy-gradient step, exports versioned safetensors bytes) and ``AlignmentChecker`` (compares every
logprob bit for bit, refuses batches sampled under other weights, keeps the metrics). Engines and trainers are
the core's protocols, chosen by name as ``aligned-mamba check`` does (``aligned_mamba.integrations``).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from aligned_mamba.contract import Contract
from aligned_mamba.errors import AlignedMambaError
from aligned_mamba.integrations import (
    EngineSpec,
    Scenario,
    Trainer,
    build_engine,
    build_trainer,
    engine_factory,
    trainer_factory,
)
from aligned_mamba.models import load_source
from aligned_mamba.train import weights_digest, weights_from_bytes
from aligned_mamba.verify import verify


@dataclass(frozen=True)
class TrainerSpec:
    """How the trainer actor builds its trainer (picklable)."""

    name: str
    model: str
    contract: dict[str, Any]
    lr: float = 1e-3
    threads: int = 1
    tp: int = 1  # the trainer's tensor-parallel degree (its own rank processes)
    sequence_parallel: bool = False  # Megatron's, over those ranks


def check_plugin(kind: str, name: str) -> dict[str, Any]:
    """Fail fast in the driver, before any actor starts, when an engine/trainer name cannot be built; returns the
    factory's ``ray_actor_options`` (env vars, ``num_gpus``) for the actors that run it ({} for "reference")."""
    factory = engine_factory(name) if kind == "engine" else trainer_factory(name)
    return dict(getattr(factory, "ray_actor_options", None) or {})


def make_trainer(spec: TrainerSpec) -> Trainer:
    """The trainer called ``spec.name`` over the model source's checkpoint."""
    config, tensors = load_source(spec.model)
    return build_trainer(spec.name, config=config, tensors=tensors, contract=Contract.from_dict(spec.contract),
                         lr=spec.lr, tp=spec.tp, sequence_parallel=spec.sequence_parallel)


def deferring_init(cls: type) -> type:
    """``cls`` whose ``__init__`` errors are kept and raised by its first method call: Ray reports an actor's
    ``__init__`` exception as an ``ActorDiedError`` holding only the traceback text, while one raised by a
    method reaches the driver as itself (``RayTaskError.cause``), with its one line and exit status."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            cls.__init__(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised, unchanged, by every method
            self._init_error = e
        else:
            self._init_error = None

    def method(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self._init_error is not None:
                raise self._init_error
            return fn(self, *args, **kwargs)

        call.__name__, call.__qualname__, call.__doc__ = fn.__name__, f"{cls.__name__}.{fn.__name__}", fn.__doc__
        return call

    body: dict[str, Any] = {"__init__": __init__, "__doc__": cls.__doc__, "__module__": cls.__module__}
    for name in dir(cls):
        fn = getattr(cls, name)
        if not name.startswith("_") and callable(fn) and not isinstance(fn, type):
            body[name] = method(fn)
    return type(cls.__name__, (cls,), body)


# -- what travels between the actors -------------------------------------------------------------------------------


@dataclass
class SampleBatch:
    """One worker's output for one iteration, stamped with the weights it was sampled under."""

    iteration: int
    worker: int
    weights_version: int
    weights_digest: str
    contract: str  # fingerprint
    sequences: list[list[int]]
    prompt_lens: list[int]
    logprobs: list[torch.Tensor]  # float32, one per sequence, one per generated token
    pid: int
    seconds: float
    hardware: str | None = None  # the class the rows were computed on (hardware.HardwareClass.key)
    child_pids: list[int] = field(default_factory=list)  # the worker's processes: a TP engine's ranks

    @property
    def tokens(self) -> int:
        return sum(int(lp.numel()) for lp in self.logprobs)


def blob_version(blob: bytes) -> int | None:
    """The "weights_version" in a safetensors blob's metadata (None when absent)."""
    (n,) = struct.unpack("<Q", blob[:8])
    meta = json.loads(blob[8:8 + n]).get("__metadata__") or {}
    v = meta.get("weights_version")
    return int(v) if v is not None else None


def even_token_reward(generated: Sequence[int]) -> float:
    """A verifiable reward: the fraction of generated token ids that are even."""
    return sum(1 for t in generated if t % 2 == 0) / max(1, len(generated))


# -- the actors ----------------------------------------------------------------------------------------------------


class RolloutWorker:
    """A rollout worker: one engine, versioned weights, seeded sampling. ``keep_rows``: keep each token's raw
    logits row (``last_rows``: per request, (position, row) pairs) for a caller that compares rows too.
    Faults (tests, ``--inject``): ``stale`` ignores weights updates after the first (reporting the old version),
    the spec's ``exact_replay=False`` runs stock decode, ``sample(kill_after_steps=n)`` SIGKILLs the process."""

    def __init__(self, worker: int, engine: str, spec: EngineSpec, budget: int | None, *, stale: bool = False,
                 keep_rows: bool = False) -> None:
        torch.set_num_threads(spec.threads)
        self.worker = worker
        self.stale = stale
        self.keep_rows = keep_rows
        self.last_rows: list[list[tuple[int, torch.Tensor]]] | None = None
        self.budget = budget
        self.contract = Contract.from_dict(spec.contract).fingerprint
        self.hardware = _hardware_key(spec.contract)
        self.engine = build_engine(engine, spec)
        self.version: int | None = None
        self.digest: str | None = None
        self.started = time.time()

    def info(self) -> dict[str, Any]:
        """Who this process is and what it serves (a restarted actor serves nothing until weights are pushed);
        ``child_pids``: the processes it started (a tensor-parallel engine's ranks), which must end with it."""
        return {"worker": self.worker, "pid": os.getpid(), "weights_version": self.version,
                "weights_digest": self.digest, "started": self.started, "child_pids": _child_pids()}

    def close(self) -> None:
        """Release the engine (a tensor-parallel engine ends its rank processes); the actor is killed next."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    def load_weights(self, blob: bytes, version: int, digest: str) -> dict[str, Any]:
        """Load safetensors bytes after checking they are the version and digest claimed."""
        if self.stale and self.version is not None:
            return self.info()  # injected fault: keep serving the old weights
        in_blob = blob_version(blob)
        if in_blob != version:
            raise AlignedMambaError(f"worker {self.worker}: weights bytes say version {in_blob}, "
                                    f"pushed as version {version}; refused")
        tensors = weights_from_bytes(blob)
        got = weights_digest(tensors)
        if got != digest:
            raise AlignedMambaError(f"worker {self.worker}: weights version {version} digest {got[:12]} != "
                                    f"{digest[:12]} claimed; refused")
        self.engine.load_weights(tensors)
        self.version, self.digest = version, digest
        return self.info()

    def sample(self, iteration: int, prompts: list[list[int]], max_new_tokens: int, seed: int,
               kill_after_steps: int | None = None) -> SampleBatch:
        """Sample ``prompts`` with ``seed`` under the loaded weights: all at once under the token budget
        (prefill chunked at unaligned points, mixed with other requests' decode)."""
        if self.version is None or self.digest is None:
            raise AlignedMambaError(f"worker {self.worker} (pid {os.getpid()}) has no weights loaded; push them first")
        t0 = time.perf_counter()

        def die(steps: int) -> None:
            if kill_after_steps is not None and steps >= kill_after_steps:
                os.kill(os.getpid(), signal.SIGKILL)  # as an OOM killer would: no cleanup, no reply

        res = self.engine.run(Scenario("rl", prompts, max_new_tokens, budget=self.budget, seed=seed), on_step=die)
        die(1 << 62)  # engines without step callbacks still die before replying
        self.last_rows = res.rows if self.keep_rows else None
        return SampleBatch(iteration, self.worker, self.version, self.digest, self.contract,
                           [list(t) for t in res.tokens], [len(p) for p in prompts],
                           [torch.tensor(lp, dtype=torch.float32) for lp in res.sampled_logprobs],
                           os.getpid(), time.perf_counter() - t0, self.hardware, _child_pids())


@dataclass
class Scores:
    """The trainer's one-pass logprobs for a set of batches, with the weights they were scored under."""

    weights_version: int
    weights_digest: str
    contract: str
    logprobs: dict[int, list[torch.Tensor]]  # worker -> per sequence
    seconds: float
    hardware: str | None = None


class TrainerScorer:
    """The trainer side: scores, steps on the batches the checker accepted, exports versioned weights."""

    def __init__(self, spec: TrainerSpec, reward: Callable[[Sequence[int]], float] = even_token_reward) -> None:
        torch.set_num_threads(spec.threads)
        self.trainer = make_trainer(spec)
        self.contract = Contract.from_dict(spec.contract).fingerprint
        self.hardware = _hardware_key(spec.contract)
        self.reward = reward
        self._export: tuple[int, bytes, str] | None = None
        self._scored: dict[tuple[int, int], list[torch.Tensor]] = {}

    def info(self) -> dict[str, Any]:
        """The trainer's weights version and process."""
        return {"weights_version": self.trainer.version, "pid": os.getpid()}

    def _current(self) -> tuple[int, bytes, str]:
        if self._export is None or self._export[0] != self.trainer.version:
            blob, digest = self.trainer.export_bytes()
            self._export = (self.trainer.version, blob, digest)
        return self._export

    def export(self) -> tuple[dict[str, Any], bytes]:
        """(version/digest/size, safetensors bytes). Call with num_returns=2 so the bytes stay one object."""
        version, blob, digest = self._current()
        return {"weights_version": version, "weights_digest": digest, "bytes": len(blob)}, blob

    def score(self, *batches: SampleBatch) -> Scores:
        """Logprobs of every generated token of every batch, all sequences in one forward pass."""
        t0 = time.perf_counter()
        version, _, digest = self._current()
        seqs = [torch.tensor(s, dtype=torch.int64) for b in batches for s in b.sequences]
        lps = self.trainer.token_logprobs(seqs, [p for b in batches for p in b.prompt_lens])
        out: dict[int, list[torch.Tensor]] = {}
        for b in batches:
            out[b.worker], lps = lps[:len(b.sequences)], lps[len(b.sequences):]
        self._scored = {(b.iteration, b.worker): out[b.worker] for b in batches}
        return Scores(version, digest, self.contract, out, time.perf_counter() - t0, self.hardware)

    def step(self, *batches: SampleBatch) -> dict[str, Any]:
        """REINFORCE on ``batches``: reward per sequence, advantage = reward - batch mean, one update. Rescored after
        it on the same tokens: ``logprob_shift`` (max |after - before|) shows the weights moved the logprobs, and
        ``loss_after`` (the same loss under the new weights) is below ``loss`` when the step descended."""
        t0 = time.perf_counter()
        seqs = [torch.tensor(s, dtype=torch.int64) for b in batches for s in b.sequences]
        pls = [p for b in batches for p in b.prompt_lens]
        rewards = [self.reward(s[p:].tolist()) for s, p in zip(seqs, pls)]
        mean = sum(rewards) / len(rewards)
        before = [lp for b in batches for lp in self._scored.get((b.iteration, b.worker), [])]
        if len(before) != len(seqs):
            before = self.trainer.token_logprobs(seqs, pls)
        advantages = [r - mean for r in rewards]
        stats = self.trainer.step(seqs, pls, advantages)
        after = self.trainer.token_logprobs(seqs, pls)
        shift = max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(after, before))
        loss_after = -sum(a * float(lp.double().sum()) for a, lp in zip(advantages, after)) / stats["tokens"]
        _, _, digest = self._current()
        return {**stats, "reward": mean, "logprob_shift": shift, "loss_after": loss_after, "weights_digest": digest,
                "seconds": time.perf_counter() - t0}


@dataclass
class CheckReport:
    """The checker's verdict on one iteration."""

    iteration: int
    weights_version: int
    tokens: int = 0
    mismatched_tokens: int = 0
    max_abs_logprob_diff: float = 0.0
    kl: float = 0.0
    mean_logprob: float = 0.0
    per_worker: dict[int, dict[str, Any]] = field(default_factory=dict)
    refused: list[dict[str, Any]] = field(default_factory=list)
    first_mismatch: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.mismatched_tokens == 0 and not self.refused


class AlignmentChecker:
    """Verifies every batch against the trainer's scores and keeps the per-iteration metrics."""

    def __init__(self, contract: str, *, allow_cross_hardware: bool = False) -> None:
        self.contract = contract
        self.allow_cross_hardware = allow_cross_hardware
        self.reports: list[CheckReport] = []

    def check(self, iteration: int, scores: Scores, *batches: SampleBatch) -> CheckReport:
        """Refuse batches sampled under weights other than the ones scored; compare every batch token by token
        (a refused one too, so the report says how far off the stale worker was)."""
        rep = CheckReport(iteration, scores.weights_version)
        kl_sum = lp_sum = 0.0
        for b in batches:
            if b.weights_version != scores.weights_version or b.weights_digest != scores.weights_digest:
                rep.refused.append({
                    "iteration": iteration, "worker": b.worker, "expected_version": scores.weights_version,
                    "served_version": b.weights_version, "expected_digest": scores.weights_digest[:12],
                    "served_digest": b.weights_digest[:12],
                    "reason": f"worker {b.worker} served weights version {b.weights_version} "
                              f"({b.weights_digest[:12]}), the trainer is at version {scores.weights_version} "
                              f"({scores.weights_digest[:12]}): batch refused"})
            t_lps = scores.logprobs.get(b.worker)
            if t_lps is None or len(t_lps) != len(b.logprobs):
                raise AlignedMambaError(f"iteration {iteration}: the trainer scored "
                                        f"{0 if t_lps is None else len(t_lps)} sequences of worker {b.worker}, "
                                        f"which sampled {len(b.logprobs)}")
            for i, (t, s) in enumerate(zip(t_lps, b.logprobs)):
                if t.shape != s.shape:
                    raise AlignedMambaError(f"iteration {iteration}, worker {b.worker}, request {i}: sampler "
                                            f"reported {s.numel()} logprobs, the trainer scored {t.numel()}")
            t_all, s_all = torch.cat(t_lps), torch.cat(list(b.logprobs))
            r = verify(t_all, s_all, kind="logprobs", trainer_contract=scores.contract, sampler_contract=b.contract,
                       trainer_hardware=scores.hardware, sampler_hardware=b.hardware,
                       allow_cross_hardware=self.allow_cross_hardware)
            rep.per_worker[b.worker] = {"tokens": r.rows, "mismatched_tokens": r.mismatched_rows,
                                        "hardware": b.hardware, "logprobs_digest": r.sampler_digest,
                                        "max_abs_logprob_diff": r.max_abs_logprob_diff, "kl": r.kl,
                                        "weights_version": b.weights_version, "pid": b.pid,
                                        "child_pids": b.child_pids,
                                        "sample_s": round(b.seconds, 3)}
            rep.tokens += r.rows
            rep.mismatched_tokens += r.mismatched_rows
            rep.max_abs_logprob_diff = max(rep.max_abs_logprob_diff, r.max_abs_logprob_diff)
            kl_sum += r.kl * r.rows
            lp_sum += float(s_all.double().sum())
            if r.first_mismatch is not None and rep.first_mismatch is None:
                rep.first_mismatch = self._locate(iteration, b, t_lps, r.first_mismatch)
        rep.kl = kl_sum / rep.tokens if rep.tokens else 0.0
        rep.mean_logprob = lp_sum / rep.tokens if rep.tokens else 0.0
        self.reports.append(rep)
        return rep

    @staticmethod
    def _locate(iteration: int, b: SampleBatch, t_lps: list[torch.Tensor], row: int) -> dict[str, Any]:
        """Flat token index -> (iteration, worker, request, position in the sequence, token id, both logprobs)."""
        for req, s in enumerate(b.logprobs):
            if row < s.numel():
                return {"iteration": iteration, "worker": b.worker, "request": req,
                        "position": b.prompt_lens[req] + row, "generated_index": row,
                        "token": b.sequences[req][b.prompt_lens[req] + row],
                        "trainer_logprob": float(t_lps[req][row]), "sampler_logprob": float(s[row])}
            row -= s.numel()
        raise AssertionError("mismatch row outside the batch")

    def history(self) -> list[CheckReport]:
        """Every iteration's report, in order."""
        return list(self.reports)


def _child_pids() -> list[int]:
    """This process's live descendants (Linux; [] elsewhere)."""
    from aligned_mamba.processes import descendants

    return sorted(descendants(os.getpid()))


def _hardware_key(contract: dict[str, Any]) -> str:
    """This process's hardware class key for a contract's backend (triton: the GPU, torch: the CPU)."""
    from aligned_mamba.hardware import hardware_class

    return hardware_class("cuda" if contract.get("backend") == "triton" else "cpu").key
