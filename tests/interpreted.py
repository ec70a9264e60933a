"""What a Triton interpreter test imports first.

``@triton.jit`` (Triton's own library too) picks interpreted or compiled code when triton is
imported, so the interpreter must be on before the first import of triton in the process: importing
this module switches it on. ``require()``, called at a test module's top, skips the module where
triton is missing and fails or skips it where the switch came too late.
"""

import os
import sys

TOO_LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"


def require() -> None:
    """Skip the calling module without triton; where triton was imported compiled before, fail it
    without a GPU (the interpreter is its only way to run there) or skip it with one."""
    import pytest
    import torch

    pytest.importorskip("triton")
    if not TOO_LATE:
        return
    # Only possible where the session runs compiled Triton (conftest turns the interpreter on for
    # the whole session on a machine without a GPU): there these tests need a process of their own.
    if not torch.cuda.is_available():
        pytest.fail("triton was imported before the interpreter was switched on (tests/conftest.py sets "
                    "TRITON_INTERPRET=1 first on a machine without a GPU)", pytrace=False)
    pytest.skip("a GPU session compiles Triton; these interpreter tests need their own process: run this file "
                "alone with TRITON_INTERPRET=1", allow_module_level=True)
