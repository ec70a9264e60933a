"""What a Triton interpreter test imports first.

``@triton.jit`` (Triton's own library too) picks interpreted or compiled code when triton is
imported, so the interpreter must be on before the first import of triton in the process: importing
this module switches it on, except in a GPU session (a machine with ``nvidia-smi`` and no
``TRITON_INTERPRET=1`` set), whose GPU tests in the same process must run compiled. ``require()``,
called at a test module's top, skips the module where triton is missing or the session is a GPU
one, and fails it where the switch came too late on a machine without a GPU.
"""

import os
import shutil
import sys

GPU_SESSION = os.environ.get("TRITON_INTERPRET") != "1" and shutil.which("nvidia-smi") is not None
TOO_LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not GPU_SESSION and not TOO_LATE:
    os.environ["TRITON_INTERPRET"] = "1"


def require() -> None:
    """Skip the calling module without triton; where triton was imported compiled before, fail it
    without a GPU (the interpreter is its only way to run there) or skip it with one."""
    import pytest
    import torch

    pytest.importorskip("triton")
    if not GPU_SESSION and not TOO_LATE:
        return
    # Only possible where the session runs compiled Triton (conftest turns the interpreter on for
    # the whole session on a machine without a GPU): there these tests need a process of their own.
    if not GPU_SESSION and not torch.cuda.is_available():
        pytest.fail("triton was imported before the interpreter was switched on (tests/conftest.py sets "
                    "TRITON_INTERPRET=1 first on a machine without a GPU)", pytrace=False)
    pytest.skip("a GPU session compiles Triton; these interpreter tests need their own process: run this file "
                "alone with TRITON_INTERPRET=1", allow_module_level=True)
