"""Causal depthwise conv1d over (window ++ new tokens), then SiLU: the torch form. A prefilled and a
decoded token see the same operands, added in the same order (bias + w_0 x_{t-K+1} + ... + w_{K-1} x_t
in float32), so they get the same bits."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .. import elementwise as ew

if TYPE_CHECKING:
    from ..step import Step


def _tap_sum(taps: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bias + w_0 x_0 + ... + w_{K-1} x_{K-1} per row in float32, added in that order: taps [T, K, Cd]
    (each row's K inputs, oldest first), weight [Cd, K], bias [Cd] or None -> [T, Cd] float32."""
    T, K, Cd = taps.shape
    prods = taps.to(torch.float32) * weight.to(torch.float32).t()  # [T, K, Cd]
    out = torch.zeros(T, Cd, dtype=torch.float32, device=taps.device)
    if bias is not None:
        out = out + bias.to(torch.float32)
    for k in range(K):
        out = out + prods[:, k]
    return out


def conv_out(taps: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: bool) -> torch.Tensor:
    """``_tap_sum`` (then SiLU) rounded to taps' dtype: [T, K, Cd] -> [T, Cd]."""
    out = _tap_sum(taps, weight, bias)
    return (ew.silu(out) if activation else out).to(taps.dtype)


ConvOut = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor]


def causal_conv1d(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    activation: bool = True,
    out_form: ConvOut = conv_out,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convolve the new tokens of S packed sequences: x [T, Cd] (model dtype), cu_seqlens [S+1], window
    [S, K-1, Cd] (the inputs before each sequence's first new token), weight [Cd, K], bias [Cd] or None
    -> (out [T, Cd], new_window [S, K-1, Cd]) in x's dtype. ``out_form``: ``conv_out`` or its bits."""
    S, Km1, _ = window.shape
    stream, src, lens = _streams(x, cu_seqlens, window)
    out = out_form(stream[src], weight, bias, activation)  # taps [T, K, Cd]
    q = torch.arange(Km1, device=x.device)
    sidx = torch.arange(S, device=x.device)[:, None].expand(S, Km1)
    new_window = stream[_stream_row(sidx, lens[:, None] + q[None, :], cu_seqlens.to(torch.int64).to(x.device), S,
                                    Km1)]
    return out, new_window



def _stream_row(seq_ids: torch.Tensor, p: torch.Tensor, cu: torch.Tensor, S: int, Km1: int) -> torch.Tensor:
    """Row of the stream (``_streams``) holding position p of a sequence's (window ++ new) stream."""
    return torch.where(p < Km1, seq_ids * Km1 + p, S * Km1 + cu[:-1][seq_ids] + p - Km1)


def _streams(x: torch.Tensor, cu_seqlens: torch.Tensor, window: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequences' (window ++ new) streams as one table: (stream [S*(K-1) + T, Cd] in x's dtype,
    src [T, K] the stream rows of each new row's K taps, oldest first, lens [S])."""
    T, Cd = x.shape
    S, Km1, _ = window.shape
    dev = x.device
    cu = cu_seqlens.to(torch.int64).to(dev)
    lens = cu[1:] - cu[:-1]
    stream = torch.cat([window.reshape(S * Km1, Cd).to(x.dtype), x])
    seq = torch.repeat_interleave(torch.arange(S, device=dev), lens, output_size=T)
    j = torch.arange(T, device=dev) - cu[:-1][seq]  # index of each new row within its sequence
    src = _stream_row(seq[:, None], j[:, None] + torch.arange(Km1 + 1, device=dev)[None, :], cu, S, Km1)
    return stream, src, lens


def causal_conv1d_backward(x: torch.Tensor, cu_seqlens: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None, g: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gradient of ``causal_conv1d(...)[0]`` (with SiLU) against g [T, Cd]: (dx, dwindow, dweight,
    dbias or None), each in its input's dtype; native torch ops in fp32. Deterministic: a tap's scatter
    adds at most one value per stream row (distinct rows' tap k reads distinct stream rows)."""
    S, Km1, Cd = window.shape
    stream, src, _ = _streams(x, cu_seqlens, window)
    taps = stream[src].to(torch.float32)  # [T, K, Cd]
    wf = weight.to(torch.float32)
    pre = (taps * wf.t()).sum(1)
    if bias is not None:
        pre = pre + bias.to(torch.float32)
    s = torch.sigmoid(pre)
    dpre = g.to(torch.float32) * (s * (1.0 + pre * (1.0 - s)))
    dstream = torch.zeros(stream.shape, device=x.device, dtype=torch.float32)
    for k in range(Km1 + 1):
        dstream.index_put_((src[:, k],), dpre * wf[:, k], accumulate=True)
    dw = torch.stack([(dpre * taps[:, k]).sum(0) for k in range(Km1 + 1)], 1)
    db = None if bias is None else dpre.sum(0).to(bias.dtype)
    return (dstream[S * Km1:].to(x.dtype), dstream[:S * Km1].view(S, Km1, Cd).to(window.dtype),
            dw.to(weight.dtype), db)


def causal_conv1d_step(
    x: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    activation: bool = True,
    out_form: ConvOut = conv_out,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal_conv1d`` for one new token per sequence (a decode step), the same arithmetic: x [S, Cd],
    window [S, K-1, Cd] -> (out [S, Cd], new_window [S, K-1, Cd]) in x's dtype."""
    taps = torch.cat([window.to(x.dtype), x[:, None]], dim=1)  # [S, K, Cd]
    return out_form(taps, weight, bias, activation), taps[:, 1:]


def conv_advance(windows: torch.Tensor, step: Step, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *,
                 out_form: ConvOut = conv_out) -> torch.Tensor:
    """The op's signature (the package docstring); a decode step takes ``causal_conv1d_step``."""
    if step.decode_only:
        slots = step.plans[windows.device].slots
        out, window = causal_conv1d_step(x, windows.index_select(0, slots), w, b, out_form=out_form)
        windows.index_copy_(0, slots, window)
        return out
    slots = step.slots.to(windows.device)
    out, window = causal_conv1d(x, step.cu_seqlens, windows[slots], w, b, out_form=out_form)
    windows[slots] = window
    return out
