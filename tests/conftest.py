"""Test-session setup.

Triton decides at import time whether kernels run compiled or in its CPU interpreter, so on a
machine without a CUDA GPU the interpreter is switched on here, before any test imports triton.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
