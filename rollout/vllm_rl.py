"""The RL loop's ``vllm`` engine: a rollout worker's sampler on a real in-process vLLM engine.

Registered as ``aligned_mamba.rl_engines: vllm``; ``rollout.actors.build_sampler`` builds it in the
worker actor's process. With the plugin on (``exact_replay`` in the spec, the default) vLLM runs
the model on the core's ``advance``; off, it is stock vLLM (the ``--inject no-replay`` drill).

Each sampled token's logprob is the core's ``log_softmax`` of the raw logits row vLLM sampled it
from (``logprobs_mode="raw_logits"``, full vocabulary), the function the trainer scores with:
vLLM's own logprob of the same row is another rounding. New weights arrive as HF-named tensors
and go through vLLM's ``reload_weights`` (the plugin's model rebuilds its core weights).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from aligned_mamba.contract import Contract
from aligned_mamba.errors import AlignedMambaError
from aligned_mamba.model.config import Mamba2Config
from aligned_mamba.ops.logprobs import log_softmax

from .actors import Sample, SamplerSpec
from .vllm_runner import EngineSpec, Scenario, _engine_env, build_llm, drive


class VLLMSampler:
    """``rollout.actors.Sampler`` on ``vllm.LLM`` (one engine per worker process)."""

    def __init__(self, spec: SamplerSpec) -> None:
        self.spec = spec
        self.config = Mamba2Config.from_hf_dict(spec.config, source="sampler config")
        self.contract = Contract.from_dict(spec.contract)
        self.dtype = getattr(torch, self.contract.model_dtype)
        self._tmp = tempfile.TemporaryDirectory(prefix="aligned_mamba_rl_vllm_")
        path = spec.model
        if path == "tiny" or not os.path.isdir(path):
            # vLLM loads from a directory: write the config with placeholder weights; the worker's
            # first load_weights replaces every tensor before anything is sampled.
            from aligned_mamba.model.checkpoint import make_tiny, save_checkpoint

            if spec.model != "tiny":
                raise AlignedMambaError(f"vllm engine: model {spec.model!r} is not a directory on this node")
            path = os.path.join(self._tmp.name, "tiny")
            config, tensors = make_tiny(0, dtype=self.contract.model_dtype)
            save_checkpoint(path, config, tensors)
        _engine_env()
        os.environ["ALIGNED_MAMBA_EXACT_REPLAY"] = "1" if spec.exact_replay else "0"
        kwargs: dict[str, Any] = {"dtype": self.contract.model_dtype}
        if spec.exact_replay:
            kwargs["additional_config"] = {"aligned_mamba": {"contract": self.contract.to_dict()}}
        torch.set_num_threads(max(1, spec.threads))
        self.llm = build_llm(EngineSpec(model_dir=path, exact_replay=spec.exact_replay, max_model_len=4096,
                                        max_num_batched_tokens=4096, max_num_seqs=64, llm_kwargs=kwargs))
        self.loaded = False

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int, digest: str) -> None:
        """Serve these HF-named tensors (checked against ``digest`` by the worker)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(tensors.items())})
        self.loaded = True

    def sample(self, prompts: list[list[int]], max_new_tokens: int, seed: int,
               on_step: Callable[[int], None] | None = None) -> list[Sample]:
        """All prompts at once under the spec's token budget (chunked prefill mixed with decode).

        The in-process engine samples from this process's torch RNG, seeded here, so the tokens
        depend on (weights, prompts, seed) and not on what the worker sampled before.
        """
        if not self.loaded:
            raise AlignedMambaError("vllm engine: no weights loaded yet")
        torch.manual_seed(seed)
        # no step callback: the worker's fault drill kills the process before the reply instead
        res = drive(self.llm, Scenario("rl", prompts, max_new_tokens, budget=self.spec.max_batch_tokens))
        out = []
        for prompt, tokens, rows in zip(prompts, res.tokens, res.rows):
            p = len(prompt)
            # rows: (position, fp32 copy of the model-dtype logits row) for each sampled token
            logits = torch.stack([row for _, row in rows]).to(self.dtype)
            lp = log_softmax(logits).gather(-1, torch.tensor(tokens[p:]).unsqueeze(-1)).squeeze(-1)
            out.append(Sample(list(tokens), p, lp.tolist()))
        return out


def make_sampler(spec: SamplerSpec) -> VLLMSampler:
    """The ``aligned_mamba.rl_engines`` entry point."""
    return VLLMSampler(spec)


# Worker actors with a vLLM engine: environment set before vLLM is imported in the actor's process.
make_sampler.ray_actor_options = {  # type: ignore[attr-defined]
    "runtime_env": {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                                 "TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}},
}
