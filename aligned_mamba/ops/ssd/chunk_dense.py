"""The SSD scan as dense per-chunk blocks on ``chunk.py``'s grid, for autograd: the function whose gradient
``triton_backward`` computes (autograd through it is their reference). Not row-invariant, so never a forward.
Deterministic without torch's deterministic mode: every index op moves rows to distinct places, so the
atomics of its backward add into zeros once per element; keep it so.
"""

from __future__ import annotations

import torch

from .chunk import Chunks, pack_chunks
from .state import SSMParams


def dense_outputs(ch: Chunks, C: torch.Tensor, A: torch.Tensor, D: torch.Tensor,
                  h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid ``ch`` (x [NC, H, L, P], dt [NC, H, L], B [NC, G, L, N] fp32), C [T, G, N], A [H], D [H] or [H, P],
    h0 [S, H, P, N] at each first boundary -> y [T, H, P] fp32 of the new rows, final states [S, H, P, N] fp32."""
    NC, H, L, P = ch.x.shape
    G, N = ch.B.shape[1], ch.B.shape[3]
    HG, dev = H // G, ch.x.device
    Cc = torch.zeros(NC, G, L, N, device=dev)
    Cc = Cc.index_put((ch.row_chunk[:, None], torch.arange(G, device=dev)[None, :], ch.row_pos[:, None]),
                      C.to(torch.float32))
    a = torch.cumsum(ch.dt * A.to(torch.float32)[None, :, None], dim=-1)  # [NC, H, L]

    # within the chunk: scores[t, s] = (C_t . B_s) exp(a_t - a_s) dt_s for s <= t, else 0
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    seg = (a[..., :, None] - a[..., None, :]).masked_fill(~causal, float("-inf"))
    CB = Cc @ ch.B.transpose(-1, -2)  # [NC, G, L, L]
    scores = CB[:, :, None] * (seg.exp() * ch.dt[..., None, :]).view(NC, G, HG, L, L)
    y = (scores @ ch.x.view(NC, G, HG, L, P)).view(NC, H, L, P)

    # boundary states: chunk k of every sequence at once
    w = (a[..., -1:] - a).exp() * ch.dt  # [NC, H, L]
    states = (ch.x * w[..., None]).transpose(-1, -2) @ ch.B.repeat_interleave(HG, dim=1)  # [NC, H, P, N]
    decay = a[..., -1].exp()[..., None, None]  # [NC, H, 1, 1]
    h, order, h_ins = h0.to(torch.float32), [], []
    for k in range(int(ch.index.max()) + 1 if NC else 0):
        ck = torch.nonzero(ch.index == k).flatten()
        sq = ch.seq[ck]
        h_in = h.index_select(0, sq)
        order.append(ck)
        h_ins.append(h_in)
        h = h.index_copy(0, sq, decay[ck] * h_in + states[ck])
    if NC:
        inv = torch.empty(NC, dtype=torch.int64, device=dev)
        inv[torch.cat(order)] = torch.arange(NC, device=dev)
        h_in = torch.cat(h_ins).index_select(0, inv)  # [NC, H, P, N] in chunk order
        inter = (Cc.view(NC, G, 1, L, N) @ h_in.view(NC, G, HG, P, N).transpose(-1, -2)).view(NC, H, L, P)
        y = y + a.exp()[..., None] * inter
    Dv = D.to(torch.float32).view(1, H, 1, -1)
    y = y + Dv * ch.x
    return y[ch.row_chunk, :, ch.row_pos], h


def ssd_chunk_dense(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    params: SSMParams,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None = None,
    *,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan forms' signature: x [T, H, P], dt [T, H] raw, B/C [T, G, N], cu_seqlens [S+1] ->
    (y [T, H, P] in x's dtype, states [S, H, P, N] float32 at each sequence's end)."""
    S = cu_seqlens.numel() - 1
    H, P, N = x.shape[1], x.shape[2], B.shape[2]
    if initial_states is None:
        initial_states = torch.zeros(S, H, P, N, device=x.device)
    ch = pack_chunks(x, dt, B, cu_seqlens, chunk_size, params.dt_bias, params.dt_limit)
    y, h = dense_outputs(ch, C, params.A, params.D, initial_states)
    return y.to(x.dtype), h
