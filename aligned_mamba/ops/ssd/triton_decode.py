"""The exact-replay decode step on Triton: one new token per sequence, any offsets, any batch, with the bits
``triton_chunk.replay_chunk_triton`` gives that row (why the slot's boundary state and buffer suffice:
docs/design.md, "The one idea"). Launches (grids):

1. ``_prep_kernel`` [S, G x head blocks, L / BLOCK_K], no fp contraction: the token's x, raw dt and B into row
   ``pos % L`` of the buffers; the chunk's softplus'd dt row up to the token's column block, zeros past it (the
   prefill pack's bits); the token's C.B row once per group.
2. ``_row_kernel`` [S, H / HPP, PB] ("row", fp32 models) or ``_tile_kernel`` [S, H, PB] ("tile", bf16 models): the
   cumsum a (``_cumsum_kernel``'s code), then the output row. "tile" runs ``_tile_output_kernel`` on a
   ``DECODE_ROW_TILE``-row tile whose one live row is the token's; "row" runs the row alone in fma chains in the
   fp32 dot's order (k ascending, from the accumulator), which cannot reproduce tensor-core dots.
3. ``_update_kernel`` [H, entries / COMPLETION_BLOCK, PB]: where the token completes the chunk (pos % L == L - 1),
   the new boundary state by ``_chunk_state_kernel`` + ``_state_pass_kernel``'s code.
4. ``_zero_kernel`` [H, entries / COMPLETION_BLOCK]: empties those sequences' buffers.

Nothing later in a step reads what 3 and 4 write (the next step's prep and tile kernels do): inside
``completions_on(stream)`` they run on that side stream, joined back when the context exits, so a step's
later layers need not wait for them (``DecodeGraphs`` captures its completion steps so by default).

"step" mode (bf16 models) runs the four as one ``_step_kernel``, the same operations in the same order. The
interpreter cannot show the bits (numpy ``tl.dot``, two-rounding ``tl.fma``): tests/ops/ssd/test_triton_decode.py
checks them on the GPU; "tile" is the fallback if "row" ever differs there.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..configs import TritonKernelConfigs
from ..triton_math import dt_softplus_exact, has_limit, interpreting, limits
from .plan import host_to_device
from .state import SSDState, SSMParams, Step
from .triton_dot import DOT_MODES, dot_acc, tensor_core_dots

MODES = ("row", "tile", "step")
DEFAULT_MODE = "row"  # fp32 models; bf16 models run "tile" (tensor-core dots: see triton_dot)
# the "tile" kernel's row tile: the smallest MMA tile; a row's bits do not depend on it
DECODE_ROW_TILE = 16

# programmatic dependent launch (sm_90+, see _tile_kernel): scheduling only, the arithmetic is the same
PDL: bool = True
# the tile kernel's occupancy, never its arithmetic (benchmarks/README.md)
TILE_OPTS: dict = {"num_stages": 2}
# whether the tile kernel's K loop is a run-time ``tl.range`` the compiler pipelines (compiled only; the same dots in
# the same order)
TILE_RT_RANGE: bool = True
# step entries per program of the completion kernels (see _update_kernel)
COMPLETION_BLOCK = 16
# heads per prep program (a power of two; None: a group's heads in one program): scheduling only, each head's
# dt row is computed alone
PREP_HEADS: int | None = 16
# bf16 models run "step" up to this many sequences, "tile" above (0: never); the same bits, speed only
STEP_MAX_BATCH: int = 0
# "step" mode's occupancy options, and whether its K loop is a run-time ``tl.range`` (compiled only)
STEP_OPTS: dict = {"num_stages": 2}
STEP_RT_RANGE: bool = False
# measurement only: a step-kernel P block the contract does not pin (None: the contract's block_p)
STEP_BLOCK_P: int | None = None
# measurement only: whether the inter-chunk dots read the boundary state's bf16 copy where the state keeps one
# and the dots round (False: the fp32 state, the same bits from twice the bytes; the copy is written either way)
READ_STATE_COPY: bool = True
# the side stream of the completion launches and whether a launch went there since ``completions_on`` opened
# (None outside it: in order on the current stream); a context variable, so one thread's capture forks only its
# own launches
_COMPLETION_STREAM: contextvars.ContextVar[list | None] = contextvars.ContextVar("completion_stream", default=None)
# "step" mode's completion counters per device, one per (entry, group), zero between launches; grown,
# never freed: a captured CUDA graph keeps their address
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _counters(dev: torch.device, n: int) -> torch.Tensor:
    """n int32 zeros on ``dev`` that the step kernel counts in (and leaves zero)."""
    held = _COUNTERS.setdefault(dev, [])
    if not held or held[-1].numel() < n:
        held.append(torch.zeros(max(n, 2 * held[-1].numel() if held else 256), dtype=torch.int32, device=dev))
    return held[-1]


@contextlib.contextmanager
def completions_on(stream: torch.cuda.Stream) -> Iterator[None]:
    """Decode steps inside ("tile" and "row" modes; "step" has no completion launch) run their completion launches
    on ``stream``, after the launches before them on the current stream; on exit the current stream waits for
    ``stream``. Scheduling only: the same kernels on the same values. Under CUDA-graph capture the fork and the
    join are captured."""
    held = [stream, False]
    token = _COMPLETION_STREAM.set(held)
    try:
        yield
    finally:
        _COMPLETION_STREAM.reset(token)
        if held[1]:  # (a capture may join only a stream forked from it)
            torch.cuda.current_stream(stream.device).wait_stream(stream)


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched as programmatic dependents (sm_90+, compiled)."""
    if interpreting() or device.type != "cuda":
        return False
    return _sm_major(device) >= 9


@functools.cache
def _sm_major(device: torch.device) -> int:
    """The device's compute capability major, asked once per device (decode calls this per layer)."""
    return torch.cuda.get_device_capability(device)[0]


def state_block_n(N: int) -> int:
    """The N block of the chunk-state dots, prefill and decode alike: all of N (x read once per head)."""
    return triton.next_power_of_2(N)


# -- shared pieces ---------------------------------------------------------------------------


@triton.jit
def _mirror_cumsum(dt_ptr, A_ptr, a_ptr, src_base, dst_base, h, L: tl.constexpr, BLOCK_L: tl.constexpr):
    """The body of ``triton_chunk._cumsum_kernel``, line for line (dt row at src_base, a row at dst_base)."""
    s = tl.arange(0, BLOCK_L)
    m = s < L
    dt = tl.load(dt_ptr + src_base + s, mask=m, other=0.0)
    a = tl.cumsum(dt * tl.load(A_ptr + h), axis=0)
    tl.store(a_ptr + dst_base + s, a, mask=m)


@triton.jit
def _cols4(blk):
    """The 4 columns of a [M, 4] block (4 contiguous elements per row: one 16-byte load per fp32 row)."""
    M: tl.constexpr = blk.shape[0]
    lo, hi = tl.split(tl.reshape(blk, (M, 2, 2)))  # lo: columns 0, 2; hi: 1, 3
    c0, c2 = tl.split(lo)
    c1, c3 = tl.split(hi)
    return c0, c1, c2, c3


# -- launch 1: dt, buffer rows, cb -----------------------------------------------------------


@triton.jit
def _prep_kernel(
    x_ptr, dt_ptr, B_ptr, C_ptr, dt_bias_ptr, slots_ptr, pos_ptr,
    buf_x_ptr, buf_dt_ptr, buf_B_ptr, dts_ptr, cb_ptr, lo, hi, sx_q, sdt_q, sB_q, sC_q,
    H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_HG: tl.constexpr, BLOCK_PF: tl.constexpr, BLOCK_NF: tl.constexpr, KB: tl.constexpr,
    HAS_LIMIT: tl.constexpr, WITH_CB: tl.constexpr, TC: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (q, g HB + hb, kb), columns s of block kb (KB wide), heads hb BLOCK_HG .. of group g: (kb = 0) the
    token's x and raw dt of those heads (and, hb = 0, its B) into the buffers at row r = pos % L;
    dts[q, h, s] = softplus(dt_s + dt_bias), 0 past r (``pack_chunks``'s row; a block past r only stores zeros);
    (WITH_CB, hb = 0) cb[q, g, s] = C_q . B_s for s <= r: (TC) the token's row of ``_tile_kernel``'s C.B tile (KB
    its BLOCK_K), or the fp32 dot's fma chain. Each column and head is computed alone: the splits keep the bits."""
    if PDL:
        gdc_launch_dependents()
    q = tl.program_id(0).to(tl.int64)
    HG: tl.constexpr = H // G
    HB: tl.constexpr = (HG + BLOCK_HG - 1) // BLOCK_HG
    g = tl.program_id(1) // HB
    hb = tl.program_id(1) % HB
    kb = tl.program_id(2)
    slot = tl.load(slots_ptr + q)
    r = tl.load(pos_ptr + q) % L

    j = hb * BLOCK_HG + tl.arange(0, BLOCK_HG)
    hm = j < HG
    hh = g * HG + j
    raw = tl.load(dt_ptr + q * sdt_q + hh, mask=hm, other=0.0)
    if kb == 0:
        tl.store(buf_dt_ptr + (slot * H + hh) * L + r, raw.to(buf_dt_ptr.dtype.element_ty), mask=hm)
        pf = tl.arange(0, BLOCK_PF)
        m2 = hm[:, None] & (pf < P)[None, :]
        xv = tl.load(x_ptr + q * sx_q + hh[:, None] * P + pf[None, :], mask=m2, other=0.0)
        tl.store(buf_x_ptr + ((slot * H + hh[:, None]) * L + r) * P + pf[None, :], xv, mask=m2)
        if hb == 0:
            nf = tl.arange(0, BLOCK_NF)
            nfm = nf < N
            bv = tl.load(B_ptr + q * sB_q + g * N + nf, mask=nfm, other=0.0)
            tl.store(buf_B_ptr + ((slot * G + g) * L + r) * N + nf, bv, mask=nfm)

    s = kb * KB + tl.arange(0, KB)
    dts_out = dts_ptr + (q * H + hh[:, None]) * L + s[None, :]
    if kb * KB <= r:
        buffered = hm[:, None] & (s < r)[None, :]
        raws = tl.load(buf_dt_ptr + (slot * H + hh[:, None]) * L + s[None, :], mask=buffered, other=0.0)
        raws = tl.where((s == r)[None, :], raw[:, None], raws)  # the token's row (the kb = 0 program writes it)
        bias = tl.load(dt_bias_ptr + hh, mask=hm, other=0.0)
        d = dt_softplus_exact(raws, bias[:, None], lo, hi, HAS_LIMIT)
        d = tl.where((s <= r)[None, :], d, 0.0)
        tl.store(dts_out, d, mask=hm[:, None] & (s < L)[None, :])
    else:
        # a block past the token: zeros, as the block holding it has past r, without the softplus (the exact one
        # is most of this kernel's time); the scratch is not zeroed, and the tile's cumsum reads every column
        tl.store(dts_out, tl.zeros((BLOCK_HG, KB), dtype=tl.float32), mask=hm[:, None] & (s < L)[None, :])

    if WITH_CB and TC:
        # (hb = 0) the live row of the tile kernel's C.B dots; columns past r are zero here, later tokens' B in the
        # prefill (the zero decay discards both)
        t0 = r - r % R
        if (kb * KB < t0 + R) & (hb == 0):
            rr = tl.arange(0, R)
            live = (t0 + rr) == r
            nn = tl.arange(0, BLOCK_N)
            cbt = tl.zeros((R, KB), dtype=tl.float32)
            for n0 in range(0, N, BLOCK_N):
                nc = n0 + nn
                ncm = nc < N
                Cn = tl.load(C_ptr + q * sC_q + g * N + nc[None, :] + rr[:, None] * 0,
                             mask=live[:, None] & ncm[None, :], other=0.0).to(tl.float32)
                BT = tl.load(buf_B_ptr + ((slot * G + g) * L + s[None, :]) * N + nc[:, None],
                             mask=ncm[:, None] & (s < r)[None, :], other=0.0)
                Bnew = tl.load(B_ptr + q * sB_q + g * N + nc, mask=ncm, other=0.0)
                BT = tl.where((s == r)[None, :], Bnew[:, None], BT).to(tl.float32)
                cbt = dot_acc(cbt, Cn, BT, TC, 0, "ieee")
            tl.store(cb_ptr + (q * G + g) * L + s[None, :] + rr[:, None] * 0, cbt,
                     mask=live[:, None] & (s < L)[None, :])
    elif WITH_CB:
        # (hb = 0) the fp32 dot's chain: fma(C_n, B_sn, acc), n ascending, from 0; row r from the token's B
        if (kb * KB <= r) & (hb == 0):
            jj = tl.arange(0, 4)
            cq = C_ptr + q * sC_q + g * N
            bq = B_ptr + q * sB_q + g * N
            bb = buf_B_ptr + (slot * G + g) * L * N
            old = s < r
            is_new = s == r
            acc = tl.zeros((KB,), dtype=tl.float32)
            for n0 in tl.static_range(0, N, 4):
                blk = tl.load(bb + s[:, None] * N + n0 + jj[None, :], mask=old[:, None], other=0.0)
                new = tl.load(bq + n0 + jj)
                blk = tl.where(is_new[:, None], new[None, :], blk).to(tl.float32)
                b0, b1, b2, b3 = _cols4(blk)
                acc = tl.fma(tl.load(cq + n0).to(tl.float32), b0, acc)
                acc = tl.fma(tl.load(cq + n0 + 1).to(tl.float32), b1, acc)
                acc = tl.fma(tl.load(cq + n0 + 2).to(tl.float32), b2, acc)
                acc = tl.fma(tl.load(cq + n0 + 3).to(tl.float32), b3, acc)
            tl.store(cb_ptr + (q * G + g) * L + s, acc, mask=s <= r)


# -- launch 2: the output row ----------------------------------------------------------------


@triton.jit
def _row_kernel(
    buf_x_ptr, dts_ptr, state_ptr, slots_ptr, pos_ptr, C_ptr, A_ptr, D_ptr, y_ptr, a_ptr, cb_ptr,
    sD_h, sD_p, sC_q,
    H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    HPP: tl.constexpr, RB_P: tl.constexpr, BLOCK_L: tl.constexpr, SB: tl.constexpr,
):
    """Program (q, head pair, p block): y[q, heads, p] for the token's row alone, HPP heads x RB_P values of p,
    each element on its own (HPP and RB_P keep the bits):
        inter = fma chain over n of C_n h[p, n], then * exp(a_t)        (the prefill's first dot)
        acc   = fma chain from inter over s <= t of ((cb_s exp(min(a_t - a_s, 0))) dt_s) x[s, p]
        y     = acc + D x_t
    """
    q = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * HPP
    pb = tl.program_id(2)
    HG: tl.constexpr = H // G
    g = h0 // HG
    slot = tl.load(slots_ptr + q)
    r = tl.load(pos_ptr + q) % L
    ROWS: tl.constexpr = HPP * RB_P
    rr = tl.arange(0, ROWS)
    head = h0 + rr // RB_P
    p = pb * RB_P + rr % RB_P
    pm = p < P
    sh = slot * H + head
    qh = q * H + head

    for j in tl.static_range(HPP):
        _mirror_cumsum(dts_ptr, A_ptr, a_ptr, (q * H + h0 + j) * L, (q * H + h0 + j) * L, h0 + j, L, BLOCK_L)
    tl.debug_barrier()  # a is read back below by other threads of this program
    a_row = a_ptr + qh * L
    a_t = tl.load(a_row + r)

    # the state row of (head, p) is contiguous in n: 16-byte loads of 4 n
    jj = tl.arange(0, 4)
    hrow = state_ptr + (sh * P + p) * N
    cq = C_ptr + q * sC_q + g * N
    inter = tl.zeros((ROWS,), dtype=tl.float32)
    for n0 in tl.static_range(0, N, 4):
        hb = tl.load(hrow[:, None] + n0 + jj[None, :], mask=pm[:, None], other=0.0)
        h_0, h_1, h_2, h_3 = _cols4(hb)
        inter = tl.fma(tl.load(cq + n0).to(tl.float32), h_0, inter)
        inter = tl.fma(tl.load(cq + n0 + 1).to(tl.float32), h_1, inter)
        inter = tl.fma(tl.load(cq + n0 + 2).to(tl.float32), h_2, inter)
        inter = tl.fma(tl.load(cq + n0 + 3).to(tl.float32), h_3, inter)
    inter = inter * tl.exp(a_t)

    # rows up to the token's (later rows add exact zeros in the prefill)
    xrow = buf_x_ptr + sh * (L * P) + p
    dtrow = dts_ptr + qh * L
    cbrow = cb_ptr + (q * G + g) * L
    intra = inter  # the chain continues from the inter-chunk term, as the prefill's dots do
    s0 = 0
    while s0 <= r:
        for j in tl.static_range(SB):
            s = s0 + j
            live = s <= r
            a_s = tl.load(a_row + s, mask=live, other=0.0)
            dt_s = tl.load(dtrow + s, mask=live, other=0.0)
            cb_s = tl.load(cbrow + s, mask=live, other=0.0)
            decay = tl.exp(tl.minimum(a_t - a_s, 0.0))
            score = (cb_s * decay) * dt_s
            xs = tl.load(xrow + s * P, mask=pm & live, other=0.0).to(tl.float32)
            intra = tl.fma(score, xs, intra)
        s0 += SB

    x_t = tl.load(xrow + r * P, mask=pm, other=0.0).to(tl.float32)
    d = tl.load(D_ptr + head * sD_h + p * sD_p, mask=pm, other=0.0).to(tl.float32)
    out = intra + d * x_t
    tl.store(y_ptr + qh * P + p, out.to(y_ptr.dtype.element_ty), mask=pm)


@triton.jit
def _tile_intra_block(intra, k0, r, t, a_t, live, q, g, slot, sh, qa, p, pm, nn, buf_x_ptr, dts_ptr, buf_B_ptr, cq,
                      a_ptr, cb_ptr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, TC: tl.constexpr):
    """intra + the K block at k0 of ``_tile_output_kernel``'s intra-chunk term, for the decode tile."""
    R: tl.constexpr = t.shape[0]
    s = k0 + tl.arange(0, BLOCK_K)
    sm = s < L
    if TC:  # the token's C.B row, from the prep kernel
        cbr = tl.load(cb_ptr + (q * G + g) * L + s, mask=sm, other=0.0)
        cb = tl.where(live[:, None], cbr[None, :], 0.0)
    else:
        cb = tl.zeros((R, BLOCK_K), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            n = n0 + nn
            nm = n < N
            Cn = tl.load(cq + n[None, :] + t[:, None] * 0, mask=live[:, None] & nm[None, :],
                         other=0.0).to(tl.float32)
            BT = tl.load(buf_B_ptr + ((slot * G + g) * L + s[None, :]) * N + n[:, None],
                         mask=nm[:, None] & sm[None, :], other=0.0).to(tl.float32)
            cb = dot_acc(cb, Cn, BT, TC, 0, PRECISION)
    a_s = tl.load(a_ptr + qa + s, mask=sm, other=0.0)
    dt_s = tl.load(dts_ptr + qa + s, mask=sm, other=0.0)
    decay = tl.where(s[None, :] <= t[:, None], tl.exp(tl.minimum(a_t[:, None] - a_s[None, :], 0.0)), 0.0)
    scores = (cb * decay) * dt_s[None, :]
    # rows past the token's are not read: zeros here, zero scores in the prefill (the same exact zeros)
    xs = tl.load(buf_x_ptr + (sh * L + s[:, None]) * P + p[None, :], mask=(sm & (s <= r))[:, None] & pm[None, :],
                 other=0.0)
    if not TC:
        xs = xs.to(tl.float32)
    return dot_acc(intra, scores, xs, TC, 1, PRECISION)


@triton.jit
def _tile_kernel(
    buf_x_ptr, dts_ptr, buf_B_ptr, state_ptr, slots_ptr, pos_ptr, C_ptr, A_ptr, D_ptr, y_ptr, a_ptr, cb_ptr,
    sD_h, sD_p, sC_q,
    H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr, R: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    PRECISION: tl.constexpr, TC: tl.constexpr, PDL: tl.constexpr, RT_RANGE: tl.constexpr,
):
    """Program (q, h, p block): ``_tile_output_kernel`` on the row tile holding the token, its one live row.
    ``state_ptr``: the fp32 boundary state, or (TC "round") its bf16 copy, which the dot's rounding makes the
    same operand. (PDL) the inter-chunk dots read only the state and C, which the prep does not write, so they
    overlap the prep; ``gdc_wait`` precedes the reads of its outputs. The completion kernels wait for this one."""
    if PDL:
        gdc_launch_dependents()
    q = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = p < P
    g = h // (H // G)
    slot = tl.load(slots_ptr + q)
    r = tl.load(pos_ptr + q) % L
    sh = slot * H + h
    qa = (q * H + h) * L
    t0 = r - r % R
    t = t0 + tl.arange(0, R)
    live = t == r
    nn = tl.arange(0, BLOCK_N)
    cq = C_ptr + q * sC_q + g * N  # the token's C row (row stride: a view of the conv's output)

    inter = tl.zeros((R, BLOCK_P), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + nn
        nm = n < N
        Cn = tl.load(cq + n[None, :] + t[:, None] * 0, mask=live[:, None] & nm[None, :],
                     other=0.0).to(tl.float32)
        hT = tl.load(state_ptr + (sh * P + p[None, :]) * N + n[:, None], mask=nm[:, None] & pm[None, :], other=0.0)
        inter = dot_acc(inter, Cn, hT, TC, 2, PRECISION)

    if PDL:
        gdc_wait()
    _mirror_cumsum(dts_ptr, A_ptr, a_ptr, qa, qa, h, L, BLOCK_L)
    tl.debug_barrier()
    a_t = tl.load(a_ptr + qa + t)
    inter = inter * tl.exp(a_t)[:, None]

    intra = inter  # the intra-chunk dots accumulate onto the inter-chunk term, as in the prefill
    if RT_RANGE:  # compiled: a run-time range the compiler pipelines (the prefill tile's K blocks, in order)
        for k0 in tl.range(0, t0 + R, BLOCK_K):
            intra = _tile_intra_block(intra, k0, r, t, a_t, live, q, g, slot, sh, qa, p, pm, nn, buf_x_ptr, dts_ptr,
                                      buf_B_ptr, cq, a_ptr, cb_ptr, G, L, P, N, BLOCK_K, BLOCK_N, PRECISION, TC)
    else:  # the interpreter's form: a while loop (triton_chunk's docstring)
        k0 = 0
        while k0 < t0 + R:
            intra = _tile_intra_block(intra, k0, r, t, a_t, live, q, g, slot, sh, qa, p, pm, nn, buf_x_ptr, dts_ptr,
                                      buf_B_ptr, cq, a_ptr, cb_ptr, G, L, P, N, BLOCK_K, BLOCK_N, PRECISION, TC)
            k0 += BLOCK_K

    # the live row only: the tile's rows past the token are never stored (up to R - 1 rows of reads saved)
    x_t = tl.load(buf_x_ptr + (sh * L + t[:, None]) * P + p[None, :], mask=live[:, None] & pm[None, :],
                  other=0.0).to(tl.float32)
    d = tl.load(D_ptr + h * sD_h + p * sD_p, mask=pm, other=0.0).to(tl.float32)
    out = intra + d[None, :] * x_t
    tl.store(y_ptr + (q * H + h) * P + p[None, :] + t[:, None] * 0, out.to(y_ptr.dtype.element_ty),
             mask=live[:, None] & pm[None, :])


# -- launches 3 and 4: chunk completion ------------------------------------------------------


@triton.jit
def _completing(pos_ptr, seq_ptr, n, L: tl.constexpr, QB: tl.constexpr, LISTED: tl.constexpr):
    """Program block pid 1's QB entries i < n as int32 sequences (i, or seq[i] if LISTED), and which complete."""
    i = tl.program_id(1) * QB + tl.arange(0, QB)
    valid = i < n
    if LISTED:
        qi = tl.load(seq_ptr + i, mask=valid, other=0).to(tl.int32)
    else:
        qi = i
    r = tl.load(pos_ptr + qi, mask=valid, other=0) % L
    return qi, valid & (r == L - 1)


@triton.jit
def _next_completing(qi, done):
    """The smallest completing sequence left (int64) and the mask without it."""
    q = tl.min(tl.where(done, qi, 2147483647), axis=0)
    return q.to(tl.int64), done & (qi != q)


@triton.jit(do_not_specialize=["n"])  # n, the entries listed, changes from step to step
def _update_kernel(
    buf_x_ptr, dts_ptr, buf_B_ptr, state_ptr, copy_ptr, slots_ptr, pos_ptr, a_ptr, seq_ptr, n,
    H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    TC: tl.constexpr, LISTED: tl.constexpr, QB: tl.constexpr, PDL: tl.constexpr, COPY: tl.constexpr,
):
    """Program (h, j, block): for each completing sequence of entries j QB .. j QB + QB - 1, the boundary state
    block h = exp(a_L) h + sum_s exp(a_L - a_s) dt_s x_s B_s^T by ``_chunk_state_kernel``'s then
    ``_state_pass_kernel``'s arithmetic, and (COPY) its bf16 copy (``SSDState.ssm_state_bf16``). QB entries a
    program keep the grid small (a sequence completes one step in L); heads vary fastest, so a sequence's
    programs dispatch together. (PDL) waits for the tile kernel."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    qi, done = _completing(pos_ptr, seq_ptr, n, L, QB, LISTED)
    h = tl.program_id(0)
    NB: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pb = tl.program_id(2) // NB
    nb = tl.program_id(2) % NB
    g = h // (H // G)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n_ = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    pm = p < P
    nm = n_ < N
    while tl.max(done.to(tl.int32), axis=0) > 0:
        q, done = _next_completing(qi, done)
        slot = tl.load(slots_ptr + q)
        sh = slot * H + h
        qa = (q * H + h) * L
        a_last = tl.load(a_ptr + qa + L - 1)
        acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, L, BLOCK_K):
            s = k0 + tl.arange(0, BLOCK_K)
            sm = s < L
            a_s = tl.load(a_ptr + qa + s, mask=sm, other=0.0)
            dt_s = tl.load(dts_ptr + qa + s, mask=sm, other=0.0)
            w = tl.exp(a_last - a_s) * dt_s
            xT = tl.load(buf_x_ptr + (sh * L + s[None, :]) * P + p[:, None], mask=pm[:, None] & sm[None, :],
                         other=0.0).to(tl.float32)
            Bs = tl.load(buf_B_ptr + ((slot * G + g) * L + s[:, None]) * N + n_[None, :],
                         mask=sm[:, None] & nm[None, :], other=0.0).to(tl.float32)
            acc = dot_acc(acc, xT * w[None, :], Bs, TC, 1, PRECISION)
        m = pm[:, None] & nm[None, :]
        off = (sh * P + p[:, None]) * N + n_[None, :]
        hs = tl.load(state_ptr + off, mask=m, other=0.0)
        decay = tl.exp(a_last)
        # the select keeps the add out of the dot: with one K block Triton folds `d + dot(a, b, 0)` into
        # `dot(a, b, d)`, other bits than the prefill's stored chunk state added by its pass
        hs = decay * hs + tl.where(m, acc, 0.0)
        tl.store(state_ptr + off, hs, mask=m)
        if COPY:
            tl.store(copy_ptr + off, hs.to(tl.bfloat16), mask=m)


@triton.jit(do_not_specialize=["n"])  # n, the entries listed, changes from step to step
def _zero_kernel(
    buf_x_ptr, buf_dt_ptr, buf_B_ptr, slots_ptr, pos_ptr, seq_ptr, n,
    H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_L: tl.constexpr, ZB: tl.constexpr, LISTED: tl.constexpr, QB: tl.constexpr, PDL: tl.constexpr,
):
    """Program (h, j): for each completing sequence of entries j QB .. j QB + QB - 1, zero head h's x and dt
    buffer rows (group h's B rows for h < G). (PDL) waits for the update kernel."""
    if PDL:
        gdc_wait()
    qi, done = _completing(pos_ptr, seq_ptr, n, L, QB, LISTED)
    h = tl.program_id(0)
    while tl.max(done.to(tl.int32), axis=0) > 0:
        q, done = _next_completing(qi, done)
        slot = tl.load(slots_ptr + q)
        s = tl.arange(0, BLOCK_L)
        tl.store(buf_dt_ptr + (slot * H + h) * L + s, tl.zeros((BLOCK_L,), tl.float32).to(buf_dt_ptr.dtype.element_ty),
                 mask=s < L)
        i = tl.arange(0, ZB)
        xb = buf_x_ptr + (slot * H + h) * (L * P)
        for k0 in range(0, L * P, ZB):
            tl.store(xb + k0 + i, tl.zeros((ZB,), tl.float32).to(buf_x_ptr.dtype.element_ty), mask=k0 + i < L * P)
        if h < G:
            bb = buf_B_ptr + (slot * G + h) * (L * N)
            for k0 in range(0, L * N, ZB):
                tl.store(bb + k0 + i, tl.zeros((ZB,), tl.float32).to(buf_B_ptr.dtype.element_ty),
                         mask=k0 + i < L * N)


# -- the whole step in one launch ("step" mode, tensor-core dots) ----------------------------


@triton.jit
def _step_intra_block(intra, k0, r, t, a_t, live, bq, cq, sg, sh, p, pm, nn, x_tok, buf_x_ptr, buf_B_ptr,
                      dts, a_row, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, TC: tl.constexpr):
    """intra + K block k0 of the step kernel's output tile: ``_prep_kernel``'s C.B, then ``_tile_intra_block``."""
    R: tl.constexpr = t.shape[0]
    ks = k0 + tl.arange(0, BLOCK_K)
    ksm = ks < L
    cb = tl.zeros((R, BLOCK_K), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + nn
        nm = n < N
        Cn = tl.load(cq + n[None, :] + t[:, None] * 0, mask=live[:, None] & nm[None, :],
                     other=0.0).to(tl.float32)
        BT = tl.load(buf_B_ptr + (sg * L + ks[None, :]) * N + n[:, None], mask=nm[:, None] & (ks < r)[None, :],
                     other=0.0)
        Bnew = tl.load(bq + n, mask=nm, other=0.0)
        BT = tl.where((ks == r)[None, :], Bnew[:, None], BT).to(tl.float32)
        cb = dot_acc(cb, Cn, BT, TC, 0, PRECISION)
    a_s = tl.load(a_row + ks, mask=ksm, other=0.0)
    dt_s = tl.load(dts + ks, mask=ksm, other=0.0)
    decay = tl.where(ks[None, :] <= t[:, None], tl.exp(tl.minimum(a_t[:, None] - a_s[None, :], 0.0)), 0.0)
    scores = (cb * decay) * dt_s[None, :]
    xs = tl.load(buf_x_ptr + (sh * L + ks[:, None]) * P + p[None, :], mask=(ks < r)[:, None] & pm[None, :], other=0.0)
    xs = tl.where((ks == r)[:, None], x_tok[None, :], xs)
    if not TC:
        xs = xs.to(tl.float32)
    return dot_acc(intra, scores, xs, TC, 1, PRECISION)


@triton.jit
def _step_kernel(
    x_ptr, dt_ptr, B_ptr, C_ptr, dt_bias_ptr, A_ptr, D_ptr, slots_ptr, pos_ptr,
    buf_x_ptr, buf_dt_ptr, buf_B_ptr, state_ptr, copy_ptr, y_ptr, scr_ptr, cnt_ptr, lo, hi, sD_h, sD_p,
    sx_q, sdt_q, sB_q, sC_q,
    H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr, R: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_NS: tl.constexpr,
    BLOCK_L: tl.constexpr, PRECISION: tl.constexpr, TC: tl.constexpr, HAS_LIMIT: tl.constexpr,
    PB: tl.constexpr, ZB: tl.constexpr, RT_RANGE: tl.constexpr, COPY: tl.constexpr, READ_COPY: tl.constexpr,
):
    """Program (h, q, p block): the step's four launches in one, with the operations and order of ``_prep_kernel``
    (C.B per head here), ``_tile_kernel`` and, on a completion, ``_update_kernel`` (all of N) and ``_zero_kernel``.
    The token's x, raw dt and B come from the inputs, so no program reads what another writes, except the group's
    dt and B buffers on a completion: the last program of the group to read them empties them (counter ``cnt``,
    zero between launches). Scratch per program: the dt row and a (2 L fp32). Heads vary fastest over the grid:
    a sequence's programs, which read the same B rows, run together. (COPY) the boundary state's bf16 copy is
    written with it, and (READ_COPY) the inter-chunk dots read it, as ``_tile_kernel`` and ``_update_kernel``."""
    h = tl.program_id(0)
    q = tl.program_id(1).to(tl.int64)
    pb = tl.program_id(2)
    HG: tl.constexpr = H // G
    g = h // HG
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = p < P
    slot = tl.load(slots_ptr + q)
    r = tl.load(pos_ptr + q) % L
    sh = slot * H + h
    qh = q * H + h
    sg = slot * G + g
    qg = q * G + g
    bq = B_ptr + q * sB_q + g * N  # the token's B and C rows (row strides: views of the conv's output)
    cq = C_ptr + q * sC_q + g * N
    dts = scr_ptr + (qh * PB + pb) * (2 * L)
    a_row = dts + L
    t0 = r - r % R
    t = t0 + tl.arange(0, R)
    live = t == r
    nn = tl.arange(0, BLOCK_N)
    x_tok = tl.load(x_ptr + q * sx_q + h * P + p, mask=pm, other=0.0)

    # _tile_kernel's inter-chunk dots (the boundary state and C only)
    if READ_COPY:
        h_in = copy_ptr
    else:
        h_in = state_ptr
    inter = tl.zeros((R, BLOCK_P), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + nn
        nm = n < N
        Cn = tl.load(cq + n[None, :] + t[:, None] * 0, mask=live[:, None] & nm[None, :],
                     other=0.0).to(tl.float32)
        hT = tl.load(h_in + (sh * P + p[None, :]) * N + n[:, None], mask=nm[:, None] & pm[None, :], other=0.0)
        inter = dot_acc(inter, Cn, hT, TC, 2, PRECISION)

    # _prep_kernel's dt row: the buffered raw rows, the token's at r, zero past it
    s = tl.arange(0, BLOCK_L)
    raw = tl.load(dt_ptr + q * sdt_q + h)
    raws = tl.load(buf_dt_ptr + sh * L + s, mask=s < r, other=0.0)
    raws = tl.where(s == r, raw, raws)
    d = dt_softplus_exact(raws, tl.load(dt_bias_ptr + h), lo, hi, HAS_LIMIT)
    d = tl.where(s <= r, d, 0.0)
    tl.store(dts + s, d, mask=s < L)
    tl.debug_barrier()
    _mirror_cumsum(dts, A_ptr, a_row, 0, 0, h, L, BLOCK_L)
    tl.debug_barrier()
    a_t = tl.load(a_row + t)
    inter = inter * tl.exp(a_t)[:, None]

    intra = inter
    if RT_RANGE:  # compiled: a run-time range the compiler may pipeline (the same dots in order)
        for kr in tl.range(0, t0 + R, BLOCK_K):
            intra = _step_intra_block(intra, kr, r, t, a_t, live, bq, cq, sg, sh, p, pm, nn, x_tok, buf_x_ptr,
                                      buf_B_ptr, dts, a_row, L, P, N, BLOCK_K, BLOCK_N, PRECISION, TC)
    else:  # the interpreter: a while loop (triton_chunk's note on loops)
        k0 = 0
        while k0 < t0 + R:
            intra = _step_intra_block(intra, k0, r, t, a_t, live, bq, cq, sg, sh, p, pm, nn, x_tok, buf_x_ptr,
                                      buf_B_ptr, dts, a_row, L, P, N, BLOCK_K, BLOCK_N, PRECISION, TC)
            k0 += BLOCK_K

    x_t = x_tok.to(tl.float32)
    dd = tl.load(D_ptr + h * sD_h + p * sD_p, mask=pm, other=0.0).to(tl.float32)
    out = intra + dd[None, :] * x_t[None, :]
    tl.store(y_ptr + qh * P + p[None, :] + t[:, None] * 0, out.to(y_ptr.dtype.element_ty),
             mask=live[:, None] & pm[None, :])

    if r == L - 1:
        # _update_kernel for this head and P block: every row of the chunk, the last the token's
        a_last = tl.load(a_row + L - 1)
        ns = tl.arange(0, BLOCK_NS)
        nsm = ns < N
        Btok = tl.load(bq + ns, mask=nsm, other=0.0)
        acc = tl.zeros((BLOCK_P, BLOCK_NS), dtype=tl.float32)
        for k0 in range(0, L, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            ksm = ks < L
            a_s = tl.load(a_row + ks, mask=ksm, other=0.0)
            dt_s = tl.load(dts + ks, mask=ksm, other=0.0)
            w = tl.exp(a_last - a_s) * dt_s
            xT = tl.load(buf_x_ptr + (sh * L + ks[None, :]) * P + p[:, None], mask=pm[:, None] & (ks < r)[None, :],
                         other=0.0)
            xT = tl.where((ks == r)[None, :], x_tok[:, None], xT).to(tl.float32)
            Bs = tl.load(buf_B_ptr + (sg * L + ks[:, None]) * N + ns[None, :], mask=(ks < r)[:, None] & nsm[None, :],
                         other=0.0)
            Bs = tl.where((ks == r)[:, None], Btok[None, :], Bs).to(tl.float32)
            acc = dot_acc(acc, xT * w[None, :], Bs, TC, 1, PRECISION)
        m = pm[:, None] & nsm[None, :]
        off = (sh * P + p[:, None]) * N + ns[None, :]
        hs = tl.load(state_ptr + off, mask=m, other=0.0)
        decay_l = tl.exp(a_last)
        hs = decay_l * hs + tl.where(m, acc, 0.0)  # the select keeps the add out of the dot (_update_kernel)
        tl.store(state_ptr + off, hs, mask=m)
        if COPY:
            tl.store(copy_ptr + off, hs.to(tl.bfloat16), mask=m)
        # _zero_kernel: this P block's x rows are this program's alone, once all its threads read them
        tl.debug_barrier()
        i = tl.arange(0, ZB)
        zx = tl.zeros((ZB,), tl.float32).to(buf_x_ptr.dtype.element_ty)
        for k1 in range(0, L * BLOCK_P, ZB):
            e = k1 + i
            pe = pb * BLOCK_P + e % BLOCK_P
            tl.store(buf_x_ptr + (sh * L + e // BLOCK_P) * P + pe, zx, mask=(e < L * BLOCK_P) & (pe < P))
        # the group's dt and B rows, by the last of its HG x PB programs (acq_rel: the others' reads first)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + qg, 1, sem="acq_rel")
        if done == HG * PB - 1:
            zd = tl.zeros((ZB,), tl.float32).to(buf_dt_ptr.dtype.element_ty)
            for k1 in range(0, HG * L, ZB):
                e = k1 + i
                tl.store(buf_dt_ptr + (slot * H + g * HG) * L + e, zd, mask=e < HG * L)
            zb = tl.zeros((ZB,), tl.float32).to(buf_B_ptr.dtype.element_ty)
            for k1 in range(0, L * N, ZB):
                e = k1 + i
                tl.store(buf_B_ptr + sg * (L * N) + e, zb, mask=e < L * N)
            tl.atomic_xchg(cnt_ptr + qg, 0, sem="relaxed")
    else:
        # the token's rows into the buffers (the x row by each P block, dt by the head, B by the group)
        tl.store(buf_x_ptr + (sh * L + r) * P + p, x_tok, mask=pm)
        if pb == 0:
            tl.store(buf_dt_ptr + sh * L + r, raw)
            if h % HG == 0:
                ns = tl.arange(0, BLOCK_NS)
                nsm = ns < N
                tl.store(buf_B_ptr + (sg * L + r) * N + ns, tl.load(bq + ns, mask=nsm, other=0.0),
                         mask=nsm)


# -- host side -------------------------------------------------------------------------------


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [S, ...] as the decode kernels read it: any row stride, each row's elements packed (a model's column
    slices of the conv's or in_proj's output are read in place); anything else is copied."""
    packed = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != packed:
            return t.contiguous()
        packed *= size
    return t


def _as(t: torch.Tensor, dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if t.device == dev and t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(device=dev, dtype=dtype).contiguous()


def _row_layout(H: int, G: int, P: int) -> tuple[int, int]:
    """(heads, p values) per row-kernel program: 2 heads of a group with an even head count (128 rows at P = 64)."""
    rb_p = min(triton.next_power_of_2(P), 64)
    hpp = 2 if (H // G) % 2 == 0 and rb_p * 2 <= 128 else 1
    return hpp, rb_p


def decode_step_triton(
    state: SSDState,
    slots: torch.Tensor,
    pos: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    params: SSMParams,
    *,
    cfg: TritonKernelConfigs,
    row_tile: int | None = None,
    mode: str | None = None,
    completes: bool | torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step, S sequences of one new token each: y [S, H, P] with the bits of
    ``triton_chunk.replay_chunk_triton``'s rows, ``state`` updated in place as that call would; nothing is read
    back to the host (CUDA-graph capturable).

    state: contiguous, buffers in the model dtype, ssm_state fp32 (ssm_state_bf16, where kept, its rounding:
    read where the dots round the state, written with it). slots [S] int64 (distinct); pos [S] int64, the
    tokens each slot consumed before. x [S, H, P], dt [S, H] raw, B and C [S, G, N], model dtype, any row stride
    with a row's elements packed (else copied). row_tile: default ``DECODE_ROW_TILE``; any power of two >= 16
    dividing L gives the same bits. mode: "row" (fp32 default), "tile" (bf16 default) or "step" (bf16 on a GPU;
    default up to ``STEP_MAX_BATCH``). completes: an int64 tensor of the batch indices whose token completes
    its chunk, False for none, None or True to check the whole batch ("step" checks every entry itself);
    listing too many is harmless, too few is not.
    """
    A, D, dt_bias, dt_limit = params.A, params.D, params.dt_bias, params.dt_limit
    tc = tensor_core_dots(C.dtype, cfg.bf16_dots)
    if mode is None:
        mode = ("step" if slots.numel() <= STEP_MAX_BATCH else "tile") if tc else DEFAULT_MODE
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if tc and mode == "row":
        raise ValueError("row mode reproduces the fp32 (ieee) dots; a bf16 model's dots run on tensor cores: "
                         "use mode='tile'")
    if mode == "step" and not tc and not interpreting():
        # step mode compiles once, without contraction (the softplus needs it off); fp32 tile kernels contract
        raise ValueError("step mode runs bf16 models (tensor-core dots, no FMA contraction); an fp32 model's "
                         "kernels contract: use mode='row' or 'tile'")
    S = int(slots.numel())
    SS, H, L, P = state.buf_x.shape
    G, N = state.buf_B.shape[1], state.buf_B.shape[3]
    if x.shape != (S, H, P) or dt.shape != (S, H) or B.shape != (S, G, N) or C.shape != (S, G, N):
        raise ValueError(f"inputs do not match the state: x {tuple(x.shape)}, dt {tuple(dt.shape)}, "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)} for S={S}, H={H}, P={P}, G={G}, N={N}")
    R = min(DECODE_ROW_TILE, L) if row_tile is None else row_tile
    if R < 16 or R & (R - 1) or L % R or L & (L - 1):
        raise ValueError(f"row tile {R} must be a power of two >= 16 dividing chunk_size {L} (a power of two)")
    if H % G:
        raise ValueError(f"{H} heads do not split into {G} groups")
    if mode == "row" and N % 4:
        raise ValueError(f"row mode needs a state size divisible by 4, not {N}; use mode='tile'")
    for name in ("ssm_state", "buf_x", "buf_dt", "buf_B", "ssm_state_bf16"):
        t = getattr(state, name)
        if t is not None and not t.is_contiguous():
            raise ValueError(f"state.{name} must be contiguous")
    if state.ssm_state.dtype != torch.float32:
        raise ValueError(f"exact replay needs the fp32 boundary state, not {state.ssm_state.dtype}")
    if not state.buf_x.dtype == state.buf_dt.dtype == state.buf_B.dtype == x.dtype:
        raise ValueError(f"the buffers (x {state.buf_x.dtype}, dt {state.buf_dt.dtype}, B {state.buf_B.dtype}) "
                         f"and the inputs ({x.dtype}) must share the model dtype")
    dev = x.device
    y = torch.empty(S, H, P, dtype=x.dtype, device=dev)
    if S == 0:
        return y
    # the bf16 copy of the boundary state: written where the state is; read where the dots round the state to it
    copy = state.ssm_state_bf16
    keeps = copy is not None
    read_copy = keeps and tc == DOT_MODES["round"] and READ_STATE_COPY
    copy = copy if keeps else state.ssm_state  # (a pointer the kernels ignore without one)
    if mode == "step":
        return _step(state, slots, pos, x, dt, B, C, params, y, cfg, tc, R, copy, keeps, read_copy)
    slots_d = _as(slots, dev, torch.int64)
    pos_d = _as(pos, dev, torch.int64)
    x_c, dt_c, B_c, C_c = (_rows(t) for t in (x, dt, B, C))  # row-strided views are read in place
    strides = dict(sx_q=x_c.stride(0), sdt_q=dt_c.stride(0), sB_q=B_c.stride(0), sC_q=C_c.stride(0))
    Af = _as(A, dev, torch.float32)
    bias = dt_bias if dt_bias.is_contiguous() and dt_bias.device == dev else dt_bias.to(dev).contiguous()
    Dd = D if D.device == dev else D.to(dev)
    sD_h, sD_p = (Dd.stride(0), 0) if Dd.dim() == 1 else (Dd.stride(0), Dd.stride(1))
    lo, hi = limits(dt_limit)
    BLOCK_L = triton.next_power_of_2(L)
    row = mode == "row"
    with_cb = row or bool(tc)  # the prep kernel's C.B row
    # one scratch allocation, fp32: a [S, H, L], the chunk's softplus'd dt [S, H, L], cb [S, G, L]
    scratch = torch.empty(S * (2 * H + (G if with_cb else 0)) * L, dtype=torch.float32, device=dev)
    a_scr = scratch
    dt_scr = scratch[S * H * L:]
    cb_scr = scratch[2 * S * H * L:] if with_cb else scratch
    dims = dict(H=H, G=G, L=L, P=P, N=N)
    with_limit = has_limit(dt_limit)
    PB = triton.cdiv(P, cfg.block_p)

    KB = min(cfg.block_k, L)  # the tile kernel's K block: the prep's column block
    pdl = PDL and not row and pdl_supported(dev)
    launch = {"launch_pdl": True} if pdl else {}
    block_hg = triton.next_power_of_2(H // G)
    if PREP_HEADS is not None:
        if type(PREP_HEADS) is not int or PREP_HEADS < 1 or PREP_HEADS & (PREP_HEADS - 1):
            raise ValueError(f"triton_decode.PREP_HEADS {PREP_HEADS!r} refused: a power of two, or None")
        block_hg = min(PREP_HEADS, block_hg)
    _prep_kernel[(S, G * triton.cdiv(H // G, block_hg), L // KB)](
        x_c, dt_c, B_c, C_c, bias, slots_d, pos_d, state.buf_x, state.buf_dt, state.buf_B, dt_scr, cb_scr, lo,
        hi, **strides, **dims, BLOCK_HG=block_hg, BLOCK_PF=triton.next_power_of_2(P),
        BLOCK_NF=triton.next_power_of_2(N), KB=KB, HAS_LIMIT=with_limit, WITH_CB=with_cb, TC=tc, R=R,
        BLOCK_N=cfg.block_n, PDL=pdl, num_warps=4, enable_fp_fusion=False,
    )
    if row:
        hpp, rb_p = _row_layout(H, G, P)
        _row_kernel[(S, H // hpp, triton.cdiv(P, rb_p))](
            state.buf_x, dt_scr, state.ssm_state, slots_d, pos_d, C_c, Af, Dd, y, a_scr, cb_scr, sD_h, sD_p,
            C_c.stride(0), **dims, HPP=hpp, RB_P=rb_p, BLOCK_L=BLOCK_L, SB=16, num_warps=cfg.num_warps,
        )
    else:
        _tile_kernel[(S, H, PB)](
            state.buf_x, dt_scr, state.buf_B, copy if read_copy else state.ssm_state, slots_d, pos_d, C_c, Af, Dd,
            y, a_scr, cb_scr, sD_h, sD_p, C_c.stride(0), **dims, R=R, BLOCK_K=cfg.block_k, BLOCK_P=cfg.block_p,
            BLOCK_N=cfg.block_n, BLOCK_L=BLOCK_L, PRECISION=cfg.dot_precision, TC=tc, PDL=pdl,
            RT_RANGE=TILE_RT_RANGE and not interpreting(), num_warps=cfg.num_warps,
            enable_fp_fusion=not tc, **launch, **(TILE_OPTS if tc else {}),
        )
    listed = isinstance(completes, torch.Tensor)
    n_upd = int(completes.numel()) if listed else (0 if completes is False else S)
    QB = COMPLETION_BLOCK
    if n_upd:
        seq = _as(completes, dev, torch.int64) if listed else slots_d  # (unused unless listed)
        NBS = state_block_n(N)
        held = _COMPLETION_STREAM.get() if dev.type == "cuda" else None
        on = contextlib.nullcontext()
        if held is not None:
            side = held[0]
            # after the tile kernel, which reads the state and buffers these write; the tensors made here are
            # recorded on the side stream, so their memory is not reused before it is done with them
            side.wait_stream(torch.cuda.current_stream(dev))
            held[1] = True
            for t in (scratch, slots_d, pos_d) + ((seq,) if listed else ()):
                t.record_stream(side)
            on, pdl, launch = torch.cuda.stream(side), False, {}
        with on:
            _update_kernel[(H, triton.cdiv(n_upd, QB), PB * triton.cdiv(N, NBS))](
                state.buf_x, dt_scr, state.buf_B, state.ssm_state, copy, slots_d, pos_d, a_scr, seq, n_upd, **dims,
                BLOCK_K=cfg.block_k, BLOCK_P=cfg.block_p, BLOCK_N=NBS, PRECISION=cfg.dot_precision, TC=tc,
                LISTED=listed, QB=QB, PDL=pdl, COPY=keeps, num_warps=cfg.num_warps, enable_fp_fusion=not tc,
                **launch,
            )
            _zero_kernel[(H, triton.cdiv(n_upd, QB))](
                state.buf_x, state.buf_dt, state.buf_B, slots_d, pos_d, seq, n_upd, **dims, BLOCK_L=BLOCK_L,
                ZB=1024, LISTED=listed, QB=QB, PDL=pdl, num_warps=cfg.num_warps, **launch,
            )
    return y


def _step(state: SSDState, slots: torch.Tensor, pos: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
          B: torch.Tensor, C: torch.Tensor, params: SSMParams, y: torch.Tensor, cfg: TritonKernelConfigs, tc: int,
          R: int, copy: torch.Tensor, keeps: bool, read_copy: bool) -> torch.Tensor:
    """``decode_step_triton`` in one launch (``_step_kernel``); the arguments as checked and chosen there."""
    S = int(slots.numel())
    SS, H, L, P = state.buf_x.shape
    G, N = state.buf_B.shape[1], state.buf_B.shape[3]
    dev = x.device
    Dd = params.D if params.D.device == dev else params.D.to(dev)
    sD_h, sD_p = (Dd.stride(0), 0) if Dd.dim() == 1 else (Dd.stride(0), Dd.stride(1))
    bias = params.dt_bias
    bias = bias if bias.is_contiguous() and bias.device == dev else bias.to(dev).contiguous()
    lo, hi = limits(params.dt_limit)
    BP = cfg.block_p if STEP_BLOCK_P is None else STEP_BLOCK_P
    PB = triton.cdiv(P, BP)
    scratch = torch.empty(S * H * PB * 2 * L, dtype=torch.float32, device=dev)
    x, dt, B, C = (_rows(t) for t in (x, dt, B, C))  # row-strided views read in place (see _rows)
    _step_kernel[(H, S, PB)](
        x, dt, B, C, bias, _as(params.A, dev, torch.float32), Dd, _as(slots, dev, torch.int64),
        _as(pos, dev, torch.int64), state.buf_x, state.buf_dt, state.buf_B, state.ssm_state, copy, y, scratch,
        _counters(dev, S * G), lo, hi, sD_h, sD_p, x.stride(0), dt.stride(0), B.stride(0), C.stride(0),
        H=H, G=G, L=L, P=P, N=N, R=R,
        BLOCK_K=cfg.block_k, BLOCK_P=BP, BLOCK_N=cfg.block_n, BLOCK_NS=state_block_n(N),
        BLOCK_L=triton.next_power_of_2(L), PRECISION=cfg.dot_precision, TC=tc, HAS_LIMIT=has_limit(params.dt_limit),
        PB=PB, ZB=1024, RT_RANGE=STEP_RT_RANGE and not interpreting(), COPY=keeps, READ_COPY=read_copy,
        num_warps=cfg.num_warps,
        enable_fp_fusion=False, **(STEP_OPTS if tc else {}),
    )
    return y


def replay_decode_triton(
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
    """A decode step, one new token per slot of ``step`` (the replay forms' signature): y [S, H, P] in x's dtype,
    ``replay_chunk_triton``'s rows' bits; every row is computed, whatever ``rows`` says. Slots, positions and
    completing tokens go to the device in one copy per step (``StepPlan.ssd_decode_tables``)."""
    if not bool((step.lengths == 1).all()):
        raise ValueError("the decode kernels take one new token per sequence; use replay_chunk_triton")
    state.check_inputs(x, dt, B)
    L = state.chunk_size
    dev = x.device

    def tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | bool]:
        done = torch.nonzero(step.start_pos % L == L - 1).flatten()
        n = step.slots.numel()
        t = host_to_device(torch.cat([step.slots, step.start_pos, done]).numpy(), dev)  # one copy
        return t[:n], t[n:2 * n], t[2 * n:] if done.numel() else False

    plan = step.plans[dev]
    slots_d, pos_d, done_d = plan.once(plan.ssd_decode_tables, L, tables)
    return decode_step_triton(state, slots_d, pos_d, x, dt, B, C, params, cfg=cfg, completes=done_d)
