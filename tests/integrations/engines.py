"""vLLM engines kept in their own processes between calls, and the ones several test modules share.

An engine start costs about 30 s of CPU (three processes at TP 2), more than most of the runs a
test asks of it. ``EngineProcess`` starts one engine in a spawned process (vLLM loads its plugins
once per process, so plugin-on and stock engines never share one) and keeps it: each ``call``
runs a function on that engine in its process, so one engine serves every run asked of it, in
order, whichever module asks. ``Engines`` (the session fixture ``engines``, tests/integrations/
conftest.py) holds the engines that more than one module uses, on checkpoints written once per
session, and closes each when the last collected module that names it in ``USERS`` is done. All
of these tests are in the ``engines`` xdist group, so they run on one worker, in one session.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from aligned_mamba.contract import Contract
from aligned_mamba.integrations import EngineSpec, Scenario, ScenarioResult
from aligned_mamba.models.mamba2 import make_tiny
from aligned_mamba.models.mamba2 import save_checkpoint as save_mamba2
from aligned_mamba.models.nemotron_h import make_tiny_hybrid
from aligned_mamba.models.nemotron_h import save_checkpoint as save_hybrid
from rollout.vllm_runner import LLMSpec, LogprobJob, Run, drive, report_logprobs, start_llm, try_start

# In the engine's process: its ``vllm.LLM`` ("llm"), and the ``VLLMEngine`` around it where the
# process was started from an ``EngineSpec`` ("engine").
_STATE: dict[str, Any] = {}


def _start(spec: LLMSpec | EngineSpec | None, capture: str | None) -> dict[str, Any] | str:
    """(In the engine's process.) Start the engine: {"pid"}, or its one-line start failure. ``spec``
    None: no engine (a process for ``try_start``). ``capture``: a file that takes this process's
    stdout and stderr from here on."""
    if capture:
        fd = os.open(capture, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    if isinstance(spec, EngineSpec):
        from rollout.vllm_engine import VLLMEngine

        try:
            _STATE["engine"] = VLLMEngine(spec)
        except Exception as e:
            return f"{type(e).__name__}: {' '.join(str(e).split())}"
        _STATE["llm"] = _STATE["engine"].llm
    elif spec is not None:
        llm = start_llm(spec)
        if isinstance(llm, str):
            return llm
        _STATE["llm"] = llm
    return {"pid": os.getpid()}


def _call(fn: Any, args: tuple) -> Any:
    """(In the engine's process.) ``fn(llm, *args)``."""
    return fn(_STATE["llm"], *args)


def _runs(llm: Any, runs: Sequence[Run]) -> dict[str, ScenarioResult]:
    return {r.scenario.name: drive(llm, r.scenario, logprobs_mode=r.logprobs_mode, reprefill=r.reprefill,
                                   logprobs=r.logprobs) for r in runs}


def _logprobs(llm: Any, jobs: Sequence[LogprobJob]) -> dict[str, Any]:
    # the jobs sample from the process's torch generator: seeded, their tokens do not depend on
    # what the engine ran before (an in-process engine: the worker is this process)
    torch.manual_seed(0)
    return report_logprobs(llm, jobs)


def _push(llm: Any, scenario: Scenario, tensors: dict[str, torch.Tensor], restore: dict[str, torch.Tensor]
          ) -> tuple[ScenarioResult, ScenarioResult]:
    """``VLLMEngine.run`` before and after ``VLLMEngine.load_weights(tensors)``; ``restore`` (the
    checkpoint's weights) is loaded afterwards, for whatever the engine runs next."""
    engine = _STATE["engine"]
    before = engine.run(scenario)
    engine.load_weights(tensors)
    after = engine.run(scenario)
    engine.load_weights(restore)
    return before, after


class EngineProcess:
    """One engine in a spawned process of its own, started at once; ``call`` runs on it."""

    def __init__(self, name: str, spec: LLMSpec | EngineSpec | None, capture: str | None = None) -> None:
        self.name = name
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        self._started = self._pool.submit(_start, spec, capture)

    def started(self, timeout: float = 900) -> dict[str, Any]:
        """{"pid"} once the engine runs; fails the test with the start failure otherwise."""
        out = self._started.result(timeout=timeout)
        if isinstance(out, str):
            pytest.fail(f"engine {self.name!r} did not start: {out}")
        return out

    def call(self, fn: Any, *args: Any, timeout: float = 1500) -> Any:
        """``fn(llm, *args)`` in the engine's process (``fn`` importable by name there)."""
        self.started()
        return self._pool.submit(_call, fn, args).result(timeout=timeout)

    def runs(self, runs: Sequence[Run]) -> dict[str, ScenarioResult]:
        """Each run driven on the engine (``vllm_runner.drive``), by scenario name."""
        return self.call(_runs, list(runs))

    def logprobs(self, jobs: Sequence[LogprobJob]) -> dict[str, Any]:
        """``vllm_runner.report_logprobs`` of ``jobs`` (seeded) on the engine."""
        return self.call(_logprobs, list(jobs))

    def push(self, scenario: Scenario, tensors: dict[str, torch.Tensor], restore: dict[str, torch.Tensor]
             ) -> tuple[ScenarioResult, ScenarioResult]:
        """A weight push on an engine started from an ``EngineSpec``: (before, after), see ``_push``."""
        return self.call(_push, scenario, tensors, restore)

    def try_start(self, specs: Sequence[LLMSpec]) -> list[str | None]:
        """``vllm_runner.try_start`` in a process started without an engine (``spec`` None)."""
        self.started()
        return self._pool.submit(try_start, list(specs)).result(timeout=1500)

    def close(self) -> None:
        """Stop the process (and its engine). Results already read stay valid."""
        self._pool.shutdown(wait=True, cancel_futures=True)


# The shared checkpoints: the embedded default Mamba2, and a bf16 hybrid with attention in the
# middle (GQA 4; its pages and prompts: tests/integrations/test_vllm_hybrid.py).
def mamba2_checkpoint() -> tuple[Any, dict[str, torch.Tensor]]:
    return make_tiny(0)


def hybrid_checkpoint() -> tuple[Any, dict[str, torch.Tensor]]:
    return make_tiny_hybrid(3, dtype="bfloat16", pattern="M*-M", num_attention_heads=8, num_key_value_heads=2,
                            head_dim=32)


def stated(contract: Contract) -> dict[str, Any]:
    """The LLM keyword that states ``contract`` to the plugin."""
    return {"additional_config": {"aligned_mamba": {"contract": contract.to_dict()}}}


HYBRID_PAGES = {"kv_cache_memory_bytes": 128 << 20, "block_size": 32}
SIZES = dict(max_model_len=512, max_num_batched_tokens=1024, max_num_seqs=8)
# engine -> the modules that use it (closed once the last one that was collected is done)
USERS = {
    "mamba2/exact": ("test_vllm_logprobs", "test_vllm_plugin"),
    "mamba2/stock": ("test_vllm_plugin", "test_vllm_tensor_parallel"),
    "hybrid/exact": ("test_vllm_hybrid", "test_vllm_logprobs"),
    "refusals": ("test_vllm_hybrid", "test_vllm_plugin", "test_vllm_tensor_parallel"),
}


class Engines:
    """The shared engines of one session, started when first asked for:

    - ``mamba2/exact``: the default Mamba2, switched on by ``additional_config`` alone (the variable
      unset) with its contract stated; stdout and stderr in ``log("mamba2/exact")``.

    The plugin-on engines start under ``logprobs_mode="processed_logprobs"``: the plugin checks each
    request against the mode the engine started with (a run may switch the mode it reports in).
    - ``mamba2/stock``: the same checkpoint on stock vLLM (the baseline).
    - ``hybrid/exact``: the hybrid, plugin on, its contract stated (the one the engine derives).
    - ``refusals``: no engine; ``try_start`` of plugin-on specs that must be refused.
    """

    def __init__(self, root: Path, modules: set[str]) -> None:
        self.root = root
        self.pending = {m for users in USERS.values() for m in users if m in modules}
        self.open: dict[str, EngineProcess] = {}
        config, tensors = mamba2_checkpoint()
        save_mamba2(root / "mamba2", config, tensors)
        self.mamba2_contract = Contract.from_hf_config(config.to_hf_dict(), backend="torch", model_dtype="bfloat16")
        hconfig, htensors = hybrid_checkpoint()
        save_hybrid(root / "hybrid", hconfig, htensors)
        self.hybrid_contract = Contract(chunk_size=hconfig.chunk_size, backend="torch", model_dtype="bfloat16")

    def checkpoint(self, name: str) -> Path:
        """The directory of the shared checkpoint ``mamba2`` or ``hybrid``."""
        return self.root / name

    def log(self, name: str) -> Path:
        return self.root / f"{name.replace('/', '_')}.log"

    def spec(self, name: str) -> LLMSpec | None:
        mamba2 = str(self.checkpoint("mamba2"))
        return {
            "mamba2/exact": LLMSpec(model_dir=mamba2, exact_replay=None, **SIZES, logprobs_mode="processed_logprobs",
                                    llm_kwargs=stated(self.mamba2_contract)),
            "mamba2/stock": LLMSpec(model_dir=mamba2, exact_replay=False, **SIZES),
            "hybrid/exact": LLMSpec(model_dir=str(self.checkpoint("hybrid")), exact_replay=True, **SIZES,
                                    logprobs_mode="processed_logprobs",
                                    llm_kwargs={"dtype": "bfloat16", **HYBRID_PAGES, **stated(self.hybrid_contract)}),
            "refusals": None,
        }[name]

    def get(self, name: str) -> EngineProcess:
        """The engine ``name`` (see the class), started on first use."""
        if name not in USERS:
            raise KeyError(f"no shared engine {name!r}; expected one of {sorted(USERS)}")
        if name not in self.open:
            capture = str(self.log(name)) if name == "mamba2/exact" else None
            self.open[name] = EngineProcess(name, self.spec(name), capture)
        return self.open[name]

    def done(self, module: str) -> None:
        """``module`` finished: close the engines no module still to run uses."""
        self.pending.discard(module)
        for name in [n for n in self.open if not self.pending & set(USERS[n])]:
            self.open.pop(name).close()

    def close(self) -> None:
        for proc in self.open.values():
            proc.close()
        self.open.clear()
