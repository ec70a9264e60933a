"""The SSD scan's backward in Triton: the gradient of ``chunk_dense``'s function on the chunk grid, for the forward
``triton_chunk`` runs; accurate and deterministic, not row-invariant (docs/design.md, "Backends"). Per chunk and
head, with a_t the cumsum of dt*A, M[t, s] = (C_t . B_s) exp(a_t - a_s) dt_s (s <= t), xdy[s, t] = dy_t . x_s,
e[s, t] = (C_t . B_s) exp(a_t - a_s) xdy[s, t], w_s = exp(a_L - a_s) dt_s, dh_out the gradient of the state handed on:

    dx_s   = sum_{t>=s} M[t, s] dy_t + w_s dh_out B_s + D dy_s
    ddt_s  = sum_{t>=s} e[s, t] + exp(a_L - a_s) x_s . (dh_out B_s)        (through M and w)
    dB_s   = sum_{t>=s} exp(a_t - a_s) dt_s xdy[s, t] C_t + w_s x_s dh_out  (per head; summed per group)
    dC_t   = sum_{s<=t} exp(a_t - a_s) dt_s xdy[s, t] B_s + exp(a_t) dy_t h_in
    da_t   = sum_{s<=t} dt_s e[s, t] - dt_t ddt_t + exp(a_t) C_t . (dy_t h_in)  (+ the a_L terms)
    dh_in  = exp(a_L) dh_out + sum_t exp(a_t) dy_t^T C_t

then d(dt*A) = the reverse cumsum of da, ddt += A d(dt*A), dA = sum dt d(dt*A), dD = sum dy x. dB = dcb^T C and
dC = dcb B (+ the states' shares) are fp32 GEMMs a chunk and group (B and C do not depend on the head).
Deterministic: every program owns the rows it writes (no atomics), sums run in a fixed order inside a program,
and sums across programs are torch reductions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ..autograd import column_blocks, grad_needed
from ..configs import TritonKernelConfigs
from ..step import Step
from ..triton_math import dt_softplus_triton, has_limit, interpreting, limits, softplus_exact
from .chunk import ChunkGrid, Chunks, chunk_grid, dt_softplus, dt_softplus_backward, pack_chunks
from .state import SSDState, SSMParams
from .triton_chunk import _pass_block, _state_pass_kernel, replay_chunk_triton
from .triton_decode import replay_decode_triton
from .triton_dot import dot_acc, tensor_core_dots

Tensor = torch.Tensor

# Launch choices beyond the contract's configs (gradients only: a sum's order over heads, occupancy; never a
# forward's bits). A dcb (state-rows) program sums up to BWD_(ROWS_)HEADS_PER_PROGRAM heads of a group in order (the
# largest divisor of the group's heads not above it), the partials summed by torch: a whole group a program where it
# fits, so torch sums no partials (80 heads at 2.7b); a num_warps here overrides bwd_warps.
BWD_HEADS_PER_PROGRAM = 128
BWD_ROWS_HEADS_PER_PROGRAM = 128
BWD_OPTS: dict = {"num_stages": 2}
# The dx, dcb and state-rows launches as one flat grid, a chunk's (and head's) programs side by side, so the tiles
# they reload (dh_out, h_in, x, dy) come from L2; else two axes, the chunk's programs one grid row apart. Each
# program computes the same either way.
BWD_FLAT_GRID = True
# The chunk-state kernel's blocks (at most) and launch options. At most 2 stages: 3 or 4 (B and C read as
# bf16 rows) gave non-repeatable garbage on the H200.
STATE_OPTS: dict = {"BLOCK_K": 32, "BLOCK_P": 64, "BLOCK_N": 128, "num_stages": 2}


@triton.jit
def _dstate_pass_kernel(a_ptr, dS_ptr, dh_out_ptr, dh0_ptr, first_ptr, count_ptr,
                        H: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sequence q, head h, a (p, n) block: walking q's chunks last to first from g = 0, dh_out[c] = g, then
    g = exp(a_L[c]) g + dS[c]; dh0[q] = the last g. a [NC, H, L], dS/dh_out [NC, H, P, N], dh0 [S, H, P, N] fp32."""
    q, h, m, pn = _pass_block(P, N, BLOCK_P, BLOCK_N)
    c0 = tl.load(first_ptr + q)
    c = c0 + tl.load(count_ptr + q) - 1
    g = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    while c >= c0:
        off = (c * H + h) * P * N + pn
        tl.store(dh_out_ptr + off, g, mask=m)
        g = tl.exp(tl.load(a_ptr + (c * H + h) * L + L - 1)) * g + tl.load(dS_ptr + off, mask=m, other=0.0)
        c -= 1
    tl.store(dh0_ptr + (q * H + h) * P * N + pn, g, mask=m)


@triton.jit
def _weighted_state_kernel(u_ptr, v_ptr, a_ptr, dt_ptr, out_ptr, su_c, su_h, su_l, sv_c, sv_g, sv_l,
                           H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                           TO_END: tl.constexpr, PRECISION: tl.constexpr, TC: tl.constexpr):
    """Chunk c, head h (pid 0 = c * H + h), a (p, n) block (pid 1): out[c, h] = sum_l w_l u_l^T v_l, w_l =
    exp(a_L - a_l) dt_l (TO_END: the chunk's state, u = x, v = B) or exp(a_l) (what its outputs ask of h_in: u = dy,
    v = C). u [NC, H, L, P], v [NC, G, L, N] strided, model dtype or fp32; a/dt [NC, H, L], out [NC, H, P, N] fp32."""
    ch = tl.program_id(0).to(tl.int64)
    h = ch % H
    c = ch // H
    v_base = v_ptr + c * sv_c + (h // (H // G)) * sv_g
    NB: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    p = (tl.program_id(1) // NB) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = (tl.program_id(1) % NB) * BLOCK_N + tl.arange(0, BLOCK_N)
    pm = p < P
    nm = n < N
    u_base = u_ptr + c * su_c + h * su_h
    a_last = tl.load(a_ptr + ch * L + L - 1)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a_k = tl.load(a_ptr + ch * L + k)
        if TO_END:
            w = tl.exp(a_last - a_k) * tl.load(dt_ptr + ch * L + k)
        else:
            w = tl.exp(a_k)
        uT = tl.load(u_base + k[None, :] * su_l + p[:, None], mask=pm[:, None], other=0.0).to(tl.float32)
        vk = _operand(tl.load(v_base + k[:, None] * sv_l + n[None, :], mask=nm[None, :], other=0.0), TC)
        acc = dot_acc(acc, uT * w[None, :], vk, TC, 1, PRECISION)
    tl.store(out_ptr + (ch * P + p[:, None]) * N + n[None, :], acc, mask=pm[:, None] & nm[None, :])


def _weighted_states(u: Tensor, v: Tensor, a: Tensor, dt: Tensor, to_end: bool, cfg: TritonKernelConfigs,
                     tc: int, opts: dict) -> Tensor:
    """``_weighted_state_kernel`` over every chunk and head -> [NC, H, P, N] fp32 (u, v: unit stride along P, N)."""
    NC, H, L, P = u.shape
    G, N = v.shape[1], v.shape[3]
    out = torch.empty(NC, H, P, N, device=u.device, dtype=torch.float32)
    so = dict(STATE_OPTS)
    BK, BP, BN = (min(so.pop(k), d) for k, d in (("BLOCK_K", L), ("BLOCK_P", triton.next_power_of_2(P)),
                                                  ("BLOCK_N", triton.next_power_of_2(N))))
    if NC:
        _weighted_state_kernel[(NC * H, triton.cdiv(P, BP) * triton.cdiv(N, BN))](
            u, v, a, dt, out, *u.stride()[:3], *v.stride()[:3], H=H, G=G, L=L, P=P, N=N, BLOCK_K=BK, BLOCK_P=BP,
            BLOCK_N=BN, TO_END=to_end, PRECISION=cfg.dot_precision, TC=tc, **{**opts, **so})
    return out


@triton.jit
def _operand(v, TC: tl.constexpr):
    """An exact input (x, dy, B, C) as the dots take it: bf16 for tensor-core dots (its values are bf16), else fp32."""
    return v.to(tl.bfloat16 if TC else tl.float32)


@triton.jit
def _bwd_dx_kernel(
    x_ptr, dt_ptr, a_ptr, B_ptr, cb_ptr, dy_ptr, dh_ptr, D_ptr, dx_ptr, f_ptr, dDp_ptr,
    sD_h, sD_p, sx_c, sx_h, sx_l, sy_c, sy_h, sy_l, so_c, so_h, so_l,
    H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BS: tl.constexpr, BT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, TC: tl.constexpr, FLAT: tl.constexpr,
):
    """Chunk c, head h (the outer id), s block (the inner id; ``_outer_inner``, FLAT the grid's form):
    dx_s = dt_s sum_{t>=s} cb[t, s] exp(a_t - a_s) dy_t (a dot a t block) + w_s dh_out B_s + D dy_s;
    f_s = exp(a_L - a_s) x_s . (dh_out B_s), ddt's part through w; the block's share of dD into
    dDp [NC, H, L / BS, BLOCK_P]. x, dy, dx [NC, H, L, P] strided (dx in its own dtype); dt/a/f [NC, H, L],
    B [NC, G, L, N], cb [NC, G, L, L], dh [NC, H, P, N] (dh_out) fp32, contiguous; D strided."""
    ch, sb = _outer_inner(L // BS, FLAT)
    c = ch // H
    h = ch % H
    cg = c * G + h // (H // G)
    s = sb * BS + tl.arange(0, BS)
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm = (p < P)[None, :]
    nm = (n < N)[None, :]
    yb = dy_ptr + c * sy_c + h * sy_h
    cb_g = cb_ptr + cg * L * L
    a_s = tl.load(a_ptr + ch * L + s)
    dt_s = tl.load(dt_ptr + ch * L + s)
    acc = tl.zeros((BS, BLOCK_P), dtype=tl.float32)
    t0 = sb * BS
    t0 = t0 - t0 % BT
    while t0 < L:
        t = t0 + tl.arange(0, BT)
        a_t = tl.load(a_ptr + ch * L + t)
        dy_t = _operand(tl.load(yb + t[:, None] * sy_l + p[None, :], mask=pm, other=0.0), TC)
        cbT = tl.load(cb_g + t[None, :] * L + s[:, None])  # [BS, BT]: C_t . B_s
        decay = tl.where(t[None, :] >= s[:, None], tl.exp(tl.minimum(a_t[None, :] - a_s[:, None], 0.0)), 0.0)
        acc = dot_acc(acc, cbT * decay, dy_t, TC, 1, PRECISION)
        t0 += BT

    # the state this chunk hands on: h_out = exp(a_L) h_in + sum_s w_s x_s B_s^T
    x_s = tl.load(x_ptr + c * sx_c + h * sx_h + s[:, None] * sx_l + p[None, :], mask=pm, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + (ch * P + p[:, None]) * N + n[None, :], mask=(p < P)[:, None] & nm, other=0.0)
    B_s = _operand(tl.load(B_ptr + (cg * L + s[:, None]) * N + n[None, :], mask=nm, other=0.0), TC)
    hb = dot_acc(tl.zeros((BS, BLOCK_P), dtype=tl.float32), B_s, tl.trans(dh), TC, 2, PRECISION)  # B_s dh^T
    decay_L = tl.exp(tl.load(a_ptr + ch * L + L - 1) - a_s)
    f = decay_L * tl.sum(x_s * hb, axis=1)
    dy_s = tl.load(yb + s[:, None] * sy_l + p[None, :], mask=pm, other=0.0).to(tl.float32)
    d = tl.load(D_ptr + h * sD_h + p * sD_p, mask=p < P, other=0.0)
    dx = dt_s[:, None] * acc + (decay_L * dt_s)[:, None] * hb + d[None, :] * dy_s
    tl.store(dx_ptr + c * so_c + h * so_h + s[:, None] * so_l + p[None, :], dx.to(dx_ptr.dtype.element_ty), mask=pm)
    tl.store(f_ptr + ch * L + s, f)
    tl.store(dDp_ptr + (ch * (L // BS) + sb) * BLOCK_P + p, tl.sum(dy_s * x_s, axis=0))


@triton.jit
def _outer_inner(INNER: tl.constexpr, FLAT: tl.constexpr):
    """A program's (outer, inner) ids: pid 0 and pid 1 of a two-axis grid, or of a flat grid of outer x INNER
    programs, inner fastest (FLAT)."""
    if FLAT:
        outer = tl.program_id(0).to(tl.int64) // INNER
        inner = (tl.program_id(0) % INNER).to(tl.int32)
    else:
        outer = tl.program_id(0).to(tl.int64)
        inner = tl.program_id(1)
    return outer, inner


def _grid(outer: int, inner: int, flat: bool) -> tuple[int, ...]:
    """``_outer_inner``'s launch grid, its FLAT = ``flat``."""
    return (outer * inner,) if flat else (outer, inner)


@triton.jit
def _group_part(part, H: tl.constexpr, G: tl.constexpr, HPP: tl.constexpr):
    """part = (chunk * G + group) * K + k, K = H / G / HPP programs a group, each summing HPP heads: the chunk,
    its first head, the chunk's group row and the program's partial row."""
    K: tl.constexpr = H // G // HPP
    cg = part // K
    return cg // G, (cg % G) * (H // G) + (part % K) * HPP, cg, part


@triton.jit
def _bwd_dcb_kernel(
    x_ptr, dt_ptr, a_ptr, cb_ptr, dy_ptr, dcb_ptr, dap_ptr, dep_ptr, sx_c, sx_h, sx_l, sy_c, sy_h, sy_l,
    H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr,
    BS: tl.constexpr, BT: tl.constexpr, BLOCK_P: tl.constexpr, HPP: tl.constexpr,
    PRECISION: tl.constexpr, TC: tl.constexpr, FLAT: tl.constexpr,
):
    """Chunk c, HPP heads of a group (the outer id, ``_group_part``), tile of t block i, s block j (the inner id
    i * L / BS + j; ``_outer_inner``):
    W[t, s] = exp(a_t - a_s) dt_s xdy[s, t] (s <= t), the gradient of cb[t, s] through one head; dcb = its sum over
    the program's heads in order (a partial a program, [NC * G * K, L, L]); per head the tile's shares of da,
    sum_s W cb (dap [NC, H, L / BS, L]), and of ddt, sum_t W cb / dt_s (dep [NC, H, L / BT, L]); tiles above the
    diagonal write no share. x, dy strided; dt/a [NC, H, L], cb [NC, G, L, L] fp32."""
    NS: tl.constexpr = L // BS
    part, tile = _outer_inner((L // BT) * NS, FLAT)
    c, h0, cg, part = _group_part(part, H, G, HPP)
    i = tile // NS
    j = tile % NS
    t = i * BT + tl.arange(0, BT)
    s = j * BS + tl.arange(0, BS)
    p = tl.arange(0, BLOCK_P)
    pm = (p < P)[None, :]
    causal = s[None, :] <= t[:, None]
    cb = tl.load(cb_ptr + (cg * L + t[:, None]) * L + s[None, :])  # [BT, BS]
    acc = tl.zeros((BT, BS), dtype=tl.float32)
    heads = tl.where(j * BS < i * BT + BT, HPP, 0)  # a tile above the diagonal is all zero
    for k in range(heads):
        h = h0 + k
        ch = c * H + h
        a_t = tl.load(a_ptr + ch * L + t)
        a_s = tl.load(a_ptr + ch * L + s)
        dt_s = tl.load(dt_ptr + ch * L + s)
        dy_t = _operand(tl.load(dy_ptr + c * sy_c + h * sy_h + t[:, None] * sy_l + p[None, :], mask=pm, other=0.0),
                        TC)
        x_s = _operand(tl.load(x_ptr + c * sx_c + h * sx_h + s[:, None] * sx_l + p[None, :], mask=pm, other=0.0),
                       TC)
        xdy = dot_acc(tl.zeros((BT, BS), dtype=tl.float32), dy_t, tl.trans(x_s), TC, 0, PRECISION)
        decay = tl.where(causal, tl.exp(tl.minimum(a_t[:, None] - a_s[None, :], 0.0)), 0.0)
        e = decay * xdy
        w = e * dt_s[None, :]
        acc += w
        tl.store(dap_ptr + (ch * NS + j) * L + t, tl.sum(w * cb, axis=1))
        tl.store(dep_ptr + (ch * (L // BT) + i) * L + s, tl.sum(e * cb, axis=0))
    tl.store(dcb_ptr + (part * L + t[:, None]) * L + s[None, :], acc)


@triton.jit
def _bwd_rows_kernel(
    u_ptr, v_ptr, a_ptr, dt_ptr, C_ptr, out_ptr, das_ptr, su_c, su_h, su_l,
    H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BR: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, HPP: tl.constexpr,
    TO_END: tl.constexpr, PRECISION: tl.constexpr, TC: tl.constexpr, FLAT: tl.constexpr,
):
    """Chunk c, HPP heads of a group (the outer id), row block (the inner id; ``_outer_inner``): out [BR, N] = the
    sum over the program's heads, in order, of w_l (u_l v), v [P, N] the head's state: the states' share of dB
    (TO_END: u = x, v = dh_out, w_l = exp(a_L - a_l) dt_l) or of dC (u = dy, v = h_in, w_l = exp(a_l)), then per
    head da's state part das = w_l C_l . (u_l v). u strided; v [NC, H, P, N], a/dt/das [NC, H, L], C [NC, G, L, N]
    fp32; out [NC * G * KR, L, N], a partial a program."""
    part, rb = _outer_inner(L // BR, FLAT)
    c, h0, cg, part = _group_part(part, H, G, HPP)
    rows = rb * BR + tl.arange(0, BR)
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm = (p < P)[None, :]
    nm = (n < N)[None, :]
    sm = (p < P)[:, None] & nm
    if not TO_END:
        C_l = tl.load(C_ptr + (cg * L + rows[:, None]) * N + n[None, :], mask=nm, other=0.0)
    acc = tl.zeros((BR, BLOCK_N), dtype=tl.float32)
    for k in range(HPP):
        h = h0 + k
        ch = c * H + h
        u = _operand(tl.load(u_ptr + c * su_c + h * su_h + rows[:, None] * su_l + p[None, :], mask=pm, other=0.0),
                     TC)
        v = tl.load(v_ptr + (ch * P + p[:, None]) * N + n[None, :], mask=sm, other=0.0)
        uv = dot_acc(tl.zeros((BR, BLOCK_N), dtype=tl.float32), u, v, TC, 2, PRECISION)
        a_l = tl.load(a_ptr + ch * L + rows)
        if TO_END:
            w = tl.exp(tl.load(a_ptr + ch * L + L - 1) - a_l) * tl.load(dt_ptr + ch * L + rows)
        else:
            w = tl.exp(a_l)
            tl.store(das_ptr + ch * L + rows, w * tl.sum(C_l * uv, axis=1))
        acc += w[:, None] * uv
    tl.store(out_ptr + (part * L + rows[:, None]) * N + n[None, :], acc, mask=nm)


@triton.jit
def _bwd_epilogue_kernel(
    dap_ptr, dep_ptr, f_ptr, das_ptr, dt_ptr, a_ptr, dh_ptr, hin_ptr, A_ptr, ddt_ptr, dAp_ptr,
    raw_ptr, bias_ptr, graw_ptr, dbp_ptr, row0_ptr, row_lo_ptr, row_hi_ptr, s_raw, lo, hi,
    H: tl.constexpr, L: tl.constexpr, PN: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr,
    BLOCK_PN: tl.constexpr, DT_ROWS: tl.constexpr, HAS_LIMIT: tl.constexpr,
):
    """Chunk c, head h (pid 0): the per-head sums that close the backward, the chunk's L rows at once: ddt and d(dt*A)
    from the dcb tiles' shares (only those written, at or below the diagonal), f, das and the a_L terms (hh = dh_out .
    h_in); ddt += A d(dt*A); the chunk's share of dA (dAp). DT_ROWS: also ``chunk.dt_softplus_backward`` to the raw dt
    of the chunk's packed rows (row0 + r within [row_lo, row_hi), ``chunk.ChunkGrid``'s), into graw [T, H] in its
    dtype, and the chunk's share of dt_bias's gradient (dbp [NC * H]). raw [T, H] at row stride s_raw."""
    ch = tl.program_id(0).to(tl.int64)
    h = ch % H
    r = tl.arange(0, L)
    acc = tl.zeros((BLOCK_PN,), dtype=tl.float32)
    for k in range(0, PN, BLOCK_PN):
        q = k + tl.arange(0, BLOCK_PN)
        acc += tl.load(dh_ptr + ch * PN + q, mask=q < PN, other=0.0) * tl.load(hin_ptr + ch * PN + q, mask=q < PN,
                                                                              other=0.0)
    hh = tl.sum(acc, axis=0)
    NS: tl.constexpr = L // BS
    NT: tl.constexpr = L // BT
    e = tl.zeros((L,), dtype=tl.float32)
    for i in range(NT):  # t block i wrote the s blocks j with j * BS < (i + 1) * BT
        ok = (r // BS) * BS < (i + 1) * BT
        e += tl.load(dep_ptr + (ch * NT + i) * L + r, mask=ok, other=0.0)
    d = tl.zeros((L,), dtype=tl.float32)
    for j in range(NS):  # s block j wrote the t blocks i with j * BS < (i + 1) * BT
        ok = j * BS < (r // BT + 1) * BT
        d += tl.load(dap_ptr + (ch * NS + j) * L + r, mask=ok, other=0.0)
    f = tl.load(f_ptr + ch * L + r)
    dt = tl.load(dt_ptr + ch * L + r)
    ddt = e + f
    da = d + tl.load(das_ptr + ch * L + r) - dt * ddt
    last = tl.sum(f * dt, axis=0) + tl.exp(tl.load(a_ptr + ch * L + L - 1)) * hh
    da = tl.where(r == L - 1, da + last, da)
    dAdt = tl.cumsum(da, axis=0, reverse=True)  # d(dt * A)_s = sum_{t >= s} da_t
    ddt = ddt + tl.load(A_ptr + h) * dAdt
    tl.store(ddt_ptr + ch * L + r, ddt)
    tl.store(dAp_ptr + ch, tl.sum(dAdt * dt, axis=0))
    if DT_ROWS:  # as chunk.dt_softplus_backward; the limit's mask from the forward's exact softplus
        c = ch // H
        row = tl.load(row0_ptr + c) + r
        ok = (row >= tl.load(row_lo_ptr + c)) & (row < tl.load(row_hi_ptr + c))
        z = tl.load(raw_ptr + row * s_raw + h, mask=ok, other=0.0).to(tl.float32) + tl.load(bias_ptr + h).to(
            tl.float32)
        g = tl.where(z > 20.0, ddt, ddt * tl.sigmoid(z))
        if HAS_LIMIT:
            pre = softplus_exact(z)
            g = tl.where((pre >= lo) & (pre <= hi), g, 0.0)
        g = tl.where(ok, g, 0.0)
        tl.store(graw_ptr + row * H + h, g.to(graw_ptr.dtype.element_ty), mask=ok)
        tl.store(dbp_ptr + ch, tl.sum(g, axis=0))


@functools.cache
def heads_per_program(cap: int, group: int) -> int:
    """The most heads, at most ``cap``, that split a group of ``group`` heads evenly (1 divides every group)."""
    return max(d for d in range(1, min(cap, group) + 1) if group % d == 0)


def _blocks(L: int, cfg: TritonKernelConfigs) -> tuple[int, int]:
    """The s and t row blocks at chunk size L (a chunk shorter than a block is one block)."""
    return min(cfg.bwd_block_s, L), min(cfg.bwd_block_t, L)


def chunk_scan_backward(ch: Chunks, Cc: Tensor, A: Tensor, D: Tensor, h0: Tensor, dyc: Tensor,
                        cfg: TritonKernelConfigs, *, bf16_operands: bool, first: Tensor, count: Tensor,
                        dx_out: Tensor | None = None, dt_rows: tuple | None = None,
                        grid: ChunkGrid | None = None, bc_rows: tuple[Tensor, Tensor] | None = None
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradient of ``chunk_dense.dense_outputs``'s y on the chunk grid: ch from ``pack_chunks``, Cc [NC, G, L, N]
    fp32 (C at the rows' positions), A [H], D [H] or [H, P], h0 [S, H, P, N] fp32 at each first boundary, dyc
    [NC, H, L, P] (zero on padding); ch.x and dyc may be model-dtype views, unit stride along P. bf16_operands: x, B,
    C and dy hold bf16 values (the tensor-core dots take them exactly). first, count [S]: ``ChunkGrid``'s. dx_out:
    where dx goes ([NC, H, L, P], unit stride along P, any float dtype, rounded once) or None. dt_rows (raw dt [T, H],
    dt_bias, dt_limit, graw [T, H], dbias_parts [NC, H]) with ``grid``: raw dt's gradient into graw and each chunk's
    dt_bias share, or None. bc_rows: (B, C) model-dtype views the chunk-state dots read instead of the fp32 grids
    (the same bits), or None. -> dx, ddt, dB, dC on the grid, dA [H], dD (D's dtype), dh0 [S, H, P, N]; fp32."""
    NC, H, L, P = ch.x.shape
    G, N = ch.B.shape[1], ch.B.shape[3]
    S, HG, dev, f32 = h0.shape[0], H // G, ch.x.device, torch.float32
    BS, BT = _blocks(L, cfg)
    if any(L % b or b < 16 for b in (BS, BT)):
        raise ValueError(f"chunk size {L} refused by the backward: its row blocks {BS}, {BT} must divide it (>= 16)")
    tc = tensor_core_dots(torch.bfloat16 if bf16_operands else f32, cfg.bwd_bf16_dots)
    opts = dict(num_warps=cfg.bwd_warps, enable_fp_fusion=not tc)
    x, dy = (t if t.stride(-1) == 1 else t.contiguous() for t in (ch.x, dyc))
    dt, B, C = (t.contiguous() for t in (ch.dt, ch.B, Cc))
    Af = A.to(device=dev, dtype=f32)
    a = torch.cumsum(dt * Af[None, :, None], dim=-1)  # [NC, H, L]

    # every chunk's boundary state: chunk states by a dot kernel, passed along by the forward's kernel
    Bv, Cv = (B, C) if bc_rows is None else bc_rows
    states = _weighted_states(x, Bv, a, dt, True, cfg, tc, opts)
    h_in = torch.empty(NC, H, P, N, device=dev, dtype=f32)
    h_run = h0.to(f32).contiguous().clone()
    PP, NBk = min(cfg.pass_block_p, triton.next_power_of_2(P)), min(cfg.block_n, triton.next_power_of_2(N))
    pass_grid = (S, H, triton.cdiv(P, PP) * triton.cdiv(N, NBk))
    _state_pass_kernel[pass_grid](a, states, torch.ones(NC, dtype=torch.int64, device=dev), h_run,
                                  torch.arange(S, device=dev), h_in, first, count, H=H, L=L, P=P, N=N, BLOCK_P=PP,
                                  BLOCK_N=NBk, WRITE_IN=True, RT_RANGE=not interpreting(), num_warps=cfg.num_warps)

    # what each chunk's outputs ask of its boundary state, then dh_out walking backwards
    dS = _weighted_states(dy, Cv, a, dt, False, cfg, tc, opts)
    dh_out = torch.empty(NC, H, P, N, device=dev, dtype=f32)
    dh0 = torch.empty(S, H, P, N, device=dev, dtype=f32)
    _dstate_pass_kernel[pass_grid](a, dS, dh_out, dh0, first, count, H=H, L=L, P=P, N=N, BLOCK_P=PP, BLOCK_N=NBk,
                                   num_warps=cfg.num_warps)

    cb = C @ B.transpose(-1, -2)  # [NC, G, L, L]: cb[t, s] = C_t . B_s
    Dd = D.to(device=dev, dtype=f32)
    sD_h, sD_p = (Dd.stride(0), 0) if Dd.dim() == 1 else (Dd.stride(0), Dd.stride(1))
    dx = torch.empty(NC, H, L, P, device=dev, dtype=f32) if dx_out is None else dx_out
    if dx.shape != (NC, H, L, P) or dx.stride(-1) != 1:
        raise ValueError(f"dx_out must be [{NC}, {H}, {L}, {P}] with unit stride along P, not {tuple(dx.shape)}")
    f = torch.empty(NC, H, L, device=dev, dtype=f32)
    das = torch.empty_like(f)
    HPP = heads_per_program(BWD_HEADS_PER_PROGRAM, HG)  # heads a program sums: a divisor of the group's
    K = HG // HPP  # programs per chunk and group: the partials of dcb, summed below
    RPP = heads_per_program(BWD_ROWS_HEADS_PER_PROGRAM, HG)
    KR = HG // RPP  # the same for the state rows' partials
    NS = L // BS
    dcbp = torch.empty(NC, G, K, L, L, device=dev, dtype=f32)
    # empty, not zeros: tiles above the diagonal write no share and the epilogue reads none there
    dap = torch.empty(NC, H, NS, L, device=dev, dtype=f32)
    dep = torch.empty(NC, H, L // BT, L, device=dev, dtype=f32)
    dBs, dCs = (torch.empty(NC, G, KR, L, N, device=dev, dtype=f32) for _ in range(2))
    BP, BN = triton.next_power_of_2(P), triton.next_power_of_2(N)
    dDp = torch.empty(NC, H, NS, BP, device=dev, dtype=f32)
    launch = {**opts, **BWD_OPTS}
    if NC:
        sx, sy = x.stride()[:3], dy.stride()[:3]
        flat = BWD_FLAT_GRID  # read once: the grids and the kernels' FLAT agree
        dims = dict(H=H, G=G, L=L, P=P, BLOCK_P=BP, PRECISION=cfg.dot_precision, TC=tc, FLAT=flat)
        _bwd_dx_kernel[_grid(NC * H, NS, flat)](x, dt, a, B, cb, dy, dh_out, Dd, dx, f, dDp, sD_h, sD_p, *sx, *sy,
                                                *dx.stride()[:3], N=N, BS=BS, BT=BT, BLOCK_N=BN, **dims, **launch)
        _bwd_dcb_kernel[_grid(NC * G * K, (L // BT) * NS, flat)](x, dt, a, cb, dy, dcbp, dap, dep, *sx, *sy, BS=BS,
                                                                 BT=BT, HPP=HPP, **dims, **launch)
        for u, v, out, rb, to_end in ((x, dh_out, dBs, BS, True), (dy, h_in, dCs, BT, False)):
            _bwd_rows_kernel[_grid(NC * G * KR, L // rb, flat)](u, v, a, dt, C, out, das, *u.stride()[:3], N=N,
                                                                BR=rb, BLOCK_N=BN, HPP=RPP, TO_END=to_end, **dims,
                                                                **launch)

    # dB and dC: through cb (dcb summed over the group's heads, zero above the diagonal) and the states
    dcb = dcbp[:, :, 0] if K == 1 else dcbp.sum(2)  # [NC, G, L, L]: the gradient of cb[t, s]
    dBs, dCs = (t[:, :, 0] if KR == 1 else t.sum(2) for t in (dBs, dCs))
    dB = torch.baddbmm(dBs.reshape(-1, L, N), dcb.reshape(-1, L, L).transpose(1, 2), C.reshape(-1, L, N)).view(
        NC, G, L, N)
    dC = torch.baddbmm(dCs.reshape(-1, L, N), dcb.reshape(-1, L, L), B.reshape(-1, L, N)).view(NC, G, L, N)
    ddt = torch.empty_like(f)
    dAp = torch.empty(NC, H, device=dev, dtype=f32)
    raw, bias, dt_limit, graw, dbp = (f, f, (0.0, math.inf), f, f) if dt_rows is None else dt_rows
    rows = (first,) * 3 if dt_rows is None else (grid.row0, grid.row_lo, grid.row_hi)
    if dt_rows is not None and (grid is None or raw.stride(1) != 1 or graw.shape != raw.shape
                                or dbp.shape != (NC, H)):
        raise ValueError("dt_rows: raw dt and graw [T, H] with unit stride along H, dbias_parts [NC, H], and the "
                         "chunk grid they were packed on")
    if NC:
        # without fp contraction: the limit's mask needs the forward's softplus bits
        _bwd_epilogue_kernel[(NC * H,)](dap, dep, f, das, dt, a, dh_out, h_in, Af, ddt, dAp, raw, bias, graw, dbp,
                                        *rows, raw.stride(0), *limits(dt_limit), H=H, L=L, PN=P * N, BS=BS, BT=BT,
                                        BLOCK_PN=min(2048, triton.next_power_of_2(P * N)),
                                        DT_ROWS=dt_rows is not None, HAS_LIMIT=has_limit(dt_limit),
                                        num_warps=cfg.bwd_warps, enable_fp_fusion=False)
    dA = dAp.sum(0)
    dD = dDp[..., :P].sum((0, 2))  # [H, P]
    dD = (dD.sum(-1) if D.dim() == 1 else dD).to(D.dtype)
    return dx, ddt, dB, dC, dA.to(A.dtype), dD, dh0


# -- autograd: forward = the advance's kernels, unchanged; backward = the scan's gradient on the chunk grid ---


def ssd_backward(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, D: Tensor, dt_bias: Tensor, h0: Tensor,
                 buf_x: Tensor | None, buf_dt: Tensor | None, buf_B: Tensor | None, g: Tensor, needs: tuple[bool, ...],
                 cu_seqlens: Tensor, off: Tensor, grid: ChunkGrid, rows: Tensor | None, chunk_size: int,
                 dt_limit: tuple[float, float], cfg: TritonKernelConfigs) -> tuple[Tensor | None, ...]:
    """The gradient of an advance's y [T, H, P] (``chunk.replay_chunk``'s function, without the state writes) against
    g: (dx, ddt, dB, dC, dA, dD, ddt_bias, dh0), None where ``needs`` (a flag per leaf, in that order) is False. The
    grid is ``pack_chunks`` of the inputs (buffered rows first, buf_* at the step's slots, None when none) on ``grid``;
    the packing's gradient is written out: dt's through ``dt_softplus_backward``, dt_bias's with the buffered rows'
    share (the buffers get none). No step of it waits on the GPU."""
    nx, ndt, nB, nC, nA, nD, nbias, nh0 = needs
    L = chunk_size
    prefix = None if buf_x is None else (buf_x, buf_dt, buf_B, off)
    softplus = dt_softplus_triton if x.is_cuda else dt_softplus  # the same bits
    gy = g if rows is None else g * rows.to(g.device)[:, None, None]  # the forward's y is zero in rows not wanted
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    # sequences of whole chunks from empty (a trainer's): packed row r is row r % L of chunk r // L, so the grid
    # is a transposed view of the rows: a copy per tensor, no zero fill, scatter or gather back
    aligned = prefix is None and cu_seqlens.device.type == "cpu" and bool((lens % L == 0).all())
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    NC = grid.num_chunks
    f32, dev = torch.float32, x.device

    def to_grid(t: Tensor) -> Tensor:  # [T, K, F] -> [NC, K, L, F] fp32 (aligned rows)
        return torch.empty(NC, t.shape[1], L, t.shape[2], device=dev, dtype=f32).copy_(
            t.reshape(NC, L, t.shape[1], t.shape[2]).transpose(1, 2))

    def from_grid(t: Tensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:  # the inverse, in dtype
        out = torch.empty(T, t.shape[1], t.shape[3], device=dev, dtype=dtype) if out is None else out
        out.view(NC, L, t.shape[1], t.shape[3]).copy_(t.transpose(1, 2))
        return out

    def grid_view(t: Tensor) -> Tensor:  # [T, K, F] -> [NC, K, L, F], a view (aligned rows)
        return t.view(NC, L, t.shape[1], t.shape[2]).transpose(1, 2)

    at = (grid.row_chunk, slice(None), grid.row_pos)
    dx_rows = None
    if aligned:
        dtc = softplus(dt, dt_bias, dt_limit).view(NC, L, H).transpose(1, 2).contiguous()
        # x and dy (the large ones) read and dx written where they lie, any row stride; B, C copied to fp32 grids
        xr, gr = (t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous() for t in (x, gy))
        # x, B, C adjacent column blocks of the conv's output: their gradients fill one buffer, passed on as it is
        whole = column_blocks((x.flatten(1), B.flatten(1), C.flatten(1))) if nx and nB and nC else None
        grads = None if whole is None else torch.empty_like(whole).split((H * P, G * N, G * N), dim=1)
        dx_rows = torch.empty(T, H, P, device=dev, dtype=x.dtype) if grads is None else grads[0].view(T, H, P)
        ch = Chunks(x=grid_view(xr), dt=dtc, B=to_grid(B), seq=grid.seq, index=grid.index, length=grid.length,
                    row_chunk=grid.row_chunk, row_pos=grid.row_pos)
        Cc, dyc = to_grid(C), grid_view(gr)
        bc_rows = tuple(grid_view(t) for t in (B, C)) if B.stride(-1) == 1 and C.stride(-1) == 1 else None
    else:
        bc_rows = None
        ch = pack_chunks(x, dt, B, cu_seqlens, L, dt_bias, dt_limit, prefix=prefix, grid=grid, softplus=softplus)
        Cc = torch.zeros(NC, G, L, N, device=dev)
        Cc[at] = C.to(f32)
        dyc = torch.zeros(NC, H, L, P, device=dev)
        dyc[at] = gy.to(f32)
    bf16 = all(t.dtype == torch.bfloat16 for t in (x, B, C, g))
    # softplus's backward to the raw dt rows runs in the scan backward's last kernel
    dt_rows = None
    if ndt or nbias:
        dt_rows = (dt if dt.stride(1) == 1 else dt.contiguous(), dt_bias, dt_limit,
                   torch.empty(T, H, device=dev, dtype=dt.dtype), torch.empty(NC, H, device=dev, dtype=f32))
    dxc, ddtc, dBc, dCc, dA, dD, dh0 = chunk_scan_backward(
        ch, Cc, A, D, h0, dyc, cfg, bf16_operands=bf16, first=grid.first, count=grid.count,
        dx_out=None if dx_rows is None else grid_view(dx_rows), dt_rows=dt_rows, grid=grid, bc_rows=bc_rows)
    if aligned:
        dx = dx_rows if nx else None
        dB = from_grid(dBc, B.dtype, None if grads is None else grads[1].view(T, G, N)) if nB else None
        dC = from_grid(dCc, C.dtype, None if grads is None else grads[2].view(T, G, N)) if nC else None
    else:
        dx = dxc[at].to(x.dtype) if nx else None
        dB = dBc[at].to(B.dtype) if nB else None
        dC = dCc[at].to(C.dtype) if nC else None
    ddt = dt_rows[3] if ndt else None
    dbias = dt_rows[4].sum(0) if nbias else None
    if nbias:
        if prefix is not None and grid.fill:  # rows < off of each first chunk: buffered raw dt
            f = grid.fill
            gb = dt_softplus_backward(buf_dt[:, :, :f].transpose(1, 2), dt_bias, dt_limit,
                                      ddtc[grid.first][:, :, :f].transpose(1, 2))  # [S, f, H]
            kept = torch.arange(f, device=x.device)[None, :] < off.to(x.device)[:, None]  # [S, f]
            dbias = dbias + torch.where(kept[:, :, None], gb, torch.zeros((), device=x.device)).sum((0, 1))
        dbias = dbias.to(dt_bias.dtype)
    return (dx, ddt, dB, dC, dA if nA else None, dD if nD else None, dbias, dh0.to(h0.dtype) if nh0 else None)


class _SSDAdvance(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, D: Tensor, dt_bias: Tensor, h0: Tensor,
                buf_x: Tensor | None, buf_dt: Tensor | None, buf_B: Tensor | None, run: Callable[[], Tensor],
                consts: tuple) -> Tensor:
        # run() updates the real state; h0 and buf_* are copies of the slots' state taken before it runs
        ctx.save_for_backward(x, dt, B, C, A, D, dt_bias, h0, buf_x, buf_dt, buf_B)
        ctx.consts = consts
        return run()

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        x, dt, B, C, A, D, dt_bias, h0, buf_x, buf_dt, buf_B = ctx.saved_tensors
        grads = ssd_backward(x, dt, B, C, A, D, dt_bias, h0, buf_x, buf_dt, buf_B, g, ctx.needs_input_grad[:8],
                             *ctx.consts)
        return (*grads, None, None, None, None, None)


def _advance_function(run: Callable[..., Tensor], state: SSDState, step: Step, x: Tensor,
                      dt: Tensor, B: Tensor, C: Tensor, params: SSMParams,
                      rows: Tensor | None, cfg: TritonKernelConfigs) -> Tensor:
    """``run(state, step, x, dt, B, C, params, rows)`` (the triton advance: y [T, H, P] in x's dtype, updates
    ``state``) with the torch advance's gradient from the same state: of x, dt, B, C, params.A, D, dt_bias, and of
    ``state.ssm_state`` at the step's slots when it requires grad; the buffered rows get none."""
    L = state.chunk_size
    dev = x.device
    off = step.start_pos % L  # on the host, as the step's tables are
    # the step's slots and chunk grid on the device, once for all its layers
    plan = step.plans[dev]
    slots = plan.slots
    grid = plan.once(plan.chunk_grid, L, lambda: chunk_grid(step.cu_seqlens, off, L, dev))
    h0 = state.ssm_state[slots]  # a copy: the advance moves the boundary states in place
    # the buffers are read only where a slot has buffered rows (a trainer's forward from empty has none)
    bufs = (state.buf_x[slots], state.buf_dt[slots], state.buf_B[slots]) if grid.fill else (None,) * 3
    consts = (step.cu_seqlens, off, grid, rows, L, tuple(params.dt_limit), cfg)
    return _SSDAdvance.apply(x, dt, B, C, params.A, params.D, params.dt_bias, h0, *bufs,
                             lambda: run(state, step, x, dt, B, C, params, rows), consts)


def _kernels(state: SSDState, step: Step, x: Tensor, dt: Tensor, B: Tensor, C: Tensor,
             params: SSMParams, rows: Tensor | None, cfg: TritonKernelConfigs) -> Tensor:
    if x.is_cuda and step.decode_only:
        # the fused decode kernels: just the new rows, with the prefill's arithmetic
        return replay_decode_triton(state, step, x, dt, B, C, params, rows=rows, cfg=cfg)
    return replay_chunk_triton(state, step, x, dt, B, C, params, rows=rows, cfg=cfg)


def ssd_advance(state: SSDState, step: Step, x: Tensor, dt: Tensor, B: Tensor, C: Tensor,
                params: SSMParams, rows: Tensor | None = None, *, cfg: TritonKernelConfigs) -> Tensor:
    """The triton backend's replay form (``ops.ssd``'s replay signature): y [T, H, P] in x's dtype; updates
    ``state``. Where a gradient is recorded, inside ``_SSDAdvance`` (``_advance_function``)."""
    if grad_needed(x, dt, B, C, params.A, params.D, params.dt_bias, state.ssm_state):
        run = lambda *a: _kernels(*a, cfg)  # noqa: E731
        return _advance_function(run, state, step, x, dt, B, C, params, rows, cfg)
    return _kernels(state, step, x, dt, B, C, params, rows, cfg)


__all__ = ["chunk_scan_backward", "ssd_advance", "ssd_backward"]
