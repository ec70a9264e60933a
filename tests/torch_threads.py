"""Thread-count helpers shared by the ops row-invariance tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` inside the block, restored after."""
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        yield
    finally:
        torch.set_num_threads(prev)


@pytest.fixture(autouse=True)
def single_thread_by_default() -> Iterator[None]:
    """One thread unless a test asks for two: on a loaded 2-core machine every 2-thread parallel
    region can wait for a busy core, so the 2-thread runs are kept to the checks that need them."""
    with num_threads(1):
        yield
