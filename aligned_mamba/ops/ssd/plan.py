"""The layout of one advance, worked out on the host from each sequence's (off, n) alone (numpy: microseconds a
table, where torch CPU ops cost tens): which chunk holds which rows, which chunks complete, which row tiles hold
wanted rows; no device syncs. A step plans once for all its layers (``StepPlan.ssd_chunk``); ``to_device`` moves
the tables in one asynchronous copy, and the kernels never ask the device how many chunks or tiles there are.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    pass


@dataclass
class AdvancePlan:
    """``plan_advance``'s tables: int64 numpy arrays (bool for need, moved) on the host, int64 tensors on a
    device (``to_device``). Per chunk of NC, per sequence of S, per row tile of NT (R rows of one chunk that
    hold a wanted row)."""

    seq: Any  # [NC] owning sequence
    index: Any  # [NC] chunk number within it
    length: Any  # [NC] valid rows (<= L)
    pre: Any  # [NC] rows from the slot's buffer (off for a sequence's first chunk, else 0)
    row0: Any  # [NC] packed row of position 0: position s, pre <= s < length, holds packed row row0 + s
    part: Any  # [NC] index among the chunks with pre > 0 (copied whole), -1 for the others (read in place)
    need: Any  # [NC] the chunk's state is folded (length == L; every chunk for final "end")
    first: Any  # [S] first chunk
    count: Any  # [S] number of chunks
    moved: Any  # [S] whether the boundary moves
    keep_lo: Any  # [S] rows [keep_lo, keep_hi) of the new buffer are written (from keep_lo on, new rows)
    keep_hi: Any
    keep_row0: Any  # [S] packed row of buffer row 0
    clear_hi: Any  # [S] rows keep_hi .. clear_hi - 1 become zero
    tile_chunk: Any  # [NT] the tile's chunk
    tile_pos: Any  # [NT] its first row's position
    tile_rows: Any  # [NT, R] each tile row's packed row, -1 where not a wanted new row
    slot: Any  # [S] slot in the replay state
    chunk_slot: Any  # [NC] slot[seq]
    state_chunks: Any  # [n] the chunks with need set, in order
    chunk_id: Any  # [NC] arange
    L: int
    R: int
    any_moved: bool
    one_each: bool  # one chunk per sequence
    num_parts: int  # chunks with buffered rows (part >= 0)

    @property
    def num_chunks(self) -> int:
        return int(self.seq.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.first.shape[0])

    @property
    def num_tiles(self) -> int:
        return int(self.tile_chunk.shape[0])

    def tables(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.type == "Any"}


def host_ints(t: torch.Tensor | np.ndarray | list[int]) -> np.ndarray:
    """t as an int64 array on the host (a device tensor is copied back)."""
    if isinstance(t, torch.Tensor):
        return t.detach().to("cpu", torch.int64).numpy()
    return np.asarray(t, dtype=np.int64)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each i, the values starts[i] .. starts[i] + counts[i] - 1, concatenated, and their owner i."""
    owner = np.repeat(np.arange(counts.shape[0]), counts)
    begin = np.cumsum(counts) - counts
    return starts[owner] + np.arange(owner.shape[0]) - begin[owner], owner


@dataclass(frozen=True)
class ChunkLayout:
    """Where the chunks lie, each stream (``off`` buffered rows, then ``lens`` new ones) cut at multiples of L
    from its boundary; int64 host arrays as ``AdvancePlan``'s, plus cu [S+1] the new rows' packed offsets and
    slen [S] stream lengths. The one source of these tables for ``plan_advance`` and ``chunk.chunk_grid``."""

    L: int
    off: np.ndarray
    lens: np.ndarray
    cu: np.ndarray
    slen: np.ndarray
    count: np.ndarray
    first: np.ndarray
    seq: np.ndarray
    index: np.ndarray
    length: np.ndarray
    row0: np.ndarray

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """row_chunk, row_pos [T]: the chunk that holds each packed new row and its position there."""
        q, row_seq = _ranges(self.off, self.lens)  # each row's position in its stream
        return self.first[row_seq] + q // self.L, q % self.L


def chunk_layout(lens: np.ndarray, off: np.ndarray, L: int) -> ChunkLayout:
    """``ChunkLayout`` of sequences with lens [S] new rows after off [S] buffered ones (int64 arrays)."""
    S = lens.shape[0]
    cu = np.zeros(S + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    slen = off + lens
    count = (slen + L - 1) // L
    first = np.cumsum(count) - count
    index, seq = _ranges(np.zeros(S, dtype=np.int64), count)
    length = np.minimum(slen[seq] - index * L, L)
    row0 = cu[:-1][seq] + index * L - off[seq]
    return ChunkLayout(L, off, lens, cu, slen, count, first, seq, index, length, row0)


def plan_advance(lens: torch.Tensor | np.ndarray, off: torch.Tensor | np.ndarray, L: int, R: int, *,
                 slots: torch.Tensor | np.ndarray | None = None, rows: torch.Tensor | None = None,
                 final: str = "boundary") -> AdvancePlan:
    """The layout of an advance, on the host: lens [S] new rows (>= 0), off [S] buffered rows (< L), slots [S]
    (default 0 .. S-1), integer CPU tensors or arrays; R the row tile (dividing L); rows [T] bool wanted rows
    (default all; a device mask costs one sync); final "boundary" (exact replay) or "end" (fold the trailing
    partial chunk too). ValueError for tables the kernels cannot use."""
    if final not in ("boundary", "end"):
        raise ValueError(f"final must be 'boundary' or 'end', not {final!r}")
    if L % R:
        raise ValueError(f"chunk_size {L} is not a multiple of the row tile {R}")
    lens, off = host_ints(lens), host_ints(off)
    S = lens.shape[0]
    # The kernels trust these tables (no bounds checks on the device): a bad batch fails here.
    if lens.ndim != 1 or off.shape != lens.shape:
        raise ValueError(f"lens and off must be [S] each, not {lens.shape} and {off.shape}")
    if S and (int(lens.min()) < 0 or int(off.min()) < 0 or int(off.max()) >= L):
        raise ValueError(f"every sequence needs lens >= 0 new rows and 0 <= off < chunk_size {L}")
    slot = np.arange(S, dtype=np.int64) if slots is None else host_ints(slots)
    if slot.shape != lens.shape:
        raise ValueError(f"slots must be [{S}], not {tuple(slot.shape)}")
    T = int(lens.sum())
    lay = chunk_layout(lens, off, L)
    cu, slen, count, first, seq, index, length, row0 = (lay.cu, lay.slen, lay.count, lay.first, lay.seq, lay.index,
                                                        lay.length, lay.row0)
    NC = seq.shape[0]
    pre = np.where(index == 0, off[seq], 0)
    has_pre = pre > 0
    part = np.where(has_pre, np.cumsum(has_pre) - 1, -1)
    need = length == L if final == "boundary" else np.ones(NC, dtype=bool)
    moved = slen >= L if final == "boundary" else np.ones(S, dtype=bool)

    # a completed chunk's buffer is rewritten from row 0 and its old rows past the new fill cleared; rows past
    # the old fill are zero already (SSDState's invariant), so they are not written
    crossed = slen >= L
    base = (slen // L) * L  # stream position of the new buffer's row 0
    keep_lo = np.maximum(off - base, 0)
    keep_hi = slen - base
    keep_row0 = cu[:-1] - off + base
    clear_hi = np.where(crossed, np.maximum(keep_hi, off), keep_hi)

    # Tiles holding wanted rows: the new rows of a chunk are positions pre .. length-1.
    want = None
    if rows is None:
        lo_t = pre // R  # first and last tile with a new row
        tj, tc = _ranges(lo_t, (length - 1) // R - lo_t + 1)
    else:
        want = rows.detach().to("cpu", torch.bool).numpy()
        if want.shape != (T,):
            raise ValueError(f"rows must be a [{T}] bool mask, not {tuple(want.shape)}")
        rc, rp = lay.rows()
        key = np.unique(rc[want] * (L // R) + rp[want] // R)  # sorted: chunk-major, then tile
        tc, tj = key // (L // R), key % (L // R)
    tile_pos = tj * R
    pos = tile_pos[:, None] + np.arange(R)[None, :]  # [NT, R] positions
    tile_rows = row0[tc][:, None] + pos
    new = (pos >= pre[tc][:, None]) & (pos < length[tc][:, None])
    if want is not None:
        new &= want[np.clip(tile_rows, 0, max(T - 1, 0))]
    tile_rows = np.where(new, tile_rows, -1)
    return AdvancePlan(seq=seq, index=index, length=length, pre=pre, row0=row0, part=part, need=need, first=first,
                       count=count, moved=moved, keep_lo=keep_lo, keep_hi=keep_hi, keep_row0=keep_row0,
                       clear_hi=clear_hi, tile_chunk=tc, tile_pos=tile_pos, tile_rows=tile_rows, slot=slot,
                       chunk_slot=slot[seq],
                       state_chunks=np.flatnonzero(need), chunk_id=np.arange(NC, dtype=np.int64), L=L, R=R,
                       any_moved=bool(moved.any()), one_each=NC == S, num_parts=int(has_pre.sum()))


def host_to_device(flat: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """An int64 array on ``device`` without waiting: through pinned memory to a GPU (a pageable copy may wait
    for the stream's work)."""
    t = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.int64))
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def to_device(plan: AdvancePlan, device: torch.device | str) -> AdvancePlan:
    """The plan with every table an int64 tensor on ``device`` (bools as 0/1), moved in one asynchronous copy."""
    ts = plan.tables()
    flat = np.concatenate([np.asarray(t, dtype=np.int64).ravel() for t in ts.values()])
    dev = host_to_device(flat, device)
    out, i = {}, 0
    for name, t in ts.items():
        n = int(np.size(t))
        out[name] = dev[i:i + n].view(np.shape(t))
        i += n
    return AdvancePlan(**out, L=plan.L, R=plan.R, any_moved=plan.any_moved, one_each=plan.one_each,
                       num_parts=plan.num_parts)
