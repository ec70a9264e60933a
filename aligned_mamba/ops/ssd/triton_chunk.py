"""The chunked SSD scan on Triton: ``chunk.scan_chunks``'s inputs, outputs and invariant, its own bits.

A program owns one zero-padded chunk (or a row tile of it) and one head; tile shapes and loop bounds come from
the contract's configs and the row's position, never from the call's size; no split-K, atomics or cross-program
sums. An advance (``replay_chunk_triton``) runs from a host ``plan.AdvancePlan`` and never waits on the device;
``ssd_chunk_triton`` is the stateless form. Kernels in launch order (grids; PB/NB: the blocks of P/N):

0. ``_dt_kernel`` [NC, L / PACK_ROWS]: softplus'd dt of every chunk, all heads a program; ``_pack_kernel``
   [NC, L / PACK_ROWS, H], only where some chunk has buffered rows: its x and B (the others are read where they
   lie, ``_rows_at``).
1. ``_cumsum_kernel`` [NC, H]: a = cumsum(dt * A), once, so every kernel reads the same bits of a.
2. ``_cb_kernel`` [NC * G, L / R, L / BLOCK_K]: C.B per chunk and group.
3. ``_chunk_state_kernel`` [chunks needed, H, PB]: S = sum_s exp(a_L - a_s) dt_s x_s B_s^T.
4. ``_state_pass_kernel`` [S, H, PB * NB]: h = exp(a_L) h + S_k chunk after chunk, in the slot's state.
5. ``_tile_output_kernel`` [H, tiles, PB]: y by row tile (before 3-4 when each sequence has one chunk).
6. ``_buffer_kernel`` [S, H]: the new partial-chunk buffers (raw dt).

Loops bounded by a value read from memory are ``while`` loops: the Triton 3.6 interpreter (numpy >= 2.4), which
the CPU tests run, takes no run-time ``range`` bound.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import triton
import triton.language as tl

from ..configs import TritonKernelConfigs
from ..triton_math import dt_softplus_exact, has_limit, interpreting, limits
from .chunk import Chunks, pack_chunks
from .plan import AdvancePlan, plan_advance, to_device
from .state import SSDState, SSMParams, Step
from .triton_decode import state_block_n
from .triton_dot import DOT_MODES, dot_acc, tensor_core_dots

# occupancy only, never the arithmetic: pipelining buffers would fill shared memory (benchmarks/README.md)
TILE_OPTS: dict = {"num_stages": 1, "maxnreg": 128}
PACK_ROWS = 32


@triton.jit
def _dt_kernel(
    dt_ptr, buf_dt_ptr, dt_bias_ptr, chunk_slot_ptr, pre_ptr, length_ptr, row0_ptr, dtc_ptr, lo, hi, sdt,
    H: tl.constexpr, L: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, HAS_LIMIT: tl.constexpr,
):
    """Rows s of chunk c, every head h: dtc[c, h, s] = dt_softplus(raw dt) fp32, the raw dt from the buffer
    below pre, from packed row row0 + s (row stride sdt) below length, +0.0 past it. A program takes all heads
    of its rows: the packed rows' dt is read in whole rows. Compile without fp contraction
    (``dt_softplus_exact``)."""
    c = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    h = tl.arange(0, BLOCK_H)
    hm = (h < H)[None, :]
    slot = tl.load(chunk_slot_ptr + c)
    pre = tl.load(pre_ptr + c)
    length = tl.load(length_ptr + c)
    row = tl.load(row0_ptr + c) + s
    old = (s < pre)[:, None]
    new = ((s >= pre) & (s < length))[:, None]
    do = tl.load(buf_dt_ptr + (slot * H + h[None, :]) * L + s[:, None], mask=old & hm, other=0.0)
    dn = tl.load(dt_ptr + row[:, None] * sdt + h[None, :], mask=new & hm, other=0.0)
    bias = tl.load(dt_bias_ptr + h, mask=h < H, other=0.0)[None, :]
    d = dt_softplus_exact(tl.where(old, do, dn), bias, lo, hi, HAS_LIMIT)
    tl.store(dtc_ptr + (c * H + h[None, :]) * L + s[:, None], tl.where(old | new, d, 0.0), mask=hm)


@triton.jit
def _pack_kernel(
    x_ptr, B_ptr, buf_x_ptr, buf_B_ptr, chunk_slot_ptr, pre_ptr, length_ptr, row0_ptr, part_ptr, xc_ptr, Bc_ptr, sx,
    sb, H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_PF: tl.constexpr, BLOCK_NF: tl.constexpr,
):
    """Rows s of chunk c, head h, if k = part[c] >= 0: xc[k, h, s] (and Bc[k, h, s], h < G) in the model dtype:
    the buffer below pre, packed row row0 + s below length, zero past it."""
    c = tl.program_id(0).to(tl.int64)
    k = tl.load(part_ptr + c)
    if k >= 0:
        s = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        h = tl.program_id(2)
        slot = tl.load(chunk_slot_ptr + c)
        pre = tl.load(pre_ptr + c)
        length = tl.load(length_ptr + c)
        row = tl.load(row0_ptr + c) + s
        old = s < pre
        new = (s >= pre) & (s < length)
        pf = tl.arange(0, BLOCK_PF)
        pm = (pf < P)[None, :]
        xo = tl.load(buf_x_ptr + ((slot * H + h) * L + s[:, None]) * P + pf[None, :], mask=old[:, None] & pm,
                     other=0.0)
        xn = tl.load(x_ptr + row[:, None] * sx + h * P + pf[None, :], mask=new[:, None] & pm, other=0.0)
        tl.store(xc_ptr + ((k * H + h) * L + s[:, None]) * P + pf[None, :], tl.where(old[:, None], xo, xn), mask=pm)
        if h < G:
            nf = tl.arange(0, BLOCK_NF)
            nm = (nf < N)[None, :]
            bo = tl.load(buf_B_ptr + ((slot * G + h) * L + s[:, None]) * N + nf[None, :], mask=old[:, None] & nm,
                         other=0.0)
            bn = tl.load(B_ptr + row[:, None] * sb + h * N + nf[None, :], mask=new[:, None] & nm, other=0.0)
            tl.store(Bc_ptr + ((k * G + h) * L + s[:, None]) * N + nf[None, :], tl.where(old[:, None], bo, bn),
                     mask=nm)


@triton.jit
def _rows_at(raw_ptr, parts_ptr, part, row0, j, rs, J: tl.constexpr, L: tl.constexpr, F: tl.constexpr):
    """(pointer to position 0, row stride) of a chunk's feature block j of J (x: J = H, F = P; B: J = G, F = N):
    its copy in parts [*, J, L, F] if part >= 0, else the packed rows raw [T, J, F] (row stride rs) from row0,
    where readers mask positions >= the chunk's length."""
    whole = part >= 0
    base = tl.where(whole, parts_ptr + (part * J + j) * L * F, raw_ptr + row0 * rs + j * F)
    return base, tl.where(whole, F, rs).to(tl.int64)


@triton.jit
def _buffer_kernel(
    x_ptr, dt_ptr, B_ptr, buf_x_ptr, buf_dt_ptr, buf_B_ptr, slot_ptr, keep_lo_ptr, keep_hi_ptr, keep_row0_ptr,
    clear_hi_ptr, sx, sdt, sb,
    H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_PF: tl.constexpr, BLOCK_NF: tl.constexpr,
):
    """Sequence q, head h: buffer rows keep_lo .. keep_hi-1 (x, raw dt; B for h < G) from packed rows
    keep_row0 + s (row strides sx, sdt, sb), rows keep_hi .. clear_hi-1 zeroed (rows past the old fill level are
    zero already)."""
    q = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + q)
    klo = tl.load(keep_lo_ptr + q)
    khi = tl.load(keep_hi_ptr + q)
    r0 = tl.load(keep_row0_ptr + q)
    end = tl.load(clear_hi_ptr + q)
    pf = tl.arange(0, BLOCK_PF)
    pm = (pf < P)[None, :]
    nf = tl.arange(0, BLOCK_NF)
    nm = (nf < N)[None, :]
    s0 = klo - klo % ROWS
    while s0 < end:
        s = s0 + tl.arange(0, ROWS)
        put = (s >= klo) & (s < end)
        src = (s < khi) & put
        row = r0 + s
        xv = tl.load(x_ptr + row[:, None] * sx + h * P + pf[None, :], mask=src[:, None] & pm, other=0.0)
        tl.store(buf_x_ptr + ((slot * H + h) * L + s[:, None]) * P + pf[None, :], xv, mask=put[:, None] & pm)
        dv = tl.load(dt_ptr + row * sdt + h, mask=src, other=0.0)
        tl.store(buf_dt_ptr + (slot * H + h) * L + s, dv, mask=put)
        if h < G:
            bv = tl.load(B_ptr + row[:, None] * sb + h * N + nf[None, :], mask=src[:, None] & nm, other=0.0)
            tl.store(buf_B_ptr + ((slot * G + h) * L + s[:, None]) * N + nf[None, :], bv, mask=put[:, None] & nm)
        s0 += ROWS


@triton.jit
def _cumsum_kernel(dt_ptr, A_ptr, a_ptr, H: tl.constexpr, L: tl.constexpr, BLOCK_L: tl.constexpr):
    """a[c, h, :] = cumsum(dt[c, h, :] * A[h]); dt, a [NC, H, L] fp32, A [H] fp32."""
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_L)
    m = s < L
    base = (c * H + h) * L
    dt = tl.load(dt_ptr + base + s, mask=m, other=0.0)
    a = tl.cumsum(dt * tl.load(A_ptr + h), axis=0)
    tl.store(a_ptr + base + s, a, mask=m)


@triton.jit
def _chunk_state_kernel(
    x_ptr, xp_ptr, B_ptr, Bp_ptr, part_ptr, row0_ptr, length_ptr, dt_ptr, a_ptr, state_ptr, chunk_ptr, sx, sb,
    H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_NS: tl.constexpr, PRECISION: tl.constexpr,
    TC: tl.constexpr,
):
    """state[c, h] [P, N] fp32 = sum_s exp(a_L - a_s) dt_s x_s B_s^T, c = chunk_ptr[pid 0], a BLOCK_P x BLOCK_NS
    block a program (``state_block_n``). x [T, H, P], B [T, G, N] packed rows (row strides sx, sb) and xp, Bp the
    chunks with buffered rows (``_rows_at``), in the model dtype; dt, a [NC, H, L] fp32."""
    c = tl.load(chunk_ptr + tl.program_id(0)).to(tl.int64)
    h = tl.program_id(1)
    NB: tl.constexpr = (N + BLOCK_NS - 1) // BLOCK_NS
    pb = tl.program_id(2) // NB
    nb = tl.program_id(2) % NB
    g = h // (H // G)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = nb * BLOCK_NS + tl.arange(0, BLOCK_NS)
    pm = p < P
    nm = n < N
    ch = c * H + h
    part = tl.load(part_ptr + c)
    row0 = tl.load(row0_ptr + c)
    length = tl.load(length_ptr + c)
    xb, xs = _rows_at(x_ptr, xp_ptr, part, row0, h, sx, H, L, P)
    bb, bs = _rows_at(B_ptr, Bp_ptr, part, row0, g, sb, G, L, N)
    a_last = tl.load(a_ptr + ch * L + L - 1)
    acc = tl.zeros((BLOCK_P, BLOCK_NS), dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):  # L is constexpr: the same blocks for every chunk
        s = k0 + tl.arange(0, BLOCK_K)
        sm = s < L
        rm = s < length
        a_s = tl.load(a_ptr + ch * L + s, mask=sm, other=0.0)
        dt_s = tl.load(dt_ptr + ch * L + s, mask=sm, other=0.0)
        w = tl.exp(a_last - a_s) * dt_s  # a is non-increasing, so the exponent is <= 0
        xT = tl.load(xb + s[None, :] * xs + p[:, None], mask=pm[:, None] & rm[None, :], other=0.0).to(tl.float32)
        Bs = tl.load(bb + s[:, None] * bs + n[None, :], mask=rm[:, None] & nm[None, :], other=0.0).to(tl.float32)
        acc = dot_acc(acc, xT * w[None, :], Bs, TC, 1, PRECISION)
    tl.store(state_ptr + (ch * P + p[:, None]) * N + n[None, :], acc, mask=pm[:, None] & nm[None, :])


@triton.jit
def _pass_block(P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """(q, h, mask, offsets in a [P, N] state) of a state pass program; grid [S, H, P blocks * N blocks]."""
    NB: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    p = (tl.program_id(2) // NB) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = (tl.program_id(2) % NB) * BLOCK_N + tl.arange(0, BLOCK_N)
    return (tl.program_id(0).to(tl.int64), tl.program_id(1), (p < P)[:, None] & (n < N)[None, :],
            p[:, None] * N + n[None, :])


@triton.jit
def _state_pass_kernel(
    a_ptr, state_ptr, need_ptr, h_ptr, slot_ptr, h_in_ptr, first_ptr, count_ptr,
    H: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_IN: tl.constexpr, RT_RANGE: tl.constexpr,
):
    """From h[slot[q]], for q's chunks c = first[q] .. first[q] + count[q] - 1: (WRITE_IN) h_in[c] = h, then
    h = exp(a_L) h + state[c] if need[c]; h back to h[slot[q]]. h, state [*, H, P, N] fp32; h_in fp32, or bf16
    (the store rounds to nearest even, as the dots' cast). Elementwise in (p, n): the block split keeps the bits,
    and in place is safe."""
    q, h, m, pn = _pass_block(P, N, BLOCK_P, BLOCK_N)
    home = h_ptr + (tl.load(slot_ptr + q) * H + h) * P * N + pn
    hs = tl.load(home, mask=m, other=0.0)
    c0 = tl.load(first_ptr + q)
    end = c0 + tl.load(count_ptr + q)
    if RT_RANGE:  # compiled: a run-time range (the next chunk's loads issue early)
        for c in tl.range(c0, end, num_stages=3):
            hs = _pass_step(hs, c, a_ptr, state_ptr, need_ptr, h_in_ptr, pn, m, h, H, L, P, N, WRITE_IN)
    else:  # the interpreter: a while loop (module docstring)
        c = c0
        while c < end:
            hs = _pass_step(hs, c, a_ptr, state_ptr, need_ptr, h_in_ptr, pn, m, h, H, L, P, N, WRITE_IN)
            c += 1
    tl.store(home, hs, mask=m)


@triton.jit
def _pass_step(hs, c, a_ptr, state_ptr, need_ptr, h_in_ptr, pn, m, h, H: tl.constexpr, L: tl.constexpr,
               P: tl.constexpr, N: tl.constexpr, WRITE_IN: tl.constexpr):
    """One chunk of the state pass: (WRITE_IN) h_in[c] = hs; returns exp(a_L) hs + state[c] if need[c], else hs."""
    off = (c * H + h) * P * N + pn
    if WRITE_IN:
        tl.store(h_in_ptr + off, hs, mask=m)
    upd = tl.load(need_ptr + c) != 0
    decay = tl.exp(tl.load(a_ptr + (c * H + h) * L + L - 1))
    s_k = tl.load(state_ptr + off, mask=m & upd, other=0.0)  # not written for chunks not needed
    return tl.where(upd, decay * hs + s_k, hs)


@triton.jit
def _cb_kernel(
    B_ptr, Bp_ptr, part_ptr, C_ptr, cb_ptr, pre_ptr, length_ptr, row0_ptr, sb, sc,
    G: tl.constexpr, L: tl.constexpr, N: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, TC: tl.constexpr,
):
    """cb [NC, G, L, L] fp32 = C_t . B_s for program (c * G + g, row tile, K block), blocks with k0 < t0 + R:
    ``_tile_output_kernel``'s per-head dot, once per group; C = 0 outside the chunk's new rows. C, B [T, G, N]
    packed rows (model dtype, row strides sc, sb), Bp the chunks with buffered rows (``_rows_at``)."""
    cg = tl.program_id(0).to(tl.int64)
    c = cg // G
    g = cg % G
    t0 = tl.program_id(1) * R
    k0 = tl.program_id(2) * BLOCK_K
    if k0 < t0 + R:
        t = t0 + tl.arange(0, R)
        s = k0 + tl.arange(0, BLOCK_K)
        length = tl.load(length_ptr + c)
        sm = s < L
        bm = sm & (s < length)  # B past the chunk's length is zero (other sequences' rows, or none)
        new = (t >= tl.load(pre_ptr + c)) & (t < length)
        row0 = tl.load(row0_ptr + c)
        row = row0 + t
        bb, bs = _rows_at(B_ptr, Bp_ptr, tl.load(part_ptr + c), row0, g, sb, G, L, N)
        nn = tl.arange(0, BLOCK_N)
        cb = tl.zeros((R, BLOCK_K), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            n = n0 + nn
            nm = n < N
            Cn = tl.load(C_ptr + row[:, None] * sc + g * N + n[None, :], mask=new[:, None] & nm[None, :],
                         other=0.0).to(tl.float32)
            BT = tl.load(bb + s[None, :] * bs + n[:, None], mask=nm[:, None] & bm[None, :], other=0.0)
            cb = dot_acc(cb, Cn, BT.to(tl.float32), TC, 0, PRECISION)
        tl.store(cb_ptr + ((c * G + g) * L + t[:, None]) * L + s[None, :], cb, mask=sm[None, :])


@triton.jit
def _tile_output_kernel(
    x_ptr, xp_ptr, part_ptr, row0_ptr, length_ptr, dt_ptr, a_ptr, cb_ptr, C_ptr, D_ptr, h_in_ptr, h_row_ptr, y_ptr,
    tile_chunk_ptr, tile_pos_ptr, tile_rows_ptr, sD_h, sD_p, sx, sc,
    H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr, R: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    TC: tl.constexpr,
):
    """y of one row tile (R rows of a chunk), head h = pid 0, a BLOCK_P block: y_t = [exp(a_t) (C_t . h_in) +
    sum_{s<=t} (C_t . B_s) exp(a_t - a_s) dt_s x_s] + D x_t, the intra dots accumulating onto the inter term.
    tile_chunk, tile_pos [NT]; tile_rows [NT, R] int64 (packed row, -1 unwanted); cb from ``_cb_kernel``; h_in
    [*, H, P, N] fp32 (bf16 with TC "round"), chunk c's at h_row[c]; C's row stride sc; the rest as in
    ``_chunk_state_kernel``. Heads vary fastest over the grid: a group's heads share C, cb and B in L2."""
    h = tl.program_id(0)
    tile = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = p < P
    g = h // (H // G)
    c = tl.load(tile_chunk_ptr + tile).to(tl.int64)
    t0 = tl.load(tile_pos_ptr + tile)
    t = t0 + tl.arange(0, R)
    rows = tl.load(tile_rows_ptr + tile * R + tl.arange(0, R))
    live = rows >= 0
    ch = c * H + h
    a_t = tl.load(a_ptr + ch * L + t)
    nn = tl.arange(0, BLOCK_N)
    hb = (tl.load(h_row_ptr + c) * H + h) * P

    acc = tl.zeros((R, BLOCK_P), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + nn
        nm = n < N
        Cn = tl.load(C_ptr + rows[:, None] * sc + g * N + n[None, :], mask=live[:, None] & nm[None, :],
                     other=0.0).to(tl.float32)
        hT = tl.load(h_in_ptr + (hb + p[None, :]) * N + n[:, None], mask=nm[:, None] & pm[None, :], other=0.0)
        acc = dot_acc(acc, Cn, hT, TC, 2, PRECISION)
    acc = acc * tl.exp(a_t)[:, None]

    # the bound depends on the tile's position only: a decode step runs the prefill's blocks
    cbt = cb_ptr + ((c * G + g) * L + t) * L  # [R] row starts of the tile's C.B rows
    xb, xs = _rows_at(x_ptr, xp_ptr, tl.load(part_ptr + c), tl.load(row0_ptr + c), h, sx, H, L, P)
    xend = tl.load(length_ptr + c)  # x past the chunk's length reads as zero (the padding)
    k0 = 0
    while k0 < t0 + R:
        acc = _intra_block(acc, k0, t0 + R, xend, t, a_t, cbt, ch, p, pm, xb, xs, dt_ptr, a_ptr, L, BLOCK_K,
                           PRECISION, TC)
        k0 += BLOCK_K

    x_t = tl.load(xb + t[:, None] * xs + p[None, :], mask=live[:, None] & pm[None, :], other=0.0).to(tl.float32)
    d = tl.load(D_ptr + h * sD_h + p * sD_p, mask=pm, other=0.0).to(tl.float32)
    out = acc + d[None, :] * x_t
    tl.store(y_ptr + (rows[:, None] * H + h) * P + p[None, :], out.to(y_ptr.dtype.element_ty),
             mask=live[:, None] & pm[None, :])


@triton.jit
def _intra_block(acc, k0, kend, xend, t, a_t, cbt, ch, p, pm, xb, xs, dt_ptr, a_ptr, L: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, TC: tl.constexpr):
    """acc + (scores of columns k0 .. k0+BLOCK_K-1) @ x of those columns; columns >= kend masked,
    x of columns >= xend read as zero (x at xb, row stride xs: ``_rows_at``)."""
    s = k0 + tl.arange(0, BLOCK_K)
    sm = (s < L) & (s < kend)
    cb = tl.load(cbt[:, None] + s[None, :], mask=sm[None, :], other=0.0)
    a_s = tl.load(a_ptr + ch * L + s, mask=sm, other=0.0)
    dt_s = tl.load(dt_ptr + ch * L + s, mask=sm, other=0.0)
    # exp(a_t - a_s) for s <= t only; the min keeps the (discarded) s > t entries finite.
    decay = tl.where(s[None, :] <= t[:, None], tl.exp(tl.minimum(a_t[:, None] - a_s[None, :], 0.0)), 0.0)
    scores = (cb * decay) * dt_s[None, :]
    xv = tl.load(xb + s[:, None] * xs + p[None, :], mask=(sm & (s < xend))[:, None] & pm[None, :], other=0.0)
    if not TC:  # the tensor-core dot takes bf16 x as it is
        xv = xv.to(tl.float32)
    return dot_acc(acc, scores, xv, TC, 1, PRECISION)


# -- host side -------------------------------------------------------------------------------


def rows_in_place(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, P] (or B, C [T, G, N]) as the kernels read it: any row stride (the conv output's column slice,
    in place), heads and features adjacent; otherwise a contiguous copy."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def _check_shapes(H: int, G: int, L: int, R: int) -> None:
    if R < 16 or R & (R - 1) or L % R:
        raise ValueError(f"row tile {R} must be a power of two >= 16 that divides chunk_size {L}")
    if H % G:
        raise ValueError(f"{H} heads do not split into {G} groups")


def scan_planned(
    plan: AdvancePlan,
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    states: torch.Tensor,
    *,
    x_parts: torch.Tensor,
    B_parts: torch.Tensor,
    T: int,
    out_dtype: torch.dtype,
    zero_unwanted: bool = True,
    cfg: TritonKernelConfigs,
) -> torch.Tensor:
    """The scan proper from a device plan (``to_device(plan_advance(...))``), launched with ``cfg``: y [T, H, P]
    in ``out_dtype`` (unwanted rows zero if ``zero_unwanted``, else unset); moves ``states`` in place.

    x [T, H, P], B and C [T, G, N] the packed new rows; x_parts [*, H, L, P], B_parts [*, G, L, N] the chunks
    with plan.part >= 0, whole; model dtype (bf16 selects the tensor-core dots) or fp32 holding its values.
    dt [NC, H, L] fp32 softplus'd; A [H] fp32; D [H] or [H, P]; states [slots, H, P, N] fp32 at plan.slot."""
    NC, L = dt.shape[0], plan.L
    H, P = x_parts.shape[1], x_parts.shape[3]
    G, N = B_parts.shape[1], B_parts.shape[3]
    R = plan.R
    _check_shapes(H, G, L, R)
    dev = dt.device
    f32 = torch.float32
    tc = tensor_core_dots(C.dtype, cfg.bf16_dots)
    fuse = not tc  # tensor-core mode: no fp contraction in any kernel (triton_dot)
    dt, x_parts, B_parts = (t if t.is_contiguous() else t.contiguous() for t in (dt, x_parts, B_parts))
    x, B, C = (rows_in_place(t) for t in (x, B, C))
    Af = A if A.dtype == f32 and A.device == dev else A.to(device=dev, dtype=f32)
    Dd = D if D.device == dev else D.to(dev)
    sD_h, sD_p = (Dd.stride(0), 0) if Dd.dim() == 1 else (Dd.stride(0), Dd.stride(1))
    y = (torch.zeros if zero_unwanted else torch.empty)(T, H, P, device=dev, dtype=out_dtype)
    if NC == 0:
        return y
    PB, NB = triton.cdiv(P, cfg.block_p), triton.cdiv(N, cfg.block_n)
    dims = dict(H=H, L=L, P=P, N=N)

    a = torch.empty(NC, H, L, device=dev, dtype=f32)
    _cumsum_kernel[(NC, H)](dt, Af, a, H=H, L=L, BLOCK_L=triton.next_power_of_2(L), num_warps=cfg.num_warps,
                            enable_fp_fusion=fuse)

    # the tile kernel's per-head C.B dot, hoisted to one per group (same shapes, same bits)
    cb = torch.empty(NC, G, L, L, device=dev, dtype=f32) if plan.num_tiles else a
    if plan.num_tiles:
        _cb_kernel[(NC * G, L // R, triton.cdiv(L, cfg.block_k))](
            B, B_parts, plan.part, C, cb, plan.pre, plan.length, plan.row0, B.stride(0), C.stride(0), G=G, L=L, N=N,
            R=R, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n, PRECISION=cfg.dot_precision, TC=tc, num_warps=cfg.num_warps,
            enable_fp_fusion=fuse,
        )

    def tiles(h_in: torch.Tensor, h_row: torch.Tensor) -> None:
        if plan.num_tiles:
            _tile_output_kernel[(H, plan.num_tiles, PB)](
                x, x_parts, plan.part, plan.row0, plan.length, dt, a, cb, C, Dd, h_in, h_row, y, plan.tile_chunk,
                plan.tile_pos, plan.tile_rows, sD_h, sD_p, x.stride(0), C.stride(0), G=G, **dims, R=R,
                BLOCK_K=cfg.block_k, BLOCK_P=cfg.block_p, BLOCK_N=cfg.block_n, PRECISION=cfg.dot_precision, TC=tc,
                num_warps=cfg.tile_num_warps, enable_fp_fusion=fuse,
                **(TILE_OPTS if tc else {}),
            )

    # one chunk per sequence: its boundary state is its slot's, read before the pass moves it
    if plan.one_each:
        tiles(states, plan.chunk_slot)
    n_need = int(plan.state_chunks.shape[0])
    chunk_state = torch.empty(NC if n_need else 0, H, P, N, device=dev, dtype=f32)  # unset where not needed
    if n_need:
        NBS = state_block_n(N)
        _chunk_state_kernel[(n_need, H, PB * triton.cdiv(N, NBS))](
            x, x_parts, B, B_parts, plan.part, plan.row0, plan.length, dt, a, chunk_state, plan.state_chunks,
            x.stride(0), B.stride(0), G=G,
            **dims, BLOCK_K=cfg.block_k, BLOCK_P=cfg.block_p,
            BLOCK_NS=NBS, PRECISION=cfg.dot_precision, TC=tc, num_warps=cfg.num_warps, enable_fp_fusion=fuse,
        )
    if plan.one_each and not plan.any_moved:
        return y
    # "round" rounds the boundary states to bf16 at the tile's dot: stored so, the same bits at half the bytes
    h_dtype = torch.bfloat16 if tc == DOT_MODES["round"] else f32
    h_in = torch.empty(0 if plan.one_each else NC, H, P, N, device=dev, dtype=h_dtype)
    PP = cfg.pass_block_p  # <= block_p (the configs refuse more)
    _state_pass_kernel[(plan.num_seqs, H, triton.cdiv(P, PP) * NB)](
        a, chunk_state, plan.need, states, plan.slot, h_in, plan.first, plan.count, **dims, BLOCK_P=PP,
        BLOCK_N=cfg.block_n, WRITE_IN=not plan.one_each, RT_RANGE=not interpreting(), num_warps=cfg.num_warps,
        enable_fp_fusion=fuse,
    )
    if not plan.one_each:
        tiles(h_in, plan.chunk_id)
    return y


def advance_planned(
    state: SSDState,
    plan: AdvancePlan,
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    params: SSMParams,
    *,
    zero_unwanted: bool = True,
    device_plan: AdvancePlan | None = None,
    cfg: TritonKernelConfigs,
) -> torch.Tensor:
    """An advance from a host plan (``plan_advance`` with the step's slots): pack, scan, move the boundary
    states, rewrite the buffers. state contiguous, buffers in the model dtype; x [T, H, P], dt [T, H] raw, B/C
    [T, G, N]; device_plan: ``to_device(plan, x.device)`` if the caller keeps one. Returns y [T, H, P], x's dtype."""
    dt_bias, dt_limit = params.dt_bias, params.dt_limit
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    L = plan.L
    dev = x.device
    for name in ("ssm_state", "buf_x", "buf_dt", "buf_B"):
        if not getattr(state, name).is_contiguous():
            raise ValueError(f"state.{name} must be contiguous")
    pd = to_device(plan, dev) if device_plan is None else device_plan
    NC = plan.num_chunks
    dt = dt if dt.stride(1) == 1 else dt.contiguous()  # any row stride: in_proj's column slice, read in place
    x, B = rows_in_place(x), rows_in_place(B)
    bias = dt_bias if dt_bias.is_contiguous() and dt_bias.device == dev else dt_bias.to(dev).contiguous()
    NP = plan.num_parts  # chunks with buffered rows: copied whole; the others are read in place
    xc = torch.empty(NP, H, L, P, device=dev, dtype=x.dtype)
    dtc = torch.empty(NC, H, L, device=dev, dtype=torch.float32)
    Bc = torch.empty(NP, G, L, N, device=dev, dtype=B.dtype)
    lo, hi = limits(dt_limit)
    dims = dict(H=H, G=G, L=L, P=P, N=N)
    blocks = dict(BLOCK_PF=triton.next_power_of_2(P), BLOCK_NF=triton.next_power_of_2(N))
    rows = min(PACK_ROWS, L)
    if NC:
        _dt_kernel[(NC, triton.cdiv(L, rows))](
            dt, state.buf_dt, bias, pd.chunk_slot, pd.pre, pd.length, pd.row0, dtc, lo, hi, dt.stride(0), H=H, L=L,
            ROWS=rows, BLOCK_H=triton.next_power_of_2(H), HAS_LIMIT=has_limit(dt_limit), num_warps=4,
            enable_fp_fusion=False,
        )
    if NP:
        _pack_kernel[(NC, triton.cdiv(L, rows), H)](
            x, B, state.buf_x, state.buf_B, pd.chunk_slot, pd.pre, pd.length, pd.row0, pd.part, xc, Bc, x.stride(0),
            B.stride(0), **dims, ROWS=rows, **blocks, num_warps=4,
        )
    y = scan_planned(pd, x, dtc, B, C, params.A, params.D, state.ssm_state, x_parts=xc, B_parts=Bc, T=T,
                     out_dtype=x.dtype, zero_unwanted=zero_unwanted, cfg=cfg)
    if plan.any_moved:
        state.refresh_copy(pd.slot)  # the boundary states the scan moved (the others round to what they were)
    if plan.num_seqs:
        _buffer_kernel[(plan.num_seqs, H)](
            x, dt, B, state.buf_x, state.buf_dt, state.buf_B, pd.slot, pd.keep_lo, pd.keep_hi, pd.keep_row0,
            pd.clear_hi, x.stride(0), dt.stride(0), B.stride(0), **dims, ROWS=rows, **blocks, num_warps=4,
        )
    return y


def scan_chunks_triton(
    ch: Chunks,
    C: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    initial_states: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    final: str = "boundary",
    cfg: TritonKernelConfigs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``chunk.scan_chunks`` on Triton (its bits rule, its own bits); reads the chunk layout back to plan.

    ch: ``pack_chunks``'s output; C [T, G, N] model dtype (bf16 selects the tensor-core dots: ch.x, ch.B hold
    bf16 values); A [H] fp32; D [H] or [H, P]; initial_states [S, H, P, N] fp32; rows [T] bool (default all).
    Returns y [T, H, P] fp32 (unwanted rows zero), states [S, H, P, N] fp32 (final="boundary": at the last
    full-chunk boundary; "end": at the end) and moved [S] bool (False: the initial state's bits)."""
    NC, H, L, P = ch.x.shape
    G = ch.B.shape[1]
    row_tile = cfg.scan_row_tile(L)
    _check_shapes(H, G, L, row_tile)
    S = initial_states.shape[0]
    dev = ch.x.device
    seq, length = ch.seq.cpu(), ch.length.cpu()
    lens = torch.bincount(seq[ch.row_chunk.cpu()], minlength=S) if C.shape[0] else torch.zeros(S, dtype=torch.int64)
    off = torch.zeros(S, dtype=torch.int64).index_add_(0, seq, length) - lens
    plan = plan_advance(lens, off, L, row_tile, rows=None if rows is None else rows.cpu(), final=final)
    states = initial_states.to(device=dev, dtype=torch.float32).clone()
    # every chunk is already whole (packed): read them all from the parts
    plan = dataclasses.replace(plan, part=np.arange(plan.num_chunks, dtype=np.int64), num_parts=plan.num_chunks)
    y = scan_planned(to_device(plan, dev), ch.x, ch.dt, ch.B, C, A, D, states, x_parts=ch.x, B_parts=ch.B,
                     T=C.shape[0], out_dtype=torch.float32, cfg=cfg)
    return y, states, torch.from_numpy(plan.moved).to(dev)


def ssd_chunk_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    params: SSMParams,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None = None,
    *,
    chunk_size: int,
    cfg: TritonKernelConfigs,
    final: str = "end",
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk.ssd_chunk`` on the Triton kernels (the scan forms' signature; its own bits): x [T, H, P], dt [T, H]
    raw, B/C [T, G, N] (bf16 selects the tensor-core dots), cu_seqlens [S+1], initial_states fp32 or None (zeros)
    -> y [T, H, P] in x's dtype, states [S, H, P, N] fp32 (at the end, or the last boundary for "boundary")."""
    S = cu_seqlens.numel() - 1
    H, P, N = x.shape[1], x.shape[2], B.shape[2]
    if initial_states is None:
        initial_states = torch.zeros(S, H, P, N, device=x.device)
    ch = pack_chunks(x, dt, B, cu_seqlens, chunk_size, params.dt_bias, params.dt_limit)
    y, h, _ = scan_chunks_triton(ch, C, params.A, params.D, initial_states, rows=rows, final=final, cfg=cfg)
    return y.to(x.dtype), h


def replay_chunk_triton(
    state: SSDState,
    step: Step,
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    params: SSMParams,
    *,
    rows: torch.Tensor | None = None,
    cfg: TritonKernelConfigs,
) -> torch.Tensor:
    """An advance of every slot of ``step`` (the replay forms' signature): y [T, H, P] in x's dtype (unwanted rows
    zero when ``rows`` is given). Planned on the host without device syncs, once per step and device
    (``StepPlan.ssd_chunk``, shared by the layers); a ``rows`` mask is planned per call."""
    state.check_inputs(x, dt, B)
    L = state.chunk_size
    R = cfg.scan_row_tile(L)
    dev = x.device

    def planned() -> tuple[AdvancePlan, AdvancePlan]:
        p = plan_advance(step.lengths, step.start_pos % L, L, R, slots=step.slots, rows=rows)
        return p, to_device(p, dev)

    if rows is not None:
        plan, plan_d = planned()
    else:
        step_plan = step.plans[dev]
        plan, plan_d = step_plan.once(step_plan.ssd_chunk, (L, R), planned)
    return advance_planned(state, plan, x, dt, B, C, params, zero_unwanted=rows is not None, device_plan=plan_d,
                           cfg=cfg)
