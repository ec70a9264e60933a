"""The chunked SSD scan (torch backend): the one kernel both trainer and sampler run.

Every sequence in a call starts at a chunk boundary of its own grid (the caller prepends the
partial chunk it buffered), so chunk k of a sequence always covers the same absolute positions.
Each output row t is then a fixed sequence of float32 operations on

    (the fp32 state at t's chunk boundary, the inputs of t's chunk up to t, t's position),

with every tensor shape fixed by the chunk size and the row tile, never by how many tokens or
sequences the call holds:

- chunks are zero-padded to ``chunk_size``; padded tokens have dt = 0 and x = B = 0, which adds
  exact zeros (a no-op in a float sum);
- rows are computed in tiles of ``row_tile`` rows; a decode step computes the one tile holding
  its token with the same GEMM shapes as a prefill computing all tiles (a GEMM row depends on
  that row's operands only);
- transcendentals come from ``elementwise`` (position-invariant), cumsums are sequential;
- states pass from chunk to chunk in float32 and are never rounded.

Within a chunk, with a_t the cumulative sum of dt*A from the chunk start:

    y_t = exp(a_t) C_t . h0 + sum_{s<=t} (C_t . B_s) exp(a_t - a_s) dt_s x_s + D x_t
    h1  = exp(a_L) h0 + sum_s exp(a_L - a_s) dt_s x_s B_s^T

For a tile starting at row t0 the decay exp(a_t - a_s) is taken as exp(a_t - a_t0) exp(a_t0 - a_s)
for s < t0 (both factors <= 1, so nothing overflows) and directly inside the tile's own
diagonal block: 2*R + R^2 exponentials per tile instead of R * chunk_size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import elementwise as ew


@dataclass(frozen=True)
class ChunkPlan:
    """Where each chunk of each sequence lies in a packed call.

    tok [NC, L] int64: packed row of each chunk slot (T for padding); valid [NC, L] bool;
    seq [NC]: owning sequence; index [NC]: chunk number within the sequence; length [NC].
    """

    tok: torch.Tensor
    valid: torch.Tensor
    seq: torch.Tensor
    index: torch.Tensor
    length: torch.Tensor


def plan_chunks(cu_seqlens: torch.Tensor, chunk_size: int) -> ChunkPlan:
    """Cut every packed sequence into chunks anchored at the sequence's own start."""
    cu = cu_seqlens.to(torch.int64).cpu()
    lens = cu[1:] - cu[:-1]
    nch = (lens + chunk_size - 1) // chunk_size
    S = lens.numel()
    seq = torch.repeat_interleave(torch.arange(S), nch)
    first = torch.cumsum(nch, 0) - nch
    index = torch.arange(seq.numel()) - first[seq]
    start = cu[seq] + index * chunk_size
    length = torch.minimum(torch.full_like(start, chunk_size), cu[seq + 1] - start)
    pos = torch.arange(chunk_size)
    valid = pos[None, :] < length[:, None]
    T = int(cu[-1])
    tok = torch.where(valid, start[:, None] + pos[None, :], torch.full_like(valid, T, dtype=torch.int64))
    return ChunkPlan(tok=tok, valid=valid, seq=seq, index=index, length=length)


def _gather_padded(t: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """t [T, ...] -> [NC, L, ...] float32 with zero rows for padding (index T)."""
    tf = t.to(torch.float32)
    pad = torch.zeros((1,) + tuple(tf.shape[1:]), dtype=tf.dtype, device=tf.device)
    return torch.cat([tf, pad])[tok]


def dt_softplus(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float]) -> torch.Tensor:
    """softplus(dt + dt_bias), clamped to dt_limit when one is set. [T, H] -> [T, H] float32."""
    d = ew.softplus(dt.to(torch.float32) + dt_bias.to(torch.float32))
    if tuple(dt_limit) != (0.0, math.inf):
        d = d.clamp(float(dt_limit[0]), float(dt_limit[1]))
    return d


def chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor,
    chunk_size: int,
    *,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    rows: torch.Tensor | None = None,
    final: str = "boundary",
    row_tile: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked scan over packed sequences, each starting at a chunk boundary.

    Args:
        x: [T, H, P] (bf16 or fp32). dt: [T, H] raw dt. B, C: [T, G, N].
        A: [H] fp32 (negative). D: [H] or [H, P]. dt_bias: [H].
        cu_seqlens: [S+1] int64 offsets of the sequences in the packed rows.
        initial_states: [S, H, P, N] float32, the state at each sequence's first row.
        rows: [T] bool, the rows whose outputs are wanted (default all); C of the others is unused.
        final: "boundary" returns each sequence's state at its last full-chunk boundary (what
            exact replay keeps); "end" folds the trailing partial chunk in too (the baseline's
            running state).

    Returns:
        y [T, H, P] in x's dtype (zero in rows not wanted) and states [S, H, P, N] float32.
    """
    if final not in ("boundary", "end"):
        raise ValueError(f"final must be 'boundary' or 'end', not {final!r}")
    if chunk_size % row_tile:
        raise ValueError(f"chunk_size {chunk_size} is not a multiple of the row tile {row_tile}")
    dev = x.device
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    L, R = chunk_size, row_tile
    plan = plan_chunks(cu_seqlens, L)
    tok = plan.tok.to(dev)
    NC = tok.shape[0]
    head_group = torch.arange(H, device=dev) // (H // G)

    dtp = dt_softplus(dt, dt_bias, dt_limit)  # [T, H]
    dtc = _gather_padded(dtp, tok).transpose(1, 2)  # [NC, H, L]; padding: dt = 0
    a = torch.cumsum(dtc * A.to(torch.float32)[None, :, None], dim=-1)  # [NC, H, L]
    xc = _gather_padded(x, tok).permute(0, 2, 1, 3)  # [NC, H, L, P]
    Bc = _gather_padded(B, tok).permute(0, 2, 1, 3)  # [NC, G, L, N]

    # Chunk states (from a zero boundary): sum_s exp(a_L - a_s) dt_s x_s B_s^T.
    need = plan.length == L if final == "boundary" else torch.ones(NC, dtype=torch.bool)
    sidx = torch.nonzero(need).flatten()
    chunk_state = torch.zeros(NC, H, P, N, device=dev)
    if sidx.numel():
        si = sidx.to(dev)
        w = ew.exp(a[si, :, -1:] - a[si]) * dtc[si]  # [n, H, L]
        xw = (xc[si] * w[..., None]).transpose(-1, -2)  # [n, H, P, L]
        Bh = Bc[si][:, head_group]  # [n, H, L, N]
        n = si.numel()
        chunk_state[si] = torch.bmm(xw.reshape(n * H, P, L), Bh.reshape(n * H, L, N)).view(n, H, P, N)

    # Pass states along each sequence, chunk after chunk, in float32.
    h = initial_states.to(torch.float32).clone()
    h_in = torch.empty(NC, H, P, N, device=dev)
    chunk_decay = ew.exp(a[:, :, -1])  # [NC, H]
    for k in range(int(plan.index.max()) + 1 if NC else 0):
        ck = torch.nonzero(plan.index == k).flatten()
        sq = plan.seq[ck].to(dev)
        ck = ck.to(dev)
        h_in[ck] = h[sq]
        upd = need[ck.cpu()].to(dev)
        cu_, su_ = ck[upd], sq[upd]
        h[su_] = chunk_decay[cu_][:, :, None, None] * h[su_] + chunk_state[cu_]

    y = torch.zeros(T, H, P, dtype=x.dtype, device=dev)
    want = plan.valid.clone()
    if rows is not None:
        want &= torch.cat([rows.cpu().to(torch.bool), torch.zeros(1, dtype=torch.bool)])[plan.tok]
    tiles = torch.nonzero(want.view(NC, L // R, R).any(-1))
    if tiles.numel() == 0:
        return y, h
    tc, tr = tiles[:, 0].to(dev), tiles[:, 1].to(dev)
    NT = tc.numel()
    ar = torch.arange(R, device=dev)
    rows_in_chunk = tr[:, None] * R + ar  # [NT, R]
    a_c = a[tc]  # [NT, H, L]
    a_t = a_c.gather(-1, rows_in_chunk[:, None, :].expand(NT, H, R))  # [NT, H, R]
    a_0 = a_t[..., :1]  # the tile's first row
    s_pos = torch.arange(L, device=dev)
    before = s_pos[None, :] < (tr * R)[:, None]  # [NT, L] columns strictly before the tile
    neg_inf = torch.tensor(-math.inf, device=dev)
    e_col = ew.exp(torch.where(before[:, None, :], a_0 - a_c, neg_inf))  # [NT, H, L], <= 1
    e_row = ew.exp(a_t - a_0)  # [NT, H, R], <= 1
    decay = e_row[..., :, None] * e_col[..., None, :]  # [NT, H, R, L]
    causal = ar[:, None] >= ar[None, :]  # [R, R]
    diag = ew.exp(torch.where(causal, a_t[..., :, None] - a_t[..., None, :], neg_inf))  # [NT, H, R, R]
    decay.scatter_(-1, rows_in_chunk[:, None, None, :].expand(NT, H, R, R), diag)

    tile_tok = plan.tok.to(dev)[tc[:, None], rows_in_chunk]  # [NT, R] packed rows (T = padding)
    tile_want = want.to(dev)[tc[:, None], rows_in_chunk]
    Ct = _gather_padded(C, torch.where(tile_want, tile_tok, T))  # [NT, R, G, N]; unwanted rows: 0
    Ct = Ct.permute(0, 2, 1, 3)  # [NT, G, R, N]
    CB = torch.bmm(Ct.reshape(NT * G, R, N), Bc[tc].transpose(-1, -2).reshape(NT * G, N, L))
    CB = CB.view(NT, G, R, L)[:, head_group]  # [NT, H, R, L]
    dt_t = dtc[tc]  # [NT, H, L]
    scores = (CB * decay) * dt_t[:, :, None, :]
    intra = torch.bmm(scores.reshape(NT * H, R, L), xc[tc].reshape(NT * H, L, P)).view(NT, H, R, P)
    Ch = Ct[:, head_group]  # [NT, H, R, N]
    hT = h_in[tc].transpose(-1, -2)  # [NT, H, N, P]
    inter = torch.bmm(Ch.reshape(NT * H, R, N), hT.reshape(NT * H, N, P)).view(NT, H, R, P)
    inter = inter * ew.exp(a_t)[..., None]
    x_t = _gather_padded(x, tile_tok).permute(0, 2, 1, 3)  # [NT, H, R, P]
    Df = D.to(torch.float32)
    Df = Df[:, None] if Df.dim() == 1 else Df
    out = (inter + intra) + Df[None, :, None, :] * x_t  # [NT, H, R, P]

    out = out.permute(0, 2, 1, 3).reshape(NT * R, H, P)
    flat_tok, flat_want = tile_tok.reshape(-1), tile_want.reshape(-1)
    y[flat_tok[flat_want]] = out[flat_want].to(x.dtype)
    return y, h
