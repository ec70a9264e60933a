"""What the tests of the GEMM, norm, conv1d and log-softmax Triton kernels share.

Used by tests/ops/linear/test_linear_gemm.py, tests/ops/norm/, tests/ops/conv1d/,
tests/ops/logprobs/test_logprobs_triton.py and tests/ops/test_triton_backward.py (tests/ops/ is on
``sys.path``: tests/ops/conftest.py's folder, under the prepend import mode): the pinned configs, the
device (the GPU where there is one and the interpreter is off, else the CPU through the interpreter),
small random operands on it, the decorator of a GPU test, and the probe of a kernel's rows against
the rows of one call over all of them.
"""

from __future__ import annotations

import os

import pytest
import torch

from aligned_mamba.ops.configs import TritonKernelConfigs

CFG = TritonKernelConfigs()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRET
DEV = "cuda" if CUDA else "cpu"
EPS = 1e-5
# The ops' Functions against fp64 in fp32: measured 5e-8 .. 1.2e-7 (relative norm); 1e-5 leaves room.
OP_RTOL = 1e-5


def gpu(f):
    """A GPU test: marked ``gpu`` and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")(f))


def rand(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


def rows_invariant(fn, x: torch.Tensor, ms: list[int]) -> list[tuple[int, int]]:
    """(M, differing rows) for each M: rows [s, s + M) of one call of M rows against the same rows of a
    call of all rows, s chosen so the slices cover the start, the middle and the end."""
    full = fn(x)
    bad = []
    for i, M in enumerate(ms):
        s = [0, (x.shape[0] - M) // 2, x.shape[0] - M][i % 3]
        part = fn(x[s:s + M])
        bad.append((M, int((part != full[s:s + M]).any(dim=1).sum())))
    return bad
