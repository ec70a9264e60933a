"""The chunked SSD scan, torch form: the statement of a row's arithmetic that trainer and sampler both run
(why a row is a fixed chain: docs/design.md, "The one idea", "How the bits are kept"). With a_t the cumsum
of dt*A from the chunk start:
    y_t = exp(a_t) C_t . h0 + sum_{s<=t} (C_t . B_s) exp(a_t - a_s) dt_s x_s + D x_t
    h1  = exp(a_L) h0 + sum_s exp(a_L - a_s) dt_s x_s B_s^T
Padding rows (dt = x = B = 0) add exact zeros; cumsums are sequential. In a tile from row t0 the decay for
s < t0 is taken as exp(a_t - a_t0) exp(a_t0 - a_s) (both <= 1, no overflow), inside the diagonal block
directly: 2R + R^2 exponentials a tile and head, not R * L.
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
    """One call's inputs in zero-padded, head-major chunks: x [NC, H, L, P], dt [NC, H, L] (softplus'd, 0 on
    padding), B [NC, G, L, N] fp32; seq, index, length [NC]; packed row r sits at (row_chunk[r], row_pos[r])."""

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
    """The gradient of ``dt_softplus`` against raw dt [..., H] from g fp32: g sigmoid(dt + dt_bias) (g above
    softplus' threshold), zero where clamped; dt_bias's is its sum over the rows."""
    z = dt.to(torch.float32) + dt_bias.to(torch.float32)
    d = torch.where(z > 20.0, g, g * torch.sigmoid(z))
    if tuple(dt_limit) != (0.0, math.inf):
        pre = ew.softplus(z)
        d = torch.where((pre >= float(dt_limit[0])) & (pre <= float(dt_limit[1])), d, torch.zeros((), device=d.device))
    return d


def _prefix_dt(db: torch.Tensor, off: torch.Tensor, fill: int, dt_bias: torch.Tensor,
               dt_limit: tuple[float, float], softplus: Softplus = dt_softplus) -> torch.Tensor:
    """Buffered raw dt [S, H, L] -> fp32: ``dt_softplus`` of rows < off, +0.0 from row off on (only the first
    ``fill`` = max(off) rows go through softplus)."""
    S, H, L = db.shape
    out = torch.zeros(S, H, L, device=db.device)
    d = softplus(db[:, :, :fill].transpose(1, 2), dt_bias, dt_limit).transpose(1, 2)  # bias on the head dim
    filled = torch.arange(fill, device=db.device)[None, None, :] < off[:, None, None]  # [S, 1, fill]
    out[:, :, :fill] = torch.where(filled, d, torch.zeros((), device=db.device))
    return out


@dataclass(frozen=True)
class ChunkGrid:
    """Where one call's chunks lie, from its lengths and buffered rows alone (a step makes it once for all its
    layers); int64 on one device: seq, index, length, row0 [NC] and first, count [S] as ``plan.AdvancePlan``'s,
    row_chunk, row_pos [T], row_lo, row_hi [NC] the sequence's packed rows; fill the most rows buffered."""

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
    """``ChunkGrid`` of cu_seqlens [S+1] new rows after off [S] (None: 0) buffered ones, made on the host and put
    on ``device`` in one asynchronous copy, so a GPU step plans without waiting on the GPU."""
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
    """Cut packed rows into chunks anchored at each sequence's start: x [T, H, P], dt [T, H] raw, B [T, G, N].
    prefix (x_buf [S, H, L, P], raw dt_buf [S, H, L], B_buf [S, G, L, N] in the model dtype, off [S]): the rows
    buffered before each sequence's, x_buf and B_buf zero from off on. Buffered and new dt go through the same
    elementwise ``softplus`` (``dt_softplus`` or a form with its bits), so the same bits; +0.0 on padding.
    grid: these sequences' ``chunk_grid`` on x's device, if the caller has it."""
    dev = x.device
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    L = chunk_size
    if grid is None:
        grid = chunk_grid(cu_seqlens, None if prefix is None else prefix[3], L, dev)
    NC, S, first, fill = grid.num_chunks, grid.first.numel(), grid.first, grid.fill
    at = (grid.row_chunk, slice(None), grid.row_pos)

    # with nothing buffered (fill 0) the prefix softplus is skipped: dt_bias gets no zero-gradient branch
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
    """Where NT row tiles lie in their chunks, from their positions alone (a decode step makes it once for all
    layers): rows [NT, R] int64 positions; before [NT, L] bool columns before the tile; causal [R, R]; neg_inf.
    With one live row per tile (decode): live [NT] its row in the tile, live_pos [NT] in the chunk,
    live_causal [NT, 1, 1, R], tile_ids [NT] arange; else None."""

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
    """a [b, M, K] @ w [b, N, K]^T -> [b, M, N] fp32: one batched BLAS GEMM at the tile's shape ("tiles") or
    the lanes' fixed chains ("lanes", ``ops.linear``)."""
    if form == "tiles":
        return torch.bmm(a, w.transpose(1, 2))
    return lanes(a, w)


def tile_outputs(lay: TileLayout, a: torch.Tensor, dt: torch.Tensor, x: torch.Tensor, B: torch.Tensor,
                 h_in: torch.Tensor, Ct: torch.Tensor, D: torch.Tensor, gemm: str = "lanes") -> torch.Tensor:
    """The output rows of NT row tiles, the one statement of a row's arithmetic (a prefill runs every tile
    with new rows, a decode step the tile holding its token). Each tile's chunk's fp32 operands: a, dt
    [NT, H, L], x [NT, H, L, P], B [NT, G, L, N], h_in [NT, H, P, N]; Ct [NT, G, R, N] (zero in rows not
    wanted); D [H] or [H, P] -> [NT, H, Q, P] fp32, Q = R, or 1 with ``lay.live``. Columns past a row decay
    to exact zeros; the GEMMs always run at the tile's shapes; a live row's elementwise work is its elements
    of the whole tile's, operation by operation."""
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
    # the tile's exponentials (each <= 1) in one call: before the tile, rows vs row 0, diagonal, boundary
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
    """The state n chunks add from a zero boundary, sum_s exp(a_L - a_s) dt_s x_s B_s^T [n, H, P, N], and their
    decay exp(a_L) [n, H, 1, 1], from a, dt [n, H, L], x [n, H, L, P], B [n, G, L, N] fp32."""
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
    """The scan proper: C [T, G, N], rows [T] bool (default all) -> y [T, H, P] fp32 (zero in rows not wanted),
    states [S, H, P, N] fp32 (at the last full-chunk boundary for final "boundary", the end for "end") and
    moved [S] bool (where False, states holds the initial one)."""
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

    need = ch.length == L if final == "boundary" else torch.ones(NC, dtype=torch.bool, device=dev)
    si = torch.nonzero(need).flatten()
    n = si.numel()
    if n:
        # index_select, not t[si]: advanced indexing is ~5x slower
        chunk_state, chunk_decay = chunk_states(*(t.index_select(0, si) for t in (a, ch.dt, ch.x, ch.B)))

    # pass states along each sequence, chunk after chunk, in fp32
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

    # tiles holding wanted rows
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

    # C of the wanted rows in their tiles, other rows zero
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
    """Chunked scan over packed sequences, each starting at a chunk boundary (the scan forms' signature):
    x [T, H, P], dt [T, H] raw, B/C [T, G, N], cu_seqlens [S+1], initial_states [S, H, P, N] fp32 or None;
    rows [T] bool wanted rows; final "end" (states at each sequence's end) or "boundary" (at its last full-chunk
    boundary, what exact replay keeps) -> y [T, H, P] in x's dtype (zero in rows not wanted), states fp32."""
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
    """Advance every slot of ``step`` by its new tokens (the replay forms' signature): x [T, H, P], dt [T, H]
    raw, B/C [T, G, N] in the buffers' dtype, rows [T] bool -> y [T, H, P] in x's dtype, zero in rows not
    wanted. Updates in place the boundary states of completed chunks and the buffers (zero past the fill)."""
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
        state.refresh_copy(slots[moved])
    # new buffers: each slot's last partial chunk; a completed slot is emptied first, the others gain rows
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
