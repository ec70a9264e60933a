"""Bytes a decode step moves from HBM, per sequence, for the benchmarks' bandwidth figures.

Counting models, not measurements: ``bench_h200.py`` divides them by the measured step time and
compares the result with the device-to-device copy bandwidth. They live here rather than in the
library because no kernel reads them.
"""

from __future__ import annotations


def replay_decode_bytes(H: int, G: int, P: int, N: int, fill: int, x_bytes: int = 2, L: int = 256) -> int:
    """Bytes one sequence's decode step moves from HBM when no chunk completes: the boundary state
    read once, the partial chunk's x, raw dt and B rows (fill + 1 with the token's) read once, the
    a, dt and cb scratch written and read, the token's inputs, its rows written to the buffers,
    and the output."""
    rows = fill + 1
    state = H * P * N * 4
    buf = rows * (H * P * x_bytes + H * x_bytes + G * N * x_bytes)
    scratch = 2 * (2 * H * L * 4 + G * L * 4)
    token = 2 * (H * P * x_bytes + H * 4 + G * N * x_bytes) + H * x_bytes + G * N * x_bytes + H * P * x_bytes
    return state + buf + scratch + token


def ssu_step_bytes(H: int, G: int, P: int, N: int, x_bytes: int = 2) -> int:
    """Bytes one sequence's SSU step moves (lower bound): the fp32 state read and written."""
    return 2 * H * P * N * 4 + H * P * x_bytes * 2 + H * x_bytes + 2 * G * N * x_bytes


__all__ = ["replay_decode_bytes", "ssu_step_bytes"]
