"""The row-invariant linear layer in torch, the contract's ``gemm_form``: ``"lanes"`` (each output one
fixed fp32 chain: eight sequential partial sums, a fixed tree; the scan's GEMM too) or ``"tiles"``
(one fixed-shape batched matmul per ``linear_row_tile`` rows). One rounding to x's dtype; the
backward is plain fp32 matmuls. Why: docs/design.md, "How the bits are kept".
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
    # torch's CPU GEMM changes path by row alignment and for N == 1: K and N to multiples of 16
    return -K % 16, -N % 16


def _gemm_dtype(weight: torch.Tensor, form: str) -> torch.dtype:
    return weight.dtype if form == "lanes" and weight.dtype in (torch.bfloat16, torch.float32) else torch.float32


def gemm_weight(weight: torch.Tensor, form: str = "lanes") -> torch.Tensor:
    """weight [N, K] zero-padded once for ``form`` (lanes keep bf16: half a decode step's bytes); an
    [N, K] view of the padded tensor that ``linear`` multiplies through without a per-call pad."""
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
    """x [..., M, Kp] fp32, w [..., N, Kp] or [N, Kp] (Kp a multiple of 8) -> [..., M, N] fp32: lane j
    sums x[k] w[k] for k = j, j + 8, ... from +0.0, then ``tree_sum`` over the lanes."""
    M, Kp = x.shape[-2:]
    N = w.shape[-2]
    xv = x.reshape(*x.shape[:-2], M, 1, Kp // LANES, LANES)
    wv = w.to(torch.float32).reshape(*w.shape[:-2], 1, N, Kp // LANES, LANES)
    acc = torch.zeros(*x.shape[:-2], M, N, LANES, device=x.device)
    for kb in range(Kp // LANES):
        acc = acc + xv[..., kb, :] * wv[..., kb, :]
    return tree_sum(acc)


def _lane_forward(x: torch.Tensor, w: torch.Tensor, exact: bool) -> torch.Tensor:
    from .cpu import lane_gemm  # the same sums in one C loop where it applies

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
    """x [..., M, K] fp32 @ w [..., N, K]^T (or w [N, K]) -> [..., M, N] fp32, the lanes' form.
    ``exact``: bf16 values, so the C loop may fuse multiply-add with the same bits."""
    kp = -x.shape[-1] % LANES
    if kp:
        x, w = torch.nn.functional.pad(x, (0, kp)), torch.nn.functional.pad(w, (0, kp))
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _Lanes.apply(x, w, exact)
    return _lane_forward(x, w, exact)


def partial(x: torch.Tensor, weight: torch.Tensor, row_tile: int = 16, form: str = "lanes") -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] fp32: ``linear`` before its bias and rounding (a K slice's
    partial for ``sliced``)."""
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
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, fp32 inside; ``row_tile``,
    ``form``: the contract's ``linear_row_tile``, ``gemm_form``."""
    out = partial(x, weight, row_tile, form)
    if x.shape[0] == 0:
        return x.new_zeros(0, weight.shape[0])
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)
