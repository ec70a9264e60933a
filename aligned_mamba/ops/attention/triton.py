"""Row-invariant causal GQA attention in Triton: the triton backend's form of ``ops.attention``.

A program owns one key/value head and a tile of TOK tokens of one sequence x REP_P query heads (the
group's, padded to a power of two); a row visits key blocks of ``attn_block_n`` from position 0 in
ascending order with one fp32 online softmax in exp2 units, its row sum a dot with ones (a ``tl.sum``
tree follows the register layout). Masked keys load as zeros, so data past a sequence's end never
makes a NaN of p = 0. bf16 models round p to bf16 for the dots (as flash attention), fp32 models use
IEEE precision. Split keys, pages, decode tiles: docs/design.md, "How the bits are kept".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from ...errors import AlignedMambaError
from ..autograd import grad_needed
from ..configs import TritonKernelConfigs
from .blocked import page_index

LOG2E = 1.4426950408889634


@triton.jit
def _block(q, m, lsum, acc, k_ptr, v_ptr, kbase, j, last, pos, g, sk_r, sk_g, qk_scale, ones, bt_ptr, page,
           D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
           PAGED: tl.constexpr):
    """One key block j of a tile: the online-softmax update. PAGED: the block lies in one page,
    ``bt_ptr[j * BLOCK_N // page]``, from row ``j * BLOCK_N % page``; kbase is the page stride."""
    kp = j * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    if PAGED:
        pg = tl.load(bt_ptr + (j * BLOCK_N) // page).to(tl.int64)
        off = (j * BLOCK_N) % page + tl.arange(0, BLOCK_N)
        rows = pg * kbase + off.to(tl.int64) * sk_r + g * sk_g
    else:
        rows = (kbase + kp).to(tl.int64) * sk_r + g * sk_g
    if MASK:
        kin = kp <= last
        kt = tl.load(k_ptr + rows[None, :] + d[:, None], mask=kin[None, :], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kin[:, None], other=0.0)
    else:
        kt = tl.load(k_ptr + rows[None, :] + d[:, None])
        v = tl.load(v_ptr + rows[:, None] + d[None, :])
    s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
    if MASK:
        s = tl.where(kp[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, None]).to(v.dtype)
    lsum = lsum * alpha + tl.max(tl.dot(p, ones, input_precision=PRECISION), 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, lsum, acc


@triton.jit
def _merge(m_a, l_a, acc_a, m_b, l_b, acc_b):
    """Fold the next split's partial b into a (the online softmax's rescaling), elementwise."""
    m = tl.maximum(m_a, m_b)
    ca = tl.math.exp2(m_a - m)
    cb = tl.math.exp2(m_b - m)
    return m, l_a * ca + l_b * cb, acc_a * ca[:, None] + acc_b * cb[:, None]


@triton.jit
def _split(q, k_ptr, v_ptr, kbase, lo, hi, full, last, pos, g, sk_r, sk_g, qk_scale, ones, bt_ptr, page,
           BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
           PAGED: tl.constexpr):
    """The partial (m, l, acc) of key blocks [lo, hi) from a fresh state (blocks before ``full``
    unmasked). A row before block lo's first key gets NaN (every s -inf); the caller never uses it."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for j in range(lo, tl.minimum(hi, full)):
        m, lsum, acc = _block(q, m, lsum, acc, k_ptr, v_ptr, kbase, j, last, pos, g, sk_r, sk_g, qk_scale, ones, bt_ptr,
                              page, D, BLOCK_N, False, PRECISION, PAGED)
    for j in range(tl.maximum(lo, full), hi):
        m, lsum, acc = _block(q, m, lsum, acc, k_ptr, v_ptr, kbase, j, last, pos, g, sk_r, sk_g, qk_scale, ones, bt_ptr,
                              page, D, BLOCK_N, True, PRECISION, PAGED)
    return m, lsum, acc


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    # Per-tile tables [NT] int64
    row0_ptr, ntok_ptr, pos0_ptr, slot_ptr,
    # The block table [rows, max_blocks] (PAGED: a tile's slot is its row) and the page size in keys
    bt_ptr, s_bt, page,
    # Strides (elements); sk_slot: a slot's pitch in rows of sk_r elements (PAGED: a page's stride)
    sq_t, sq_h, sk_slot, sk_r, sk_g, so_t, so_h, sl_t,
    qk_scale,
    REP: tl.constexpr, REP_P: tl.constexpr, TOK: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, STORE_LSE: tl.constexpr = False, PAGED: tl.constexpr = False,
    SPLIT_N: tl.constexpr = 0,
):
    tile = tl.program_id(0)
    g = tl.program_id(1)
    BLOCK_M: tl.constexpr = TOK * REP_P
    r = tl.arange(0, BLOCK_M)
    tt = r // REP_P
    hh = r % REP_P
    row0 = tl.load(row0_ptr + tile)
    ntok = tl.load(ntok_ptr + tile)
    pos0 = tl.load(pos0_ptr + tile)
    slot = tl.load(slot_ptr + tile)
    if PAGED:
        kbase = slot * 0 + sk_slot  # the page stride (int64); the block table row picks each block's page
        bt_ptr += slot * s_bt
    else:
        kbase = slot * sk_slot  # in rows of sk_r elements
    valid = (tt < ntok) & (hh < REP)
    pos = pos0 + tl.where(tt < ntok, tt, 0)  # padding tokens take the first's position: no empty row
    d = tl.arange(0, D)
    head = g * REP + hh
    q = tl.load(q_ptr + (row0 + tt).to(tl.int64)[:, None] * sq_t + head[:, None] * sq_h + d[None, :],
                mask=valid[:, None], other=0.0)
    last = pos0 + ntok - 1
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    ones = tl.full([BLOCK_N, 16], 1.0, q.dtype)
    # blocks before the first row's block are whole for every row: no mask (where(true, s) is s)
    full = pos0 // BLOCK_N
    if SPLIT_N > 0:
        # each split's partial folded in ascending s at the split's end (the decode combine, in registers)
        NB: tl.constexpr = SPLIT_N // BLOCK_N
        nblk = last // BLOCK_N + 1
        for s in range(0, last // SPLIT_N + 1):
            mp, lp, ap = _split(q, k_ptr, v_ptr, kbase, s * NB, tl.minimum(s * NB + NB, nblk), full, last, pos, g,
                                sk_r, sk_g, qk_scale, ones, bt_ptr, page, BLOCK_M, D, BLOCK_N, PRECISION, PAGED)
            mm, lm, am = _merge(m, lsum, acc, mp, lp, ap)
            inside = pos >= s * SPLIT_N  # a row before the split's first key has no partial there
            m = tl.where(inside, mm, m)
            lsum = tl.where(inside, lm, lsum)
            acc = tl.where(inside[:, None], am, acc)
    else:
        for j in range(0, full):
            m, lsum, acc = _block(q, m, lsum, acc, k_ptr, v_ptr, kbase, j, last, pos, g, sk_r, sk_g, qk_scale, ones,
                                  bt_ptr, page, D, BLOCK_N, False, PRECISION, PAGED)
        for j in range(full, last // BLOCK_N + 1):
            m, lsum, acc = _block(q, m, lsum, acc, k_ptr, v_ptr, kbase, j, last, pos, g, sk_r, sk_g, qk_scale, ones,
                                  bt_ptr, page, D, BLOCK_N, True, PRECISION, PAGED)
    o = acc / lsum[:, None]
    tl.store(o_ptr + (row0 + tt).to(tl.int64)[:, None] * so_t + head[:, None] * so_h + d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=valid[:, None])
    if STORE_LSE:  # for the backward: log2 of the row's softmax denominator, in s's units (o is untouched)
        tl.store(lse_ptr + (row0 + tt).to(tl.int64) * sl_t + head, m + tl.log2(lsum), mask=valid)


@triton.jit
def _attention_partial_kernel(
    # the partials: [T, NS, H] (m, l) and [T, NS, H, D] (acc), fp32
    q_ptr, k_ptr, v_ptr, pm_ptr, pl_ptr, pa_ptr,
    # Per-tile tables [NT] int64, the block table and page size, as ``_attention_kernel``'s
    row0_ptr, ntok_ptr, pos0_ptr, slot_ptr, bt_ptr, s_bt, page,
    # Strides (elements); sp_t, sp_s: the partials' per row and per split (in rows of one head)
    sq_t, sq_h, sk_slot, sk_r, sk_g, sp_t, sp_s,
    qk_scale,
    REP: tl.constexpr, REP_P: tl.constexpr, TOK: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_N: tl.constexpr, PRECISION: tl.constexpr, PAGED: tl.constexpr = False,
):
    """Split decode, first half: program (tile, KV head, split s) writes its rows' partial over keys
    [s * SPLIT_N, min((s + 1) * SPLIT_N, t + 1)); a split past the tile's last key exits at once."""
    tile = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    row0 = tl.load(row0_ptr + tile)
    ntok = tl.load(ntok_ptr + tile)
    pos0 = tl.load(pos0_ptr + tile)
    last = pos0 + ntok - 1
    if s * SPLIT_N > last:
        return
    slot = tl.load(slot_ptr + tile)
    if PAGED:
        kbase = slot * 0 + sk_slot
        bt_ptr += slot * s_bt
    else:
        kbase = slot * sk_slot
    BLOCK_M: tl.constexpr = TOK * REP_P
    NB: tl.constexpr = SPLIT_N // BLOCK_N
    r = tl.arange(0, BLOCK_M)
    tt = r // REP_P
    hh = r % REP_P
    valid = (tt < ntok) & (hh < REP)
    pos = pos0 + tl.where(tt < ntok, tt, 0)
    d = tl.arange(0, D)
    head = g * REP + hh
    q = tl.load(q_ptr + (row0 + tt).to(tl.int64)[:, None] * sq_t + head[:, None] * sq_h + d[None, :],
                mask=valid[:, None], other=0.0)
    ones = tl.full([BLOCK_N, 16], 1.0, q.dtype)
    m, lsum, acc = _split(q, k_ptr, v_ptr, kbase, s * NB, tl.minimum(s * NB + NB, last // BLOCK_N + 1),
                          pos0 // BLOCK_N, last, pos, g, sk_r, sk_g, qk_scale, ones, bt_ptr, page, BLOCK_M, D,
                          BLOCK_N, PRECISION, PAGED)
    # a row before this split's first key (a later token of a multi-token tile) stores its unused NaN
    at = (row0 + tt).to(tl.int64) * sp_t + s * sp_s + head
    tl.store(pm_ptr + at, m, mask=valid)
    tl.store(pl_ptr + at, lsum, mask=valid)
    tl.store(pa_ptr + at[:, None] * D + d[None, :], acc, mask=valid[:, None])


@triton.jit
def _attention_combine_kernel(
    pm_ptr, pl_ptr, pa_ptr, o_ptr, lse_ptr,
    # Per-tile tables [NT] int64 (one token per tile)
    row0_ptr, pos0_ptr,
    so_t, so_h, sp_t, sp_s, sl_t,
    REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, SPLIT_N: tl.constexpr,
    STORE_LSE: tl.constexpr = False,
):
    """Split decode, second half: folds a token's partials of splits 0 .. t // SPLIT_N in ascending
    order with ``_merge`` from the empty state, as the prefill program does; out = acc / l (and lse)."""
    tile = tl.program_id(0)
    g = tl.program_id(1)
    row = tl.load(row0_ptr + tile).to(tl.int64)
    t = tl.load(pos0_ptr + tile)
    hh = tl.arange(0, REP_P)
    valid = hh < REP
    head = g * REP + hh
    d = tl.arange(0, D)
    m = tl.full([REP_P], float("-inf"), tl.float32)
    lsum = tl.zeros([REP_P], tl.float32)
    acc = tl.zeros([REP_P, D], tl.float32)
    for s in range(0, t // SPLIT_N + 1):
        at = row * sp_t + s * sp_s + head
        # padding heads read m = 0, l = 1, acc = 0: finite, never stored
        mp = tl.load(pm_ptr + at, mask=valid, other=0.0)
        lp = tl.load(pl_ptr + at, mask=valid, other=1.0)
        ap = tl.load(pa_ptr + at[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        m, lsum, acc = _merge(m, lsum, acc, mp, lp, ap)
    o = acc / lsum[:, None]
    tl.store(o_ptr + row * so_t + head[:, None] * so_h + d[None, :], o.to(o_ptr.dtype.element_ty), mask=valid[:, None])
    if STORE_LSE:
        tl.store(lse_ptr + row * sl_t + head, m + tl.log2(lsum), mask=valid)


@dataclass(frozen=True)
class AttentionTiles:
    """One launch's tiles (module docstring), device int64 tensors [NT]: row0 (packed query row of the
    tile's first token), ntok (its tokens), pos0 (the first token's position), slot (the cache slot,
    0 for a packed key tensor); decode: one token per tile with the decode tile."""

    row0: torch.Tensor
    ntok: torch.Tensor
    pos0: torch.Tensor
    slot: torch.Tensor
    decode: bool


def rep_pad(rep: int) -> int:
    """H // G padded to a power of two (a tile's heads per token)."""
    return 1 << max(0, rep - 1).bit_length()


def tokens_per_tile(rep: int, cfg: TritonKernelConfigs, decode: bool) -> int:
    block_m = cfg.attn_decode_block_m if decode else cfg.attn_block_m
    if rep_pad(rep) > block_m:
        raise ValueError(f"{rep} query heads per key/value head exceed the attention tile of {block_m} rows "
                         f"(attn_{'decode_' if decode else ''}block_m)")
    return block_m // rep_pad(rep)


def prefill_tiles(cu_seqlens_q: torch.Tensor | np.ndarray, start_pos: torch.Tensor | np.ndarray,
                  slots: torch.Tensor | np.ndarray, rep: int, cfg: TritonKernelConfigs,
                  device: torch.device | str) -> AttentionTiles:
    """Tiles of TOK tokens of one sequence, built on the host and moved in one copy: cu_seqlens_q [S+1],
    start_pos [S] (each sequence's first new position), slots [S]. Longest first (for the grid's tail)."""
    tok = tokens_per_tile(rep, cfg, decode=False)
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    sp, sl = np.asarray(start_pos, dtype=np.int64), np.asarray(slots, dtype=np.int64)
    n = np.diff(cu)
    nt = (n + tok - 1) // tok
    seq = np.repeat(np.arange(n.size), nt)
    i = np.arange(int(nt.sum())) - np.repeat(np.cumsum(nt) - nt, nt)
    row0 = cu[:-1][seq] + i * tok
    ntok = np.minimum(tok, n[seq] - i * tok)
    pos0 = sp[seq] + i * tok
    order = np.argsort(-(pos0 + ntok), kind="stable")
    t = torch.from_numpy(np.stack([row0[order], ntok[order], pos0[order], sl[seq][order]])).to(device)
    return AttentionTiles(t[0], t[1], t[2], t[3], decode=False)


def decode_tiles(slots: torch.Tensor, positions: torch.Tensor) -> AttentionTiles:
    """A decode step's tiles from its device tensors slots, positions [S] int64 (position: the new
    token's, i.e. the tokens consumed before it): one tile per sequence, nothing read back."""
    S = slots.shape[0]
    row0 = torch.arange(S, dtype=torch.int64, device=slots.device)
    # the kernel indexes the tables densely (an expanded view would be read past its one element)
    return AttentionTiles(row0, torch.ones_like(row0), positions.contiguous(), slots.contiguous(), decode=True)


@dataclass(frozen=True)
class StepTables:
    """One step over a slot cache: write_slot, write_pos [T] int64 (device) where each new token's key
    and value go, and the kernel's tiles."""

    write_slot: torch.Tensor
    write_pos: torch.Tensor
    tiles: AttentionTiles


def step_tables(slots: torch.Tensor, start_pos: torch.Tensor, cu_seqlens: torch.Tensor, rep: int,
                cfg: TritonKernelConfigs, device: torch.device | str) -> StepTables:
    """A prefill or chunked-prefill step's tables from its host ints: slots, start_pos [S] (tokens
    each slot consumed before), cu_seqlens [S+1] (new tokens' packed offsets)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    sp, sl = np.asarray(start_pos, dtype=np.int64), np.asarray(slots, dtype=np.int64)
    n = np.diff(cu)
    seq = np.repeat(np.arange(n.size), n)
    wpos = sp[seq] + np.arange(int(cu[-1])) - cu[:-1][seq]
    w = torch.from_numpy(np.stack([sl[seq], wpos])).to(device)
    return StepTables(w[0], w[1], prefill_tiles(cu, sp, sl, rep, cfg, device))


def decode_step_tables(slots: torch.Tensor, positions: torch.Tensor) -> StepTables:
    """A decode step's tables from its device slots and positions [S] int64 (no host work)."""
    return StepTables(slots, positions, decode_tiles(slots, positions))


def attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: AttentionTiles, *,
                     scale: float, cfg: TritonKernelConfigs, lse: torch.Tensor | None = None,
                     block_table: torch.Tensor | None = None, max_context: int | None = None) -> torch.Tensor:
    """Causal GQA attention of the tiles' query rows over keys where a cache holds them.

    q [T, H, D] bf16 or fp32, D a power of two from 16 to 256; k_cache, v_cache [slots, max_len, G, D]
    in q's dtype, key p of slot s at [s, p] (packed keys [Tk, G, D]: slot 0 of [1, Tk, G, D], positions
    counted from each sequence's first key row). Returns [T, H, D] in q's dtype (rows no tile covers
    unwritten); no host synchronisation. ``lse`` [T, H] fp32 contiguous: receives each row's log2
    softmax denominator in units of q.k * scale * log2(e), for the backward (the output's bits unchanged).
    ``block_table`` [rows, max_blocks] int32/int64 on the device: the caches are pages [num_blocks,
    page_size, G, D] (unit stride for D), key p of row r at page ``block_table[r, p // page_size]``;
    ``attn_block_n`` must divide page_size. ``cfg.attn_split_n`` S > 0: a decode launch's grid has
    ceil(``max_context`` / S) splits (default: the cache's max_len, or pages x page_size); no decode
    row may lie at a position >= ``max_context``.
    """
    T, H, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != D:
        raise ValueError(f"attention_triton: q {tuple(q.shape)}, caches [slots, max_len, G, D] expected; got "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype or q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"attention_triton: q {q.dtype}, caches {k_cache.dtype}/{v_cache.dtype}: one of bfloat16, "
                         "float32 expected")
    G = k_cache.shape[2]
    if H % G:
        raise ValueError(f"attention_triton: {H} query heads are not a multiple of {G} key/value heads")
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"attention_triton: head_dim {D} refused: a power of two from 16 to 256 expected")
    if block_table is None:
        if (k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride() or k_cache.stride(2) != D
                or k_cache.stride(1) != G * D or k_cache.stride(0) % k_cache.stride(1)):
            raise ValueError("attention_triton: caches must be contiguous in (max_len, G, D) with the same strides")
        page, s_bt, pitch = 1, 0, k_cache.stride(0) // k_cache.stride(1)
    else:
        page = k_cache.shape[1]
        check_page(page, cfg)
        if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
            raise ValueError("attention_triton: key and value pages need the same strides and a unit one for D")
        if (block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64)
                or block_table.stride(1) != 1 or block_table.device != q.device):
            raise ValueError("attention_triton: block_table [rows, max_blocks] int32/int64 with a unit last stride "
                             "on q's device expected")
        s_bt, pitch = block_table.stride(0), k_cache.stride(0)
    rep = H // G
    tok = tokens_per_tile(rep, cfg, tiles.decode)
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    if lse is not None and (lse.shape != (T, H) or lse.dtype != torch.float32 or lse.stride(1) != 1):
        raise ValueError(f"attention_triton: lse [{T}, {H}] float32 with unit head stride expected")
    NT = tiles.row0.shape[0]
    if NT == 0 or T == 0:
        return out
    warps = cfg.attn_decode_warps if tiles.decode else cfg.attn_warps
    stages = cfg.attn_decode_stages if tiles.decode else cfg.attn_stages
    S = cfg.attn_split_n
    if S and tiles.decode:
        if max_context is None:
            max_context = block_table.shape[1] * page if block_table is not None else k_cache.shape[1]
        if max_context < 1:
            raise ValueError(f"attention_triton: max_context {max_context} refused: at least 1 key expected")
        ns = -(-max_context // S)
        # the partials of every split of the grid (a CUDA graph keeps them in its pool across replays)
        pm = torch.empty(T, ns, H, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pa = torch.empty(T, ns, H, D, dtype=torch.float32, device=q.device)
        _attention_partial_kernel[(NT, G, ns)](
            q, k_cache, v_cache, pm, pl, pa, tiles.row0, tiles.ntok, tiles.pos0, tiles.slot,
            tiles.slot if block_table is None else block_table, s_bt, page,
            q.stride(0), q.stride(1), pitch, k_cache.stride(1), k_cache.stride(2), ns * H, H, scale * LOG2E,
            REP=rep, REP_P=rep_pad(rep), TOK=tok, D=D, BLOCK_N=cfg.attn_block_n, SPLIT_N=S,
            PAGED=block_table is not None, PRECISION="ieee", num_warps=warps, num_stages=stages,
            enable_fp_fusion=False)
        _attention_combine_kernel[(NT, G)](
            pm, pl, pa, out, pm if lse is None else lse, tiles.row0, tiles.pos0, out.stride(0), out.stride(1),
            ns * H, H, 0 if lse is None else lse.stride(0), REP=rep, REP_P=rep_pad(rep), D=D, SPLIT_N=S,
            STORE_LSE=lse is not None, num_warps=1, enable_fp_fusion=False)
        return out
    _attention_kernel[(NT, G)](
        q, k_cache, v_cache, out, out if lse is None else lse, tiles.row0, tiles.ntok, tiles.pos0, tiles.slot,
        tiles.slot if block_table is None else block_table, s_bt, page,
        q.stride(0), q.stride(1), pitch, k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), 0 if lse is None else lse.stride(0), scale * LOG2E,
        REP=rep, REP_P=rep_pad(rep), TOK=tok, D=D, BLOCK_N=cfg.attn_block_n, STORE_LSE=lse is not None,
        PAGED=block_table is not None, SPLIT_N=cfg.attn_split_n,
        PRECISION="ieee",  # fp32 operands: FMA, never TF32; bf16 operands: tensor cores either way
        # no FMA: a row meets a block in either loop, and only the unmasked loop's s * c - m would contract
        num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return out


def check_page(page_size: int, cfg: TritonKernelConfigs) -> None:
    """Refuse (ValueError) a page size that ``attn_block_n`` does not divide: a block would straddle pages."""
    if page_size < 1 or page_size % cfg.attn_block_n:
        raise ValueError(f"a KV page of {page_size} keys refused: the attention key block (attn_block_n "
                         f"{cfg.attn_block_n}) must divide the page size")


def attention_triton_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            cu_seqlens_k: torch.Tensor, *, scale: float, cfg: TritonKernelConfigs,
                            decode: bool = False, lse: torch.Tensor | None = None) -> torch.Tensor:
    """The package signature over packed keys (q [Tq, H, D], k, v [Tk, G, D], cu_seqlens [S+1] host
    ints), for tests and benchmarks; ``decode``: the decode tile (one query per sequence)."""
    cq = np.asarray(torch.as_tensor(cu_seqlens_q).cpu(), dtype=np.int64)
    ck = np.asarray(torch.as_tensor(cu_seqlens_k).cpu(), dtype=np.int64)
    nq, nk = np.diff(cq), np.diff(ck)
    if cq.size != ck.size or (nq > nk).any() or (nq < 0).any():
        raise ValueError("every sequence needs 0 <= queries <= keys (queries are its last positions)")
    start = nk - nq
    rep = q.shape[1] // k.shape[1]
    dev = q.device
    if decode:
        if (nq != 1).any():
            raise ValueError("the decode tile takes one query per sequence")
        tiles = decode_tiles(torch.as_tensor(ck[:-1], device=dev), torch.as_tensor(start, device=dev))
    else:
        tiles = prefill_tiles(cq, start, ck[:-1], rep, cfg, dev)
    # each sequence's first key row is its "slot", at a pitch of one row
    kc = k.as_strided((k.shape[0], 1, *k.shape[1:]), (k.stride(0), k.stride(0), k.stride(1), k.stride(2)))
    vc = v.as_strided((v.shape[0], 1, *v.shape[1:]), (v.stride(0), v.stride(0), v.stride(1), v.stride(2)))
    # a split decode's grid: the longest sequence's keys (the packed view's max_len of 1 says nothing)
    return attention_triton(q, kc, vc, tiles, scale=scale, cfg=cfg, lse=lse, max_context=max(1, int(nk.max(initial=0))))


__all__ = ["AttentionTiles", "StepTables", "attention_triton", "attention_triton_packed", "check_page",
           "decode_step_tables", "decode_tiles", "prefill_tiles", "rep_pad", "step_tables", "tokens_per_tile"]


# -- the triton backend's forms (the backend's ``attention`` and ``attention_packed`` signatures) ------------


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              batch: Any, *, scale: float, cfg: TritonKernelConfigs,
              block_table: torch.Tensor | None = None) -> torch.Tensor:
    """One step over a slot cache (pages with ``block_table`` [slots, max_blocks], on the device): k, v
    written at each token's position, then the kernel over the step's tiles (built once per step).
    Under autograd the same, saving each row's lse for the Triton backward."""
    grad = grad_needed(q, k, v)
    if grad and bool((batch.start_pos != 0).any()):
        # the keys of earlier calls sit in the cache outside the autograd graph: their gradient would be lost
        raise AlignedMambaError("training attention over keys cached by an earlier call is refused on the GPU: "
                                "the backward covers one pass from empty (every start_pos 0)")
    if grad and block_table is not None:
        raise AlignedMambaError("training attention over a paged KV cache is refused: the trainer's pass from "
                                "empty runs over a slot cache")
    dev, rep = q.device, q.shape[1] // k.shape[1]
    plan = batch.plans[dev]
    if batch.decode_only:
        # a decode step: tables from its device slots and positions (a captured step's static buffers)
        t = plan.once(plan.attention_tiles, 0, lambda: decode_step_tables(plan.slots, batch.start_pos.to(dev)))
    else:
        t = plan.once(plan.attention_tiles, rep, lambda: step_tables(
            batch.slots, batch.start_pos, batch.cu_seqlens, rep, cfg, dev))
    if grad:
        from .triton_backward import attention_cached

        return attention_cached(q, k, v, k_cache, v_cache, t, batch.cu_seqlens, scale=scale, cfg=cfg)
    if block_table is None:
        k_cache[t.write_slot, t.write_pos] = k
        v_cache[t.write_slot, t.write_pos] = v
    else:
        check_page(k_cache.shape[1], cfg)
        # per call, not per step: a captured step's table changes between replays
        pg, off = page_index(block_table, t.write_slot, t.write_pos, k_cache.shape[1])
        k_cache[pg, off] = k
        v_cache[pg, off] = v
    return attention_triton(q, k_cache, v_cache, t.tiles, scale=scale, cfg=cfg, block_table=block_table)


def attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, plan: Any, *, scale: float, cfg: TritonKernelConfigs) -> torch.Tensor:
    """Packed keys (an engine's paged cache gathered); ``plan`` (the torch form's tables) is unused.
    Differentiable in q, k, v (``triton_backward``)."""
    if grad_needed(q, k, v):
        from . import triton_backward

        return triton_backward.attention_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, cfg=cfg)
    return attention_triton_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, cfg=cfg)
