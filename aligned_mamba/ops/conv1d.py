"""Causal depthwise conv1d over (window ++ new tokens), then SiLU.

Prefill and decode are the same call: each sequence's new tokens are convolved with the
``K - 1`` inputs before them (its window: zeros at the start of a sequence), so one prefilled
token and one decoded token see the same operands, accumulated in the same order
(bias + w_0 x_{t-K+1} + ... + w_{K-1} x_t, in float32), and give the same bits.
"""

from __future__ import annotations

import torch

from . import elementwise as ew


def causal_conv1d(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    activation: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convolve new tokens of S packed sequences.

    x [T, Cd] (model dtype), cu_seqlens [S+1], window [S, K-1, Cd] (the inputs preceding each
    sequence's first new token), weight [Cd, K], bias [Cd] or None.
    Returns (out [T, Cd] in x's dtype, new_window [S, K-1, Cd] in x's dtype).
    """
    T, Cd = x.shape
    S, Km1, _ = window.shape
    K = Km1 + 1
    dev = x.device
    cu = cu_seqlens.to(torch.int64).to(dev)
    lens = cu[1:] - cu[:-1]
    # One stream per sequence: its window rows, then its new rows; src indexes cat([window, x]).
    stream = torch.cat([window.reshape(S * Km1, Cd).to(x.dtype), x])
    seq = torch.repeat_interleave(torch.arange(S, device=dev), lens)
    j = torch.arange(T, device=dev) - cu[:-1][seq]  # index of each new row within its sequence

    def src(seq_ids: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Row of ``stream`` holding position p of a sequence's (window ++ new) stream."""
        return torch.where(p < Km1, seq_ids * Km1 + p, S * Km1 + cu[:-1][seq_ids] + p - Km1)

    out = torch.zeros(T, Cd, dtype=torch.float32, device=dev)
    if bias is not None:
        out = out + bias.to(torch.float32)
    wf = weight.to(torch.float32)
    for k in range(K):
        out = out + wf[:, k] * stream[src(seq, j + k)].to(torch.float32)
    if activation:
        out = ew.silu(out)
    # The new window: the last K-1 positions of each (window ++ new) stream.
    q = torch.arange(Km1, device=dev)
    sidx = torch.arange(S, device=dev)[:, None].expand(S, Km1)
    new_window = stream[src(sidx, lens[:, None] + q[None, :])]
    return out.to(x.dtype), new_window
