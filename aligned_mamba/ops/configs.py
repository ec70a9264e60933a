"""Pinned kernel configurations, per backend.

No run-time autotuning: every process that runs a backend uses exactly these tile shapes, so a
row's bits never depend on which config an autotuner happened to pick. They are part of the
contract (and of its fingerprint).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

BACKENDS = ("torch", "triton")

# row_tile: output rows are computed in tiles of this many rows (zero-padded), so a decode step
# (one row) runs the same GEMM shapes as a prefill of thousands of rows.
PINNED: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "torch": MappingProxyType({"row_tile": 16, "linear_row_tile": 16}),
        "triton": MappingProxyType(
            {
                # 64 output rows per scan program: 4x fewer, larger programs than 16 (the columns a
                # row does not use carry a zero decay and add exact zeros, so its bits stay put)
                "row_tile": 64,
                "linear_row_tile": 16,
                "BLOCK_P": 64,
                "BLOCK_N": 64,
                "BLOCK_K": 32,
                "num_warps": 4,
                # the prefill's row-tile kernel's warps (its K loop runs the blocks up to the tile's end)
                "tile_num_warps": 4,
                # the state pass's P block (elementwise: parallelism only)
                "pass_block_p": 64,
                # fp32 dots in IEEE precision: TF32 would change bits and miss the fp32 accuracy target
                "dot_precision": "ieee",
                # bf16 models: tensor-core dots, bf16 operands, fp32 accumulation; fp32 operands
                # (state, scores) split into two bf16 terms (ops/ssd/triton_dot.py)
                "bf16_dots": "split2",
                # the output tiles' accumulation: the intra-chunk dots accumulate onto the decayed
                # inter-chunk term (one accumulator). Into their own, added after, gives other bits.
                "accumulate": "seeded",
            }
        ),
    }
)


def pinned_configs(backend: str) -> dict[str, Any]:
    """The pinned kernel configs of ``backend`` as a plain dict."""
    if backend not in PINNED:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    return dict(PINNED[backend])
