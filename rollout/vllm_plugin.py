"""vLLM general plugin: exact-replay decode for Mamba2 and hybrid (Nemotron-H) models, switched on by
``ALIGNED_MAMBA_EXACT_REPLAY=1``.

vLLM calls ``register()`` in every process it starts (entry point group ``vllm.general_plugins``).
Switched off, it returns at once and vLLM is untouched. Switched on, it

- registers ``rollout.vllm_model:ExactReplayMamba2ForCausalLM`` as ``Mamba2ForCausalLM`` and
  ``rollout.vllm_model:ExactReplayNemotronHForCausalLM`` as ``NemotronHForCausalLM``, so the model's
  forward and logits run on the core's layers: Mamba2 layers with their replay state in vLLM's
  Mamba cache, attention layers with their keys and values in vLLM's paged KV cache;
- puts a config hook in front of every architecture (vLLM's ``MODELS_CONFIG_MAP``), which runs
  while vLLM builds its config, in the process that constructs ``LLM(...)`` / ``vllm serve``: it
  refuses, with one line, every setting under which bits cannot be promised (``check_engine``).

The contract (chunk size, state dtype, backend, model dtype) is derived from the model and the
engine; ``additional_config={"aligned_mamba": {"contract": {...} | "name" | "path.yaml"}}`` (or
``{"chunk_size": N}``) states the trainer's, and any difference is refused at start.
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

from aligned_mamba.contract import MODEL_DTYPES, Contract, normalize_dtype
from aligned_mamba.errors import AlignedMambaError, ContractError

ENV_SWITCH = "ALIGNED_MAMBA_EXACT_REPLAY"
CONFIG_KEY = "aligned_mamba"  # the key in vLLM's additional_config
MODEL_CLASSES = {"Mamba2ForCausalLM": "rollout.vllm_model:ExactReplayMamba2ForCausalLM",
                 "NemotronHForCausalLM": "rollout.vllm_model:ExactReplayNemotronHForCausalLM"}
COVERED_ARCHITECTURES = tuple(MODEL_CLASSES)
MODEL_CLASS = MODEL_CLASSES["Mamba2ForCausalLM"]

_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
_registered = False


class ExactReplayRefused(AlignedMambaError):
    """A vLLM setting under which exact replay cannot promise bits; the message is one line.

    Not a ValueError on purpose: vLLM's pydantic configs would fold a ValueError into a
    multi-line validation report.
    """


def refuse(reason: str) -> NoReturn:
    raise ExactReplayRefused(f"aligned-mamba exact replay refused: {reason}")


def exact_replay_requested(environ: dict[str, str] | None = None) -> bool:
    """Whether ``ALIGNED_MAMBA_EXACT_REPLAY`` switches the plugin on (1/true/yes/on; 0/false/no/off/unset: off)."""
    value = (os.environ if environ is None else environ).get(ENV_SWITCH, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ExactReplayRefused(f"{ENV_SWITCH}={value!r} is neither on (1) nor off (0)")


def register() -> None:
    """vLLM's plugin hook. Off: nothing. On: the model class and the config hook (idempotent)."""
    global _registered
    if not exact_replay_requested() or _registered:
        return
    import vllm.model_executor.models.config as model_configs
    from vllm import ModelRegistry

    for arch, cls in MODEL_CLASSES.items():
        ModelRegistry.register_model(arch, cls)
    if not isinstance(model_configs.MODELS_CONFIG_MAP, _GuardedConfigMap):
        model_configs.MODELS_CONFIG_MAP = _GuardedConfigMap(model_configs.MODELS_CONFIG_MAP, _config_hooks())
    _registered = True


class _GuardedConfigMap(dict):
    """vLLM's per-architecture config hooks, with every lookup answered by the plugin's hooks:
    the covered architectures get the checks (then vLLM's own hook), all others a refusal."""

    def __init__(self, original: dict, hooks: tuple[dict[str, type], type]) -> None:
        super().__init__(original)
        self._covered, self._refused = hooks

    def get(self, key: Any, default: Any = None) -> Any:
        return self._covered.get(key, self._refused)

    def __getitem__(self, key: Any) -> Any:
        return self.get(key)


def _config_hooks() -> tuple[dict[str, type], type]:
    from vllm.model_executor.models.config import (
        MambaModelConfig,
        NemotronHForCausalLMConfig,
        VerifyAndUpdateConfig,
    )

    class ExactReplayMamba2Config(MambaModelConfig):
        @classmethod
        def verify_and_update_config(cls, vllm_config: Any) -> None:
            check_engine(vllm_config, resolved=False)
            super().verify_and_update_config(vllm_config)

    # vLLM runs its hybrid hook (MambaModelConfig's cache settings) itself after this one.
    class ExactReplayNemotronHConfig(NemotronHForCausalLMConfig):
        @classmethod
        def verify_and_update_config(cls, vllm_config: Any) -> None:
            check_engine(vllm_config, resolved=False)
            super().verify_and_update_config(vllm_config)

    class UncoveredArchitecture(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_model_config(model_config: Any) -> None:
            _refuse_architecture(model_config.architecture)

        @staticmethod
        def verify_and_update_config(vllm_config: Any) -> None:
            _refuse_architecture(vllm_config.model_config.architecture)

    return {"Mamba2ForCausalLM": ExactReplayMamba2Config,
            "NemotronHForCausalLM": ExactReplayNemotronHConfig}, UncoveredArchitecture


def _refuse_architecture(arch: str | None) -> NoReturn:
    refuse(f"architecture {arch!r} is not covered (covered: {', '.join(COVERED_ARCHITECTURES)}); "
           f"unset {ENV_SWITCH} to run it on stock vLLM")


def core_config(vllm_config: Any) -> Any:
    """The core family's config of vLLM's HF config (hf_overrides included): ``Mamba2Config`` or
    ``NemotronHConfig``. What the core does not cover (sliding-window attention, multi-token
    prediction, ...) is refused here with the core's one-line reason."""
    from aligned_mamba.models.registry import family_of

    hf = vllm_config.model_config.hf_config
    d = hf.to_dict()
    if not d.get("architectures"):
        d["architectures"] = [vllm_config.model_config.architecture]
    try:
        family = family_of(d, "vLLM hf_config")
        return family.read_config(d, "vLLM hf_config")
    except AlignedMambaError as e:
        refuse(str(e))


def engine_contract(vllm_config: Any) -> Contract:
    """The contract this engine runs under: chunk size from the model config, fp32 state, the
    backend of the device (torch on the CPU, triton on CUDA), the model dtype; checked against
    the one stated in ``additional_config["aligned_mamba"]`` if any."""
    mc = vllm_config.model_config
    dtype = normalize_dtype(mc.dtype)
    if dtype not in MODEL_DTYPES:
        refuse(f"model dtype {dtype!r}: the shared ops cover {' and '.join(MODEL_DTYPES)}")
    from vllm.platforms import current_platform

    backend = "torch" if current_platform.is_cpu() else "triton"
    chunk = core_config(vllm_config).chunk_size
    try:
        contract = Contract(chunk_size=chunk, state_dtype="float32", backend=backend, model_dtype=dtype)
    except ContractError as e:
        refuse(f"the model's config: {e}")
    extra = getattr(vllm_config, "additional_config", None) or {}
    stated = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
    if stated is None:
        return contract
    if not isinstance(stated, dict):
        refuse(f"additional_config[{CONFIG_KEY!r}] must be a dict, got {type(stated).__name__}")
    unknown = sorted(set(stated) - {"contract", "chunk_size"})
    if unknown:
        refuse(f"unknown additional_config[{CONFIG_KEY!r}] key(s) {unknown}; expected 'contract' or 'chunk_size'")
    if "chunk_size" in stated and stated["chunk_size"] != contract.chunk_size:
        refuse(f"chunk size {contract.chunk_size} (model config) differs from the contract's {stated['chunk_size']}; "
               f"the chunk grid must match the trainer's (hf_overrides={{'chunk_size': {stated['chunk_size']}}} "
               "runs the model at the contract's)")
    if "contract" in stated:
        want = stated["contract"]
        try:
            want = Contract.from_dict(want) if isinstance(want, dict) else Contract.from_yaml(str(want))
        except ContractError as e:
            refuse(f"the stated contract: {e}")
        diffs = want.diff(contract)
        if diffs:
            parts = "; ".join(f"{name} contract={a!r} engine={b!r}" for name, a, b in diffs)
            refuse(f"the engine differs from the stated contract: {parts}")
    return contract


def _check_hybrid(vllm_config: Any) -> None:
    """The attention layers' settings: full attention over an unquantised KV cache in the model dtype.
    (MoE layers are stateless core layers, row-invariant by construction; MTP layers in the checkpoint
    are refused by the core's config reader, ``core_config``.)"""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    window = getattr(cc, "sliding_window", None) or mc.get_sliding_window()
    if window is not None:
        refuse(f"sliding-window attention (window {window}): the attention layers read every key 0..t")
    if str(cc.cache_dtype) != "auto":
        refuse(f"kv_cache_dtype={cc.cache_dtype!r}: the attention layers read back the keys and values they "
               "wrote, in the model dtype")
    if getattr(cc, "kv_sharing_fast_prefill", False):
        refuse("kv_sharing_fast_prefill: every layer computes every new token's row")


def check_engine(vllm_config: Any, *, resolved: bool) -> Contract:
    """Refuse (``ExactReplayRefused``, one line) every setting under which bits cannot be promised.

    ``resolved``: False while vLLM is still building its config (CUDA graph mode not chosen yet:
    only an explicit one is seen, and eager mode is required off the CPU); True in the worker,
    where the config is final. Returns the engine's contract.
    """
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    if mc.architecture not in COVERED_ARCHITECTURES:
        _refuse_architecture(mc.architecture)
    ssm = str(cc.mamba_ssm_cache_dtype)
    if ssm not in ("auto", "float32"):
        refuse(f"mamba_ssm_cache_dtype={ssm!r}: the boundary SSM state must stay float32 "
               "(a rounded state changes every token after the next chunk boundary)")
    conv = str(cc.mamba_cache_dtype)
    if conv != "auto" and normalize_dtype(conv) != normalize_dtype(mc.dtype):
        refuse(f"mamba_cache_dtype={conv!r}: the conv window and chunk buffers keep the model dtype's bits")
    if cc.enable_prefix_caching or str(cc.mamba_cache_mode) != "none":
        refuse("prefix caching: the replay state is kept per request, not per cached block "
               "(pass enable_prefix_caching=False)")
    if vllm_config.speculative_config is not None:
        refuse("speculative decoding: draft tokens would advance the replay state past rejected tokens")
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    dcp = getattr(pc, "decode_context_parallel_size", 1) or 1
    if tp > 1 or pp > 1 or dcp > 1:
        refuse(f"tensor/pipeline/context parallel sizes {tp}/{pp}/{dcp}: the shared ops run one whole model "
               "per engine (sharded GEMMs sum in another order)")
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    cg = vllm_config.compilation_config.cudagraph_mode
    if cg is not None and cg != CUDAGraphMode.NONE and (not resolved or not current_platform.is_cpu()):
        refuse(f"CUDA graphs ({cg.name}) over the replay call: its batch shape and host-side indexing change "
               "every step (pass enforce_eager=True)")
    if not resolved and not current_platform.is_cpu() and not mc.enforce_eager:
        refuse("CUDA graphs would capture the replay call: pass enforce_eager=True")
    if mc.architecture == "NemotronHForCausalLM":
        _check_hybrid(vllm_config)
    if vllm_config.lora_config is not None:
        refuse("LoRA adapters are not covered by the shared ops")
    if mc.quantization is not None:
        refuse(f"quantization {mc.quantization!r} is not covered by the shared ops")
    return engine_contract(vllm_config)
