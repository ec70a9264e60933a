"""``aligned-mamba rl``: an RL loop on Ray that proves, iteration after iteration, that every
sampled token's logprob is bit-identical to the trainer's.

Per iteration: the trainer exports its weights (safetensors bytes, versioned, one Ray object for
all workers); every worker loads them when the version changed and samples its prompts; the
trainer scores all sampled sequences in one pass; the checker compares every token's logprob
(``torch.equal`` per token) and refuses batches sampled under other weights; the trainer takes a
REINFORCE step on the accepted batches. A worker that dies mid-iteration is restarted by Ray,
given the current weights again and its requests recomputed.

This module imports neither torch nor Ray at import time: the CLI loads it (entry point
``aligned_mamba.commands``) to build its parser.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from aligned_mamba.errors import EXIT_MISMATCH, EXIT_OK, Terminated

log = logging.getLogger("aligned_mamba")

CONNECT_TIMEOUT_S = 10.0  # a cluster address must answer a TCP connect within this
_INJECT = re.compile(r"^(stale-weights|no-replay):(\d+)$|^kill:(\d+)@(\d+)$")


@dataclass
class RLOptions:
    """Everything one run needs (the CLI's flags)."""

    model: str = "tiny"
    engine: str = "reference"
    trainer: str = "reference"
    trainer_tp: int = 1
    trainer_sp: bool = False
    sampler_tp: int = 1
    row_parallel_slices: int | None = None
    workers: int = 2
    iterations: int = 3
    prompts_per_worker: int = 4
    prompt_len: int = 240
    gen_len: int = 32
    max_batch_tokens: int = 23
    lr: float = 1e-3
    seed: int = 0
    backend: str = "auto"
    address: str = "local"
    fail_fast: bool = False
    allow_cross_hardware: bool = False
    max_restarts: int = 2
    restart_timeout_s: float = 120.0
    inject: list[str] = field(default_factory=list)


@dataclass
class Faults:
    """Parsed ``--inject`` specs."""

    stale: set[int] = field(default_factory=set)
    no_replay: set[int] = field(default_factory=set)
    kill: dict[int, set[int]] = field(default_factory=dict)  # iteration -> workers

    @classmethod
    def parse(cls, specs: list[str], workers: int, iterations: int) -> Faults:
        f = cls()
        for spec in specs:
            m = _INJECT.match(spec)
            if not m:
                raise ValueError(f"--inject {spec!r} refused: expected stale-weights:WORKER, no-replay:WORKER "
                                 "or kill:WORKER@ITERATION")
            w = int(m.group(2) if m.group(2) is not None else m.group(3))
            if not 0 <= w < workers:
                raise ValueError(f"--inject {spec!r}: worker {w} outside 0..{workers - 1}")
            if m.group(1) == "stale-weights":
                f.stale.add(w)
            elif m.group(1) == "no-replay":
                f.no_replay.add(w)
            else:
                it = int(m.group(4))
                if not 0 <= it < iterations:
                    raise ValueError(f"--inject {spec!r}: iteration {it} outside 0..{iterations - 1}")
                f.kill.setdefault(it, set()).add(w)
        return f


def make_prompts(vocab: int, prompt_len: int, count: int, seed: int, iteration: int, worker: int) -> list[list[int]]:
    """Random prompts for one (iteration, worker): lengths prompt_len, -7, -14, ... (shifted by 3 per worker)."""
    from aligned_mamba.check import random_prompts

    return random_prompts(vocab, [prompt_len - 7 * i - 3 * worker for i in range(count)],
                          _seed(seed, iteration, worker))


def _seed(seed: int, iteration: int, worker: int) -> int:
    return (seed * 1_000_003 + iteration * 10_007 + worker) % (1 << 62)


# -- cluster ---------------------------------------------------------------------------------------------------


@dataclass
class _Cluster:
    owned: bool
    temp_dir: str | None
    address: str


def _connect(address: str) -> _Cluster:
    """Use the Ray connection this process already has, start a local cluster ("local"), or join one."""
    import logging

    import ray

    if ray.is_initialized():
        return _Cluster(False, None, "existing connection")
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING, "include_dashboard": False}
    if address == "local":
        # token auth makes a throwaway single-machine cluster slow to start; it only ever talks to itself
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        tmp = tempfile.mkdtemp(prefix="amrl-")  # short: Ray's socket paths live under it
        # address="local": never attach to someone else's `ray start` cluster on this machine by accident
        try:
            ray.init(address="local", num_cpus=os.cpu_count() or 1, object_store_memory=512 << 20, _temp_dir=tmp,
                     **quiet)
        finally:
            _own_sigterm()
        return _Cluster(True, tmp, "local")
    _reachable(address)
    try:
        ray.init(address=address, **quiet)
    except Exception as e:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError or its own types
        from aligned_mamba.errors import RuntimeFailure

        raise RuntimeFailure(f"cannot reach the Ray cluster at {address}: {_first_line(e)}") from None
    finally:
        _own_sigterm()
    return _Cluster(True, None, address)


def _own_sigterm() -> None:
    """ray.init replaces the SIGTERM handler with one that exits 1 ("rows differ"): put the command's
    back (in the main thread of a command; a library caller keeps what it set)."""
    from aligned_mamba import cli

    if cli.commanding:
        cli.install_sigterm(end_now=False)  # Ray's own shutdown ends its processes, in run_rl's finally


def _reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A HOST:PORT (or ray://HOST:PORT) address must resolve and accept a TCP connection within
    ``timeout_s``: ray.init would otherwise retry for minutes. "auto" is left to Ray."""
    import socket

    from aligned_mamba.errors import RuntimeFailure

    hostport = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return
    host = host.strip("[]")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except socket.gaierror as e:
        raise RuntimeFailure(f"cannot reach the Ray cluster at {address}: cannot resolve {host!r} "
                             f"({e.strerror or e})") from None
    except TimeoutError:
        raise RuntimeFailure(f"cannot reach the Ray cluster at {address}: no answer within {timeout_s:.0f}s") from None
    except OSError as e:
        raise RuntimeFailure(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None


def _disconnect(cluster: _Cluster) -> None:
    import ray

    if cluster.owned:
        ray.shutdown()
    if cluster.temp_dir:
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)


# -- the loop --------------------------------------------------------------------------------------------------


def run_rl(opts: RLOptions, progress: Callable[[str], None] = lambda s: None,
           line: Callable[[str], None] = print,
           on_iteration: Callable[[dict[str, Any]], None] = lambda r: None) -> dict[str, Any]:
    """Run the loop; return the JSON-ready result. ``progress`` gets status lines, ``line`` one line per
    iteration, ``on_iteration`` the result so far after each iteration (a report that survives).

    Raises ``AlignedMambaError`` (one line) for refused input or a failed plug-in, ``RuntimeFailure``
    for a worker that could not be brought back, an unreachable cluster or a diverged step.
    """
    from aligned_mamba.errors import AlignedMambaError

    from .actors import check_plugin

    opts = replace(opts, inject=list(opts.inject))  # the run resolves opts.model; leave the caller's as given
    _validate(opts)
    faults = Faults.parse(opts.inject, opts.workers, opts.iterations)
    # before any actor starts: one line, not a dead actor
    from aligned_mamba.cli import require_extra

    require_extra("--engine", opts.engine)
    require_extra("--trainer", opts.trainer)
    actor_options = {"engine": check_plugin("engine", opts.engine), "trainer": check_plugin("trainer", opts.trainer)}
    config, contract = _model(opts)  # a bad checkpoint is refused before Ray starts
    try:
        import ray
    except ImportError as e:
        raise AlignedMambaError(f"aligned-mamba rl needs Ray ({e}): pip install -e '.[ray]'") from None
    cluster = _connect(opts.address)
    loop = _Loop(opts, faults, config, contract, progress, line, actor_options, on_iteration)
    try:
        return loop.run(cluster)
    except ray.exceptions.RayError as e:
        raise _one_line(e) from e
    finally:
        loop.close()
        _disconnect(cluster)


def _model(opts: RLOptions) -> tuple[Any, Any]:
    """The model's config (the whole checkpoint is validated) and the contract both sides run;
    ``opts.model`` becomes an absolute path, as actors may run in other directories."""
    from aligned_mamba.cli import build_contract
    from aligned_mamba.integrations import check_parallel
    from aligned_mamba.models import load_source
    from aligned_mamba.ops.backend import choose_backend

    config = load_source(opts.model)[0]
    if opts.model != "tiny":
        opts.model = str(Path(opts.model).resolve())
    contract = build_contract(config, None, choose_backend(opts.backend), None, None,
                              row_parallel_slices=opts.row_parallel_slices)
    check_parallel(config, trainer=opts.trainer, trainer_tp=opts.trainer_tp, trainer_sp=opts.trainer_sp,
                   trainer_contract=contract, engine=opts.engine, sampler_tp=opts.sampler_tp, sampler_contract=contract)
    return config, contract


def _validate(opts: RLOptions) -> None:
    for name in ("workers", "iterations", "prompts_per_worker", "prompt_len", "gen_len", "max_batch_tokens"):
        if getattr(opts, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(opts, name)}")
    if opts.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {opts.max_restarts}")
    if not math.isfinite(opts.lr) or opts.lr <= 0:
        raise ValueError(f"--lr must be a finite number > 0, got {opts.lr}")


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _first_line(e: BaseException) -> str:
    lines = _ANSI.sub("", str(e)).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _one_line(e: BaseException) -> Exception:
    """Ray wraps an actor's exception in a traceback-laden one; keep the cause's first line, and
    its meaning: refused input stays refused (exit 2), anything else failed the run (exit 3)."""
    from aligned_mamba.errors import AlignedMambaError, RuntimeFailure

    cause = getattr(e, "cause", None) or e
    if getattr(e, "actor_init_failed", False) and cause is e:
        # Ray keeps only the text of an exception raised in an actor's __init__: its traceback's last entry
        return RuntimeFailure(f"an actor failed to start: {_creation_error(str(e))}")
    msg = _first_line(cause)
    if isinstance(cause, RuntimeFailure):
        return type(cause)(msg)
    if isinstance(cause, AlignedMambaError | ValueError):
        return AlignedMambaError(msg)
    return RuntimeFailure(f"{type(cause).__name__}: {msg}")


def _creation_error(text: str) -> str:
    """The exception line at the end of a formatted traceback (``Type: message``), first line only."""
    lines = [ln for ln in _ANSI.sub("", text).splitlines() if ln.strip()]
    last_frame = max((i for i, ln in enumerate(lines) if ln.lstrip().startswith('File "')), default=None)
    if last_frame is None:
        return lines[0] if lines else "unknown error"
    rest = [ln for ln in lines[last_frame + 1:] if not ln.startswith("    ") and not set(ln.strip()) <= set("^~")]
    line = rest[0].strip() if rest else lines[-1].strip()
    return re.sub(r"^(?:\w+\.)+(?=\w+(?::|$))", "", line)  # aligned_mamba.errors.ContractError -> ContractError


class _Loop:
    """One run: the actors, the weights pushed to each worker, the results."""

    def __init__(self, opts: RLOptions, faults: Faults, config: Any, contract: Any, progress: Callable[[str], None],
                 line: Callable[[str], None], actor_options: dict[str, dict[str, Any]],
                 on_iteration: Callable[[dict[str, Any]], None] = lambda r: None) -> None:
        self.opts, self.faults, self.progress, self.line = opts, faults, progress, line
        self.on_iteration = on_iteration
        self.actor_options = actor_options
        self.config, self.contract = config, contract
        self.actors: list[Any] = []
        self.restart_events: list[dict[str, Any]] = []

    def close(self) -> None:
        """Kill this run's actors (a shared cluster outlives the run)."""
        import ray

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone is fine
                pass
        self.actors = []

    def _start(self) -> None:
        import ray

        from aligned_mamba.integrations import EngineSpec

        from .actors import AlignmentChecker, RolloutWorker, TrainerScorer, TrainerSpec, deferring_init

        # an __init__ error is raised by the actor's first method: the user sees it by cause
        RolloutWorker, TrainerScorer, AlignmentChecker = (deferring_init(c) for c in (RolloutWorker, TrainerScorer,
                                                                                        AlignmentChecker))

        o = self.opts
        contract = self.contract
        cdict = contract.to_dict()
        # num_cpus=0 unless the plug-in's ray_actor_options say otherwise: actors schedule whatever the CPU count
        # (a worker's --sampler-tp rank processes, outside Ray's accounting, inherit the OMP_NUM_THREADS=1 that
        # Ray gives an actor without CPUs).
        # max_task_retries=0: the driver re-runs an interrupted sample after pushing the weights again (a
        # restarted actor comes back with its original, empty, state).
        worker_cls = ray.remote(RolloutWorker).options(**{"num_cpus": 0, **self.actor_options["engine"],
                                                          "max_restarts": o.max_restarts, "max_task_retries": 0})
        self.workers = [
            worker_cls.remote(w, o.engine, EngineSpec(o.model, cdict, exact_replay=w not in self.faults.no_replay,
                                                    tp=o.sampler_tp),
                              o.max_batch_tokens, stale=w in self.faults.stale)
            for w in range(o.workers)]
        self.scorer = ray.remote(TrainerScorer).options(**{"num_cpus": 0, **self.actor_options["trainer"],
                                                           "max_restarts": 0}).remote(
            TrainerSpec(o.trainer, o.model, cdict, lr=o.lr, tp=o.trainer_tp, sequence_parallel=o.trainer_sp))
        self.checker = ray.remote(AlignmentChecker).options(num_cpus=0, max_restarts=0).remote(
            contract.fingerprint, allow_cross_hardware=o.allow_cross_hardware)
        self.actors = [*self.workers, self.scorer, self.checker]
        infos = ray.get([w.info.remote() for w in self.workers] + [self.scorer.info.remote(),
                                                                   self.checker.history.remote()])
        self.pids = {i["worker"]: i["pid"] for i in infos[:o.workers]}
        self.served: dict[int, int | None] = dict.fromkeys(range(o.workers))
        self.deaths = dict.fromkeys(range(o.workers), 0)
        self.iter_restarts = dict.fromkeys(range(o.workers), 0)

    def _summary(self) -> dict[str, Any]:
        """The model's line of the report, from its config."""
        from aligned_mamba.models import describe

        return describe(self.config)

    def _push(self, k: int, workers: list[int], meta: dict[str, Any], blob_ref: Any) -> None:
        """The same bytes (one object) to each worker that does not serve this version yet; a worker
        that dies meanwhile is waited for and pushed to again."""
        import ray
        from ray.exceptions import RayActorError

        def load(w: int) -> Any:
            return self.workers[w].load_weights.remote(blob_ref, meta["weights_version"], meta["weights_digest"])

        todo = [w for w in workers if self.served[w] != meta["weights_version"]]
        refs = {w: load(w) for w in todo}
        for w in todo:
            while True:
                try:
                    info = ray.get(refs[w])
                    break
                except RayActorError as e:
                    self._recover(k, w, e, "load_weights")
                    refs[w] = load(w)
            self.served[w] = meta["weights_version"]  # what was pushed; the checker judges what is served
            self.pids[w] = info["pid"]

    def _recover(self, k: int, w: int, e: Exception, phase: str) -> dict[str, Any]:
        """Worker ``w`` died: count it, wait for Ray to restart it (it comes back with no weights)."""
        from aligned_mamba.errors import AlignedMambaError

        self.deaths[w] += 1
        self.iter_restarts[w] += 1
        if self.deaths[w] > self.opts.max_restarts:
            raise AlignedMambaError(f"worker {w} died {self.deaths[w]} times (iteration {k}, during {phase}); "
                                    f"max_restarts={self.opts.max_restarts} exhausted")
        t0 = time.perf_counter()
        old_pid = self.pids[w]
        self.progress(f"iteration {k}: worker {w} (pid {old_pid}) died during {phase} ({type(e).__name__}); "
                      "waiting for Ray to restart it")
        info = self._wait_alive(w)
        self.served[w] = info["weights_version"]  # None: a restarted actor has its original state
        self.pids[w] = info["pid"]
        event = {"iteration": k, "worker": w, "phase": phase, "old_pid": old_pid, "new_pid": info["pid"],
                 "restart_s": round(time.perf_counter() - t0, 3)}
        self.restart_events.append(event)
        return event

    def _wait_alive(self, w: int) -> dict[str, Any]:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        from aligned_mamba.errors import AlignedMambaError

        deadline = time.monotonic() + self.opts.restart_timeout_s
        while True:
            try:
                return ray.get(self.workers[w].info.remote(), timeout=10)
            except (RayActorError, GetTimeoutError) as e:
                if time.monotonic() > deadline:
                    raise AlignedMambaError(f"worker {w} did not come back within {self.opts.restart_timeout_s:.0f}s "
                                            f"after dying (max_restarts={self.opts.max_restarts}): "
                                            f"{type(e).__name__}") from None
                time.sleep(0.5)

    def _sample(self, k: int, prompts: dict[int, list[list[int]]], meta: dict[str, Any], blob_ref: Any) -> list[Any]:
        """Every worker's SampleBatch (as object refs, in worker order). A worker killed meanwhile is waited
        for (Ray restarts it), given the current weights again, and its requests recomputed from scratch."""
        import ray
        from ray.exceptions import RayActorError

        o = self.opts
        kill = self.faults.kill.get(k, set())

        def submit(w: int, first: bool) -> Any:
            return self.workers[w].sample.remote(k, prompts[w], o.gen_len, _seed(o.seed, k, w),
                                                 kill_after_steps=3 if first and w in kill else None)

        refs = {w: submit(w, True) for w in range(o.workers)}
        for w in range(o.workers):
            while True:
                try:
                    ray.get(refs[w])
                    break
                except RayActorError as e:
                    event = self._recover(k, w, e, "sample")
                    self._push(k, [w], meta, blob_ref)
                    refs[w] = submit(w, False)
                    event.update(weights_version_pushed=meta["weights_version"],
                                 recomputed_requests=len(prompts[w]))
                    self.progress(f"iteration {k}: worker {w} restarted (pid {event['old_pid']} -> "
                                  f"{event['new_pid']}) in {event['restart_s']:.1f}s; weights "
                                  f"v{meta['weights_version']} pushed again; {len(prompts[w])} requests recomputed")
        return [refs[w] for w in range(o.workers)]

    def run(self, cluster: _Cluster) -> dict[str, Any]:
        import ray

        o = self.opts
        t_start = time.perf_counter()
        self.progress(f"starting {o.workers} rollout workers ({o.engine}{_at_tp(o.sampler_tp)}), the trainer "
                      f"({o.trainer}{_at_tp(o.trainer_tp)}) and the checker on Ray ({cluster.address})")
        self._start()
        startup_s = time.perf_counter() - t_start
        summary = self._summary()
        vocab = summary["vocab"]
        self.progress(f"model {o.model}: {summary['layers']} layers, vocab {vocab}; contract "
                      f"{self.contract.fingerprint} (chunk {self.contract.chunk_size}, {self.contract.backend}, "
                      f"{self.contract.model_dtype}); actors ready in {startup_s:.1f}s")
        rows: list[dict[str, Any]] = []
        stopped_early = False
        for k in range(o.iterations):
            t0 = time.perf_counter()
            meta_ref, blob_ref = self.scorer.export.options(num_returns=2).remote()
            meta = ray.get(meta_ref)
            self.iter_restarts = dict.fromkeys(range(o.workers), 0)
            self._push(k, list(range(o.workers)), meta, blob_ref)
            t1 = time.perf_counter()
            prompts = {w: make_prompts(vocab, o.prompt_len, o.prompts_per_worker, o.seed, k, w)
                       for w in range(o.workers)}
            batch_refs = self._sample(k, prompts, meta, blob_ref)
            t2 = time.perf_counter()
            scores_ref = self.scorer.score.remote(*batch_refs)
            rep = ray.get(self.checker.check.remote(k, scores_ref, *batch_refs))
            t3 = time.perf_counter()
            row = {"iteration": k, "weights_version": rep.weights_version,
                   "weights_digest": meta["weights_digest"][:12], "tokens": rep.tokens,
                   "mismatched_tokens": rep.mismatched_tokens, "max_abs_logprob_diff": rep.max_abs_logprob_diff,
                   "mean_logprob": rep.mean_logprob, "kl": rep.kl, "refused": rep.refused,
                   "first_mismatch": rep.first_mismatch, "restarts": {str(w): n for w, n in self.iter_restarts.items()},
                   "per_worker": {str(w): v for w, v in rep.per_worker.items()}}
            stop = o.fail_fast and not rep.ok
            refused = {r["worker"] for r in rep.refused}
            accepted = [ref for w, ref in enumerate(batch_refs) if w not in refused]
            if not stop and accepted:
                st = ray.get(self.scorer.step.remote(*accepted))
                row.update(reward=st["reward"], loss=st["loss"], loss_after=st["loss_after"], grad_norm=st["grad_norm"],
                           logprob_shift=st["logprob_shift"], next_weights_version=st["weights_version"],
                           next_weights_digest=st["weights_digest"][:12])
            t4 = time.perf_counter()
            row["seconds"] = round(t4 - t0, 3)
            row["timing"] = {"push_s": round(t1 - t0, 3), "sample_s": round(t2 - t1, 3),
                             "score_check_s": round(t3 - t2, 3), "step_s": round(t4 - t3, 3)}
            rows.append(row)
            self.line(_iteration_line(row))
            for r in rep.refused:
                self.line(f"  REFUSED iteration {k}: {r['reason']}")
            if rep.first_mismatch is not None:
                self.line("  MISMATCH " + describe_mismatch(rep.first_mismatch))
            if stop:
                stopped_early = True
                self.line(f"  --fail-fast: stopping after iteration {k}")
            self.on_iteration(self._result(rows, cluster, summary, startup_s, t_start, stopped_early))
            if stop:
                break
        self._release()
        return self._result(rows, cluster, summary, startup_s, t_start, stopped_early)

    def _release(self, timeout_s: float = 60.0) -> None:
        """Close every worker's engine before ``close`` kills the actors, so a TP engine ends its rank processes
        (a worker killed outright or late leaves its ranks to stop on their own: vLLM's workers watch a pipe
        from their parent, ``parallel.Ranks`` its parent's pid)."""
        import ray

        try:
            ray.get([w.close.remote() for w in self.workers], timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - the run's result stands; the kill that follows ends the worker
            log.warning("a rollout worker did not close its engine (%s); killing it", _first_line(e))

    def _result(self, rows: list[dict[str, Any]], cluster: _Cluster, summary: dict[str, Any], startup_s: float,
                t_start: float, stopped_early: bool) -> dict[str, Any]:
        """The JSON-ready result of the iterations in ``rows`` (all of them, or those finished so far)."""
        o = self.opts
        total_restarts = {str(w): sum(int(r["restarts"][str(w)]) for r in rows) for w in range(o.workers)}
        first = next((r["first_mismatch"] for r in rows if r["first_mismatch"] is not None), None)
        ok = all(r["mismatched_tokens"] == 0 and not r["refused"] for r in rows) and len(rows) == o.iterations
        return {
            "iterations": rows,
            "ok": ok,
            "first_mismatch": first,
            "refused": [x for r in rows for x in r["refused"]],
            "restarts": total_restarts,
            "restart_events": self.restart_events,
            "stopped_early": stopped_early,
            "engine": o.engine,
            "trainer": o.trainer,
            "trainer_tp": o.trainer_tp,
            "trainer_sp": o.trainer_sp,
            "sampler_tp": o.sampler_tp,
            "contract": self.contract.to_dict(),
            "model": {"source": o.model, **summary, "chunk_size": self.contract.chunk_size,
                      "dtype": self.contract.model_dtype},
            "params": {k: v for k, v in asdict(o).items() if k not in ("model",)},
            "cluster": {"address": cluster.address, "started_here": cluster.temp_dir is not None},
            "timing": {"startup_s": round(startup_s, 3), "total_s": round(time.perf_counter() - t_start, 3)},
        }


def _at_tp(size: int) -> str:
    return f" at TP {size}" if size != 1 else ""


def describe_mismatch(m: dict[str, Any]) -> str:
    """The first differing token, in one line."""
    return (f"iteration {m['iteration']}, worker {m['worker']}, request {m['request']}, position {m['position']} "
            f"(generated token {m['generated_index']}, id {m['token']}): trainer logprob {m['trainer_logprob']!r} "
            f"!= sampler {m['sampler_logprob']!r}")


def _iteration_line(r: dict[str, Any]) -> str:
    restarts = sum(r["restarts"].values())
    shift = f"{r['logprob_shift']:.3g}" if "logprob_shift" in r else "-"
    reward = f"{r['reward']:.3f}" if "reward" in r else "-"
    return (f"iteration {r['iteration']}: weights v{r['weights_version']} {r['weights_digest']}  "
            f"tokens {r['tokens']}  mismatched {r['mismatched_tokens']}  max|d logprob| "
            f"{r['max_abs_logprob_diff']:.3g}  kl {r['kl']:.3g}  mean logprob {r['mean_logprob']:.5f}  "
            f"reward {reward}  step moved logprobs by {shift}  restarts {restarts}  {r['seconds']:.1f}s")


# -- the subcommand ----------------------------------------------------------------------------------------------

HELP = "RL loop on Ray: every sampled token's logprob must equal the trainer's, across updates and restarts"
DESCRIPTION = """Run K iterations of sample (all workers) -> score -> verify -> update -> sync weights on a Ray
cluster (a local one by default). Exit status: 0 iff every iteration has zero mismatched tokens and no
refused batch; 1 otherwise; 2 for refused input; 3 the run failed (an actor that failed or did not come
back, an unreachable --address, within 10 s); 130 interrupted; 143 terminated (SIGTERM: the report is
closed, the actors and the local cluster are shut down). One line on stderr for 2 and 3."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``rl`` subcommand's flags."""
    from aligned_mamba.cli import seed_type

    d = RLOptions()
    p.add_argument("--model", default=d.model, help="'tiny' (the embedded default) or a checkpoint directory")
    p.add_argument("--engine", default=d.engine, choices=["reference", "vllm"],
                   help="rollout engine (vllm: registered under aligned_mamba.engines)")
    p.add_argument("--trainer", default=d.trainer, choices=["reference", "megatron"],
                   help="trainer (megatron: registered under aligned_mamba.trainers)")
    p.add_argument("--trainer-tp", type=int, default=d.trainer_tp, metavar="K",
                   help="the trainer's tensor-parallel degree (megatron: K rank processes over gloo; a power of two "
                        "dividing --row-parallel-slices)")
    p.add_argument("--trainer-sp", action="store_true",
                   help="the megatron trainer with Megatron's sequence parallelism over its --trainer-tp ranks")
    p.add_argument("--sampler-tp", type=int, default=d.sampler_tp, metavar="M",
                   help="each rollout worker's engine at tensor-parallel degree M (reference or vllm: M rank "
                        "processes inside the worker; as --trainer-tp)")
    p.add_argument("--row-parallel-slices", type=int, default=d.row_parallel_slices, metavar="S",
                   help="the contract's row_parallel_slices (default 1, the plain linear layer): every TP degree "
                        "dividing S gives the same bits")
    p.add_argument("--workers", type=int, default=d.workers, help="rollout worker actors")
    p.add_argument("--iterations", type=int, default=d.iterations,
                   help="iterations of sample -> score -> verify -> update -> sync")
    p.add_argument("--prompts-per-worker", type=int, default=d.prompts_per_worker,
                   help="prompts each worker samples per iteration")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len,
                   help="longest prompt; the others are 7 tokens shorter each (3 per worker index)")
    p.add_argument("--gen-len", type=int, default=d.gen_len, help="tokens sampled per prompt")
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                   help="token budget per engine step (prefill chunked at unaligned points, batches mix)")
    p.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate of the REINFORCE step")
    p.add_argument("--seed", type=seed_type, default=d.seed, help="seed of the prompts and of sampling (0..2**63-1)")
    p.add_argument("--backend", default=d.backend, choices=["auto", "torch", "triton"],
                   help="kernels: triton on a GPU, torch on the CPU; auto picks triton where CUDA is available")
    p.add_argument("--address", default=d.address,
                   help="'local' starts a private Ray cluster (default); 'auto' or HOST:PORT joins one (the package "
                        "must be installed on its nodes)")
    p.add_argument("--max-restarts", type=int, default=d.max_restarts, help="Ray restarts per rollout worker")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first iteration with a mismatch or refusal")
    p.add_argument("--allow-cross-hardware", action="store_true",
                   help="compare workers and a trainer on different hardware classes (bits are not promised)")
    p.add_argument("--inject", action="append", default=[], metavar="FAULT",
                   help="for tests, repeatable: 'stale-weights:W' (worker W ignores weight updates), 'no-replay:W' "
                        "(worker W samples with exact replay off), 'kill:W@K' (worker W is SIGKILLed mid-sampling "
                        "in iteration K)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the results as JSON to a regular file or a new path (checked first, rewritten "
                        "atomically after each iteration, closed with a status)")


def cmd_rl(args: argparse.Namespace) -> int:
    """Handler of ``aligned-mamba rl``: run, print, write JSON; the exit status."""
    start = time.perf_counter()

    def show(msg: str) -> None:
        log.info("[%6.1fs] %s", time.perf_counter() - start, msg)

    def line(msg: str) -> None:
        print(msg, flush=True)

    from aligned_mamba.cli import status_of, terminating
    from aligned_mamba.report import JsonReport

    report = JsonReport(args.json)  # refused before Ray starts if it cannot be written
    d = RLOptions()
    opts = RLOptions(**{k: getattr(args, k, getattr(d, k)) for k in RLOptions.__dataclass_fields__})
    try:
        result = run_rl(opts, show, line, on_iteration=report.update)
    except KeyboardInterrupt:
        report.close("interrupted", strict=False)  # the iterations that finished are in it
        raise
    except Terminated:
        report.close("terminated", strict=False)
        raise
    except BaseException as e:
        if terminating():  # SIGTERM's exception, wrapped by the C code it interrupted
            report.close("terminated", strict=False)
            raise Terminated("SIGTERM") from e
        report.close(*status_of(e), strict=False)
        raise
    n = len(result["iterations"])
    tokens = sum(r["tokens"] for r in result["iterations"])
    versions = [r["weights_version"] for r in result["iterations"]]
    restarts = sum(int(v) for v in result["restarts"].values())
    extra = f"; {restarts} worker restart(s), requests recomputed" if restarts else ""
    if result["ok"]:
        print(f"OK: {n} iterations, {tokens} tokens, every sampled logprob bit-identical to the trainer's "
              f"(weights v{versions[0]}..v{versions[-1]}{extra}) ({result['timing']['total_s']:.1f}s)")
    else:
        bad = sum(r["mismatched_tokens"] for r in result["iterations"])
        print(f"FAIL: {bad}/{tokens} tokens differ, {len(result['refused'])} batch(es) refused"
              f"{'; first: ' + describe_mismatch(result['first_mismatch']) if result['first_mismatch'] else ''}")
    report.update(result)
    report.close("ok" if result["ok"] else "mismatch")
    if args.json:
        show(f"wrote {args.json}")
    return EXIT_OK if result["ok"] else EXIT_MISMATCH


class _Command:
    """What ``aligned_mamba.cli`` expects of an ``aligned_mamba.commands`` entry point."""

    help = HELP
    description = DESCRIPTION

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        add_arguments(p)

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        return cmd_rl(args)


command = _Command()
