"""vLLM general plugin: exact-replay decode for Mamba2 and hybrid (Nemotron-H) models.

Switched on by ``ALIGNED_MAMBA_EXACT_REPLAY=1`` or by ``additional_config={"aligned_mamba": {...}}``
(``{}``, ``{"contract": dict | "name" | "path.yaml"}`` or ``{"chunk_size": N}``: the trainer's contract;
any difference from the engine's is refused at start). vLLM calls ``register()`` in every process it
starts (entry point group ``vllm.general_plugins``). Switched on, it runs the models on the core's layers,
refuses in one line every setting and request under which bits cannot be promised, and makes every logprob
vLLM reports the contract's (``aligned_mamba.token_logprobs``); each process that builds the config or the
model logs one line (logger ``vllm.aligned_mamba``). With the variable explicitly ``0``,
``additional_config`` is refused; with neither, vLLM is untouched. What it changes and refuses, and why:
docs/vllm.md; tensor parallelism: docs/tensor_parallel.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, NoReturn

import torch

from aligned_mamba.contract import MODEL_DTYPES, Contract, normalize_dtype
from aligned_mamba.errors import AlignedMambaError, ContractError

ENV_SWITCH = "ALIGNED_MAMBA_EXACT_REPLAY"
CONFIG_KEY = "aligned_mamba"  # the key in vLLM's additional_config
MODEL_CLASSES = {"Mamba2ForCausalLM": "rollout.vllm_model:ExactReplayMamba2ForCausalLM",
                 "NemotronHForCausalLM": "rollout.vllm_model:ExactReplayNemotronHForCausalLM"}
COVERED_ARCHITECTURES = tuple(MODEL_CLASSES)
MODEL_CLASS = MODEL_CLASSES["Mamba2ForCausalLM"]

_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
PROCESSED_MODES = ("processed_logprobs", "processed_logits")
_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it samples greedily, and its logprobs use T = 1
# A child of vLLM's logger: its handler and format, shown at vLLM's default level (INFO).
logger = logging.getLogger("vllm.aligned_mamba")
_registered = False
_watching = False
_engine_contract: Contract | None = None
_announced = False


class ExactReplayRefused(AlignedMambaError):
    """A vLLM setting under which exact replay cannot promise bits (a one-line message); not a ValueError,
    which vLLM's pydantic configs would fold into a multi-line validation report."""


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
    """vLLM's plugin hook. On: the model classes, the config hook, the sampler's logprobs and the
    request check (idempotent). Off: only the watch for ``additional_config["aligned_mamba"]``."""
    if exact_replay_requested():
        _enable()
    else:
        _watch_additional_config()


def _enable() -> None:
    global _registered
    if _registered:
        return
    import vllm.model_executor.models.config as model_configs
    from vllm import ModelRegistry

    for arch, cls in MODEL_CLASSES.items():
        ModelRegistry.register_model(arch, cls)
    current = model_configs.MODELS_CONFIG_MAP
    if isinstance(current, _WatchedConfigMap):
        current = current.original
    if not isinstance(current, _GuardedConfigMap):
        model_configs.MODELS_CONFIG_MAP = _GuardedConfigMap(current, _config_hooks())
    _patch_sampler()
    _patch_request_check()
    _registered = True


def _watch_additional_config() -> None:
    """Off by the variable: every config-hook lookup first looks for ``additional_config`` (``_WatchedConfigMap``)."""
    global _watching
    if _watching:
        return
    import vllm.model_executor.models.config as model_configs

    if not isinstance(model_configs.MODELS_CONFIG_MAP, (_GuardedConfigMap, _WatchedConfigMap)):
        model_configs.MODELS_CONFIG_MAP = _WatchedConfigMap(model_configs.MODELS_CONFIG_MAP)
    _watching = True


def switch_on_from_config(vllm_config: Any) -> bool:
    """Whether ``additional_config["aligned_mamba"]`` switched the plugin on (here, and through the variable in
    the processes vLLM spawns next); refused when the variable explicitly switches it off."""
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict) or CONFIG_KEY not in extra:
        return False
    raw = os.environ.get(ENV_SWITCH, "").strip()
    if raw and not exact_replay_requested():
        refuse(f"additional_config[{CONFIG_KEY!r}] asks for exact replay but {ENV_SWITCH}={raw!r} switches it "
               f"off; unset {ENV_SWITCH} (or set it to 1), or drop additional_config[{CONFIG_KEY!r}]")
    os.environ[ENV_SWITCH] = "1"
    _enable()
    return True


class _WatchedConfigMap(dict):
    """vLLM's per-architecture config hooks with the plugin off: each lookup gets a hook that switches the plugin
    on when the engine's additional_config asks for it, and otherwise runs vLLM's own hook, if any."""

    def __init__(self, original: dict) -> None:
        super().__init__(original)
        self.original = original

    def get(self, key: Any, default: Any = None) -> Any:
        stock = self.original.get(key)
        from vllm.model_executor.models.config import VerifyAndUpdateConfig

        class Watched(VerifyAndUpdateConfig):
            @staticmethod
            def verify_and_update_model_config(model_config: Any) -> None:
                if stock is not None:
                    stock.verify_and_update_model_config(model_config)

            @staticmethod
            def verify_and_update_config(vllm_config: Any) -> None:
                if switch_on_from_config(vllm_config):
                    import vllm.model_executor.models.config as model_configs

                    model_configs.MODELS_CONFIG_MAP.get(key).verify_and_update_config(vllm_config)
                else:
                    hook = stock
                    if hook is None:  # vLLM's own fallback: an HF base-model name, normalised
                        from vllm.model_executor.models import ModelRegistry

                        hook = self.original.get(ModelRegistry._normalize_arch(key, vllm_config.model_config))
                    if hook is not None:
                        hook.verify_and_update_config(vllm_config)

        return Watched

    def __getitem__(self, key: Any) -> Any:
        return self.get(key)


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
    """The core family's config (``Mamba2Config``, ``NemotronHConfig``) of vLLM's HF config, hf_overrides
    included; what the core does not cover is refused with the core's one-line reason."""
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
    """The engine's contract: the model config's chunk size, fp32 state, the device's backend (torch on the
    CPU, triton on CUDA), the model dtype and the stated contract's ``row_parallel_slices`` (1 without one);
    checked against the contract stated in ``additional_config["aligned_mamba"]``, if any."""
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
        # row_parallel_slices is the trainer's choice, taken as stated (a backend without sliced GEMMs refuses it)
        try:
            contract = dataclasses.replace(contract, row_parallel_slices=want.row_parallel_slices)
        except ContractError as e:
            refuse(f"the stated contract on this engine: {e}")
        diffs = want.diff(contract)
        if diffs:
            parts = "; ".join(f"{name} contract={a!r} engine={b!r}" for name, a, b in diffs)
            refuse(f"the engine differs from the stated contract: {parts}")
    return contract


def _check_hybrid(vllm_config: Any) -> None:
    """The attention layers' settings: full attention over an unquantised KV cache in the model dtype (MoE
    layers are row-invariant core layers; MTP layers are refused by ``core_config``)."""
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
    """Refuse (``ExactReplayRefused``, one line) every setting under which bits cannot be promised; returns
    the engine's contract. ``resolved``: True in the worker, where the config is final; False while vLLM
    builds it (no CUDA graph mode chosen yet: only an explicit one is seen; eager required off the CPU)."""
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
    _check_parallel(pc)
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
    _check_logprobs_setup(vllm_config)
    contract = engine_contract(vllm_config)
    check_tensor_parallel(vllm_config, contract)
    announce(contract, getattr(vllm_config.device_config, "device", None))
    return contract


def _check_parallel(pc: Any) -> None:
    """Pipeline and context parallelism: refused by name (tensor parallelism: ``check_tensor_parallel``)."""
    pp = pc.pipeline_parallel_size
    if pp > 1:
        refuse(f"pipeline parallelism (pipeline_parallel_size {pp}): the core runs every layer of the model in each "
               "tensor-parallel rank")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(pc, name, 1) or 1
        if size > 1:
            refuse(f"context parallelism ({name} {size}): a sequence's tokens and state are kept by one rank; "
                   "splitting them changes the scan's and attention's reductions")


def check_tensor_parallel(vllm_config: Any, contract: Contract) -> None:
    """Refuse (one line) a TP size the contract cannot keep the bits at: one not a power of two dividing
    ``row_parallel_slices``, the heads, groups, KV heads, expert widths and vocabulary slices
    (``parallel.check_tp``; the core's MoE layer shards itself, each worker building the core model)."""
    from aligned_mamba.parallel import check_tp

    tp = vllm_config.parallel_config.tensor_parallel_size
    try:
        check_tp(contract, core_config(vllm_config), tp)
    except AlignedMambaError as e:
        refuse(str(e))


def _check_logprobs_setup(vllm_config: Any) -> None:
    """What decides the reported logprobs engine-wide: vLLM's V2 model runner computes them in its own
    Triton kernel (not patched here), and custom logits processors change processed logprobs."""
    if vllm_config.use_v2_model_runner:
        refuse("vLLM's V2 model runner computes logprobs in its own kernel, not the contract's "
               "(set VLLM_USE_V2_MODEL_RUNNER=0)")
    mc = vllm_config.model_config
    if mc.logprobs_mode in PROCESSED_MODES and mc.logits_processors:
        refuse(f"custom logits processors under logprobs_mode={mc.logprobs_mode!r}: the processed logprobs would "
               "not be a function of the trainer's logits (use raw_logprobs)")


# -- the reported logprobs: the contract's function in every engine process ------------------------

def announce(contract: Contract, device: Any = None) -> None:
    """Log once per process that exact replay is on, with the contract fingerprint and the hardware
    class, and keep the contract for the sampler's logprobs (its backend computes them)."""
    global _engine_contract, _announced
    _engine_contract = contract
    if _announced:
        return
    from aligned_mamba.hardware import hardware_class

    try:
        hw = str(hardware_class(device))
    except Exception as e:  # the log line must not stop an engine that passed its checks
        hw = f"unknown ({type(e).__name__})"
    logger.info("aligned-mamba exact replay on (pid %d): contract %s, hardware %s", os.getpid(),
                contract.fingerprint, hw)
    _announced = True


def contract_log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[N, V] logits (any float dtype) -> [N, V] float32: the contract's log-softmax of logits / T,
    on the engine contract's backend (torch on the CPU, triton on CUDA)."""
    from aligned_mamba.ops.backend import resolve

    if _engine_contract is None:
        refuse("logprobs asked for before the engine's model announced its contract")
    return resolve(_engine_contract, logits.device).log_softmax(logits, temperature)


def _row_temperatures(sampling_metadata: Any, n: int) -> list[float]:
    """Each row's temperature as vLLM applies it: 1 for greedy rows (below its epsilon), else T."""
    temps = sampling_metadata.temperature
    if sampling_metadata.all_greedy or temps is None:
        return [1.0] * n
    return [1.0 if t < _SAMPLING_EPS else t for t in temps.tolist()]


def processed(raw: torch.Tensor, sampling_metadata: Any, mode: str) -> torch.Tensor:
    """The processed logprobs (or logits) of ``raw`` [N, V] float32 at each row's temperature: the
    contract's division and log-softmax, row groups of equal T at a time (both are row-invariant)."""
    from aligned_mamba.ops.logprobs import scale

    temps = _row_temperatures(sampling_metadata, raw.shape[0])
    out = torch.empty_like(raw, dtype=torch.float32)
    for t in sorted(set(temps)):
        idx = torch.tensor([i for i, x in enumerate(temps) if x == t], dtype=torch.long, device=raw.device)
        rows = raw.index_select(0, idx)
        out[idx] = contract_log_softmax(rows, t) if mode == "processed_logprobs" else scale(rows, t)
    return out


def _patch_sampler() -> None:
    """Replace vLLM's logprob function in its sampler (docs/vllm.md). Class level, once."""
    from vllm.v1.sample.sampler import Sampler

    if getattr(Sampler, "_aligned_mamba_logprobs", False):
        return
    stock_sample = Sampler.sample

    def sample(self: Any, logits: torch.Tensor, sampling_metadata: Any,
               logprobs_mode_override: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        mode = logprobs_mode_override or self.logprobs_mode
        wanted = sampling_metadata.max_num_logprobs is not None or bool(sampling_metadata.logprob_token_ids)
        if mode not in PROCESSED_MODES:
            # raw modes report the raw logprobs / logits: nothing of the sampler's may replace them
            return stock_sample(self, logits, sampling_metadata, logprobs_mode_override)[0], None
        if not wanted:
            return stock_sample(self, logits, sampling_metadata, logprobs_mode_override)
        raw = logits.to(torch.float32, copy=True)  # vLLM divides its logits by T in place
        sampled, _ = stock_sample(self, logits, sampling_metadata, logprobs_mode_override)
        return sampled, processed(raw, sampling_metadata, mode)

    Sampler.compute_logprobs = staticmethod(contract_log_softmax)
    Sampler.sample = sample
    Sampler._aligned_mamba_logprobs = True


# -- request-time refusals ------------------------------------------------------------------------

def check_request(params: Any, logprobs_mode: str) -> None:
    """Refuse (one line) a request whose reported logprobs the contract's function cannot give: under a processed
    mode, logprobs with anything that changes the logits before sampling; in any mode, with structured output."""
    if getattr(params, "logprobs", None) is None and getattr(params, "prompt_logprobs", None) is None:
        return
    if getattr(params, "structured_outputs", None) is not None and params.logprobs is not None:
        refuse("structured output with logprobs: its token mask changes the logits before any logprob")
    if logprobs_mode not in PROCESSED_MODES or params.logprobs is None:
        return
    changes = [name for name, on in (
        ("repetition_penalty", params.repetition_penalty != 1.0),
        ("presence_penalty", params.presence_penalty != 0.0),
        ("frequency_penalty", params.frequency_penalty != 0.0),
        ("top_k", params.top_k not in (0, -1) and params.top_k is not None),
        ("top_p", params.top_p < 1.0),
        ("min_p", params.min_p > 0.0),
        ("min_tokens", params.min_tokens > 0),
        ("logit_bias", bool(params.logit_bias)),
        ("bad_words", bool(params.bad_words)),
        ("allowed_token_ids", params.allowed_token_ids is not None)) if on]
    if changes:
        refuse(f"{', '.join(changes)} with logprobs_mode={logprobs_mode!r}: the processed logprobs would be "
               "renormalised or shifted past the trainer's log-softmax(logits / T) (drop them, or use raw_logprobs)")


def _patch_request_check() -> None:
    """Wrap the validator vLLM runs on every request's SamplingParams (InputProcessor), once."""
    from vllm.v1.engine.input_processor import InputProcessor

    if getattr(InputProcessor, "_aligned_mamba_check", False):
        return
    stock = InputProcessor._build_logits_processors_params_validator

    def build(self: Any) -> Any:
        inner = stock(self)
        mode = str(self.model_config.logprobs_mode)

        def validate(params: Any) -> None:
            if hasattr(params, "logprobs"):
                check_request(params, mode)
            inner(params)

        return validate

    InputProcessor._build_logits_processors_params_validator = build
    InputProcessor._aligned_mamba_check = True
