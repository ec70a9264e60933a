"""The layout of one advance, worked out on the host from the batch's lengths: no device syncs.

An advance over S sequences (each with ``off`` rows buffered since its chunk boundary and ``n``
new rows) cuts every sequence's stream (buffer ++ new rows) into chunks anchored at its
boundary, as ``chunk.pack_chunks`` does. Everything about that layout (which chunk holds which
rows, which chunks complete, which row tiles hold wanted rows) follows from (off, n) alone, which
an engine knows on the host. ``plan_advance`` computes it there with CPU tensors; ``to_device``
moves every table to the GPU in one copy. The Triton backend's kernels then read the tables and
never ask the device how many chunks or tiles there are.

Tables (int64 unless noted), per chunk c of NC:
    seq[c]   owning sequence; index[c] chunk number within it; length[c] valid rows (<= L);
    pre[c]   rows taken from the slot's buffer (off for a sequence's first chunk, else 0);
    row0[c]  packed row of chunk position 0 (position s < length holds packed row row0 + s if s >= pre);
    need[c]  the chunk's state is folded into the boundary state (length == L, or every chunk for "end").
Per sequence q of S:
    first[q], count[q]  its chunks; moved[q] (bool) whether its boundary moves;
    keep_lo[q], keep_hi[q], keep_row0[q]: the rows [keep_lo, keep_hi) of its new buffer and the
    packed row of buffer row 0 (rows from keep_lo on are new rows); crossed[q] (bool): the buffer
    is rewritten from row 0 (rows keep_hi .. L-1 become zero), else only rows keep_lo .. keep_hi-1
    change.
    state_chunks [n]: the chunks with need set, in order; chunk_slot[c] = slot[seq[c]].
Per sequence also slot[q], its slot in the replay state.
Per row tile i of NT (R rows of one chunk holding at least one wanted row):
    tile_chunk[i], tile_pos[i] (its first row's position), tile_rows[i, R] (each tile row's
    packed row, -1 where not a wanted new row).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

_I64 = torch.int64


@dataclass
class AdvancePlan:
    """See the module docstring; every tensor on one device, shapes [NC], [S] or [NT(, R)]."""

    seq: torch.Tensor
    index: torch.Tensor
    length: torch.Tensor
    pre: torch.Tensor
    row0: torch.Tensor
    need: torch.Tensor
    first: torch.Tensor
    count: torch.Tensor
    moved: torch.Tensor
    keep_lo: torch.Tensor
    keep_hi: torch.Tensor
    keep_row0: torch.Tensor
    crossed: torch.Tensor
    tile_chunk: torch.Tensor
    tile_pos: torch.Tensor
    tile_rows: torch.Tensor
    slot: torch.Tensor
    chunk_slot: torch.Tensor
    state_chunks: torch.Tensor
    L: int
    R: int
    any_moved: bool
    one_each: bool  # one chunk per sequence

    @property
    def num_chunks(self) -> int:
        return int(self.seq.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.first.shape[0])

    @property
    def num_tiles(self) -> int:
        return int(self.tile_chunk.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}


def plan_advance(lens: torch.Tensor, off: torch.Tensor, L: int, R: int, *, slots: torch.Tensor | None = None,
                 rows: torch.Tensor | None = None, final: str = "boundary") -> AdvancePlan:
    """The layout of an advance, on the CPU.

    lens [S] new rows per sequence (>= 1), off [S] rows buffered per sequence (0 <= off < L), slots
    [S] each sequence's slot (default 0 .. S-1), all int64 on the CPU; L the chunk size, R the row
    tile (dividing L); rows [T] bool: the wanted rows (default all; a device mask is copied to the
    host, one sync); final: "boundary" (exact replay) or "end" (fold the trailing partial chunk too).
    """
    if final not in ("boundary", "end"):
        raise ValueError(f"final must be 'boundary' or 'end', not {final!r}")
    if L % R:
        raise ValueError(f"chunk_size {L} is not a multiple of the row tile {R}")
    lens, off = lens.to(_I64).cpu(), off.to(_I64).cpu()
    S = lens.numel()
    T = int(lens.sum())
    cu = torch.zeros(S + 1, dtype=_I64)
    cu[1:] = torch.cumsum(lens, 0)
    slen = off + lens
    count = (slen + L - 1) // L
    NC = int(count.sum())
    first = torch.cumsum(count, 0) - count
    seq = torch.repeat_interleave(torch.arange(S), count, output_size=NC)
    index = torch.arange(NC) - first[seq]
    length = torch.clamp(slen[seq] - index * L, max=L)
    pre = torch.where(index == 0, off[seq], torch.zeros((), dtype=_I64))
    row0 = cu[:-1][seq] + index * L - off[seq]
    need = length == L if final == "boundary" else torch.ones(NC, dtype=torch.bool)
    slot = torch.arange(S) if slots is None else slots.to(_I64).cpu()
    moved = slen >= L if final == "boundary" else torch.ones(S, dtype=torch.bool)

    crossed = slen >= L
    base = (slen // L) * L  # stream position of the new buffer's row 0
    keep_lo = torch.clamp(off - base, min=0)
    keep_hi = slen - base
    keep_row0 = cu[:-1] - off + base

    # Tiles holding wanted rows: the new rows of a chunk are positions pre .. length-1.
    if rows is None:
        lo_t, hi_t = pre // R, (length - 1) // R  # first and last tile with a new row
        nt = hi_t - lo_t + 1
        tc = torch.repeat_interleave(torch.arange(NC), nt)
        tj = torch.arange(int(nt.sum())) - torch.repeat_interleave(torch.cumsum(nt, 0) - nt, nt) + lo_t[tc]
    else:
        want = rows.to(torch.bool).cpu()
        if want.shape != (T,):
            raise ValueError(f"rows must be a [{T}] bool mask, not {tuple(want.shape)}")
        row_seq = torch.repeat_interleave(torch.arange(S), lens, output_size=T)
        q = off[row_seq] + torch.arange(T) - cu[:-1][row_seq]
        rc = first[row_seq] + q // L
        key = torch.unique(rc[want] * (L // R) + (q[want] % L) // R)  # sorted: chunk-major, then tile
        tc, tj = key // (L // R), key % (L // R)
    tile_pos = tj * R
    s = tile_pos[:, None] + torch.arange(R)[None, :]  # [NT, R] positions
    tile_rows = row0[tc][:, None] + s
    new = (s >= pre[tc][:, None]) & (s < length[tc][:, None])
    if rows is not None:
        new &= want[tile_rows.clamp(0, max(T - 1, 0))]
    tile_rows = torch.where(new, tile_rows, torch.full((), -1, dtype=_I64))
    return AdvancePlan(seq=seq, index=index, length=length, pre=pre, row0=row0, need=need, first=first, count=count,
                       moved=moved, keep_lo=keep_lo, keep_hi=keep_hi, keep_row0=keep_row0, crossed=crossed,
                       tile_chunk=tc, tile_pos=tile_pos, tile_rows=tile_rows, slot=slot, chunk_slot=slot[seq],
                       state_chunks=torch.nonzero(need).flatten(), L=L, R=R,
                       any_moved=bool(moved.any()), one_each=NC == S)


def to_device(plan: AdvancePlan, device: torch.device | str) -> AdvancePlan:
    """The plan with every table as int64 on ``device`` (bool tables as 0/1), moved in one copy
    (pinned and asynchronous on a GPU): what the kernels read."""
    device = torch.device(device)
    ts = plan.tensors()
    flat = torch.cat([t.to(_I64).flatten() for t in ts.values()])
    if device.type == "cuda":
        flat = flat.pin_memory()
    dev = flat.to(device, non_blocking=True)
    out, i = {}, 0
    for name, t in ts.items():
        out[name] = dev[i:i + t.numel()].view(t.shape)
        i += t.numel()
    return AdvancePlan(**out, L=plan.L, R=plan.R, any_moved=plan.any_moved, one_each=plan.one_each)
