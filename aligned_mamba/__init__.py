"""aligned-mamba: bitwise train/inference alignment for Mamba2 language models.

One shared SSD kernel family and one chunk-size contract, used by the trainer's one-pass forward
and by the sampler's exact-replay decode, so the logits the sampler produced for a token are the
logits the trainer computes for it, bit for bit.

Public API:
    verify(trainer_logits, sampler_logits) -> VerifyReport
    Contract, check_compatible
    AlignmentError, ContractError, ContractMismatchError, ModelLoadError
"""

from .contract import Contract, check_compatible
from .errors import AlignedMambaError, AlignmentError, ContractError, ContractMismatchError, ModelLoadError
from .verify import VerifyReport, verify

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
    "verify",
]
