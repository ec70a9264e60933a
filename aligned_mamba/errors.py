"""Errors the library raises on purpose. Each message is one line that says what and why."""

from __future__ import annotations

# exit statuses of the commands (check, rl)
EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT = 0, 1, 2


class AlignedMambaError(Exception):
    """Base class: an input or setting the library refuses, with a one-line reason."""


class ContractError(AlignedMambaError):
    """A contract that cannot promise bits (e.g. a non-fp32 SSM state) or a malformed one."""


class ContractMismatchError(ContractError):
    """Trainer and sampler contracts differ; the message names the field and both values."""


class ModelLoadError(AlignedMambaError):
    """A model directory, config or tensor that is missing, malformed or mis-shaped."""


class AlignmentError(AlignedMambaError):
    """Raised by ``verify(..., strict=True)`` when trainer and sampler logits differ."""

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report
