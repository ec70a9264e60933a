"""aligned-mamba: bitwise train/inference alignment for Mamba2 (and hybrid) language models.

One shared SSD kernel family and one chunk-size contract, used by the trainer's one-pass forward
and by the sampler's exact-replay decode, so the logits the sampler produced for a token are the
logits the trainer computes for it, bit for bit.

Public API:
    load_model(path, contract=None) -> CausalLM   # model.forward(sequences) -> the trainer's logits
    token_logprobs(logits, token_ids, temperature=1.0) -> float32 logprobs (the contract's log-softmax)
    verify(trainer_logits, sampler_logits, mask=None) -> VerifyReport
    framework_metrics(trainer_lp, sampler_lp, mask) -> verl / NeMo-RL / slime mismatch metrics by their names
    rows_digest(rows) -> str; hardware_class(device=None) -> HardwareClass
    Contract, check_compatible
    AlignmentError, ContractError, ContractMismatchError, ModelLoadError
"""

from typing import TYPE_CHECKING, Any

from .contract import Contract, check_compatible
from .errors import AlignedMambaError, AlignmentError, ContractError, ContractMismatchError, ModelLoadError
from .hardware import hardware_class
from .metrics import framework_metrics, nemo_rl_metrics, slime_metrics, verl_metrics
from .verify import VerifyReport, rows_digest, verify

if TYPE_CHECKING:
    from .models import CausalLM


def load_model(path: Any, contract: Contract | str | dict[str, Any] | None = None, device: Any = None, *,
               cast: bool = False) -> "CausalLM":
    """A checkpoint directory of any registered model family (Hugging Face Mamba2, mamba_ssm's
    MambaLMHeadModel) as the trainer's model: ``model.forward(sequences)`` takes a list of [len_i]
    int64 token-id tensors and returns one [len_i, vocab] logits tensor per sequence. ``contract``
    defaults to the checkpoint's own (its chunk size, the torch backend, its dtype); the sampler
    must run the same one; one whose model dtype is not the stored one needs ``cast=True``. Raises
    ``ModelLoadError`` (one line) for a checkpoint it refuses."""
    from .models import load_model as _load

    return _load(path, _contract_arg(contract), _device_arg(device), cast=cast)


def _contract_arg(contract: Any) -> Contract | None:
    """A Contract, None, a contract name or YAML path (``Contract.from_yaml``) or a dict
    (``Contract.from_dict``); anything else is refused in one line."""
    if contract is None or isinstance(contract, Contract):
        return contract
    if isinstance(contract, str):
        return Contract.from_yaml(contract)
    if isinstance(contract, dict):
        return Contract.from_dict(contract)
    raise ContractError(f"contract: expected a Contract, a contract name or YAML path, or a dict; got "
                        f"{type(contract).__name__}")


def _device_arg(device: Any) -> Any:
    """Refuse (ModelLoadError, one line) a CUDA device where this torch has none."""
    if device is None:
        return None
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ModelLoadError(f"device {device!r}: {str(e).splitlines()[0]}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
        raise ModelLoadError(f"device {device!r} refused: {why}; load on the CPU (device=None or 'cpu')")
    return device


def token_logprobs(logits: Any, token_ids: Any, temperature: float = 1.0, contract: Contract | None = None) -> Any:
    """The contract's logprob of ``token_ids`` under ``logits`` / ``temperature``.

    logits: [..., V] floating-point tensor (any float dtype); token_ids: [...] integer tensor of the
    logits' leading shape, each in [0, V); temperature: a finite number > 0. Returns [...] float32.
    The function both sides run (the sampler's reported logprobs, the trainer's ratio and KL): fp32
    log-softmax over the whole vocabulary with position-invariant arithmetic (a row's bits do not
    depend on the batch or position it sits in), temperature as one fp32 division before it.
    ``contract`` picks the backend whose kernel computes it (default: triton on a CUDA tensor, torch
    on the CPU). Bad input raises TypeError / ValueError with one line.
    """
    from .ops import backend
    from .ops.logprobs import check_temperature, check_token_shapes

    check_token_shapes(logits, token_ids)  # the ids' range: the backend's form, in one read
    check_temperature(temperature)
    if contract is not None and not isinstance(contract, Contract):
        raise TypeError(f"contract must be a Contract, got {type(contract).__name__}")
    return backend.token_logprobs(logits, token_ids, temperature, contract)


__version__ = "0.1.0"

__all__ = [
    "AlignedMambaError",
    "AlignmentError",
    "Contract",
    "ContractError",
    "ContractMismatchError",
    "ModelLoadError",
    "VerifyReport",
    "check_compatible",
    "framework_metrics",
    "hardware_class",
    "load_model",
    "nemo_rl_metrics",
    "rows_digest",
    "slime_metrics",
    "token_logprobs",
    "verify",
    "verl_metrics",
]
