"""The chunked SSD scan (torch backend): the one kernel both trainer and sampler run.

Every sequence in a call starts at a chunk boundary of its own grid (exact replay passes the
partial chunk it buffered as a prefix), so chunk k of a sequence always covers the same absolute
positions. Each output row t is then a fixed sequence of float32 operations on

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
diagonal block: 2R + R^2 exponentials per tile and head instead of R * chunk_size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .. import elementwise as ew
from ..configs import TorchKernelConfigs
from ..linear import lanes
from .state import SSDState, SSMParams, Step


@dataclass
class Chunks:
    """One call's inputs, cut into zero-padded, head-major chunks.

    x [NC, H, L, P], dt [NC, H, L] (after softplus; 0 on padding), B [NC, G, L, N]: float32.
    seq [NC] owning sequence, index [NC] chunk number within it, length [NC] valid rows.
    Row r of the packed new tokens sits at chunk ``row_chunk[r]``, position ``row_pos[r]``.
    """

    x: torch.Tensor
    dt: torch.Tensor
    B: torch.Tensor
    seq: torch.Tensor
    index: torch.Tensor
    length: torch.Tensor
    row_chunk: torch.Tensor
    row_pos: torch.Tensor


def dt_softplus(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float]) -> torch.Tensor:
    """softplus(dt + dt_bias) in float32, clamped to dt_limit when one is set; bias on the last dim."""
    d = ew.softplus(dt.to(torch.float32) + dt_bias.to(torch.float32))
    if tuple(dt_limit) != (0.0, math.inf):
        d = d.clamp(float(dt_limit[0]), float(dt_limit[1]))
    return d


Softplus = Callable[[torch.Tensor, torch.Tensor, tuple[float, float]], torch.Tensor]


def dt_softplus_backward(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float],
                         g: torch.Tensor) -> torch.Tensor:
    """The gradient of ``dt_softplus`` against its raw dt, from g (its output's gradient, fp32, dt's
    shape [..., H]): g sigmoid(dt + dt_bias) (g itself above softplus' threshold), zero where the
    limit clamped. fp32; the same for dt_bias, summed over the rows."""
    z = dt.to(torch.float32) + dt_bias.to(torch.float32)
    d = torch.where(z > 20.0, g, g * torch.sigmoid(z))
    if tuple(dt_limit) != (0.0, math.inf):
        pre = ew.softplus(z)
        d = torch.where((pre >= float(dt_limit[0])) & (pre <= float(dt_limit[1])), d, torch.zeros((), device=d.device))
    return d


def _prefix_dt(db: torch.Tensor, off: torch.Tensor, fill: int, dt_bias: torch.Tensor,
               dt_limit: tuple[float, float], softplus: Softplus = dt_softplus) -> torch.Tensor:
    """Buffered raw dt [S, H, L] -> fp32 [S, H, L]: ``dt_softplus`` of rows < off, +0.0 from row off on.

    Only the first ``fill`` (= max(off)) rows go through softplus; the rest are zero in any case.
    """
    S, H, L = db.shape
    out = torch.zeros(S, H, L, device=db.device)
    d = softplus(db[:, :, :fill].transpose(1, 2), dt_bias, dt_limit).transpose(1, 2)  # bias on the head dim
    filled = torch.arange(fill, device=db.device)[None, None, :] < off[:, None, None]  # [S, 1, fill]
    out[:, :, :fill] = torch.where(filled, d, torch.zeros((), device=db.device))
    return out


@dataclass(frozen=True)
class ChunkGrid:
    """Where one call's chunks lie: a function of its sequences' lengths and buffered rows alone,
    so a step computes it once for all its layers (``chunk_grid``).

    num_chunks NC; fill: the most rows any sequence buffered (0 when none). int64 on one device:
    seq, index, length [NC] (owning sequence, chunk number in it, valid rows); first, count [S]
    (each sequence's first chunk and number of chunks); row_chunk, row_pos [T] (where packed row r
    sits); row0, row_lo, row_hi [NC] (the packed row at the chunk's position 0, which may lie before
    its sequence's rows when rows are buffered, and the sequence's rows [row_lo, row_hi)).
    """

    num_chunks: int
    fill: int
    seq: torch.Tensor
    index: torch.Tensor
    length: torch.Tensor
    first: torch.Tensor
    count: torch.Tensor
    row_chunk: torch.Tensor
    row_pos: torch.Tensor
    row0: torch.Tensor
    row_lo: torch.Tensor
    row_hi: torch.Tensor


def chunk_grid(cu_seqlens: torch.Tensor, off: torch.Tensor | None, chunk_size: int,
               device: torch.device | str) -> ChunkGrid:
    """The chunk grid of sequences with cu_seqlens [S+1] new rows after off [S] buffered ones (None:
    none), worked out on the host (``plan.chunk_layout``: a device cu_seqlens is read back once) and put
    on ``device`` in one asynchronous copy (``plan.host_to_device``), so a GPU step plans without waiting
    on the GPU."""
    from .plan import chunk_layout, host_ints, host_to_device

    cu = host_ints(cu_seqlens)
    lens = cu[1:] - cu[:-1]
    off = np.zeros_like(lens) if off is None else host_ints(off)
    lay = chunk_layout(lens, off, chunk_size)
    row_chunk, row_pos = lay.rows()
    parts = (lay.seq, lay.index, lay.length, lay.first, lay.count, row_chunk, row_pos, lay.row0, cu[:-1][lay.seq],
             cu[1:][lay.seq])
    flat = host_to_device(np.concatenate(parts), device)
    tables = torch.split(flat, [t.shape[0] for t in parts])
    return ChunkGrid(int(lay.seq.shape[0]), int(off.max()) if lens.shape[0] else 0, *tables)


def pack_chunks(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_size: int,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    *,
    grid: ChunkGrid | None = None,
    softplus: Softplus = dt_softplus,
) -> Chunks:
    """Cut packed rows into chunks anchored at each sequence's start.

    x [T, H, P], dt [T, H] raw, B [T, G, N], cu_seqlens [S+1].
    prefix: (x_buf [S, H, L, P], dt_buf [S, H, L] (raw dt), B_buf [S, G, L, N], all in the model
    dtype, off [S]): the rows buffered before each sequence's new rows, rows 0 .. off-1 of its
    first chunk, head-major; rows >= off of x_buf and B_buf must be zero (those of dt_buf are
    ignored). Buffered and new dt both go through ``dt_softplus`` here, which acts element by
    element, so a buffered row's dt is the bits a fresh computation gives; the result's dt is
    exactly +0.0 on padding rows (rows >= the chunk's length).
    grid: ``chunk_grid`` of these sequences on x's device, if the caller has it (else made here).
    softplus: ``dt_softplus`` or a form with its bits (``triton_math.dt_softplus_triton``).
    """
    dev = x.device
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    L = chunk_size
    if grid is None:
        grid = chunk_grid(cu_seqlens, None if prefix is None else prefix[3], L, dev)
    NC, S, first, fill = grid.num_chunks, grid.first.numel(), grid.first, grid.fill
    at = (grid.row_chunk, slice(None), grid.row_pos)

    # Buffered dt is raw: softplus it here (rows < off only). When no slot buffers anything (a
    # prefill from empty, the trainer's forward) that is skipped: dt_bias gets no zero-gradient branch.
    if prefix is not None:
        xb, db, bb, off = prefix
        off = off.to(device=dev, dtype=torch.int64)
    if prefix is not None and NC == S:  # every sequence fits in its first chunk (decode): no zero fill
        xc, Bc = xb.to(torch.float32), bb.to(torch.float32)
        dtc = _prefix_dt(db, off, fill, dt_bias, dt_limit, softplus) if fill else torch.zeros(NC, H, L, device=dev)
    else:
        xc = torch.zeros(NC, H, L, P, device=dev)
        dtc = torch.zeros(NC, H, L, device=dev)
        Bc = torch.zeros(NC, G, L, N, device=dev)
        if prefix is not None and S:
            xc[first], Bc[first] = xb.to(torch.float32), bb.to(torch.float32)
            if fill:
                dtc[first] = _prefix_dt(db, off, fill, dt_bias, dt_limit, softplus)
    xc[at] = x.to(torch.float32)
    dtc[at] = softplus(dt, dt_bias, dt_limit)
    Bc[at] = B.to(torch.float32)
    return Chunks(x=xc, dt=dtc, B=Bc, seq=grid.seq, index=grid.index, length=grid.length, row_chunk=grid.row_chunk,
                  row_pos=grid.row_pos)


@dataclass(frozen=True)
class TileLayout:
    """Where NT row tiles lie in their chunks: what the tile arithmetic indexes with, fixed by the
    tiles' positions alone (so a decode step computes it once for all its layers).

    rows [NT, R] int64: each tile row's position in its chunk; before [NT, L] bool: the chunk's
    columns before the tile's first row; causal [R, R] bool: row >= column inside the tile;
    neg_inf: the -inf scalar that masked exponents take. With one live row per tile (a decode
    step): live [NT] its row in the tile, live_pos [NT] its position in the chunk, live_causal
    [NT, 1, 1, R] its row of ``causal``, tile_ids [NT] = 0 .. NT-1; all None otherwise.
    """

    rows: torch.Tensor
    before: torch.Tensor
    causal: torch.Tensor
    neg_inf: torch.Tensor
    live: torch.Tensor | None = None
    live_pos: torch.Tensor | None = None
    live_causal: torch.Tensor | None = None
    tile_ids: torch.Tensor | None = None


def tile_layout(tile: torch.Tensor, L: int, R: int, live: torch.Tensor | None = None) -> TileLayout:
    """The layout of tiles number ``tile`` [NT] (int64, row tiles of R rows in chunks of L); live [NT]
    (optional): the one row of each tile whose output is wanted."""
    dev = tile.device
    ar = torch.arange(R, device=dev)
    rows = tile[:, None] * R + ar
    causal = ar[:, None] >= ar[None, :]
    lay = TileLayout(rows=rows, before=torch.arange(L, device=dev)[None, :] < (tile * R)[:, None], causal=causal,
                     neg_inf=torch.tensor(-math.inf, device=dev))
    if live is None:
        return lay
    return dataclasses.replace(lay, live=live, live_pos=tile * R + live, live_causal=causal[live][:, None, None, :],
                               tile_ids=torch.arange(tile.shape[0], device=dev))


def tile_gemm(a: torch.Tensor, w: torch.Tensor, form: str) -> torch.Tensor:
    """a [b, M, K] @ w [b, N, K]^T -> [b, M, N] float32 in the contract's GEMM form (``ops.linear``):
    one batched BLAS GEMM at the tile's shape ("tiles") or the lanes' fixed chains ("lanes", where a
    row's bits do not depend on the other rows of the call, so a decode step may compute its row alone)."""
    if form == "tiles":
        return torch.bmm(a, w.transpose(1, 2))
    return lanes(a, w)


def tile_outputs(lay: TileLayout, a: torch.Tensor, dt: torch.Tensor, x: torch.Tensor, B: torch.Tensor,
                 h_in: torch.Tensor, Ct: torch.Tensor, D: torch.Tensor, gemm: str = "lanes") -> torch.Tensor:
    """The output rows of NT row tiles: the one statement of a row's arithmetic, which a prefill
    runs for every tile holding new rows and a decode step for the tile holding its token.

    Per tile, its chunk's operands in float32: a [NT, H, L] (cumsum of dt*A), dt [NT, H, L], x
    [NT, H, L, P], B [NT, G, L, N]; h_in [NT, H, P, N] the chunk's boundary state; Ct [NT, G, R, N]
    C of the tile's rows (zero in rows not wanted); D [H] or [H, P]. Returns [NT, H, Q, P] float32:
    every row (Q = R), or with ``lay.live`` set each tile's live row (Q = 1).

    Columns past a row carry a zero decay, so what the chunk holds there (later tokens in a
    prefill, zeros in a decode) adds exact zeros: a row's bits depend on columns up to it only.
    The GEMMs always run at the tile's shapes, [R, N] x [N, L], [R, L] x [L, P] and [R, N] x
    [N, Hg*P], in the ``gemm`` form (``tile_gemm``; a GEMM row's bits depend on that row's operands,
    not on the other rows); the elementwise work of a live row is that row's elements of the whole
    tile's, operation by operation.
    """
    NT, H, L, P = x.shape
    G, N = B.shape[1], B.shape[3]
    R = Ct.shape[2]
    Hg = H // G  # heads per group
    rows_in_chunk, neg_inf = lay.rows, lay.neg_inf
    a_t = a.gather(-1, rows_in_chunk[:, None, :].expand(NT, H, R))  # [NT, H, R]
    a_0 = a_t[..., :1]
    if lay.live is None:
        Q, a_q, causal = R, a_t, lay.causal
    else:
        Q, a_q, causal = 1, a.gather(-1, lay.live_pos[:, None, None].expand(NT, H, 1)), lay.live_causal
    # All exponentials of the tile in one call (each is <= 1): columns before the tile, the
    # tile's rows against its first row, its diagonal block, and the boundary-state decay.
    args = (
        torch.where(lay.before[:, None, :], a_0 - a, neg_inf),  # [NT, H, L]
        a_q - a_0,  # [NT, H, Q]
        torch.where(causal, a_q[..., :, None] - a_t[..., None, :], neg_inf),  # [NT, H, Q, R]
        a_q,  # [NT, H, Q]
    )
    e = ew.exp(torch.cat([t.reshape(NT, H, -1) for t in args], dim=-1))
    e_col, e_row, diag, e_in = torch.split(e, [L, Q, Q * R, Q], dim=-1)
    decay = e_row[..., :, None] * e_col[..., None, :]  # [NT, H, Q, L]
    decay.scatter_(-1, rows_in_chunk[:, None, None, :].expand(NT, H, Q, R), diag.reshape(NT, H, Q, R))

    CB = tile_gemm(Ct.view(NT * G, R, N), B.view(NT * G, L, N), gemm)  # [NT*G, R, L]
    # C_t . h_in for all heads of a group in one GEMM: [R, N] x [N, Hg*P]
    inter = tile_gemm(Ct.view(NT * G, R, N), h_in.reshape(NT * G, Hg * P, N), gemm)
    if lay.live is not None:
        ids, live = lay.tile_ids, lay.live
        CB = CB.view(NT, G, R, L)[ids, :, live]  # [NT, G, L]
        inter = inter.view(NT, G, R, Hg * P)[ids, :, live]  # [NT, G, Hg*P]
    # (C.B) * decay * dt, with a group's C.B broadcast over its heads
    scores = (CB.view(NT, G, 1, Q, L) * decay.view(NT, G, Hg, Q, L)) * dt.view(NT, G, Hg, 1, L)
    if lay.live is None:
        intra = _intra(scores.view(NT * H, R, L), x.view(NT * H, L, P), gemm).view(NT, H, R, P)
        x_t = x.gather(2, rows_in_chunk[:, None, :, None].expand(NT, H, R, P))  # [NT, H, R, P]
    else:  # the live row in its place in a zero tile: the GEMM's shape
        tiles = scores.new_zeros(NT, H, R, L)
        tiles[ids, :, live] = scores.view(NT, H, L)
        intra = _intra(tiles.view(NT * H, R, L), x.view(NT * H, L, P), gemm).view(NT, H, R, P)[ids, :, live][:, :, None]
        x_t = x[ids, :, lay.live_pos][:, :, None]  # [NT, H, 1, P]
    inter = inter.view(NT, G, Q, Hg, P).permute(0, 1, 3, 2, 4).reshape(NT, H, Q, P) * e_in[..., None]
    Df = D.to(torch.float32)
    Df = Df[:, None] if Df.dim() == 1 else Df
    return (inter + intra) + Df[None, :, None, :] * x_t  # [NT, H, Q, P]


def _intra(scores: torch.Tensor, x: torch.Tensor, gemm: str) -> torch.Tensor:
    """scores [b, R, L] @ x [b, L, P] -> [b, R, P] float32 (the lanes take x transposed, [b, P, L])."""
    if gemm == "tiles":
        return torch.bmm(scores, x)
    return lanes(scores, x.transpose(1, 2))


def chunk_states(a: torch.Tensor, dt: torch.Tensor, x: torch.Tensor,
                 B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The state n chunks add from a zero boundary, sum_s exp(a_L - a_s) dt_s x_s B_s^T, and their
    decay exp(a_L): what a prefill and a decode step's chunk completion both fold into the state.

    a, dt [n, H, L], x [n, H, L, P], B [n, G, L, N] float32. Returns ([n, H, P, N], [n, H, 1, 1]).
    """
    n, H, L, P = x.shape
    G, N = B.shape[1], B.shape[3]
    Hg = H // G
    w = ew.exp(a[:, :, -1:] - a) * dt  # [n, H, L]
    xw = (x * w[..., None]).view(n * G, Hg * L, P)  # heads of a group stacked on rows
    xw = xw.view(n * G, Hg, L, P).transpose(1, 2).reshape(n * G, L, Hg * P)
    st = torch.bmm(xw.transpose(1, 2), B.view(n * G, L, N))  # [n*G, Hg*P, N]
    return st.view(n, H, P, N), ew.exp(a[:, :, -1])[:, :, None, None]


def fold_state(h: torch.Tensor, decay: torch.Tensor, chunk_state: torch.Tensor) -> torch.Tensor:
    """The state at a chunk's end from the state at its boundary: decay * h + chunk_state (float32)."""
    return decay * h + chunk_state


def scan_chunks(
    ch: Chunks,
    C: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    initial_states: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    final: str = "boundary",
    row_tile: int = 16,
    gemm: str = "lanes",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scan proper. C [T, G, N] for the packed new rows; rows [T] bool (default all).

    Returns y [T, H, P] float32 (zero in rows not wanted), states [S, H, P, N] float32 (at each
    sequence's last full-chunk boundary for final="boundary", at its end for "end") and
    moved [S] bool (whether a sequence's state changed; where not, states holds the initial one).
    """
    if final not in ("boundary", "end"):
        raise ValueError(f"final must be 'boundary' or 'end', not {final!r}")
    NC, H, L, P = ch.x.shape
    G, N = ch.B.shape[1], ch.B.shape[3]
    S = initial_states.shape[0]
    R = row_tile
    if L % R:
        raise ValueError(f"chunk_size {L} is not a multiple of the row tile {R}")
    dev = ch.x.device
    T = C.shape[0]
    a = torch.cumsum(ch.dt * A.to(torch.float32)[None, :, None], dim=-1)  # [NC, H, L]
    h0 = initial_states.to(torch.float32)

    # Chunk states from a zero boundary: sum_s exp(a_L - a_s) dt_s x_s B_s^T, [n, H, P, N].
    need = ch.length == L if final == "boundary" else torch.ones(NC, dtype=torch.bool, device=dev)
    si = torch.nonzero(need).flatten()
    n = si.numel()
    if n:
        # index_select, not t[si]: the same rows, copied whole (advanced indexing is ~5x slower)
        chunk_state, chunk_decay = chunk_states(*(t.index_select(0, si) for t in (a, ch.dt, ch.x, ch.B)))

    # Pass states along each sequence, chunk after chunk, in float32.
    moved = torch.zeros(S, dtype=torch.bool, device=dev)
    if NC == S:  # one chunk per sequence (decode, short prefill): its boundary state is the initial one
        h_in = h0
        h = h0
        if n:
            h = h0.clone()
            h[ch.seq[si]] = fold_state(h0.index_select(0, ch.seq[si]), chunk_decay, chunk_state)
            moved[ch.seq[si]] = True
    else:
        h = h0.clone()
        h_in = torch.empty(NC, H, P, N, device=dev)
        slot_of = torch.full((NC,), -1, dtype=torch.int64, device=dev)
        slot_of[si] = torch.arange(n, device=dev)
        for k in range(int(ch.index.max()) + 1):
            ck = torch.nonzero(ch.index == k).flatten()
            sq = ch.seq[ck]
            h_in[ck] = h[sq]
            upd = need[ck]
            cu_, su_ = slot_of[ck[upd]], sq[upd]
            h[su_] = fold_state(h[su_], chunk_decay[cu_], chunk_state[cu_])
        moved[ch.seq[si]] = True

    # Tiles holding wanted rows.
    want = torch.ones(T, dtype=torch.bool, device=dev) if rows is None else rows.to(dev)
    tile_id = torch.full((NC, L // R), -1, dtype=torch.int64, device=dev)
    tile_id[ch.row_chunk[want], ch.row_pos[want] // R] = 0
    tiles = torch.nonzero(tile_id >= 0)
    y = torch.zeros(T, H, P, device=dev)
    if tiles.numel() == 0:
        return y, h, moved
    NT = tiles.shape[0]
    tile_id[tiles[:, 0], tiles[:, 1]] = torch.arange(NT, device=dev)
    tc, tr = tiles[:, 0], tiles[:, 1]
    ident = NT == NC and bool((tc == torch.arange(NC, device=dev)).all())

    # C of the wanted rows, placed in their tiles (other rows stay zero).
    rt = tile_id[ch.row_chunk, ch.row_pos // R]
    Ct = torch.zeros(NT, G, R, N, device=dev)
    Ct[rt[want], :, ch.row_pos[want] % R] = C[want].to(torch.float32)
    pick = (lambda t: t) if ident else (lambda t: t.index_select(0, tc))
    out = tile_outputs(tile_layout(tr, L, R), pick(a), pick(ch.dt), pick(ch.x), pick(ch.B), pick(h_in), Ct, D, gemm)
    y[want] = out[rt[want], :, ch.row_pos[want] % R]
    return y, h, moved


def ssd_chunk(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    params: SSMParams,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None = None,
    *,
    chunk_size: int,
    row_tile: int = 16,
    gemm: str = "lanes",
    final: str = "end",
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked scan over packed sequences, each starting at a chunk boundary (the forms' signature).

    x [T, H, P] (bf16 or fp32), dt [T, H] raw, B/C [T, G, N], cu_seqlens [S+1] int64 offsets of the
    sequences in the packed rows, initial_states [S, H, P, N] float32 (the state at each sequence's
    first row; None: zeros). rows [T] bool: the rows whose outputs are wanted (default all).
    final: "end" folds every chunk into the returned states (a sequence's state at its last row),
    "boundary" stops at each sequence's last full-chunk boundary (what exact replay keeps).

    Returns y [T, H, P] in x's dtype (zero in rows not wanted) and states [S, H, P, N] float32.
    """
    S = cu_seqlens.numel() - 1
    H, P, N = x.shape[1], x.shape[2], B.shape[2]
    if initial_states is None:
        initial_states = torch.zeros(S, H, P, N, device=x.device)
    ch = pack_chunks(x, dt, B, cu_seqlens, chunk_size, params.dt_bias, params.dt_limit)
    y, h, _ = scan_chunks(ch, C, params.A, params.D, initial_states, rows=rows, final=final, row_tile=row_tile,
                          gemm=gemm)
    return y.to(x.dtype), h


def replay_chunk(
    state: SSDState,
    step: Step,
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    params: SSMParams,
    *,
    rows: torch.Tensor | None = None,
    cfg: TorchKernelConfigs,
) -> torch.Tensor:
    """Advance every slot of ``step`` by its new tokens on the torch backend (the replay forms'
    signature); returns y [T, H, P] in x's dtype, zero in rows not wanted.

    x [T, H, P], dt [T, H] raw, B/C [T, G, N] in the model dtype (the buffers'); rows [T] bool
    (default all). Updates ``state`` in place: boundary states of the slots whose chunk completed,
    buffers (rows past a slot's fill level stay zero, so a slot's buffer is its first chunk's
    zero-padded prefix; ``pack_chunks`` zeroes the softplus'd dt past the fill level).
    """
    state.check_inputs(x, dt, B)
    L = state.chunk_size
    dev = x.device
    slots, cu = step.slots.to(dev), step.cu_seqlens.to(dev)
    lens = cu[1:] - cu[:-1]
    off = step.start_pos.to(dev) % L  # rows buffered since the boundary
    prefix = (state.buf_x.index_select(0, slots), state.buf_dt.index_select(0, slots),
              state.buf_B.index_select(0, slots), off)
    ch = pack_chunks(x, dt, B, cu, L, params.dt_bias, params.dt_limit, prefix=prefix)
    y, h, moved = scan_chunks(ch, C, params.A, params.D, state.ssm_state.index_select(0, slots), rows=rows,
                              final="boundary", row_tile=cfg.scan_row_tile(L), gemm=cfg.gemm_form)
    if bool(moved.any()):
        state.ssm_state[slots[moved]] = h[moved]
    # New buffer: the rows of each slot's last, partial chunk. A slot whose chunk completed is
    # emptied first (rows past the fill level stay zero); the others only gain rows.
    rem = (off + lens) % L
    crossed = off + lens >= L
    if bool(crossed.any()):
        for buf in (state.buf_x, state.buf_dt, state.buf_B):
            buf.index_fill_(0, slots[crossed], 0)
    row_seq = torch.repeat_interleave(torch.arange(slots.numel(), device=dev), lens, output_size=x.shape[0])
    last_chunk = ch.row_chunk == (torch.cumsum((off + lens + L - 1) // L, 0) - 1)[row_seq]
    keep = last_chunk & (rem[row_seq] > 0)
    dst_slot, dst_pos = slots[row_seq[keep]], ch.row_pos[keep]
    state.buf_x[dst_slot, :, dst_pos] = x[keep]
    state.buf_dt[dst_slot, :, dst_pos] = dt[keep]  # raw: pack_chunks applies softplus on replay
    state.buf_B[dst_slot, :, dst_pos] = B[keep]
    return y.to(x.dtype)
