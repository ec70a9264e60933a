"""The torch forms of ``ops.attention``: ``attention_blocked`` (the contract's: key blocks from each
sequence's position 0, one fp32 online softmax, fixed-shape GEMM items; docs/design.md, "How the bits
are kept") and ``attention_stock`` (the eager baseline). Rotary embeddings are the caller's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from .. import elementwise as ew
from ..reduce import tree_sum
from .naive import _check, _lengths

KV_BLOCK = 64
"""Key positions per block of ``attention_blocked`` (a fixed part of the bits: both sides use it)."""
ROW_TILE = 16
"""Query rows (token x query head of one key/value head) per GEMM item of ``attention_blocked``."""


@dataclass(frozen=True)
class BlockedPlan:
    """One ``attention_blocked`` call's index tables, from cu_seqlens alone (one per step, all layers).
    key_index [NB, kv_block] int64: each block position's packed key row (Tk: a zero row); tile_rows,
    tile_pos [NT, tile_tokens] int64: each entry's packed query row (Tq: a zero row) and position
    (padding: the tile's first entry's); tile_block0 [NT]: the sequence's first block. Tiles are sorted
    by blocks read, most first: the first ``active[j]`` tiles read block j.
    """

    key_index: torch.Tensor
    tile_rows: torch.Tensor
    tile_pos: torch.Tensor
    tile_block0: torch.Tensor
    active: tuple[int, ...]
    kv_block: int
    tile_tokens: int

    def to(self, device: torch.device | str) -> BlockedPlan:
        return BlockedPlan(self.key_index.to(device), self.tile_rows.to(device), self.tile_pos.to(device),
                           self.tile_block0.to(device), self.active, self.kv_block, self.tile_tokens)


def blocked_plan(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, rep: int, *, kv_block: int = KV_BLOCK,
                 row_tile: int = ROW_TILE) -> BlockedPlan:
    """The tables of ``attention_blocked`` for these sequences and H // G = ``rep`` (CPU tensors)."""
    nq, nk = _lengths(cu_seqlens_q, cu_seqlens_k)
    cu_q, cu_k = cu_seqlens_q.to("cpu", torch.int64), cu_seqlens_k.to("cpu", torch.int64)
    S, Tq, Tk = nq.numel(), int(cu_q[-1]), int(cu_k[-1])
    tt = max(1, row_tile // rep)
    seqs = torch.arange(S)

    def excl_cumsum(n: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(n, 0) - n

    nb = (nk + kv_block - 1) // kv_block
    block_seq = seqs.repeat_interleave(nb)
    block_j = torch.arange(int(nb.sum())) - excl_cumsum(nb)[block_seq]
    kpos = block_j[:, None] * kv_block + torch.arange(kv_block)[None, :]
    key_index = torch.where(kpos < nk[block_seq, None], cu_k[block_seq, None] + kpos, Tk)

    nt = (nq + tt - 1) // tt
    tile_seq = seqs.repeat_interleave(nt)
    tile_i = torch.arange(int(nt.sum())) - excl_cumsum(nt)[tile_seq]
    tok = tile_i[:, None] * tt + torch.arange(tt)[None, :]
    valid = tok < nq[tile_seq, None]
    rows = torch.where(valid, cu_q[tile_seq, None] + tok, Tq)
    pos = (nk - nq)[tile_seq, None] + torch.where(valid, tok, tile_i[:, None] * tt)
    blocks = pos.amax(1) // kv_block + 1                    # blocks 0 .. last row's block
    order = torch.sort(blocks, descending=True, stable=True).indices
    blocks = blocks[order]
    max_blocks = int(blocks[0]) if blocks.numel() else 0
    active = tuple(int((blocks > j).sum()) for j in range(max_blocks))
    return BlockedPlan(key_index, rows[order], pos[order], excl_cumsum(nb)[tile_seq][order], active, kv_block, tt)


def attention_blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, *, scale: float, kv_block: int = KV_BLOCK,
                      row_tile: int = ROW_TILE, plan: BlockedPlan | None = None) -> torch.Tensor:
    """The contract's attention: q, k, v bf16 or fp32 -> [Tq, H, D] in q's dtype, fp32 inside.
    ``plan``: the call's ``blocked_plan`` on q's device (one shared by a step's layers)."""
    rep = _check(q, k, v)
    if plan is None:
        plan = blocked_plan(cu_seqlens_q, cu_seqlens_k, rep, kv_block=kv_block, row_tile=row_tile).to(q.device)
    Tq, H, D = q.shape
    G = k.shape[1]
    Bk, tt = plan.kv_block, plan.tile_tokens
    NT, M = plan.tile_rows.shape[0], plan.tile_tokens * rep
    if Tq == 0:
        return q.new_zeros(q.shape)
    f32 = torch.float32
    # D zero-padded to a multiple of 16 (one GEMM path whatever D); an extra zero row is the padding row
    dp = -D % 16

    def padded(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x.to(f32), (0, dp))
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])

    kb = padded(k)[plan.key_index].permute(0, 2, 3, 1).contiguous()      # [NB, G, Dp, Bk]
    vb = padded(v)[plan.key_index].permute(0, 2, 1, 3).contiguous()      # [NB, G, Bk, Dp]
    # a tile's rows: (token, query head of the group), token-major; [NT, G, M, Dp]
    qt = padded(q)[plan.tile_rows].view(NT, tt, G, rep, D + dp).permute(0, 2, 1, 3, 4).reshape(NT, G, M, D + dp)
    row_pos = plan.tile_pos.repeat_interleave(rep, dim=1)[:, None, :, None]  # [NT, 1, M, 1]
    m = torch.full((NT, G, M), -math.inf, dtype=f32, device=q.device)
    l = torch.zeros((NT, G, M), dtype=f32, device=q.device)  # noqa: E741
    acc = torch.zeros((NT, G, M, D + dp), dtype=f32, device=q.device)
    offsets = torch.arange(Bk, device=q.device)
    for j, n in enumerate(plan.active):  # the first n tiles read block j
        blk = plan.tile_block0[:n] + j
        s = torch.matmul(qt[:n], kb[blk]) * scale                          # [n, G, M, Bk]
        s = torch.where(offsets + j * Bk <= row_pos[:n], s, -math.inf)
        m_new = torch.maximum(m[:n], s.amax(-1))
        alpha = ew.exp(m[:n] - m_new)  # exp(-inf) = 0 on block 0, exp(0) = 1 where the max holds
        p = ew.exp(s - m_new[..., None])
        # out of place (the tiles past n keep their values): autograd may hold the old ones
        l = torch.cat([alpha * l[:n] + tree_sum(p), l[n:]])  # noqa: E741
        acc = torch.cat([alpha[..., None] * acc[:n] + torch.matmul(p, vb[blk]), acc[n:]])
        m = torch.cat([m_new, m[n:]])
    o = (acc / l[..., None]).view(NT, G, tt, rep, D + dp).permute(0, 2, 1, 3, 4).reshape(NT * tt, H, D + dp)
    out = q.new_zeros(Tq + 1, H, D)  # row Tq takes the padding entries
    out[plan.tile_rows.reshape(-1)] = o[..., :D].to(q.dtype)
    return out[:Tq]


@dataclass(frozen=True)
class CacheTables:
    """One step's tables over a slot cache [slots, max_len, G, D], shared by its attention layers:
    write_slot, write_pos [T] int64 (where new keys and values go); read_slot, read_pos [Tk] (each
    sequence's keys 0 .. start + n - 1, packed in batch order); cu_seqlens_k [S+1] (CPU); plan (device)."""

    write_slot: torch.Tensor
    write_pos: torch.Tensor
    read_slot: torch.Tensor
    read_pos: torch.Tensor
    cu_seqlens_k: torch.Tensor
    plan: BlockedPlan


def cache_tables(batch: Any, rep: int, device: torch.device) -> CacheTables:
    """The tables of ``batch`` (an ``ops.step.Step``) for H // G = ``rep``, built on the host."""
    n = batch.lengths
    end = batch.start_pos + n
    seq_t = torch.repeat_interleave(torch.arange(n.numel()), n)
    write_pos = batch.start_pos[seq_t] + torch.arange(batch.num_tokens) - batch.cu_seqlens[:-1][seq_t]
    cu_k = torch.zeros(n.numel() + 1, dtype=torch.int64)
    cu_k[1:] = torch.cumsum(end, 0)
    seq_k = torch.repeat_interleave(torch.arange(n.numel()), end)
    read_pos = torch.arange(int(cu_k[-1])) - cu_k[:-1][seq_k]
    plan = blocked_plan(batch.cu_seqlens, cu_k, rep, kv_block=KV_BLOCK, row_tile=ROW_TILE).to(device)
    return CacheTables(batch.slots[seq_t].to(device), write_pos.to(device), batch.slots[seq_k].to(device),
                      read_pos.to(device), cu_k, plan)


def attention_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: CacheTables, cu_seqlens_q: torch.Tensor, *, scale: float) -> torch.Tensor:
    """``attention_blocked`` over a slot cache: writes k, v [T, G, D] at their slots and positions,
    then attends q [T, H, D] over each slot's keys 0 .. position. [T, H, D] in q's dtype."""
    k_cache[tables.write_slot, tables.write_pos] = k
    v_cache[tables.write_slot, tables.write_pos] = v
    return attention_blocked(q, k_cache[tables.read_slot, tables.read_pos], v_cache[tables.read_slot, tables.read_pos],
                             cu_seqlens_q, tables.cu_seqlens_k, scale=scale, plan=tables.plan)


def attention_stock(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, *, scale: float) -> torch.Tensor:
    """The eager baseline: per sequence one fp32 torch.softmax over the row's keys, model-dtype matmuls."""
    rep = _check(q, k, v)
    nq, nk = _lengths(cu_seqlens_q, cu_seqlens_k)
    out = torch.zeros_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(nq.numel()):
        qs = q[cq[i]:cq[i + 1]].transpose(0, 1)                                       # [H, n_q, D]
        ks = k[ck[i]:ck[i + 1]].repeat_interleave(rep, dim=1).transpose(0, 1)         # [H, n_k, D]
        vs = v[ck[i]:ck[i + 1]].repeat_interleave(rep, dim=1).transpose(0, 1)
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scale
        pos = torch.arange(int(nq[i]), device=q.device) + int(nk[i] - nq[i])
        future = torch.arange(int(nk[i]), device=q.device)[None, :] > pos[:, None]
        weights = torch.softmax(scores.masked_fill(future, -math.inf), dim=-1, dtype=torch.float32).to(q.dtype)
        out[cq[i]:cq[i + 1]] = torch.matmul(weights, vs).transpose(0, 1)
    return out


__all__ = ["KV_BLOCK", "ROW_TILE", "BlockedPlan", "CacheTables", "attention_blocked", "attention_cached",
           "attention_stock", "blocked_plan", "cache_tables", "page_index"]


def page_index(block_table: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor,
               page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the key of position ``pos`` of block-table row ``slot`` lies in a paged cache: (page, row
    in the page), int64 tensors of pos's shape, computed on block_table's device (no host read)."""
    blk = torch.div(pos, page_size, rounding_mode="floor")
    return block_table[slot, blk].to(torch.int64), pos - blk * page_size


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              batch: Any, *, scale: float, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """The torch backend's ``attention``: the step's tables (built once per step), ``attention_cached``.
    ``block_table`` [slots, max_blocks]: the caches are pages [num_blocks, page_size, G, D]."""
    rep = q.shape[1] // k.shape[1]
    plan = batch.plans[q.device]
    t = plan.once(plan.attention_cache, rep, lambda: cache_tables(batch, rep, q.device))
    if block_table is not None:
        P = k_cache.shape[1]
        bt = block_table.to(q.device)
        ws, wp = page_index(bt, t.write_slot, t.write_pos, P)
        rs, rp = page_index(bt, t.read_slot, t.read_pos, P)
        t = dataclasses.replace(t, write_slot=ws, write_pos=wp, read_slot=rs, read_pos=rp)
    return attention_cached(q, k, v, k_cache, v_cache, t, batch.cu_seqlens, scale=scale)


def attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, plan: BlockedPlan | None, *, scale: float) -> torch.Tensor:
    """Packed keys (an engine's pages gathered): ``attention_blocked`` with the step's ``plan`` (None: made here)."""
    return attention_blocked(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, plan=plan)
