"""Row-invariant linear layer, the torch form: a row's bits depend on that row alone, whatever the number of rows.

A GEMM library picks its algorithm by shape: fp32 ``F.linear`` rows computed in a call of 1, 2
or 7 rows differ from the same rows in a 600-row call (torch 2.13 CPU). Two forms avoid that (the
contract's ``gemm_form``, which the scan's GEMMs follow too):

- ``"lanes"`` (default): every output is the same fixed chain of float32 operations, eight partial
  sums (lane j takes k = j, j + 8, ... in order, each step the product rounded, then the sum) and a
  fixed tree over the lanes (``lane_matmul``, the readable statement). No tile, no padding of rows:
  a decode step computes its one row, and reads the weights once in the model dtype. On the CPU
  ``cpu.py`` runs it as one loop (the same bits; for bfloat16 operands the products are exact,
  so it may fuse each multiply and add).
- ``"tiles"``: rows padded to whole tiles of ``linear_row_tile`` and one fixed-shape GEMM per
  tile (a batched matmul), so every row goes through the same BLAS call whatever M is.

Operands are taken to float32 (exact for bf16), accumulated in float32 and rounded once to the
input dtype. Pass weights from ``gemm_weight`` (the torch backend's ``linear_weight`` makes them) to skip a
per-call conversion and pad. Gradients (the trainer's backward) are plain float32 matmuls: they need
accuracy, not row invariance.
"""

from __future__ import annotations

import torch

from ..reduce import tree_sum

_PADDED = "_aligned_mamba_padded"  # the attribute ``gemm_weight`` leaves on its view
LANES = 8
FORMS = ("lanes", "tiles")


def _pads(K: int, N: int, form: str) -> tuple[int, int]:
    if form == "lanes":  # K in whole lanes
        return -K % LANES, 0
    # K and N padded (with exact zeros) to multiples of 16: with fp32 rows of K % 4 != 0 bytes
    # the GEMM takes another path for rows at 16-byte aligned offsets, and N == 1 takes another
    # path for one tile than for several (torch 2.13 CPU); aligned shapes have neither.
    return -K % 16, -N % 16


def _gemm_dtype(weight: torch.Tensor, form: str) -> torch.dtype:
    # the lanes keep bfloat16 weights (half the bytes a decode step reads); the tiles' GEMM is fp32
    return weight.dtype if form == "lanes" and weight.dtype in (torch.bfloat16, torch.float32) else torch.float32


def gemm_weight(weight: torch.Tensor, form: str = "lanes") -> torch.Tensor:
    """weight [N, K] as ``linear``'s ``form`` takes it, built once: zero-padded (K to whole lanes, or
    K and N to multiples of 16 for the tiles), in bfloat16 or float32 for the lanes, float32 for the
    tiles. Returns an [N, K] tensor (differentiable; the padded one's leading block) that ``linear``
    recognises and multiplies through the padded tensor as it is, with no per-call pad."""
    w = weight.to(_gemm_dtype(weight, form))
    kp, n_pad = _pads(*w.shape[::-1], form)
    if not (kp or n_pad):
        return w
    padded = torch.nn.functional.pad(w, (0, kp, 0, n_pad))
    view = padded[: w.shape[0], : w.shape[1]]
    setattr(view, _PADDED, padded)
    return view


def padded(weight: torch.Tensor, form: str) -> torch.Tensor:
    N, K = weight.shape
    kp, n_pad = _pads(K, N, form)
    w = getattr(weight, _PADDED, None)
    if w is not None and w.shape == (N + n_pad, K + kp) and w.dtype == _gemm_dtype(weight, form):
        return w
    w = weight.to(_gemm_dtype(weight, form))
    return torch.nn.functional.pad(w, (0, kp, 0, n_pad)) if kp or n_pad else w


def lane_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The lanes' sums in torch ops: x [..., M, Kp] float32, w [..., N, Kp] (or [N, Kp]; Kp a multiple
    of 8, zero-padded) -> [..., M, N] float32. Lane j of an output accumulates x[k] w[k] for k = j,
    j + 8, ... in order from +0.0; the output is ``tree_sum`` over its eight lanes."""
    M, Kp = x.shape[-2:]
    N = w.shape[-2]
    xv = x.reshape(*x.shape[:-2], M, 1, Kp // LANES, LANES)
    wv = w.to(torch.float32).reshape(*w.shape[:-2], 1, N, Kp // LANES, LANES)
    acc = torch.zeros(*x.shape[:-2], M, N, LANES, device=x.device)
    for kb in range(Kp // LANES):
        acc = acc + xv[..., kb, :] * wv[..., kb, :]
    return tree_sum(acc)


def _lane_forward(x: torch.Tensor, w: torch.Tensor, exact: bool) -> torch.Tensor:
    from .cpu import lane_gemm  # the same sums in one loop where it applies (a primitive picks its C form)

    out = lane_gemm(x, w, exact)
    return lane_matmul(x, w) if out is None else out


class _Lanes(torch.autograd.Function):
    """The lanes' forward; a plain float32 backward. x [..., M, Kp] float32, w [..., N, Kp] or [N, Kp]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, exact: bool) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return _lane_forward(x, w, exact)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, w = ctx.saved_tensors
        wf = w.to(torch.float32)
        gx = g @ wf if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = g.transpose(-1, -2) @ x
            if w.dim() < gw.dim():  # one w for every matrix of the batch
                gw = gw.reshape(-1, *gw.shape[-2:]).sum(0)
            gw = gw.to(w.dtype)
        return gx, gw, None


def lanes(x: torch.Tensor, w: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """x [..., M, K] float32 @ w [..., N, K]^T (or w [N, K]) -> [..., M, N] float32 in the lanes' form,
    K zero-padded to whole lanes here. ``exact``: every product is exact (bfloat16 values), which lets
    the native loop fuse multiply and add (the same bits)."""
    kp = -x.shape[-1] % LANES
    if kp:
        x, w = torch.nn.functional.pad(x, (0, kp)), torch.nn.functional.pad(w, (0, kp))
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _Lanes.apply(x, w, exact)
    return _lane_forward(x, w, exact)


def partial(x: torch.Tensor, weight: torch.Tensor, row_tile: int = 16, form: str = "lanes") -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] float32, not rounded: ``linear`` before its bias and its one
    rounding (a row-parallel layer's partial sum over one K slice, ``linear.sliced``)."""
    if form not in FORMS:
        raise ValueError(f"linear form {form!r} refused: expected one of {', '.join(FORMS)}")
    M, K = x.shape
    N = weight.shape[0]
    if M == 0:
        return x.new_zeros(0, N, dtype=torch.float32)
    w = padded(weight, form)
    kp = w.shape[1] - K
    if form == "lanes":
        xp = torch.nn.functional.pad(x.to(torch.float32), (0, kp))
        return lanes(xp, w, exact=x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16)
    tiles = (M + row_tile - 1) // row_tile
    xp = torch.nn.functional.pad(x.to(torch.float32), (0, kp, 0, tiles * row_tile - M))
    xp = xp.view(tiles, row_tile, K + kp)
    return torch.bmm(xp, w.t().expand(tiles, *w.t().shape)).view(tiles * row_tile, w.shape[0])[:M, :N]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, row_tile: int = 16,
           form: str = "lanes") -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, float32 inside. ``row_tile`` and
    ``form``: the contract's ``linear_row_tile`` and ``gemm_form``; weight from ``gemm_weight``, or any
    [N, K] tensor (padded here, per call)."""
    out = partial(x, weight, row_tile, form)
    if x.shape[0] == 0:
        return x.new_zeros(0, weight.shape[0])
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)
