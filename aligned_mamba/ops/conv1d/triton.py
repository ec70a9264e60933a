"""Causal depthwise conv1d + SiLU in Triton (the GPU path of ``ops.conv1d``), slot-indexed windows.

Each output is bias + w_0 x_{t-K+1} + ... + w_{K-1} x_t, each operation rounded once in fp32 (no fp
contraction), then the SiLU of the configs' ``silu``: ``silu_exact`` (``ops.conv1d``'s operations, so the
torch backend's bits) or ``silu_device`` (the GPU's exp and division), in a prefill or a decode step alike.
Two launches: the outputs from the old windows, then each slot's new window in place; a row finds its
sequence by a binary search over cu_seqlens on the device (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..autograd import grad_block, grad_needed, wanted
from ..configs import TritonKernelConfigs
from ..step import Step
from ..triton_math import silu_of
from . import taps


@triton.jit
def _row_sequence(cu_ptr, rows, rmask, S, SEARCH_STEPS, BLOCK_T: tl.constexpr):
    """Each row's sequence (the largest s with cu[s] <= row; cu[0] = 0 <= row < cu[S] = T) and its index
    in that sequence, by a binary search over cu_seqlens [S+1]: (seq [BLOCK_T] int32, j [BLOCK_T] int32)."""
    lo = tl.zeros((BLOCK_T,), dtype=tl.int32)
    hi = tl.full((BLOCK_T,), S, dtype=tl.int32)
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        below = tl.load(cu_ptr + mid, mask=rmask, other=0) <= rows
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo, rows - tl.load(cu_ptr + lo, mask=rmask, other=0).to(tl.int32)


@triton.jit
def _conv_kernel(x_ptr, cu_ptr, slots_ptr, win_ptr, w_ptr, b_ptr, out_ptr, T, S, Cd, stride_x, stride_ws, stride_wk,
                 stride_out, SEARCH_STEPS, K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                 DEVICE_SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows [BLOCK_T] x channels [BLOCK_C] of the output, from the old windows and x."""
    r0 = tl.program_id(0) * BLOCK_T
    rows = r0 + tl.arange(0, BLOCK_T)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < T
    cmask = ch < Cd
    r64 = rows.to(tl.int64)
    if HAS_BIAS:
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32) + tl.load(b_ptr + ch, mask=cmask, other=0.0).to(
            tl.float32)[None, :]
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    m2 = rmask[:, None] & cmask[None, :]
    # a block inside one sequence, past its first K - 1 rows, reads only x: no per-row search, no window
    seq0 = _find_sequence(cu_ptr, r0, S, SEARCH_STEPS)
    inside = (r0 - tl.load(cu_ptr + seq0) >= K - 1) & (r0 + BLOCK_T <= tl.load(cu_ptr + seq0 + 1))
    if inside:
        for k in tl.static_range(K):
            xv = tl.load(x_ptr + (r64 + (k - (K - 1)))[:, None] * stride_x + ch[None, :], mask=m2, other=0.0)
            acc = acc + tl.load(w_ptr + ch * K + k, mask=cmask, other=0.0).to(tl.float32)[None, :] * xv.to(tl.float32)
    else:
        lo, j = _row_sequence(cu_ptr, rows, rmask, S, SEARCH_STEPS, BLOCK_T)
        slot = tl.load(slots_ptr + lo, mask=rmask, other=0).to(tl.int64)
        for k in tl.static_range(K):
            # stream position j + k: window row j + k, or new row row + k - (K - 1)
            p = j + k
            in_win = (p < K - 1)[:, None]
            wv = tl.load(win_ptr + slot[:, None] * stride_ws + p[:, None].to(tl.int64) * stride_wk + ch[None, :],
                         mask=m2 & in_win, other=0.0)
            xv = tl.load(x_ptr + (r64 + (k - (K - 1)))[:, None] * stride_x + ch[None, :], mask=m2 & ~in_win,
                         other=0.0)
            v = tl.where(in_win, wv.to(tl.float32), xv.to(tl.float32))
            acc = acc + tl.load(w_ptr + ch * K + k, mask=cmask, other=0.0).to(tl.float32)[None, :] * v
    if SILU:
        acc = silu_of(acc, DEVICE_SILU)
    tl.store(out_ptr + r64[:, None] * stride_out + ch[None, :], acc.to(out_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _window_kernel(x_ptr, cu_ptr, slots_ptr, win_ptr, Cd, stride_x, stride_ws, stride_wk, K: tl.constexpr,
                   BLOCK_Q: tl.constexpr, BLOCK_C: tl.constexpr):
    """Sequence s (program (s, c)): its slot's window := the last K - 1 rows of (window ++ new rows)."""
    s = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < Cd
    start = tl.load(cu_ptr + s)
    n = tl.load(cu_ptr + s + 1) - start
    slot = tl.load(slots_ptr + s).to(tl.int64)
    q = tl.arange(0, BLOCK_Q)
    qmask = q < K - 1
    p = n + q  # stream position of the new window's row q
    in_win = (p < K - 1)[:, None]
    m2 = qmask[:, None] & cmask[None, :]
    base = win_ptr + slot * stride_ws
    wv = tl.load(base + p[:, None] * stride_wk + ch[None, :], mask=m2 & in_win, other=0.0)
    xv = tl.load(x_ptr + (start + p - (K - 1))[:, None].to(tl.int64) * stride_x + ch[None, :], mask=m2 & ~in_win,
                 other=0.0)
    v = tl.where(in_win, wv, xv.to(wv.dtype))
    # all old-window reads before any write: a short sequence shifts its window within the same rows
    tl.debug_barrier()
    tl.store(base + q[:, None] * stride_wk + ch[None, :], v, mask=m2)


@triton.jit
def _stream_value(x_ptr, win_ptr, xrow, seq, p, ch, m2, stride_x, stride_ws, stride_wk, K: tl.constexpr):
    """Position p [BLOCK_T] of each row's stream (window ++ new rows), [BLOCK_T, BLOCK_C] in the inputs'
    dtype: window row p of sequence seq for p < K-1, else packed row xrow; zero where m2 is False."""
    in_win = (p < K - 1)[:, None]
    wv = tl.load(win_ptr + seq[:, None].to(tl.int64) * stride_ws + p[:, None].to(tl.int64) * stride_wk + ch[None, :],
                 mask=m2 & in_win, other=0.0)
    xv = tl.load(x_ptr + xrow[:, None] * stride_x + ch[None, :], mask=m2 & ~in_win, other=0.0)
    return tl.where(in_win, wv, xv.to(wv.dtype))


@triton.jit
def _conv_bwd_kernel(x_ptr, cu_ptr, win_ptr, w_ptr, b_ptr, g_ptr, dx_ptr, dw_ptr, db_ptr, T, S, Cd, stride_x,
                     stride_ws, stride_wk, stride_g, SEARCH_STEPS, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """The tile form of the gradient of conv1d + SiLU, rows [BLOCK_T] x channels [BLOCK_C]: dx (fp32,
    rounded once to x's dtype) and this block's partial sums of dw, db (dw_ptr [blocks, K, Cd], db_ptr
    [blocks, Cd], fp32). dx_t = sum_d w_{K-1-d} dpre_{t+d}, dpre = g silu'(pre), each shifted pre
    recomputed from the stream in the forward's order, so no program needs another's output."""
    blk = tl.program_id(0)
    rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < T
    cmask = ch < Cd
    seq, j = _row_sequence(cu_ptr, rows, rmask, S, SEARCH_STEPS, BLOCK_T)
    n = tl.load(cu_ptr + seq + 1, mask=rmask, other=0).to(tl.int32) - (rows - j)  # the sequence's length
    r64 = rows.to(tl.int64)
    pre0 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        pre0 += tl.load(b_ptr + ch, mask=cmask, other=0.0).to(tl.float32)[None, :]
    # the stream at shifts -(K-1) .. K-1 (K <= 4), tiles named rather than indexed, to stay in registers
    vm3 = _stream_value(x_ptr, win_ptr, r64 - 3, seq, j + (K - 4), ch, (rmask & (K >= 4))[:, None] & cmask[None, :],
                        stride_x, stride_ws, stride_wk, K)
    vm2 = _stream_value(x_ptr, win_ptr, r64 - 2, seq, j + (K - 3), ch, (rmask & (K >= 3))[:, None] & cmask[None, :],
                        stride_x, stride_ws, stride_wk, K)
    vm1 = _stream_value(x_ptr, win_ptr, r64 - 1, seq, j + (K - 2), ch, (rmask & (K >= 2))[:, None] & cmask[None, :],
                        stride_x, stride_ws, stride_wk, K)
    v0 = _stream_value(x_ptr, win_ptr, r64, seq, j + (K - 1), ch, rmask[:, None] & cmask[None, :],
                       stride_x, stride_ws, stride_wk, K)
    v1 = _stream_value(x_ptr, win_ptr, r64 + 1, seq, j + K, ch, (rmask & (K >= 2) & (j + 1 < n))[:, None]
                       & cmask[None, :], stride_x, stride_ws, stride_wk, K)
    v2 = _stream_value(x_ptr, win_ptr, r64 + 2, seq, j + K + 1, ch, (rmask & (K >= 3) & (j + 2 < n))[:, None]
                       & cmask[None, :], stride_x, stride_ws, stride_wk, K)
    v3 = _stream_value(x_ptr, win_ptr, r64 + 3, seq, j + K + 2, ch, (rmask & (K >= 4) & (j + 3 < n))[:, None]
                       & cmask[None, :], stride_x, stride_ws, stride_wk, K)
    w0 = tl.load(w_ptr + ch * K, mask=cmask, other=0.0).to(tl.float32)[None, :]
    w1 = tl.load(w_ptr + ch * K + 1, mask=cmask & (K >= 2), other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + ch * K + 2, mask=cmask & (K >= 3), other=0.0).to(tl.float32)[None, :]
    w3 = tl.load(w_ptr + ch * K + 3, mask=cmask & (K >= 4), other=0.0).to(tl.float32)[None, :]
    dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for d in tl.static_range(K):
        m2 = (rmask & (j + d < n))[:, None] & cmask[None, :]
        # pre_{t+d} = bias + sum_k w_k v_{d+k-(K-1)}, k ascending (the forward's order)
        pre = pre0 + w0 * _shift(vm3, vm2, vm1, v0, v1, v2, v3, d - (K - 1)).to(tl.float32)
        if K >= 2:
            pre += w1 * _shift(vm3, vm2, vm1, v0, v1, v2, v3, d + 1 - (K - 1)).to(tl.float32)
        if K >= 3:
            pre += w2 * _shift(vm3, vm2, vm1, v0, v1, v2, v3, d + 2 - (K - 1)).to(tl.float32)
        if K >= 4:
            pre += w3 * _shift(vm3, vm2, vm1, v0, v1, v2, v3, d + 3 - (K - 1)).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-pre))
        g = tl.load(g_ptr + (r64 + d)[:, None] * stride_g + ch[None, :], mask=m2, other=0.0).to(tl.float32)
        dpre = tl.where(m2, g * (s * (1.0 + pre * (1.0 - s))), 0.0)
        dx += tl.load(w_ptr + ch * K + (K - 1 - d), mask=cmask, other=0.0).to(tl.float32)[None, :] * dpre
        if d == 0:  # the block's own rows: their weight and bias gradients
            tl.store(db_ptr + blk * Cd + ch, tl.sum(dpre, axis=0), mask=cmask)
            for k in tl.static_range(K):
                v = _shift(vm3, vm2, vm1, v0, v1, v2, v3, k - (K - 1)).to(tl.float32)
                tl.store(dw_ptr + (blk * K + k) * Cd + ch, tl.sum(dpre * v, axis=0), mask=cmask)
    tl.store(dx_ptr + r64[:, None] * Cd + ch[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _shift(vm3, vm2, vm1, v0, v1, v2, v3, m: tl.constexpr):
    """The stream tile at shift m (-3 .. 3), chosen at compile time."""
    if m == -3:
        return vm3
    elif m == -2:
        return vm2
    elif m == -1:
        return vm1
    elif m == 0:
        return v0
    elif m == 1:
        return v1
    elif m == 2:
        return v2
    else:
        return v3


# -- the backward as one walk per row block (the default form) --------------------------------------------


@triton.jit
def _zeros(BLOCK_C: tl.constexpr):
    """fp32 zeros [BLOCK_C], a new IR value per call (see the walk kernel's loop-carried rows)."""
    return tl.zeros((BLOCK_C,), dtype=tl.float32)


@triton.jit
def _find_sequence(cu_ptr, row, S, SEARCH_STEPS):
    """The sequence of one row (the largest s with cu[s] <= row), a scalar binary search over cu_seqlens."""
    lo = row * 0
    hi = lo + S
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        below = tl.load(cu_ptr + mid).to(tl.int32) <= row
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def _stream_row(x_ptr, win_ptr, row, seq, p, ch, cmask, stride_x, stride_ws, stride_wk, K: tl.constexpr):
    """Position p (a scalar) of sequence seq's stream (its window ++ its new rows) as fp32 [BLOCK_C]:
    window row p for p < K-1, else the packed row ``row``."""
    in_win = p < K - 1
    wv = tl.load(win_ptr + seq.to(tl.int64) * stride_ws + p.to(tl.int64) * stride_wk + ch, mask=cmask & in_win,
                 other=0.0)
    xv = tl.load(x_ptr + row.to(tl.int64) * stride_x + ch, mask=cmask & (p >= K - 1), other=0.0)
    return tl.where(in_win, wv.to(tl.float32), xv.to(tl.float32))


@triton.jit
def _ahead(ptr, row, lo, stride, ch, cmask):
    """Row ``row`` of ptr ([BLOCK_C] in its dtype), zeros where row < max(lo, 0)."""
    return tl.load(ptr + row.to(tl.int64) * stride + ch, mask=cmask & (row >= lo) & (row >= 0), other=0.0)


@triton.jit
def _tap(w0, w1, w2, w3, k: tl.constexpr):
    """Tap k (0 .. 3) of the weights, chosen at compile time."""
    if k == 0:
        return w0
    elif k == 1:
        return w1
    elif k == 2:
        return w2
    else:
        return w3


@triton.jit
def _taps_and_bias(w_ptr, b_ptr, ch, cmask, K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr):
    """The K (<= 4) taps of the block's channels (w_ptr [Cd, K]) and their bias (zeros without one), fp32
    [BLOCK_C] each; taps past K are zeros."""
    w0 = tl.load(w_ptr + ch * K, mask=cmask, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + ch * K + 1, mask=cmask & (K >= 2), other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + ch * K + 2, mask=cmask & (K >= 3), other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + ch * K + 3, mask=cmask & (K >= 4), other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + ch, mask=cmask, other=0.0).to(tl.float32)
    else:
        bias = _zeros(BLOCK_C)
    return w0, w1, w2, w3, bias


@triton.jit
def _conv_bwd_walk_kernel(x_ptr, cu_ptr, win_ptr, w_ptr, b_ptr, g_ptr, dx_ptr, dw_ptr, db_ptr, T, S, Cd, stride_x,
                          stride_ws, stride_wk, stride_g, stride_dx, SEARCH_STEPS, K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr, AHEAD: tl.constexpr):
    """The walk form of ``_conv_bwd_kernel``'s outputs for rows [ROWS] x channels [BLOCK_C] (the dw, db
    partials summed by ``_partials_kernel``). It walks the rows last to first, from K-1 rows past its
    block (their dpre only), carrying the last K-1 dpre and stream rows in registers: each row reads x
    and g once and computes its pre (the forward's order) and sigmoid once. AHEAD (2 or 4): rows of x and
    g loaded ahead of their use."""
    blk = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < Cd
    r0 = blk * ROWS
    r1 = tl.minimum(r0 + ROWS, T)
    top = tl.minimum(r1 + (K - 1), T)
    w0, w1, w2, w3, bias = _taps_and_bias(w_ptr, b_ptr, ch, cmask, K, HAS_BIAS, BLOCK_C)
    # stream rows j+1 .. j+3 (c1 .. c3), dpre of rows t+1 .. t+3 (e1 .. e3), each from its own zeros:
    # shared zeros are not loop-carried (docs/design.md, "Backends")
    c1, c2, c3 = _zeros(BLOCK_C), _zeros(BLOCK_C), _zeros(BLOCK_C)
    e1, e2, e3 = _zeros(BLOCK_C), _zeros(BLOCK_C), _zeros(BLOCK_C)
    dw0, dw1, dw2, dw3, db = _zeros(BLOCK_C), _zeros(BLOCK_C), _zeros(BLOCK_C), _zeros(BLOCK_C), _zeros(BLOCK_C)
    seq = _find_sequence(cu_ptr, top - 1, S, SEARCH_STEPS)
    start = tl.load(cu_ptr + seq).to(tl.int32)
    end = tl.load(cu_ptr + seq + 1).to(tl.int32)
    # x row t-(K-1) and g row t loaded AHEAD rows ahead of their use (the compiler does not pipeline the loop)
    xa = _ahead(x_ptr, top - 1 - (K - 1), r0 - (K - 1), stride_x, ch, cmask)
    ga = _ahead(g_ptr, top - 1, r0, stride_g, ch, cmask)
    xb = _ahead(x_ptr, top - 2 - (K - 1), r0 - (K - 1), stride_x, ch, cmask)
    gb = _ahead(g_ptr, top - 2, r0, stride_g, ch, cmask)
    xc, gc, xd, gd = xa, ga, xb, gb
    if AHEAD == 4:
        xc = _ahead(x_ptr, top - 3 - (K - 1), r0 - (K - 1), stride_x, ch, cmask)
        gc = _ahead(g_ptr, top - 3, r0, stride_g, ch, cmask)
        xd = _ahead(x_ptr, top - 4 - (K - 1), r0 - (K - 1), stride_x, ch, cmask)
        gd = _ahead(g_ptr, top - 4, r0, stride_g, ch, cmask)
    for i in range(top - r0):
        t = top - 1 - i
        x_t, g_t = xa, ga
        if AHEAD == 4:
            xa, ga, xb, gb, xc, gc = xb, gb, xc, gc, xd, gd
            xd = _ahead(x_ptr, t - 4 - (K - 1), r0 - (K - 1), stride_x, ch, cmask)
            gd = _ahead(g_ptr, t - 4, r0, stride_g, ch, cmask)
        else:
            xa, ga = xb, gb
            xb = _ahead(x_ptr, t - 2 - (K - 1), r0 - (K - 1), stride_x, ch, cmask)
            gb = _ahead(g_ptr, t - 2, r0, stride_g, ch, cmask)
        if t < start:  # the row before this sequence: a new one (empty ones skipped by the search)
            seq = _find_sequence(cu_ptr, t, S, SEARCH_STEPS)
            start = tl.load(cu_ptr + seq).to(tl.int32)
            end = tl.load(cu_ptr + seq + 1).to(tl.int32)
        j = t - start
        if (t == end - 1) | (i == 0):  # nothing carried from this sequence yet
            if K >= 2:
                c1 = _stream_row(x_ptr, win_ptr, t - (K - 2), seq, j + 1, ch, cmask, stride_x, stride_ws,
                                 stride_wk, K)
            if K >= 3:
                c2 = _stream_row(x_ptr, win_ptr, t - (K - 3), seq, j + 2, ch, cmask, stride_x, stride_ws,
                                 stride_wk, K)
            if K >= 4:
                c3 = _stream_row(x_ptr, win_ptr, t, seq, j + 3, ch, cmask, stride_x, stride_ws, stride_wk, K)
        c0 = x_t.to(tl.float32)
        if j < K - 1:  # the row's first tap is in its sequence's window
            c0 = tl.load(win_ptr + seq.to(tl.int64) * stride_ws + j.to(tl.int64) * stride_wk + ch, mask=cmask,
                         other=0.0).to(tl.float32)
        # pre_t = bias + sum_k w_k stream[j + k], k ascending (the forward's order)
        pre = bias + w0 * c0
        if K >= 2:
            pre += w1 * c1
        if K >= 3:
            pre += w2 * c2
        if K >= 4:
            pre += w3 * c3
        s = 1.0 / (1.0 + tl.exp(-pre))
        dpre = g_t.to(tl.float32) * (s * (1.0 + pre * (1.0 - s)))
        dx = _tap(w0, w1, w2, w3, K - 1) * dpre
        if K >= 2:
            dx += _tap(w0, w1, w2, w3, K - 2) * tl.where(t + 1 < end, e1, 0.0)
        if K >= 3:
            dx += _tap(w0, w1, w2, w3, K - 3) * tl.where(t + 2 < end, e2, 0.0)
        if K >= 4:
            dx += _tap(w0, w1, w2, w3, K - 4) * tl.where(t + 3 < end, e3, 0.0)
        own = t < r1  # the K-1 rows past the block give their dpre only
        tl.store(dx_ptr + t.to(tl.int64) * stride_dx + ch, dx.to(dx_ptr.dtype.element_ty), mask=cmask & own)
        d_own = tl.where(own, dpre, 0.0)
        db += d_own
        dw0 += d_own * c0
        dw1 += d_own * c1
        dw2 += d_own * c2
        dw3 += d_own * c3
        e3, e2, e1 = e2, e1, dpre
        c3, c2, c1 = c2, c1, c0
    base = dw_ptr + blk.to(tl.int64) * K * Cd + ch
    tl.store(base, dw0, mask=cmask)
    if K >= 2:
        tl.store(base + Cd, dw1, mask=cmask)
    if K >= 3:
        tl.store(base + 2 * Cd, dw2, mask=cmask)
    if K >= 4:
        tl.store(base + 3 * Cd, dw3, mask=cmask)
    if HAS_BIAS:
        tl.store(db_ptr + blk.to(tl.int64) * Cd + ch, db, mask=cmask)


@triton.jit
def _sum_blocks(ptr, NB, stride_b, ch, cmask, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """sum over b < NB of ptr[b * stride_b + ch] (fp32 [BLOCK_C]): BLOCK_B rows at a time, in order."""
    b = tl.arange(0, BLOCK_B)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for b0 in range(0, NB, BLOCK_B):
        m = ((b0 + b) < NB)[:, None] & cmask[None, :]
        acc += tl.sum(tl.load(ptr + (b0 + b)[:, None].to(tl.int64) * stride_b + ch[None, :], mask=m, other=0.0),
                      axis=0)
    return acc


@triton.jit
def _partials_kernel(dw_ptr, db_ptr, dwo_ptr, dbo_ptr, NB, Cd, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """dweight [Cd, K] and dbias [Cd] from the row blocks' fp32 partials (dw_ptr [NB, K, Cd], db_ptr
    [NB, Cd]) summed in block order; program (channel block, k): tap k's column, or dbias for k = K."""
    ch = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < Cd
    k = tl.program_id(1)
    if k < K:
        acc = _sum_blocks(dw_ptr + k * Cd, NB, K * Cd, ch, cmask, BLOCK_B, BLOCK_C)
        tl.store(dwo_ptr + ch * K + k, acc.to(dwo_ptr.dtype.element_ty), mask=cmask)
    elif HAS_BIAS:
        acc = _sum_blocks(db_ptr, NB, Cd, ch, cmask, BLOCK_B, BLOCK_C)
        tl.store(dbo_ptr + ch, acc.to(dbo_ptr.dtype.element_ty), mask=cmask)


# rows the walks (forward and backward) load ahead of their use (2 or 4; the same bits): a measurement knob for
# bench --knobs-b
WALK_AHEAD: int = 2
WALK_AHEADS = (2, 4)  # the depths the kernels have


def _walk_ahead() -> int:
    if WALK_AHEAD not in WALK_AHEADS:
        raise ValueError(f"conv1d.triton.WALK_AHEAD must be 2 or 4, not {WALK_AHEAD!r}")
    return WALK_AHEAD

# the tile kernel's launch (rows, channels, warps): the reference the walk's dx is tested against
TILE_LAUNCH: tuple[int, int, int] = (32, 64, 4)


def causal_conv1d_backward_triton(x: torch.Tensor, cu_seqlens: torch.Tensor, window: torch.Tensor,
                                  weight: torch.Tensor, bias: torch.Tensor | None, g: torch.Tensor,
                                  cfg: TritonKernelConfigs, walk: bool = True, dx_out: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gradient of ``causal_conv1d_triton``'s output against g [T, Cd], from the windows as they were
    (window [S, K-1, Cd]): (dx in x's dtype, dweight [Cd, K] in weight's, dbias [Cd] or None); the
    window's own is ``taps.causal_conv1d_backward``'s. Deterministic; ``walk=False``: the tile kernel at
    ``TILE_LAUNCH``, the same dx bits. ``dx_out``: where the walk writes dx ([T, Cd], unit column stride)."""
    T, Cd = x.shape
    S, K = window.shape[0], weight.shape[1]
    if not 1 <= K <= 4:
        raise ValueError(f"the conv backward kernel takes widths 1 to 4, not {K}")
    x, w, b = _operands(x, weight, bias)
    g = g if g.stride(1) == 1 else g.contiguous()
    if walk:
        return _backward_walk(x, cu_seqlens, window, w, b if bias is not None else None, g, weight.dtype,
                              None if bias is None else bias.dtype, cfg, dx_out)
    BT, BC, warps = TILE_LAUNCH
    nb = triton.cdiv(T, BT)
    dx = torch.empty(T, Cd, device=x.device, dtype=x.dtype)  # no fp32 copy to round afterwards
    dw = torch.empty(nb, K, Cd, device=x.device, dtype=torch.float32)
    db = torch.empty(nb, Cd, device=x.device, dtype=torch.float32)
    if T:
        _conv_bwd_kernel[(nb, triton.cdiv(Cd, BC))](
            x, cu_seqlens, window, w, b, g, dx, dw, db, T, S, Cd, x.stride(0), window.stride(0), window.stride(1),
            g.stride(0), max(S, 1).bit_length(), K=K, HAS_BIAS=bias is not None, BLOCK_T=BT, BLOCK_C=BC,
            num_warps=warps)
    return (dx, dw.sum(0).t().to(weight.dtype),
            None if bias is None else db.sum(0).to(bias.dtype))


def _backward_walk(x: torch.Tensor, cu_seqlens: torch.Tensor, window: torch.Tensor, w: torch.Tensor,
                   b: torch.Tensor | None, g: torch.Tensor, w_dtype: torch.dtype, b_dtype: torch.dtype | None,
                   cfg: TritonKernelConfigs, dx_out: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``causal_conv1d_backward_triton`` by ``_conv_bwd_walk_kernel`` and ``_partials_kernel`` (x and g
    with unit channel stride, w [Cd, K] contiguous)."""
    T, Cd = x.shape
    S, K = window.shape[0], w.shape[1]
    rows, block_c, warps = cfg.conv_bwd_block_t, cfg.conv_bwd_block_c, cfg.conv_bwd_warps
    nb = triton.cdiv(T, rows)
    dev = x.device
    dx = torch.empty(T, Cd, device=dev, dtype=x.dtype) if dx_out is None else dx_out
    if dx.shape != (T, Cd) or dx.dtype != x.dtype or (T and dx.stride(1) != 1):
        raise ValueError(f"dx_out must be [{T}, {Cd}] {x.dtype} with unit column stride, got {tuple(dx.shape)} "
                         f"{dx.dtype}")
    dw = torch.empty(Cd, K, device=dev, dtype=w_dtype)
    db = torch.empty(Cd, device=dev, dtype=b_dtype) if b is not None else None
    if T == 0:
        dw.zero_()
        return dx, dw, None if db is None else db.zero_()
    dwp = torch.empty(nb, K, Cd, device=dev, dtype=torch.float32)
    dbp = torch.empty(nb, Cd, device=dev, dtype=torch.float32) if b is not None else dwp
    _conv_bwd_walk_kernel[(nb, triton.cdiv(Cd, block_c))](
        x, cu_seqlens, window, w, b if b is not None else w, g, dx, dwp, dbp, T, S, Cd, x.stride(0),
        window.stride(0), window.stride(1), g.stride(0), dx.stride(0), max(S, 1).bit_length(), K=K,
        HAS_BIAS=b is not None, ROWS=rows, BLOCK_C=block_c, AHEAD=_walk_ahead(), num_warps=warps)
    # a program per (128 channels, tap or bias): per channel block alone, too few programs to fill the GPU
    _partials_kernel[(triton.cdiv(Cd, 128), K + (b is not None))](
        dwp, dbp, dw, db if db is not None else dw, nb, Cd, K=K, HAS_BIAS=b is not None, BLOCK_B=16, BLOCK_C=128,
        num_warps=4)
    return dx, dw, db


def _operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x with unit channel stride (any row stride: a column slice is read in place), weight and bias
    contiguous as the kernels index them; the bias pointer is the weight's when there is none (unread)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    w = weight.contiguous()
    return x, w, bias.contiguous() if bias is not None else w


def _check_windows(windows: torch.Tensor, x: torch.Tensor, K: int) -> None:
    Cd = x.shape[1]
    if windows.dim() != 3 or windows.shape[1:] != (K - 1, Cd) or windows.stride(2) != 1:
        raise ValueError(f"windows {tuple(windows.shape)} must be [num_slots, {K - 1}, {Cd}] with unit last stride")
    if windows.dtype != x.dtype:
        raise ValueError(f"windows are {windows.dtype} but x is {x.dtype}: keeping x in the window would round it")


def causal_conv1d_triton(x: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor, windows: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor | None, cfg: TritonKernelConfigs, *,
                         activation: bool = True) -> torch.Tensor:
    """Conv1d (+ SiLU) of the new rows of S packed sequences, their windows moved on in place: x [T, Cd]
    (model dtype; rows may be strided), cu_seqlens [S+1] int64 and slots [S] int64 (distinct) on x's
    device, windows [num_slots, K-1, Cd] in x's dtype (``slots[s]``: the K-1 inputs before sequence s's
    new rows, zeros for a fresh one), weight [Cd, K], bias [Cd] or None -> [T, Cd] in x's dtype. A
    sequence may have no new rows."""
    T, Cd = x.shape
    S = slots.shape[0]
    K = weight.shape[1]
    x, w, b = _operands(x, weight, bias)
    _check_windows(windows, x, K)
    if cu_seqlens.shape != (S + 1,):
        raise ValueError(f"cu_seqlens {tuple(cu_seqlens.shape)} does not match {S} slots")
    out = torch.empty(T, Cd, dtype=x.dtype, device=x.device)
    if S == 0:
        return out
    bc = cfg.conv_block_c
    if T > 0 and cfg.conv_walk and K <= 4:
        rows, wc = cfg.conv_walk_block_t, cfg.conv_walk_block_c
        _conv_walk_kernel[(triton.cdiv(T, rows), triton.cdiv(Cd, wc))](
            x, cu_seqlens, slots, windows, w, b, out, T, S, Cd, x.stride(0), windows.stride(0), windows.stride(1),
            out.stride(0), max(S, 1).bit_length(), K=K, HAS_BIAS=bias is not None, SILU=activation,
            DEVICE_SILU=cfg.device_silu, ROWS=rows,
            BLOCK_C=wc, AHEAD=_walk_ahead(), num_warps=cfg.conv_walk_warps, enable_fp_fusion=False)
    elif T > 0:
        grid = (triton.cdiv(T, cfg.conv_block_t), triton.cdiv(Cd, bc))
        _conv_kernel[grid](x, cu_seqlens, slots, windows, w, b, out, T, S, Cd, x.stride(0), windows.stride(0),
                           windows.stride(1), out.stride(0), max(S, 1).bit_length(), K=K, HAS_BIAS=bias is not None,
                           SILU=activation, DEVICE_SILU=cfg.device_silu, BLOCK_T=cfg.conv_block_t, BLOCK_C=bc,
                           num_warps=4, enable_fp_fusion=False)
    if K > 1:
        _window_kernel[(S, triton.cdiv(Cd, bc))](x, cu_seqlens, slots, windows, Cd, x.stride(0), windows.stride(0),
                                                windows.stride(1), K=K, BLOCK_Q=triton.next_power_of_2(K - 1),
                                                BLOCK_C=bc, num_warps=4)
    return out


# -- the forward as one walk per row block (prefill and chunked prefill) ----------------------------------


@triton.jit
def _conv_walk_kernel(x_ptr, cu_ptr, slots_ptr, win_ptr, w_ptr, b_ptr, out_ptr, T, S, Cd, stride_x, stride_ws,
                      stride_wk, stride_out, SEARCH_STEPS, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SILU: tl.constexpr, DEVICE_SILU: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
                      AHEAD: tl.constexpr):
    """``_conv_kernel``'s outputs for rows [ROWS] x channels [BLOCK_C], walking the rows in order with the
    last K - 1 stream rows in registers (each input read once): the same operations on the same values.
    AHEAD (2 or 4): rows loaded ahead of their use, the loads a warp keeps in flight."""
    blk = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < Cd
    r0 = blk * ROWS
    r1 = tl.minimum(r0 + ROWS, T)
    w0, w1, w2, w3, b0 = _taps_and_bias(w_ptr, b_ptr, ch, cmask, K, HAS_BIAS, BLOCK_C)
    # stream rows j - 3 .. j - 1 (c3, c2, c1), each from its own zeros (see the backward walk)
    c1, c2, c3 = _zeros(BLOCK_C), _zeros(BLOCK_C), _zeros(BLOCK_C)
    seq = _find_sequence(cu_ptr, r0, S, SEARCH_STEPS)
    start = tl.load(cu_ptr + seq).to(tl.int32)
    end = tl.load(cu_ptr + seq + 1).to(tl.int32)
    # the next AHEAD rows' x, loaded ahead of their use (addresses independent of the walk)
    xa = tl.load(x_ptr + r0.to(tl.int64) * stride_x + ch, mask=cmask & (r0 < r1), other=0.0)
    xb = tl.load(x_ptr + (r0 + 1).to(tl.int64) * stride_x + ch, mask=cmask & (r0 + 1 < r1), other=0.0)
    xc, xd = xa, xb
    if AHEAD == 4:
        xc = tl.load(x_ptr + (r0 + 2).to(tl.int64) * stride_x + ch, mask=cmask & (r0 + 2 < r1), other=0.0)
        xd = tl.load(x_ptr + (r0 + 3).to(tl.int64) * stride_x + ch, mask=cmask & (r0 + 3 < r1), other=0.0)
    for i in range(r1 - r0):
        t = r0 + i
        x_t = xa
        if AHEAD == 4:
            xa, xb, xc = xb, xc, xd
            xd = tl.load(x_ptr + (t + 4).to(tl.int64) * stride_x + ch, mask=cmask & (t + 4 < r1), other=0.0)
        else:
            xa = xb
            xb = tl.load(x_ptr + (t + 2).to(tl.int64) * stride_x + ch, mask=cmask & (t + 2 < r1), other=0.0)
        if t >= end:  # the first row of a later sequence (empty ones skipped by the search)
            seq = _find_sequence(cu_ptr, t, S, SEARCH_STEPS)
            start = tl.load(cu_ptr + seq).to(tl.int32)
            end = tl.load(cu_ptr + seq + 1).to(tl.int32)
        j = t - start + (K - 1)  # the row's position in its stream (window ++ new rows)
        if (t == start) | (i == 0):  # nothing carried from this sequence yet
            slot = tl.load(slots_ptr + seq).to(tl.int64)
            if K >= 4:
                c3 = _stream_row(x_ptr, win_ptr, t - 3, slot, j - 3, ch, cmask, stride_x, stride_ws, stride_wk, K)
            if K >= 3:
                c2 = _stream_row(x_ptr, win_ptr, t - 2, slot, j - 2, ch, cmask, stride_x, stride_ws, stride_wk, K)
            if K >= 2:
                c1 = _stream_row(x_ptr, win_ptr, t - 1, slot, j - 1, ch, cmask, stride_x, stride_ws, stride_wk, K)
        c0 = x_t.to(tl.float32)
        acc = _zeros(BLOCK_C) + b0
        if K == 4:
            acc = acc + w0 * c3
            acc = acc + w1 * c2
            acc = acc + w2 * c1
            acc = acc + w3 * c0
        elif K == 3:
            acc = acc + w0 * c2
            acc = acc + w1 * c1
            acc = acc + w2 * c0
        elif K == 2:
            acc = acc + w0 * c1
            acc = acc + w1 * c0
        else:
            acc = acc + w0 * c0
        if SILU:
            acc = silu_of(acc, DEVICE_SILU)
        tl.store(out_ptr + t.to(tl.int64) * stride_out + ch, acc.to(out_ptr.dtype.element_ty), mask=cmask)
        c3, c2, c1 = c2, c1, c0


# -- autograd: forward = the kernel, unchanged; backward = a Triton kernel (the windows' own: the torch form) --


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, window: torch.Tensor,
                cu_seqlens: torch.Tensor, slots: torch.Tensor, windows: torch.Tensor,
                cfg: TritonKernelConfigs) -> torch.Tensor:
        # window: windows[slots] as the kernel finds them (it overwrites them in place)
        ctx.save_for_backward(x, w, b, window)
        ctx.consts = (cu_seqlens, cfg)
        ctx.x_block = grad_block(x)  # x a block of in_proj's output: dx written into its one gradient
        return causal_conv1d_triton(x, cu_seqlens, slots, windows, w, b, cfg)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, b, window = ctx.saved_tensors
        cu_seqlens, cfg = ctx.consts
        # the windows' own gradient, or a width the kernel does not take: the torch form has it
        if ctx.needs_input_grad[3] or w.shape[1] > 4:
            dx, dwindow, dw, db = taps.causal_conv1d_backward(x, cu_seqlens, window, w, b, g)
            return wanted(ctx, dx, dw, db, dwindow)
        dx_out = ctx.x_block.take() if ctx.x_block is not None and ctx.needs_input_grad[0] else None
        dx, dw, db = causal_conv1d_backward_triton(x, cu_seqlens, window, w, b, g, cfg, dx_out=dx_out)
        return wanted(ctx, dx, dw, db)


def conv_advance(windows: torch.Tensor, step: Step, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                 cfg: TritonKernelConfigs) -> torch.Tensor:
    """The op's signature (``taps.conv_advance``): x [T, Cd] -> [T, Cd], windows updated in place;
    differentiable in x, w, b and the windows (from the slots' windows as they were)."""
    plan = step.plans[windows.device]
    cu, slots = plan.cu_seqlens, plan.slots
    if grad_needed(x, w, b, windows):
        return _Conv.apply(x, w, b, windows[slots], cu, slots, windows, cfg)
    return causal_conv1d_triton(x, cu, slots, windows, w, b, cfg)

# -- a decode step in one launch ------------------------------------------------------------------------------
# A prefill needs two launches (a sequence's rows span programs, and all must read the window before it
# moves); with one row per sequence, program (sequence, channel block) owns its channels of the window:
# ``_conv_kernel``'s operations, then the window shifted in place (the two-launch form's bits).


@triton.jit
def _conv_step_kernel(x_ptr, slots_ptr, win_ptr, w_ptr, b_ptr, out_ptr, Cd, stride_x, stride_ws, stride_wk,
                      stride_out, K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                      DEVICE_SILU: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_C: tl.constexpr):
    """Sequence s (program (s, c)): out[s] = silu(bias + sum_k w_k (window ++ x[s])_k) for the block's
    channels, then its slot's window := window rows 1 .. K - 2 ++ x[s]."""
    s = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < Cd
    slot = tl.load(slots_ptr + s).to(tl.int64)
    base = win_ptr + slot * stride_ws
    xrow = x_ptr + s * stride_x
    if HAS_BIAS:
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32) + tl.load(b_ptr + ch, mask=cmask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for k in tl.static_range(K):
        if k < K - 1:
            v = tl.load(base + k * stride_wk + ch, mask=cmask, other=0.0).to(tl.float32)
        else:
            v = tl.load(xrow + ch, mask=cmask, other=0.0).to(tl.float32)
        acc = acc + tl.load(w_ptr + ch * K + k, mask=cmask, other=0.0).to(tl.float32) * v
    if SILU:
        acc = silu_of(acc, DEVICE_SILU)
    tl.store(out_ptr + s * stride_out + ch, acc.to(out_ptr.dtype.element_ty), mask=cmask)
    if K > 1:
        q = tl.arange(0, BLOCK_Q)
        p = q + 1  # the new window's row q: old row q + 1, or the new row at q = K - 2
        in_win = (p < K - 1)[:, None]
        m2 = (q < K - 1)[:, None] & cmask[None, :]
        wv = tl.load(base + p[:, None] * stride_wk + ch[None, :], mask=m2 & in_win, other=0.0)
        xv = tl.load(xrow + q[:, None] * 0 + ch[None, :], mask=m2 & ~in_win, other=0.0)
        v = tl.where(in_win, wv, xv.to(wv.dtype))
        tl.debug_barrier()  # every thread's reads of the old window before any thread's writes
        tl.store(base + q[:, None] * stride_wk + ch[None, :], v, mask=m2)


def conv_step_triton(x: torch.Tensor, slots: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, cfg: TritonKernelConfigs, activation: bool = True) -> torch.Tensor:
    """One row per sequence: x [S, Cd] (unit channel stride), slots [S] int64 (distinct), windows
    [num_slots, K-1, Cd] in x's dtype, weight [Cd, K], bias [Cd] or None -> [S, Cd] in x's dtype,
    ``causal_conv1d_triton``'s bits; the slots' windows moved on by the row in place."""
    S, Cd = x.shape
    K = weight.shape[1]
    x, w, b = _operands(x, weight, bias)
    _check_windows(windows, x, K)
    if slots.shape != (S,):
        raise ValueError(f"slots {tuple(slots.shape)} do not match {S} rows")
    out = torch.empty(S, Cd, dtype=x.dtype, device=x.device)
    if S == 0:
        return out
    bc = cfg.conv_block_c
    _conv_step_kernel[(S, triton.cdiv(Cd, bc))](
        x, slots, windows, w, b, out, Cd, x.stride(0), windows.stride(0), windows.stride(1), out.stride(0), K=K,
        HAS_BIAS=bias is not None, SILU=activation, DEVICE_SILU=cfg.device_silu,
        BLOCK_Q=triton.next_power_of_2(max(K - 1, 1)), BLOCK_C=bc,
        num_warps=4, enable_fp_fusion=False)
    return out


def conv_advance_decode(windows: torch.Tensor, step: Step, x: torch.Tensor, w: torch.Tensor,
                        b: torch.Tensor | None, cfg: TritonKernelConfigs) -> torch.Tensor:
    """``conv_advance``, a decode step without gradient in one launch (``conv_step_triton``)."""
    if step.decode_only and x.shape[0] == step.slots.numel() and not grad_needed(x, w, b, windows):
        return conv_step_triton(x, step.plans[windows.device].slots, windows, w, b, cfg)
    return conv_advance(windows, step, x, w, b, cfg)

