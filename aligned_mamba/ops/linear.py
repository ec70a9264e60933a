"""Row-invariant linear layer: fixed 16-row tiles, whatever the number of rows.

A GEMM library picks its algorithm by shape: fp32 ``F.linear`` rows computed in a call of 1, 2
or 7 rows differ from the same rows in a 600-row call (torch 2.13 CPU). Padding the rows to whole
tiles and running one fixed-shape GEMM per tile (a batched matmul over tiles) gives each row the
same operation sequence in every call: a decode step's row equals the trainer's row.

Operands are taken to float32 (exact for bf16), accumulated in float32 and rounded once to the
input dtype: what a bf16 GEMM computes, and 3-4x faster than bf16 ``bmm`` on CPUs without bf16
units. Pass weights from ``gemm_weight`` (``TorchBackend.linear_weight`` makes them) to skip a
per-call conversion and pad.
"""

from __future__ import annotations

import torch

_PADDED = "_aligned_mamba_padded"  # the attribute ``gemm_weight`` leaves on its view


def _pads(K: int, N: int) -> tuple[int, int]:
    # K and N padded (with exact zeros) to multiples of 16: with fp32 rows of K % 4 != 0 bytes
    # the GEMM takes another path for rows at 16-byte aligned offsets, and N == 1 takes another
    # path for one tile than for several (torch 2.13 CPU); aligned shapes have neither.
    return -K % 16, -N % 16


def gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] as ``linear``'s GEMM takes it, built once: float32, zero-padded to multiples
    of 16. Returns an [N, K] float32 tensor (differentiable; the padded one's leading block) that
    ``linear`` recognises and multiplies through the padded tensor as it is, with no per-call pad."""
    w = weight.to(torch.float32)
    kp, n_pad = _pads(*w.shape[::-1])
    if not (kp or n_pad):
        return w
    padded = torch.nn.functional.pad(w, (0, kp, 0, n_pad))
    view = padded[: w.shape[0], : w.shape[1]]
    setattr(view, _PADDED, padded)
    return view


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, row_tile: int = 16) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, float32 inside."""
    M, K = x.shape
    N = weight.shape[0]
    tiles = (M + row_tile - 1) // row_tile
    if tiles == 0:
        return x.new_zeros(0, N)
    kp, n_pad = _pads(K, N)
    w = getattr(weight, _PADDED, None)
    if w is None or w.shape != (N + n_pad, K + kp):
        w = weight.to(torch.float32)
        if kp or n_pad:
            w = torch.nn.functional.pad(w, (0, kp, 0, n_pad))
    xp = torch.nn.functional.pad(x.to(torch.float32), (0, kp, 0, tiles * row_tile - M))
    xp = xp.view(tiles, row_tile, K + kp)
    out = torch.bmm(xp, w.t().expand(tiles, K + kp, N + n_pad)).view(tiles * row_tile, N + n_pad)[:M, :N]
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)
