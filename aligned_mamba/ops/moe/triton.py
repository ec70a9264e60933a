"""The routed experts on the GPU: the router, a row-invariant grouped GEMM, the combine, the backward.

Forward: ``route_triton`` (sigmoid, top-k, weights and, for few rows, ``dispatch``'s tables; the bits
of ``naive.route``) on ``router_logits`` (``linear_triton``'s fp32 bits); ``_grouped_gemm_kernel``
for up (squared ReLU fused) and down; ``_combine_kernel`` (``naive.combine``'s bits). A program owns
rows of ONE expert and a column block, K ascending inside it, rows past the expert's last masked,
so a row's bits do not depend on its tile's other rows (``moe_block_k`` = ``linear_block_k`` gives
``linear_triton``'s bits). Backward (``ExpertsFunction``): the same kernels, no atomics; the bits of
those steps as torch ops (tests/moe_unfused.py); a trainer's per-expert parameters are read where they
lie (``ExpertTable``). Why: docs/design.md, "How the bits are kept" (MoE).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ...errors import AlignedMambaError
from ..configs import TritonKernelConfigs
from ..triton_math import exp_exact
from .grouped import Dispatch, dispatch


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, u_ptr,
    # int64: the sorted rows' A rows [R]; the row tiles [NT] (``Dispatch``)
    arow_ptr, tile_expert_ptr, tile_row0_ptr, tile_row1_ptr,
    N, K, stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    GATHER: tl.constexpr, RELU2: tl.constexpr, DRELU2: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, B_TABLE: tl.constexpr = False,
):
    """c[r, n] = sum_k a[arow(r), k] b[e, n, k] over the rows of tile program_id(0) // nb (expert e) and
    the columns of block program_id(0) % nb, arow(r) = arow_ptr[r] if GATHER else r. RELU2: u = the
    rounded product (stored), c = round(relu(u)^2) in fp32. DRELU2: c = round(q + q), q = p relu(u) in
    fp32, torch's ``d * relu(u) * 2`` (no FMA). B_TABLE: b_ptr is int64 [E], expert e's weight address
    (each expert's own tensor, not a stack; stride_be unused)."""
    # a row tile's column blocks are consecutive programs: they share its A rows in L2
    nb = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0) // nb
    row0 = tl.load(tile_row0_ptr + tile)
    row1 = tl.load(tile_row1_ptr + tile)
    if row0 >= row1:
        return
    e = tl.load(tile_expert_ptr + tile)
    rm = row0 + tl.arange(0, BLOCK_M)
    rmask = rm < row1
    if GATHER:
        ar = tl.load(arow_ptr + rm, mask=rmask, other=0)
    else:
        ar = rm
    rn = (tl.program_id(0) % nb) * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = a_ptr + ar[:, None].to(tl.int64) * stride_am
    if B_TABLE:
        # the launcher passes 16-byte aligned weights only, as a stack's are (vector loads)
        b_base = tl.multiple_of(tl.load(b_ptr + e).to(tl.pointer_type(a_ptr.dtype.element_ty)), 16)
    else:
        b_base = b_ptr + e.to(tl.int64) * stride_be
    b_cols = b_base + rn[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        rk = ki * BLOCK_K + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + rk[None, :], mask=rmask[:, None] & (rk[None, :] < K), other=0.0)
        b = tl.load(b_cols + rk[:, None].to(tl.int64) * stride_bk, mask=(rn[None, :] < N) & (rk[:, None] < K),
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    c = acc.to(c_ptr.dtype.element_ty)
    offs = rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    mask = rmask[:, None] & (rn[None, :] < N)
    if RELU2:
        tl.store(u_ptr + offs, c, mask=mask)
        r = c.to(tl.float32)
        r = tl.where(r < 0.0, 0.0, r)  # nan stays nan, as torch.relu
        c = (r * r).to(c_ptr.dtype.element_ty)
    if DRELU2:
        r = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.where(r < 0.0, 0.0, r)
        q = c.to(tl.float32) * r
        c = (q + q).to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + offs, c, mask=mask)


@triton.jit
def _expert_wgrad_kernel(
    g_ptr, x_ptr, dw_ptr,
    # int64: the sorted rows' x rows [R]; the experts' row offsets [E + 1]
    xrow_ptr, offsets_ptr,
    N, K, stride_g, stride_x, stride_dwe,
    GATHER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dw[e, n, k] = sum_r g[r, n] x[xrow(r), k] over expert e's sorted rows, ascending in BLOCK_T
    blocks; program (weight tile, e), weight tiles inner so resident programs share e's rows in L2
    (experts inner, every program would read its rows from memory)."""
    e = tl.program_id(1)
    nk = tl.cdiv(K, BLOCK_K)
    rn = (tl.program_id(0) // nk) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = (tl.program_id(0) % nk) * BLOCK_K + tl.arange(0, BLOCK_K)
    lo = tl.load(offsets_ptr + e)
    hi = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for t0 in range(lo, hi, BLOCK_T):
        rt = t0 + tl.arange(0, BLOCK_T)
        tmask = rt < hi
        if GATHER:
            xr = tl.load(xrow_ptr + rt, mask=tmask, other=0)
        else:
            xr = rt
        gt = tl.load(g_ptr + rt[None, :].to(tl.int64) * stride_g + rn[:, None],
                     mask=tmask[None, :] & (rn[:, None] < N), other=0.0)
        x = tl.load(x_ptr + xr[:, None].to(tl.int64) * stride_x + rk[None, :],
                    mask=tmask[:, None] & (rk[None, :] < K), other=0.0)
        acc = tl.dot(gt, x, acc, input_precision=PRECISION)
    tl.store(dw_ptr + e.to(tl.int64) * stride_dwe + rn[:, None].to(tl.int64) * K + rk[None, :],
             acc.to(dw_ptr.dtype.element_ty), mask=(rn[:, None] < N) & (rk[None, :] < K))


@triton.jit
def _combine_kernel(
    # y [R, d] (sorted rows), pos [T, k] int64, w [T, k] fp32, out [T, d], add [T, d] (HAS_ADD)
    y_ptr, pos_ptr, w_ptr, out_ptr, add_ptr,
    d, stride_y, stride_out, stride_add,
    K: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ADD: tl.constexpr, WEIGHTED: tl.constexpr = True,
):
    """out[t] = round(0 + y[pos[t, 0]] w[t, 0] + ...) in fp32, no FMA: ``naive.combine``'s bits. HAS_ADD:
    then round(out + add[t]) in fp32, torch's add of two model-dtype tensors. Not WEIGHTED (the input
    gradient): the plain sum from the first term, w unread."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < d
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(pos_ptr + t * K + j)
        y = tl.load(y_ptr + r * stride_y + cols, mask=cmask, other=0.0).to(tl.float32)
        if WEIGHTED:
            w = tl.load(w_ptr + t * K + j)
            acc = acc + y * w
        elif j == 0:
            acc = y
        else:
            acc = acc + y
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_ADD:
        a = tl.load(add_ptr + t * stride_add + cols, mask=cmask, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + a).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_out + cols, out, mask=cmask)


@triton.jit
def _combine_bwd_kernel(
    # g [T, d], y [R, d], token [R], perm [R], w [T * k] fp32 -> dy [R, d], dw [T * k] fp32
    g_ptr, y_ptr, token_ptr, perm_ptr, w_ptr, dy_ptr, dw_ptr,
    d, stride_g, stride_y, stride_dy,
    BLOCK_D: tl.constexpr,
):
    """Sorted row r = program_id(0), slot f = perm[r]: dy[r] = round(g[t] w[f]); dw[f] = <g[t], y[r]> in
    fp32, per-lane sums over ascending BLOCK_D blocks, then ``tl.sum`` (fixed for a fixed BLOCK_D)."""
    r = tl.program_id(0).to(tl.int64)
    t = tl.load(token_ptr + r)
    f = tl.load(perm_ptr + r)
    w = tl.load(w_ptr + f)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for c0 in range(0, d, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        cmask = cols < d
        gv = tl.load(g_ptr + t * stride_g + cols, mask=cmask, other=0.0).to(tl.float32)
        yv = tl.load(y_ptr + r * stride_y + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(dy_ptr + r * stride_dy + cols, (gv * w).to(dy_ptr.dtype.element_ty), mask=cmask)
        acc = acc + gv * yv
    tl.store(dw_ptr + f, tl.sum(acc, axis=0))


@triton.jit
def _router_kernel(
    # x [T, K] (model dtype), w [N, K] fp32, out [T, N] fp32
    x_ptr, w_ptr, out_ptr,
    T, N, K, stride_x, stride_w,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[t, n] = sum_k float(x[t, k]) w[n, k] (x widened on load, exact): the triton linear's fp32 dots
    and K loop on small tiles. A trip loads four K blocks, then dots those below K in order: the same
    dots, the loads in flight together."""
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + rt[:, None].to(tl.int64) * stride_x
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_w
    tmask, nmask = rt[:, None] < T, rn[None, :] < N
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K * 4):
        r0 = k0 + tl.arange(0, BLOCK_K)
        r1, r2, r3 = r0 + BLOCK_K, r0 + 2 * BLOCK_K, r0 + 3 * BLOCK_K
        a0 = tl.load(x_rows + r0[None, :], mask=tmask & (r0[None, :] < K), other=0.0).to(tl.float32)
        a1 = tl.load(x_rows + r1[None, :], mask=tmask & (r1[None, :] < K), other=0.0).to(tl.float32)
        a2 = tl.load(x_rows + r2[None, :], mask=tmask & (r2[None, :] < K), other=0.0).to(tl.float32)
        a3 = tl.load(x_rows + r3[None, :], mask=tmask & (r3[None, :] < K), other=0.0).to(tl.float32)
        b0 = tl.load(w_cols + r0[:, None], mask=nmask & (r0[:, None] < K), other=0.0)
        b1 = tl.load(w_cols + r1[:, None], mask=nmask & (r1[:, None] < K), other=0.0)
        b2 = tl.load(w_cols + r2[:, None], mask=nmask & (r2[:, None] < K), other=0.0)
        b3 = tl.load(w_cols + r3[:, None], mask=nmask & (r3[:, None] < K), other=0.0)
        acc = tl.dot(a0, b0, acc, input_precision="ieee")
        if k0 + BLOCK_K < K:  # the linear's cdiv(K, BLOCK_K) dots, no more
            acc = tl.dot(a1, b1, acc, input_precision="ieee")
        if k0 + 2 * BLOCK_K < K:
            acc = tl.dot(a2, b2, acc, input_precision="ieee")
        if k0 + 3 * BLOCK_K < K:
            acc = tl.dot(a3, b3, acc, input_precision="ieee")
    tl.store(out_ptr + rt[:, None].to(tl.int64) * N + rn[None, :], acc, mask=tmask & nmask)


@triton.jit
def _route_rows(logits_ptr, bias_ptr, t0, T, E: tl.constexpr, E_PAD: tl.constexpr, N_GROUP: tl.constexpr,
                TOPK_GROUP: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr):
    """Rows t0 .. t0 + BLOCK_T - 1 -> (rows, row mask, cols, sigmoid scores, chosen [BT, E_PAD]):
    ``naive.route``'s stable sort as k picks of the greatest value left, its lowest index."""
    rows = t0 + tl.arange(0, BLOCK_T)
    rmask = rows < T
    cols = tl.arange(0, E_PAD)
    cmask = cols < E
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * E + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                other=0.0)
    s = tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), exp_exact(-x) + 1.0)  # elementwise.sigmoid
    choice = s + tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]
    live = cmask[None, :] & (rows[:, None] >= 0)  # [BT, E_PAD]
    if N_GROUP > 1:
        PER: tl.constexpr = E // N_GROUP
        group = cols // PER
        gs = tl.zeros((BLOCK_T, E_PAD), dtype=tl.float32)  # each expert carries its group's score
        for gi in tl.static_range(N_GROUP):
            ing = live & (group[None, :] == gi)
            top1 = tl.max(tl.where(ing, choice, float("-inf")), axis=1)
            first = tl.min(tl.where(ing & (choice == top1[:, None]), cols[None, :], E_PAD), axis=1)
            top2 = tl.max(tl.where(ing & (cols[None, :] != first[:, None]), choice, float("-inf")), axis=1)
            gs = tl.where(ing, (top1 + top2)[:, None], gs)
        allowed = live & (cols[None, :] < 0)
        for _ in tl.static_range(TOPK_GROUP):  # the best group left, ties to the lower group
            best = tl.max(tl.where(live & ~allowed, gs, float("-inf")), axis=1)
            pick = tl.min(tl.where(live & ~allowed & (gs == best[:, None]), group[None, :], N_GROUP), axis=1)
            allowed = allowed | (live & (group[None, :] == pick[:, None]))
    else:
        allowed = live
    chosen = live & (cols[None, :] < 0)
    for _ in tl.static_range(K):
        left = allowed & ~chosen
        best = tl.max(tl.where(left, choice, float("-inf")), axis=1)
        e = tl.min(tl.where(left & (choice == best[:, None]), cols[None, :], E_PAD), axis=1)
        chosen = chosen | (cols[None, :] == e[:, None])
    return rows, rmask, cols, s, chosen


@triton.jit
def _route_kernel(
    # logits [T, E] fp32, bias [E] fp32 -> experts [T, K] int64, weights [T, K] fp32
    logits_ptr, bias_ptr, experts_ptr, weights_ptr,
    # DISPATCH's tables (int64): token [R], perm [R], pos [T, K], offsets [E + 1], tiles [NT]
    token_ptr, perm_ptr, pos_ptr, offsets_ptr, tile_expert_ptr, tile_row0_ptr, tile_row1_ptr,
    T, NT, scale,
    E: tl.constexpr, E_PAD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
    NORM: tl.constexpr, BLOCK_T: tl.constexpr, ROUTE: tl.constexpr, DISPATCH: tl.constexpr,
    TILE_M: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """``naive.route`` on sigmoid(logits), one program per BLOCK_T rows: the same choice and weights (the
    chosen scores summed in ascending expert order, ``div_rn``, times ``scale``). DISPATCH: one program
    walks every row and writes ``grouped.dispatch``'s tables (the same integers); without ROUTE only
    the tables, from the experts already stored."""
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    first_block = 0 if DISPATCH else tl.program_id(0) * BLOCK_T
    last_block = (T if DISPATCH else first_block + 1) if ROUTE else 0
    if not ROUTE:  # each expert's rows, counted from the stored experts
        for t0 in range(0, T, BLOCK_T):
            rows = t0 + tl.arange(0, BLOCK_T)
            rmask = rows < T
            cols = tl.arange(0, E_PAD)
            for j in tl.static_range(K):
                e = tl.load(experts_ptr + rows.to(tl.int64) * K + j, mask=rmask, other=E_PAD).to(tl.int32)
                counts += tl.sum((cols[None, :] == e[:, None]).to(tl.int32), axis=0)
    for t0 in range(first_block, last_block, BLOCK_T):
        rows, rmask, cols, s, chosen = _route_rows(logits_ptr, bias_ptr, t0, T, E, E_PAD, N_GROUP, TOPK_GROUP, K,
                                                   BLOCK_T)
        counts += tl.sum((chosen & rmask[:, None]).to(tl.int32), axis=0)
        # the total summed in ascending expert order
        left = chosen
        total = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for j in tl.static_range(K):
            e = tl.min(tl.where(left, cols[None, :], E_PAD), axis=1)
            left = left & (cols[None, :] != e[:, None])
            w = tl.max(tl.where(cols[None, :] == e[:, None], s, float("-inf")), axis=1)
            if j == 0:
                total = w
            else:
                total = total + w
        denom = total + 1e-20
        left = chosen
        for j in tl.static_range(K):
            e = tl.min(tl.where(left, cols[None, :], E_PAD), axis=1)
            left = left & (cols[None, :] != e[:, None])
            w = tl.max(tl.where(cols[None, :] == e[:, None], s, float("-inf")), axis=1)
            if NORM:
                w = tl.math.div_rn(w, denom)
            w = w * scale
            tl.store(experts_ptr + rows.to(tl.int64) * K + j, e.to(tl.int64), mask=rmask)
            tl.store(weights_ptr + rows.to(tl.int64) * K + j, w, mask=rmask)
    if DISPATCH:
        cols = tl.arange(0, E_PAD)
        cmask = cols < E
        ends = tl.cumsum(counts, axis=0)
        starts = ends - counts  # offsets[e]: expert e's first sorted row
        tl.store(offsets_ptr + cols, starts.to(tl.int64), mask=cmask)
        tl.store(offsets_ptr + 1 + cols, ends.to(tl.int64), mask=cols == E - 1)
        tl.debug_barrier()  # the experts stored above, read back by other threads below
        seen = tl.zeros((E_PAD,), dtype=tl.int32)  # rows of each expert in earlier row blocks
        for t0 in range(0, T, BLOCK_T):
            rows = t0 + tl.arange(0, BLOCK_T)
            rmask = rows < T
            chosen = (cols[None, :] < 0) & rmask[:, None]
            slot = tl.zeros((BLOCK_T, E_PAD), dtype=tl.int32)
            for j in tl.static_range(K):
                e = tl.load(experts_ptr + rows.to(tl.int64) * K + j, mask=rmask, other=E_PAD).to(tl.int32)
                hit = cols[None, :] == e[:, None]
                chosen = chosen | hit
                slot = tl.where(hit, j, slot)
            c = chosen.to(tl.int32)
            # a stable sort of t * K + j by expert: an expert's rows in ascending token order
            r = starts[None, :] + seen[None, :] + tl.cumsum(c, axis=0) - c
            seen += tl.sum(c, axis=0)
            flat = rows[:, None] * K + slot
            tl.store(pos_ptr + flat.to(tl.int64), r.to(tl.int64), mask=chosen)
            tl.store(token_ptr + r.to(tl.int64), (rows[:, None] + slot * 0).to(tl.int64), mask=chosen)
            tl.store(perm_ptr + r.to(tl.int64), flat.to(tl.int64), mask=chosen)
        tiles = (counts + TILE_M - 1) // TILE_M
        tile_end = tl.cumsum(tiles, axis=0)
        tile_end = tl.where(cmask, tile_end, 1 << 30)
        tile_start = tile_end - tiles
        for p0 in range(0, NT, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            te = tl.sum((tile_end[None, :] <= p[:, None]).to(tl.int32), axis=1)  # searchsorted(right=True)
            used = te < E
            e = tl.minimum(te, E - 1)
            at = cols[None, :] == e[:, None]
            row0 = tl.sum(tl.where(at, starts[None, :] + (p[:, None] - tile_start[None, :]) * TILE_M, 0), axis=1)
            row1 = tl.sum(tl.where(at, ends[None, :], 0), axis=1)
            pm = p < NT
            tl.store(tile_expert_ptr + p, e.to(tl.int64), mask=pm)
            tl.store(tile_row0_ptr + p, tl.where(used, row0, 0).to(tl.int64), mask=pm)
            tl.store(tile_row1_ptr + p, tl.where(used, row1, 0).to(tl.int64), mask=pm)


def combine_triton(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None, dtype: torch.dtype,
                   cfg: TritonKernelConfigs, add: torch.Tensor | None = None) -> torch.Tensor:
    """``naive.combine([y[pos[:, j]] for j], weights, dtype)`` (+ ``add``, its bits) in one pass: y [R, d],
    pos [T, k] int64, weights [T, k] fp32 or None (the plain sum in slot order) -> [T, d]."""
    T, k = pos.shape
    y, pos = y.contiguous(), pos.contiguous()
    w = pos if weights is None else weights.to(torch.float32).contiguous()
    out = torch.empty(T, y.shape[1], dtype=dtype, device=y.device)
    if add is not None and (add.shape != out.shape or add.dtype != dtype or add.stride(1) != 1):
        raise ValueError(f"combine_triton: add {tuple(add.shape)} {add.dtype} must be [{T}, {y.shape[1]}] {dtype} "
                         "with unit column stride")
    if out.numel():
        grid = (T, triton.cdiv(y.shape[1], cfg.moe_combine_block_d))
        _combine_kernel[grid](y, pos, w, out, out if add is None else add, y.shape[1], y.stride(0),
                              out.stride(0), 0 if add is None else add.stride(0), K=k,
                              BLOCK_D=cfg.moe_combine_block_d, HAS_ADD=add is not None,
                              WEIGHTED=weights is not None, num_warps=4, enable_fp_fusion=False)
    return out


def router_logits_triton(x: torch.Tensor, gate_w: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
    """x [T, d] (bf16 or fp32), gate_w [E, d] fp32 -> logits [T, E] fp32, ``linear_triton(x.float(),
    gate_w)``'s bits in small tiles (a decode row spreads over many programs); the large tile from
    ``moe_router_large_rows`` rows."""
    if x.dim() != 2 or gate_w.dim() != 2 or x.shape[1] != gate_w.shape[1] or gate_w.dtype != torch.float32:
        raise ValueError(f"router_logits_triton: x {tuple(x.shape)} and gate_w {tuple(gate_w.shape)} "
                         f"{gate_w.dtype} must be [T, d] and [E, d] float32")
    if x.stride(1) != 1:
        x = x.contiguous()
    w = gate_w.contiguous()
    T, K = x.shape
    E = w.shape[0]
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if out.numel():
        c = cfg
        # a row's bits are the K loop's whatever the tile, so many rows may take a larger one
        large = c.moe_router_large_rows and T >= c.moe_router_large_rows
        bt, bn, warps = ((c.moe_router_large_block_t, c.moe_router_large_block_n, c.moe_router_large_warps) if large
                         else (c.moe_router_block_t, c.moe_router_block_n, c.moe_router_warps))
        grid = (triton.cdiv(T, bt), triton.cdiv(E, bn))
        # launched as the triton linear is (the same FMAs)
        _router_kernel[grid](x, w, out, T, E, K, x.stride(0), w.stride(0), BLOCK_T=bt, BLOCK_N=bn,
                             BLOCK_K=c.linear_fp32_block_k, num_warps=warps, num_stages=2)
    return out


class _Router(torch.autograd.Function):
    """The router kernel's forward; the triton linear's fp32 backward in torch (dx = g w rounded to x's
    dtype, as autograd of ``x.float()``; dw = g^T x)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate_w: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
        ctx.save_for_backward(x, gate_w)
        return router_logits_triton(x, gate_w, cfg)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        nx, nw, _ = ctx.needs_input_grad
        return ((g @ w).to(x.dtype) if nx else None, g.t() @ x.to(torch.float32) if nw else None, None)


def router_logits(x: torch.Tensor, gate_w: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
    """The router GEMM on the triton backend, sampler and trainer alike: ``router_logits_triton``,
    differentiable under autograd."""
    if torch.is_grad_enabled() and (x.requires_grad or gate_w.requires_grad):
        return _Router.apply(x, gate_w, cfg)
    return router_logits_triton(x, gate_w, cfg)


#: the most experts the routing kernel takes (one row's scores are one register tile)
ROUTE_MAX_EXPERTS = 1024


def route_triton(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, cfg: TritonKernelConfigs,
                 with_dispatch: bool = True, dtype: torch.dtype = torch.bfloat16,
                 ) -> tuple[torch.Tensor, torch.Tensor, Dispatch | None]:
    """``naive.route(sigmoid(logits), bias, ...)``'s bits in one launch: logits [T, E] fp32, bias [E] ->
    (experts [T, k] int64, weights [T, k] fp32, ``grouped.dispatch``'s tables for ``dtype``'s tile where
    ``with_dispatch`` and R <= ``moe_dispatch_max_rows``, else None)."""
    T, E = logits.shape
    if bias.shape != (E,) or logits.dtype != torch.float32 or not 1 <= top_k <= E or E > ROUTE_MAX_EXPERTS:
        raise ValueError(f"route_triton: logits {tuple(logits.shape)} {logits.dtype}, bias {tuple(bias.shape)}, "
                         f"top_k {top_k}: expected float32 [T, E] and [E], 1 <= top_k <= E <= {ROUTE_MAX_EXPERTS}")
    if E % n_group or not 1 <= topk_group <= n_group or top_k > topk_group * (E // n_group):
        raise ValueError(f"route_triton: {E} experts in {n_group} groups, topk_group {topk_group}, top_k {top_k}: "
                         "the kept groups must hold top_k experts")
    dev, i64 = logits.device, torch.int64
    logits, bias = logits.contiguous(), bias.to(torch.float32).contiguous()
    experts = torch.empty(T, top_k, dtype=i64, device=dev)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    R = T * top_k
    E_PAD = triton.next_power_of_2(E)
    block_t = min(cfg.moe_route_block_t, max(1, 4096 // E_PAD))
    # one row block: route and tables in one program; more: route in parallel, then a tables launch
    one = with_dispatch and 0 < T <= block_t and R <= cfg.moe_dispatch_max_rows
    two = with_dispatch and not one and 0 < R <= cfg.moe_dispatch_max_rows
    if one or two:
        bm = gemm_tile(R, dtype, cfg)[0]
        NT = -(-R // bm) + min(E, R)
        token, perm = torch.empty(R, dtype=i64, device=dev), torch.empty(R, dtype=i64, device=dev)
        pos, offsets = torch.empty(T, top_k, dtype=i64, device=dev), torch.empty(E + 1, dtype=i64, device=dev)
        tiles = [torch.empty(NT, dtype=i64, device=dev) for _ in range(3)]
        d = Dispatch(token, perm, pos, offsets, *tiles, bm)
    else:
        bm, NT = 16, 0
        token = perm = pos = offsets = experts
        tiles = [experts] * 3
        d = None
    if T:
        args = (logits, bias, experts, weights, token, perm, pos, offsets, *tiles, T, NT, float(routed_scaling_factor))
        meta = dict(E=E, E_PAD=E_PAD, N_GROUP=n_group, TOPK_GROUP=topk_group, K=top_k, NORM=norm_topk_prob,
                    BLOCK_T=block_t, TILE_M=bm, BLOCK_P=64, num_warps=cfg.moe_route_warps, enable_fp_fusion=False)
        grid = (1,) if one else (triton.cdiv(T, block_t),)
        _route_kernel[grid](*args, ROUTE=True, DISPATCH=one, **meta)
        if two:
            _route_kernel[(1,)](*args, ROUTE=False, DISPATCH=True, **meta)
    return experts, weights, d


def gemm_tile(R: int, dtype: torch.dtype, cfg: TritonKernelConfigs) -> tuple[int, int, int, int]:
    """(block_m, block_n, warps, stages) for R sorted rows: the decode tile up to
    ``moe_decode_max_rows``, else the large; a row's bits do not depend on it (one K block)."""
    c = cfg
    if R <= c.moe_decode_max_rows:
        bm, bn, warps, stages = c.moe_decode_block_m, c.moe_decode_block_n, c.moe_decode_warps, c.moe_decode_stages
    else:
        bm, bn, warps, stages = c.moe_block_m, c.moe_block_n, c.moe_warps, c.moe_stages
    if dtype == torch.float32:
        return min(bm, 64), min(bn, 128), 4, min(stages, 3)
    return bm, bn, warps, stages


@dataclasses.dataclass(frozen=True)
class ExpertTable:
    """Each expert's own weight [N, K] (or [K, N]) where it lies, as the kernels read it: ``ptrs`` int64
    [E] on the weights' device, ``shape`` one expert's; ``weights`` keeps them alive while it is used."""

    ptrs: torch.Tensor
    shape: tuple[int, int]
    weights: tuple[torch.Tensor, ...]

    @staticmethod
    def readable(ws: Sequence[torch.Tensor]) -> bool:
        """Whether the kernels can read ``ws`` in place: contiguous 2-D, one shape, dtype and device, each
        16-byte aligned (the kernels' vector loads assume it, as for a stack)."""
        w0 = ws[0]
        return all(w.dim() == 2 and w.shape == w0.shape and w.dtype == w0.dtype and w.device == w0.device
                   and w.is_contiguous() and w.data_ptr() % 16 == 0 for w in ws)

    @staticmethod
    def of(ws: Sequence[torch.Tensor]) -> ExpertTable:
        if not ExpertTable.readable(ws):
            raise ValueError("grouped_gemm: the experts' weights must be contiguous, 16-byte aligned, of one shape, "
                             "dtype and device")
        ptrs = torch.tensor([w.data_ptr() for w in ws], dtype=torch.int64).to(ws[0].device)
        return ExpertTable(ptrs, (ws[0].shape[0], ws[0].shape[1]), tuple(ws))


def grouped_gemm(a: torch.Tensor, b: torch.Tensor | ExpertTable, d: Dispatch, cfg: TritonKernelConfigs, *,
                 gather: bool, transpose_b: bool = False, relu2: bool = False,
                 drelu2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """c[r] = a[row(r)] @ b[e]^T (b [E, N, K]; [E, K, N] with ``transpose_b``; or an ``ExpertTable`` of
    each expert's [N, K] / [K, N], read in place: the same bits), row(r) = d.token[r] if ``gather`` else
    r; a, b bf16 or fp32 -> (c [R, N], u or None). ``relu2``: u the product, c relu(u)^2; ``drelu2`` =
    the forward's u: c = round(2 p relu(u)), the gradient through relu(u)^2."""
    if a.stride(1) != 1:
        a = a.contiguous()
    table = isinstance(b, ExpertTable)
    if table:
        shape, b_arg, stride_be = b.shape, b.ptrs, 0
    else:
        b = b.contiguous()
        shape, b_arg, stride_be = tuple(b.shape[1:]), b, b.stride(0)
    N, K = (shape[1], shape[0]) if transpose_b else (shape[0], shape[1])
    sbn, sbk = (1, N) if transpose_b else (K, 1)
    R = d.token.numel()
    c = torch.empty(R, N, dtype=a.dtype, device=a.device)
    u = torch.empty_like(c) if relu2 else None
    if drelu2 is not None:
        if relu2 or drelu2.shape != c.shape or drelu2.dtype != c.dtype:
            raise ValueError(f"grouped_gemm: drelu2 {tuple(drelu2.shape)} {drelu2.dtype} must be [{R}, {N}] "
                             f"{c.dtype}, without relu2")
        u = drelu2.contiguous()
    if R == 0 or N == 0:
        return c, u
    _, bn, warps, stages = gemm_tile(R, a.dtype, cfg)  # the rows of a tile are the tables' (d.block_m)
    grid = (d.tile_row0.numel() * triton.cdiv(N, bn),)
    _grouped_gemm_kernel[grid](
        a, b_arg, c, c if u is None else u, d.token, d.tile_expert, d.tile_row0, d.tile_row1,
        N, K, a.stride(0), stride_be, sbn, sbk, N,
        GATHER=gather, RELU2=relu2, DRELU2=drelu2 is not None, BLOCK_M=d.block_m, BLOCK_N=bn,
        BLOCK_K=cfg.moe_block_k, PRECISION="ieee", B_TABLE=table, num_warps=warps, num_stages=stages,
        enable_fp_fusion=False)
    return c, u


def combine_backward(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, d: Dispatch,
                     cfg: TritonKernelConfigs) -> tuple[torch.Tensor, torch.Tensor]:
    """The combine's backward, one pass: g [T, d], y [R, d] sorted, weights [T, k] fp32 -> (dy [R, d]:
    round(g[t] w[t, j]); d_weights [T, k] fp32: <g[t], y[pos[t, j]]> in a fixed order)."""
    T, k = weights.shape
    R, D = y.shape
    g, y = g.contiguous(), y.contiguous()
    dy = torch.empty(R, D, dtype=y.dtype, device=g.device)
    dw = torch.empty(T, k, dtype=torch.float32, device=g.device)
    if R:
        _combine_bwd_kernel[(R,)](g, y, d.token, d.perm, weights.to(torch.float32).contiguous(), dy, dw, D,
                                  g.stride(0), y.stride(0), dy.stride(0), BLOCK_D=cfg.moe_combine_block_d,
                                  num_warps=4, enable_fp_fusion=False)
    return dy, dw


def expert_wgrad(g: torch.Tensor, x: torch.Tensor, d: Dispatch, num_experts: int, cfg: TritonKernelConfigs, *,
                 gather: bool) -> torch.Tensor:
    """dw [E, N, K]: dw[e] = sum over e's sorted rows r, ascending, of g[r]^T x[row(r)]; g [R, N], x [*, K]."""
    g, x = g.contiguous(), x.contiguous()
    N, K = g.shape[1], x.shape[1]
    dw = torch.empty(num_experts, N, K, dtype=g.dtype, device=g.device)
    if dw.numel() == 0:
        return dw
    c = cfg
    grid = (triton.cdiv(N, c.moe_wgrad_block_n) * triton.cdiv(K, c.moe_wgrad_block_k), num_experts)
    _expert_wgrad_kernel[grid](
        g, x, dw, d.token, d.offsets, N, K, g.stride(0), x.stride(0), N * K,
        GATHER=gather, BLOCK_N=c.moe_wgrad_block_n, BLOCK_K=c.moe_wgrad_block_k, BLOCK_T=c.moe_wgrad_block_t,
        PRECISION="ieee", num_warps=c.moe_wgrad_warps, enable_fp_fusion=False)
    return dw


Weights = torch.Tensor | Sequence[torch.Tensor]
Experts = torch.Tensor | ExpertTable  # stacked [E, *s], or each expert's own tensor


def _dims(w: Experts) -> tuple[int, int, int, torch.dtype]:
    """(E, rows, columns, dtype) of stacked weights or a table."""
    if isinstance(w, ExpertTable):
        return len(w.weights), *w.shape, w.weights[0].dtype
    if w.dim() != 3:
        raise ValueError(f"experts_triton: stacked expert weights must be [E, rows, columns], not {tuple(w.shape)}")
    return *w.shape, w.dtype


def _check(h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, up_w: Experts, down_w: Experts) -> None:
    T, d = h.shape
    (E, f, du, up_t), (E2, dd, f2, down_t) = _dims(up_w), _dims(down_w)
    if (E2, dd, f2) != (E, d, f) or du != d:
        raise ValueError(f"experts_triton: h {tuple(h.shape)}, up_w {(E, f, du)} [E, f, d] and down_w "
                         f"{(E2, dd, f2)} [E, d, f] do not match")
    if experts.shape != weights.shape or experts.shape[0] != T:
        raise ValueError(f"experts_triton: experts {tuple(experts.shape)} and weights {tuple(weights.shape)} "
                         f"must both be [{T}, k]")
    if not (h.dtype == up_t == down_t) or h.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"experts_triton: h {h.dtype}, up_w {up_t}, down_w {down_t} must all be "
                         "bfloat16 or float32")


def _experts(ws: Weights) -> Experts:
    """Stacked weights as they are; a list of each expert's weights as an ``ExpertTable`` (read in place),
    stacked (a copy for this call) where the kernels cannot read them in place."""
    if isinstance(ws, torch.Tensor):
        return ws
    if not ws:
        raise ValueError("experts_triton: no expert weights")
    if ExpertTable.readable(ws):
        return ExpertTable.of(ws)
    with torch.no_grad():
        return torch.stack(list(ws))


def _forward(h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, up_w: Experts,
             down_w: Experts, cfg: TritonKernelConfigs, d: Dispatch | None = None,
             add: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple]:
    if d is None:
        d = dispatch(experts, _dims(up_w)[0], gemm_tile(experts.numel(), h.dtype, cfg)[0])
    act, u = grouped_gemm(h, up_w, d, cfg, gather=True, relu2=True)
    y, _ = grouped_gemm(act, down_w, d, cfg, gather=False)
    return combine_triton(y, d.pos, weights, h.dtype, cfg, add), (d, u, act, y)


def _backward(g: torch.Tensor, h: torch.Tensor, weights: torch.Tensor, up_w: Experts, down_w: Experts,
              saved: tuple, cfg: TritonKernelConfigs) -> tuple[torch.Tensor, ...]:
    """(d h, d weights, d up_w [E, f, d], d down_w [E, d, f]) from the forward's ``saved`` (d, u, act, y)."""
    d, u, act, y = saved
    E = _dims(up_w)[0]
    # out = round(sum_j w_j y_j): d w_j = <g, y_j>, d y_j = round(g w_j)
    dy, d_weights = combine_backward(g, y, weights, d, cfg)
    # d u = round(2 relu(u) round(dy @ down)), in the data GEMM's epilogue
    d_u, _ = grouped_gemm(dy, down_w, d, cfg, gather=False, transpose_b=True, drelu2=u)
    d_down = expert_wgrad(dy, act, d, E, cfg, gather=False)
    d_h_sorted, _ = grouped_gemm(d_u, up_w, d, cfg, gather=False, transpose_b=True)
    d_up = expert_wgrad(d_u, h, d, E, cfg, gather=True)
    # token t's k input gradients summed in slot order in fp32, rounded once
    d_h = combine_triton(d_h_sorted, d.pos, None, h.dtype, cfg)
    return d_h, d_weights, d_up, d_down


def experts_triton(h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, up_w: Weights,
                   down_w: Weights, cfg: TritonKernelConfigs, *, dispatch: Dispatch | None = None,
                   add: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts (``ops.moe``'s signature; bf16 or fp32, experts distinct per row), no host
    sync. ``up_w`` / ``down_w``: stacked [E, f, d] / [E, d, f], or lists of each expert's contiguous [f, d]
    / [d, f] (a trainer's own parameters: read where they lie through an ``ExpertTable``, no stacked copy;
    the table's addresses are copied to the device, so a list is for eager steps,
    not CUDA graphs). ``dispatch``: ``route_triton``'s tables or None (built here); ``add`` [T, d]: returns
    out + add (the shared expert, in the combine's pass). Differentiable."""
    listed = not isinstance(up_w, torch.Tensor)
    if listed != (not isinstance(down_w, torch.Tensor)) or (listed and len(up_w) != len(down_w)):
        raise ValueError("experts_triton: up_w and down_w must both be stacked tensors or lists of one weight "
                         "per expert")
    ws = (*up_w, *down_w) if listed else (up_w, down_w)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (h, weights, *ws))
    up, down = _experts(up_w), _experts(down_w)
    _check(h, experts, weights, up, down)
    if not grad:
        return _forward(h, experts, weights, up, down, cfg, dispatch, add)[0]
    out = ExpertsFunction.apply(h, experts, weights, cfg, dispatch, (up, down), listed, *ws)
    return out if add is None else out + add


class ExpertsFunction(torch.autograd.Function):
    """The kernels' forward (the inference path's bits) and its deterministic backward. ``kernels``: the
    (up, down) weights as the launches read them (stacked, or ``ExpertTable``s over a trainer's per-expert
    parameters, so no stacked copy is made or kept for the backward); ``ws`` the weights given, which get
    the gradients (``listed``: E up then E down, each its slice of the stacked gradient)."""

    @staticmethod
    def forward(ctx, h, experts, weights, cfg, d, kernels, listed, *ws):  # type: ignore[override]
        out, (d, u, act, y) = _forward(h, experts, weights, *kernels, cfg, d)
        ctx.save_for_backward(h, weights, u, act, y, *ws)  # the weights: a table's addresses stay theirs
        ctx.dispatch, ctx.cfg, ctx.kernels, ctx.listed = d, cfg, kernels if listed else None, listed
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        h, weights, u, act, y, *ws = ctx.saved_tensors
        kernels = ctx.kernels if ctx.listed else ws
        d_h, d_weights, d_up, d_down = _backward(g, h, weights, *kernels, (ctx.dispatch, u, act, y), ctx.cfg)
        grads = (*d_up.unbind(0), *d_down.unbind(0)) if ctx.listed else (d_up, d_down)
        return d_h, None, d_weights, None, None, None, None, *grads


def moe_experts(h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, up_w: Weights,
                down_w: Weights, up_b: object = None, down_b: object = None, *,
                cfg: TritonKernelConfigs, dispatch: Dispatch | None = None,
                add: torch.Tensor | None = None) -> torch.Tensor:
    """The backend's ``moe_experts``: ``experts_triton``; expert biases refused (no bias term)."""
    if up_b is not None or down_b is not None:
        raise AlignedMambaError("MoE expert biases on a CUDA device are refused: the grouped expert kernels have "
                                "no bias term (mlp_bias MoE checkpoints run on the torch backend)")
    return experts_triton(h, experts, weights, up_w, down_w, cfg, dispatch=dispatch, add=add)


__all__ = ["ROUTE_MAX_EXPERTS", "ExpertTable", "ExpertsFunction", "combine_triton",
           "expert_wgrad", "experts_triton", "gemm_tile", "grouped_gemm", "moe_experts", "route_triton",
           "router_logits", "router_logits_triton"]
