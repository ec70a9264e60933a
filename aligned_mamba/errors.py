"""Errors the library raises on purpose. Each message is one line that says what and why."""

from __future__ import annotations

# exit statuses of the commands (check, rl): each means one thing
EXIT_OK = 0  # every exact-replay row (token) is bit-identical
EXIT_MISMATCH = 1  # rows differ: the alignment is broken
EXIT_BAD_INPUT = 2  # an input or setting refused before (or instead of) the work
EXIT_RUNTIME = 3  # the work failed: out of memory, a dead worker, an unreachable cluster, a diverged step
EXIT_NO_CONTROL = 4  # every row agreed, but the baseline did too: these sizes could not have shown a mismatch
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), as shells report it
EXIT_TERMINATED = 143  # SIGTERM (128 + 15), as shells report a process it ended


class Terminated(BaseException):
    """SIGTERM, raised in the main thread; a BaseException, so no ``except Exception`` swallows it."""


class AlignedMambaError(Exception):
    """Base class: an input or setting the library refuses, with a one-line reason."""


class ContractError(AlignedMambaError):
    """A contract that cannot promise bits (e.g. a non-fp32 SSM state) or a malformed one."""


class ContractMismatchError(ContractError):
    """Trainer and sampler contracts differ; the message names the field and both values."""


class ModelLoadError(AlignedMambaError):
    """A model directory, config or tensor that is missing, malformed or mis-shaped."""


class RuntimeFailure(AlignedMambaError):
    """The work itself failed (not the input): exit status 3. The message says what and where."""


class TrainingDiverged(RuntimeFailure):
    """A training step produced a non-finite loss, gradient or weight; nothing was exported."""


class AlignmentError(AlignedMambaError):
    """Raised by ``verify(..., strict=True)`` when trainer and sampler logits differ."""

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class HardwareMismatchError(ContractError):
    """Trainer and sampler on different hardware classes; the message names both and the override."""
