"""Test-session setup.

Triton decides at import time whether kernels run compiled or in its CPU interpreter, so on a
machine without a CUDA GPU the interpreter is switched on here, before any test imports triton.

Where a test runs is a marker (registered in pyproject.toml): ``gpu`` tests are skipped here
without a CUDA device; ``engines`` tests (vLLM engines, Ray clusters, signal timing) form
pytest-xdist groups ("lanes", the marker's argument; "shared" without one), so under
``-n 2 --dist loadgroup`` each lane runs one test at a time on one worker while the other
worker takes the rest. Lane "shared" holds the modules that share the session's vLLM engines
(tests/integrations/engines.py: they must be one session) and the server test; lane "own" the tests
that start their own (Ray clusters, the CLI's engines, signal-timed processes). One lane was the suite's
critical path: it set the wall time while the other worker waited idle at the end.
"""

import os
import shutil
from pathlib import Path

import pytest

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_dot_per_element() -> None:
    """``tl.dot`` in the Triton interpreter as one fixed-order sum over K per output element.

    The interpreter computes a dot with ``np.matmul``, i.e. BLAS, whose blocking can make an element's
    bits depend on the tile's shape: on OpenBLAS's AVX2 kernels rows of an M = 1, 2 or 9 product differ
    from the same rows of an M = 32 one. On the GPU an MMA element does not depend on the tile's other
    rows or columns, and the kernels' row-invariance tests check the kernels' logic on that premise.
    numpy's einsum (no BLAS) sums each element's K products in an order set by K alone."""
    import numpy as np

    try:
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    except ImportError:
        return
    plain = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        dt = d.data.dtype
        bt = np.ascontiguousarray(np.swapaxes(b.data.astype(dt), -1, -2))
        out = np.einsum("...mk,...nk->...mn", np.ascontiguousarray(a.data.astype(dt)), bt)
        return TensorHandle(out + d.data, d.dtype.scalar)

    InterpreterBuilder.create_dot = create_dot


def _interpreter_bf16_rounds_to_nearest_even() -> None:
    """fp32 -> bf16 ``.to()`` in the Triton interpreter rounded to nearest even, as the GPU's conversion
    (and torch's) rounds it. The interpreter drops the low 16 bits when no rounding mode is given (its
    "rtne" does not break ties to even), so a kernel that rounds an fp32 value to bf16 in registers and
    computes on would show other bits there than on the GPU."""
    import numpy as np
    import torch

    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    except ImportError:
        return
    plain_cast, plain_fp = InterpreterBuilder.cast_impl, InterpreterBuilder.create_fp_to_fp

    def to_bf16(src):
        bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16).numpy()
        return TensorHandle(bits.view(np.uint16), tl.bfloat16)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return to_bf16(src)
        return plain_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return to_bf16(src)
        return plain_fp(self, src, dst_type, rounding_mode)

    InterpreterBuilder.cast_impl = cast_impl  # create_fp_trunc calls it
    InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_dot_per_element()
    _interpreter_bf16_rounds_to_nearest_even()


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    import torch

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:  # before xdist's hook reads the groups off the items
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if lane := _lane(item):
            item.add_marker(pytest.mark.xdist_group(lane))
    result = yield
    if config.getoption("loadgroup", default=False):
        # xdist (3.8) names the group in the test id by setting item._nodeid, which pytest 9 no longer
        # reads (it keeps the id in item._id): without the name every test is scheduled on its own and
        # two engine modules run at once on the two workers
        from _pytest.nodeid import coerce_node_id

        for item in items:
            if (lane := _lane(item)) and not item.nodeid.endswith(f"@{lane}"):
                item._id = coerce_node_id(f"{item.nodeid}@{lane}")
        # xdist hands out the lanes first, then single tests in this order: the sm_90 compiles (the
        # longest single tests, 45-200 s) go first so that none of them is left to run alone at the end
        items.sort(key=lambda item: item.get_closest_marker("compile") is None)
    return result


@pytest.fixture(scope="session")
def sm90_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Triton cache of the session's sm_90 compile scripts (tests/sm90_offline.py), one for both
    xdist workers (their base folders' parent): a kernel that several tests compile alike is compiled
    once. Triton writes each entry to a temporary file and renames it, so two workers may share it."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "triton-sm90"
    path.mkdir(exist_ok=True)
    return path


def _lane(item: pytest.Item) -> str | None:
    """The xdist group of an ``engines`` test ("engines-" + its lane), None for the others."""
    mark = item.get_closest_marker("engines")
    if mark is None:
        return None
    lane = mark.args[0] if mark.args else "shared"
    if lane not in ("shared", "own"):
        raise pytest.UsageError(f"{item.nodeid}: engines lane {lane!r}: must be 'shared' or 'own'")
    return f"engines-{lane}"
