"""The chunked SSD scan, Triton backend: same inputs, outputs and invariant as ``chunk.scan_chunks``.

The math and the invariant are stated in ``chunk.py``'s docstring: every output row is a fixed
sequence of float32 operations on (its chunk's fp32 boundary state, its chunk's inputs up to it,
its position in the chunk). Here that is kept by construction:

- every program works on one zero-padded chunk (or one row tile of it) and one head, with tile
  shapes and loop bounds fixed by the pinned configs and the row's position, never by how many
  rows, tiles, chunks or sequences the call holds; there is no split-K, atomic or cross-program
  reduction;
- the within-chunk cumsum ``a`` is computed once per (chunk, head) by one kernel and read by the
  others, so every kernel sees the same bits of ``a`` (recomputing it per kernel could let the
  compiler contract ``dt * A`` into the scan's adds differently in each);
- states pass from chunk to chunk in float32, sequentially per sequence, by one kernel.

Kernels, in launch order (grids in brackets; PB/NB = number of BLOCK_P/BLOCK_N blocks of P/N):

1. ``_cumsum_kernel`` [NC, H]: a = cumsum(dt * A) over the chunk.
2. ``_chunk_state_kernel`` [chunks needed, H, PB * NB]: S = sum_s exp(a_L - a_s) dt_s x_s B_s^T.
3. ``_state_pass_kernel`` [S, H, PB * NB]: h_in[k] = h; h = exp(a_L) h + S_k, chunk after chunk
   (skipped when every sequence has one chunk and none completes: a decode step reads the state
   in place and writes none).
4. ``_tile_output_kernel`` [tiles holding wanted rows, H, PB]: y rows of one row tile.

Loops whose bound is read from memory are written as ``while`` loops: the Triton 3.6 interpreter
(with numpy >= 2.4) cannot use a run-time value as a ``range`` bound, and the CPU tests run the
kernels through it. A ``range`` would let the compiler pipeline the loads; the arithmetic order,
and so the bits, would be the same, but re-check on the GPU before switching.

Configs: BLOCK_P, BLOCK_N, BLOCK_K and num_warps come from ``PINNED["triton"]``; the row tile is an
argument, as for the torch scan (callers pass ``PINNED["triton"]["row_tile"]``). Every dot goes
through ``triton_dot.dot_acc``: fp32 FMA dots ("ieee") for fp32 models, tensor-core dots with bf16
operands (fp32 operands split in two) for bf16 models, chosen by C's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import PINNED
from .chunk import Chunks
from .triton_dot import dot_acc, tensor_core_dots

_CFG = PINNED["triton"]
BLOCK_P: int = _CFG["BLOCK_P"]
BLOCK_N: int = _CFG["BLOCK_N"]
BLOCK_K: int = _CFG["BLOCK_K"]
NUM_WARPS: int = _CFG["num_warps"]
# fp32 operands are multiplied in full IEEE fp32: Triton's default (tf32) keeps a 10-bit mantissa
# and would miss the fp32 accuracy target by orders of magnitude. Pinned (and fingerprinted) with
# the other configs: a different precision gives different bits.
DOT_PRECISION: str = _CFG["dot_precision"]


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
    x_ptr, dt_ptr, a_ptr, B_ptr, state_ptr, chunk_ptr,
    H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    TC: tl.constexpr,
):
    """state[c, h] = sum_s exp(a_L - a_s) dt_s x_s B_s^T for chunk c = chunk_ptr[pid 0], [P, N] fp32.

    x [NC, H, L, P], dt/a [NC, H, L], B [NC, G, L, N], state [NC, H, P, N]: fp32, contiguous.
    """
    c = tl.load(chunk_ptr + tl.program_id(0)).to(tl.int64)
    h = tl.program_id(1)
    NB: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pb = tl.program_id(2) // NB
    nb = tl.program_id(2) % NB
    g = h // (H // G)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    pm = p < P
    nm = n < N
    ch = c * H + h
    a_last = tl.load(a_ptr + ch * L + L - 1)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):  # L is constexpr: the same blocks for every chunk
        s = k0 + tl.arange(0, BLOCK_K)
        sm = s < L
        a_s = tl.load(a_ptr + ch * L + s, mask=sm, other=0.0)
        dt_s = tl.load(dt_ptr + ch * L + s, mask=sm, other=0.0)
        w = tl.exp(a_last - a_s) * dt_s  # a is non-increasing, so the exponent is <= 0
        xT = tl.load(x_ptr + (ch * L + s[None, :]) * P + p[:, None], mask=pm[:, None] & sm[None, :], other=0.0)
        Bs = tl.load(B_ptr + ((c * G + g) * L + s[:, None]) * N + n[None, :], mask=sm[:, None] & nm[None, :],
                     other=0.0)
        acc = dot_acc(acc, xT * w[None, :], Bs, TC, 1, PRECISION)
    tl.store(state_ptr + (ch * P + p[:, None]) * N + n[None, :], acc, mask=pm[:, None] & nm[None, :])


@triton.jit
def _state_pass_kernel(
    a_ptr, state_ptr, need_ptr, h0_ptr, h_in_ptr, h_out_ptr, first_ptr, count_ptr,
    H: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Walk sequence q's chunks in order: h_in[c] = h, then h = exp(a_L) h + state[c] if need[c].

    first/count [S] int64: q's chunks are first[q] .. first[q] + count[q] - 1. need [NC] int8.
    h0/h_out [S, H, P, N], h_in/state [NC, H, P, N]: fp32. Elementwise in (p, n), so the block
    split does not touch the bits.
    """
    q = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    NB: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    p = (tl.program_id(2) // NB) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = (tl.program_id(2) % NB) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (p < P)[:, None] & (n < N)[None, :]
    pn = p[:, None] * N + n[None, :]
    hs = tl.load(h0_ptr + (q * H + h) * P * N + pn, mask=m, other=0.0)
    c = tl.load(first_ptr + q)
    end = c + tl.load(count_ptr + q)
    while c < end:  # a while loop: see the note on loops in the module docstring
        off = (c * H + h) * P * N + pn
        tl.store(h_in_ptr + off, hs, mask=m)
        upd = tl.load(need_ptr + c) != 0
        decay = tl.exp(tl.load(a_ptr + (c * H + h) * L + L - 1))
        s_k = tl.load(state_ptr + off, mask=m & upd, other=0.0)  # not written for chunks not needed
        hs = tl.where(upd, decay * hs + s_k, hs)
        c += 1
    tl.store(h_out_ptr + (q * H + h) * P * N + pn, hs, mask=m)


@triton.jit
def _tile_output_kernel(
    x_ptr, dt_ptr, a_ptr, B_ptr, C_ptr, D_ptr, h_in_ptr, y_ptr, tile_chunk_ptr, tile_pos_ptr, tile_rows_ptr,
    H: tl.constexpr, G: tl.constexpr, L: tl.constexpr, P: tl.constexpr, N: tl.constexpr, R: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    TC: tl.constexpr,
):
    """y rows of one tile (R consecutive rows of one chunk), one head, one BLOCK_P block of P.

    y_t = exp(a_t) (C_t . h_in) + sum_{s<=t} (C_t . B_s) exp(a_t - a_s) dt_s x_s + D x_t.
    tile_chunk/tile_pos [NT]: the tile's chunk and first row's position; tile_rows [NT, R] int64:
    the packed row of each tile row, -1 where not wanted (its C is taken as zero, nothing stored).
    C [T, G, N], y [T, H, P], D [H, P], h_in [NC, H, P, N]; the rest as in _chunk_state_kernel.
    """
    tile = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
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

    # Inter-chunk term: C_t . h_in, then the decay from the boundary.
    inter = tl.zeros((R, BLOCK_P), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + nn
        nm = n < N
        Cn = tl.load(C_ptr + (rows[:, None] * G + g) * N + n[None, :], mask=live[:, None] & nm[None, :], other=0.0)
        hT = tl.load(h_in_ptr + (ch * P + p[None, :]) * N + n[:, None], mask=nm[:, None] & pm[None, :], other=0.0)
        inter = dot_acc(inter, Cn, hT, TC, 2, PRECISION)
    inter = inter * tl.exp(a_t)[:, None]

    # Intra-chunk term over the columns up to the tile's end. The bound depends on the tile's
    # position only, so a decode step runs exactly the blocks a prefill runs for this tile.
    intra = tl.zeros((R, BLOCK_P), dtype=tl.float32)
    k0 = 0
    while k0 < t0 + R:
        s = k0 + tl.arange(0, BLOCK_K)
        sm = s < L
        cb = tl.zeros((R, BLOCK_K), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            n = n0 + nn
            nm = n < N
            Cn = tl.load(C_ptr + (rows[:, None] * G + g) * N + n[None, :], mask=live[:, None] & nm[None, :],
                         other=0.0)
            BT = tl.load(B_ptr + ((c * G + g) * L + s[None, :]) * N + n[:, None], mask=nm[:, None] & sm[None, :],
                         other=0.0)
            cb = dot_acc(cb, Cn, BT, TC, 0, PRECISION)
        a_s = tl.load(a_ptr + ch * L + s, mask=sm, other=0.0)
        dt_s = tl.load(dt_ptr + ch * L + s, mask=sm, other=0.0)
        # exp(a_t - a_s) for s <= t only; the min keeps the (discarded) s > t entries finite.
        decay = tl.where(s[None, :] <= t[:, None], tl.exp(tl.minimum(a_t[:, None] - a_s[None, :], 0.0)), 0.0)
        scores = (cb * decay) * dt_s[None, :]
        xs = tl.load(x_ptr + (ch * L + s[:, None]) * P + p[None, :], mask=sm[:, None] & pm[None, :], other=0.0)
        intra = dot_acc(intra, scores, xs, TC, 1, PRECISION)
        k0 += BLOCK_K

    x_t = tl.load(x_ptr + (ch * L + t[:, None]) * P + p[None, :], mask=pm[None, :], other=0.0)
    d = tl.load(D_ptr + h * P + p, mask=pm, other=0.0)
    out = (inter + intra) + d[None, :] * x_t
    tl.store(y_ptr + (rows[:, None] * H + h) * P + p[None, :], out, mask=live[:, None] & pm[None, :])


def scan_chunks_triton(
    ch: Chunks,
    C: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    initial_states: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    final: str = "boundary",
    row_tile: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scan proper on Triton; a drop-in for ``chunk.scan_chunks`` (same bits rule, own bits).

    ch: ``pack_chunks`` output (x [NC, H, L, P], dt [NC, H, L] softplus'd, B [NC, G, L, N] fp32).
    C [T, G, N] for the packed new rows, in the model dtype (bf16 selects the tensor-core dots, so
    ch.x and ch.B must hold bf16 values too); A [H] fp32; D [H] or [H, P]; initial_states [S, H, P, N]
    fp32; rows [T] bool, the rows whose outputs are wanted (default all); row_tile a power of two
    >= 16 dividing L.

    Returns y [T, H, P] float32 (zero in rows not wanted), states [S, H, P, N] float32 (at each
    sequence's last full-chunk boundary for final="boundary", at its end for "end") and moved [S]
    bool (whether a sequence's state changed; where not, states holds the initial one's bits, and
    may be ``initial_states`` itself when no sequence moved).
    """
    if final not in ("boundary", "end"):
        raise ValueError(f"final must be 'boundary' or 'end', not {final!r}")
    NC, H, L, P = ch.x.shape
    G, N = ch.B.shape[1], ch.B.shape[3]
    R = row_tile
    if R < 16 or R & (R - 1) or L % R:
        raise ValueError(f"row tile {R} must be a power of two >= 16 that divides chunk_size {L}")
    if H % G:
        raise ValueError(f"{H} heads do not split into {G} groups")
    dev = ch.x.device
    f32 = torch.float32
    tc = tensor_core_dots(C.dtype)  # x, B, C of a bf16 model are exact in bf16 (pack_chunks widens them)
    fuse = not tc  # tensor-core mode: no fp contraction anywhere (see triton_dot), in every kernel
    T, S = C.shape[0], initial_states.shape[0]
    x, dt, Bc = (t.to(f32).contiguous() for t in (ch.x, ch.dt, ch.B))
    Cf = C.to(device=dev, dtype=f32).contiguous()
    Af = A.to(device=dev, dtype=f32).contiguous()
    Df = D.to(device=dev, dtype=f32)
    Df = (Df[:, None].expand(H, P) if Df.dim() == 1 else Df).contiguous()
    h0 = initial_states.to(device=dev, dtype=f32).contiguous()
    y = torch.zeros(T, H, P, device=dev, dtype=f32)
    moved = torch.zeros(S, dtype=torch.bool, device=dev)
    if NC == 0:
        return y, h0.clone(), moved
    PB, NB = triton.cdiv(P, BLOCK_P), triton.cdiv(N, BLOCK_N)
    dims = dict(H=H, L=L, P=P, N=N)

    a = torch.empty(NC, H, L, device=dev, dtype=f32)
    _cumsum_kernel[(NC, H)](dt, Af, a, H=H, L=L, BLOCK_L=triton.next_power_of_2(L), num_warps=NUM_WARPS,
                            enable_fp_fusion=fuse)

    need = ch.length == L if final == "boundary" else torch.ones(NC, dtype=torch.bool, device=dev)
    si = torch.nonzero(need).flatten()
    moved[ch.seq.to(dev)[si]] = True
    chunk_state = torch.empty(NC, H, P, N, device=dev, dtype=f32)  # rows of chunks not needed stay unset
    if si.numel():
        _chunk_state_kernel[(si.numel(), H, PB * NB)](
            x, dt, a, Bc, chunk_state, si, G=G, **dims, BLOCK_K=BLOCK_K, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N,
            PRECISION=DOT_PRECISION, TC=tc, num_warps=NUM_WARPS, enable_fp_fusion=fuse,
        )

    # With one chunk per sequence (a decode step, a short prefill) chunk i belongs to sequence i
    # and its boundary state is the initial one: read it in place, and write states only if a
    # chunk completed (a decode step then only reads the state, as the torch scan does).
    one_each = NC == S
    h_in, h_out = h0, h0
    if not one_each or si.numel():
        count = torch.bincount(ch.seq.to(dev), minlength=S)
        first = torch.cumsum(count, 0) - count
        h_pass = torch.empty(NC, H, P, N, device=dev, dtype=f32)
        h_out = torch.empty(S, H, P, N, device=dev, dtype=f32)
        _state_pass_kernel[(S, H, PB * NB)](
            a, chunk_state, need.to(torch.int8), h0, h_pass, h_out, first, count, **dims,
            BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS, enable_fp_fusion=fuse,
        )
        h_in = h0 if one_each else h_pass

    # The tiles holding wanted rows, and for each tile row its packed row (or -1).
    want = torch.ones(T, dtype=torch.bool, device=dev) if rows is None else rows.to(device=dev, dtype=torch.bool)
    wi = torch.nonzero(want).flatten()
    if wi.numel() == 0:
        return y, h_out, moved
    rc, rp = ch.row_chunk.to(dev)[wi], ch.row_pos.to(dev)[wi]
    tile_id = torch.full((NC, L // R), -1, dtype=torch.int64, device=dev)
    tile_id[rc, rp // R] = 0
    tiles = torch.nonzero(tile_id >= 0)  # [NT, 2]: (chunk, tile in chunk)
    NT = tiles.shape[0]
    tile_id[tiles[:, 0], tiles[:, 1]] = torch.arange(NT, device=dev)
    tile_rows = torch.full((NT, R), -1, dtype=torch.int64, device=dev)
    tile_rows[tile_id[rc, rp // R], rp % R] = wi
    tile_chunk = tiles[:, 0].contiguous()
    tile_pos = (tiles[:, 1] * R).to(torch.int32).contiguous()
    _tile_output_kernel[(NT, H, PB)](
        x, dt, a, Bc, Cf, Df, h_in, y, tile_chunk, tile_pos, tile_rows, G=G, **dims, R=R,
        BLOCK_K=BLOCK_K, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N, PRECISION=DOT_PRECISION, TC=tc, num_warps=NUM_WARPS,
        enable_fp_fusion=fuse,
    )
    return y, h_out, moved
