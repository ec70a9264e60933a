"""The ``vllm`` engine (``aligned_mamba.integrations.Engine``): a real in-process vLLM engine.

Entry ``vllm`` of ``aligned_mamba.engines`` (``check --engine vllm``, ``rl --engine vllm``): the plugin on
(``exact_replay``) or off (stock vLLM), in a process of its own, as vLLM loads its plugins once per process.
Rows are vLLM's raw logits rows, cast back to the model dtype (vLLM hands out fp32 copies: exact, else
refused); ``sampled_logprobs`` come from a separate pass (same seed, same tokens) with ``logprobs=0`` under
``processed_logprobs``, the number verl reads. New weights go through vLLM's ``reload_weights``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import replace

import torch

from aligned_mamba.contract import Contract
from aligned_mamba.errors import AlignedMambaError
from aligned_mamba.integrations import EngineSpec, Scenario, ScenarioResult

from .vllm_runner import LLMSpec, _engine_env, build_llm, drive


def model_dir(spec: EngineSpec, root: str) -> str:
    """A directory vLLM can load: the checkpoint directory itself, or the embedded default saved under ``root``."""
    if spec.model != "tiny":
        if not os.path.isdir(spec.model):
            raise AlignedMambaError(f"vllm engine: model {spec.model!r} is not a directory on this node")
        return spec.model
    from aligned_mamba.models.mamba2 import make_tiny, save_checkpoint

    path = os.path.join(root, "tiny")
    if not os.path.exists(os.path.join(path, "config.json")):
        config, tensors = make_tiny(0, dtype=spec.dtype or Contract.from_dict(spec.contract).model_dtype)
        save_checkpoint(path, config, tensors)
    return path


class VLLMEngine:
    """One ``vllm.LLM`` in this process, run scenario by scenario."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.contract = Contract.from_dict(spec.contract)
        self.dtype = getattr(torch, self.contract.model_dtype)
        self._tmp = tempfile.TemporaryDirectory(prefix="aligned_mamba_vllm_")
        path = model_dir(spec, self._tmp.name)
        _engine_env()
        os.environ["ALIGNED_MAMBA_EXACT_REPLAY"] = "1" if spec.exact_replay else "0"
        kwargs: dict = {"dtype": self.contract.model_dtype}
        if spec.tp > 1:  # one worker process per rank; the plugin refuses a TP the contract cannot keep
            kwargs.update(tensor_parallel_size=spec.tp, distributed_executor_backend="mp")
        if spec.exact_replay:
            kwargs["additional_config"] = {"aligned_mamba": {"contract": self.contract.to_dict()}}
        self.llm = build_llm(LLMSpec(model_dir=path, exact_replay=spec.exact_replay,
                                     max_model_len=spec.max_model_len, max_num_batched_tokens=spec.max_batch_tokens,
                                     max_num_seqs=spec.max_num_seqs, llm_kwargs=kwargs))

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(tensors.items())})

    def run(self, scenario: Scenario, on_step: Callable[[int], None] | None = None) -> ScenarioResult:
        """The scenario on the engine (no step callback: vLLM steps inside ``drive``): the rows pass
        (unless ``rows="none"``), then the pass whose reported logprobs fill ``sampled_logprobs``."""
        rep = drive(self.llm, replace(scenario, rows="none"), logprobs_mode="processed_logprobs", logprobs=0)
        if scenario.rows == "none":
            res = rep
        else:
            res = drive(self.llm, scenario)
            res.rows = [[(pos, self._model_dtype(res.name, row)) for pos, row in req] for req in res.rows]
            if rep.tokens != res.tokens:
                if self.spec.exact_replay:
                    raise AlignedMambaError(f"{scenario.name}: the logprobs pass sampled other tokens than the rows "
                                            "pass under the same seed")
                res.info["reported_tokens"] = rep.tokens  # the baseline's passes may part ways
        res.sampled_logprobs = rep.info["sampled_values"]
        res.info["logprobs_pass_seconds"] = rep.seconds
        return res

    def _model_dtype(self, name: str, row: torch.Tensor) -> torch.Tensor:
        cast = row.to(self.dtype)
        if self.spec.exact_replay and not torch.equal(cast.to(torch.float32), row):
            raise AlignedMambaError(f"{name}: a logits row is not representable in {self.dtype} (engine output dtype "
                                    "differs from the contract's model dtype)")
        return cast

    def close(self) -> None:
        # the executor's shutdown ends a TP engine's rank processes now, not whenever the collector runs
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        del self.llm
        self._tmp.cleanup()


def make_engine(spec: EngineSpec) -> VLLMEngine:
    """The ``aligned_mamba.engines`` entry point ``vllm``."""
    return VLLMEngine(spec)


make_engine.own_process = True  # type: ignore[attr-defined]  # vLLM loads its plugins once per process
# Ray worker actors with a vLLM engine: environment set before vLLM is imported in the actor's process.
make_engine.ray_actor_options = {  # type: ignore[attr-defined]
    "runtime_env": {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                                 "TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}},
}
