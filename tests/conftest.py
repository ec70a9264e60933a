"""Test-session setup.

Triton decides at import time whether kernels run compiled or in its CPU interpreter, so on a
machine without a CUDA GPU the interpreter is switched on here, before any test imports triton.

Where a test runs is a marker (registered in pyproject.toml): ``gpu`` tests are skipped here
without a CUDA device; ``engines`` tests (vLLM engines, Ray clusters, signal timing) form one
pytest-xdist group, so under ``-n 2 --dist loadgroup`` they run one at a time on one worker
while the other worker takes the rest.
"""

import os
import shutil

import pytest

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    import torch

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:  # before xdist's hook reads the groups off the items
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if item.get_closest_marker("engines"):
            item.add_marker(pytest.mark.xdist_group("engines"))
    result = yield
    if config.getoption("loadgroup", default=False):
        # xdist (3.8) names the group in the test id by setting item._nodeid, which pytest 9 no longer
        # reads (it keeps the id in item._id): without the name every test is scheduled on its own and
        # two engine modules run at once on the two workers
        from _pytest.nodeid import coerce_node_id

        for item in items:
            if item.get_closest_marker("engines") and not item.nodeid.endswith("@engines"):
                item._id = coerce_node_id(f"{item.nodeid}@engines")
    return result
