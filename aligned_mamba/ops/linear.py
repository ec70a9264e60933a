"""Row-invariant linear layer: fixed 16-row tiles, whatever the number of rows.

A GEMM library picks its algorithm by shape: fp32 ``F.linear`` rows computed in a call of 1, 2
or 7 rows differ from the same rows in a 600-row call (torch 2.13 CPU). Padding the rows to whole
tiles and running one fixed-shape GEMM per tile (a batched matmul over tiles) gives each row the
same operation sequence in every call: a decode step's row equals the trainer's row.

Operands are taken to float32 (exact for bf16), accumulated in float32 and rounded once to the
input dtype: what a bf16 GEMM computes, and 3-4x faster than bf16 ``bmm`` on CPUs without bf16
units. Pass float32 weights (``Mamba2LM`` keeps them) to skip a per-call conversion.
"""

from __future__ import annotations

import torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, row_tile: int = 16) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, float32 inside."""
    M, K = x.shape
    N = weight.shape[0]
    w = weight.to(torch.float32)
    tiles = (M + row_tile - 1) // row_tile
    if tiles == 0:
        return x.new_zeros(0, N)
    xp = torch.nn.functional.pad(x.to(torch.float32), (0, 0, 0, tiles * row_tile - M)).view(tiles, row_tile, K)
    out = torch.bmm(xp, w.t().expand(tiles, K, N)).view(tiles * row_tile, N)[:M]
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)
