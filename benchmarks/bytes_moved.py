"""Bytes the kernels move from HBM, for the benchmarks' bandwidth figures: a decode step per sequence, and
a Mamba2 layer's forward kernel by kernel (``forward_layer_bytes``).

Counting models, not measurements: ``bench_h200.py`` divides them by the measured step time and
compares the result with the device-to-device copy bandwidth. They live here rather than in the
library because no kernel reads them.

    python3 benchmarks/bytes_moved.py --shape mamba2-2.7b --tokens 16384   # the forward's floors, a table
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_mamba_ssm_h200 import SHAPES  # noqa: E402 - mamba_ssm's shapes: (layers, hidden size)


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


def forward_layer_bytes(T: int, H: int, P: int, G: int, N: int, hidden: int, L: int = 256, x_bytes: int = 2,
                        residual_bytes: int = 4, boundary_bytes: int = 2) -> dict[str, int]:
    """The least bytes each non-GEMM kernel of one Mamba2 layer's forward moves for T tokens (whole chunks of L),
    by kernel: every input read once and every output written once (x_bytes the model dtype's, residual_bytes the
    residual's, boundary_bytes the stored boundary states': 2 under "round", 4 under "split2")."""
    d, NC = H * P, -(-T // L)
    xbc = T * (d + 2 * G * N) * x_bytes
    states = NC * H * P * N * 4
    return {
        "conv + SiLU": 2 * xbc,
        "chunk states": T * d * x_bytes + T * G * N * x_bytes + 2 * NC * H * L * 4 + states,
        "state pass": states + NC * H * P * N * boundary_bytes,
        "scan output": 2 * T * d * x_bytes + 2 * T * G * N * x_bytes + NC * G * L * L * 4
        + NC * H * P * N * boundary_bytes,
        "gated norm": 3 * T * d * x_bytes,
        "add + RMSNorm": 2 * T * hidden * (x_bytes + residual_bytes),
        "dt, cumsum, C.B": T * H * x_bytes + 3 * NC * H * L * 4 + NC * G * L * L * 4,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a Mamba2 forward's non-GEMM bytes and their time at a bandwidth")
    ap.add_argument("--shape", default="mamba2-2.7b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--tb-s", type=float, default=3.0, help="bandwidth, TB/s")
    ap.add_argument("--boundary-bytes", type=int, default=2, choices=(2, 4))
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.tb_s <= 0:
        ap.error(f"--tokens must be >= 1 and --tb-s > 0, got {a.tokens} and {a.tb_s}")
    layers, hidden = SHAPES[a.shape]
    H = 2 * hidden // 64
    rows = forward_layer_bytes(a.tokens, H, 64, 1, 128, hidden, boundary_bytes=a.boundary_bytes)
    print(f"{a.shape}, {a.tokens} tokens, {layers} layers, {a.tb_s} TB/s")
    print("| kernel | bytes a layer | floor, ms |\n| --- | --- | --- |")
    for name, b in [*rows.items(), ("all", sum(rows.values()))]:
        print(f"| {name} | {b / 1e6:.0f} MB | {b * layers / (a.tb_s * 1e12) * 1e3:.1f} |")
    return 0


__all__ = ["forward_layer_bytes", "replay_decode_bytes", "ssu_step_bytes"]


if __name__ == "__main__":
    raise SystemExit(main())
