"""The backward of ``triton.attention_triton`` (packed causal GQA, the package's shapes), its Function.

With s = q.k * scale, P = softmax(s), o = P v: dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * o)),
dQ = scale dS K, dK = scale dS^T Q; P is recomputed from the forward's saved lse (in its exp2 units),
so nothing of size Tq x Tk is stored. No atomics, so two backwards give the same bits: dK, dV by one
program per (key block, KV head) walking the query rows that see the block in ascending order (the
group's query heads rows of the same dots); dQ by one per (query tile, KV head) walking key blocks from
0. bf16 models round P and dS to bf16 for the dots (as flash attention), fp32 models use IEEE precision.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl

from ..configs import TritonKernelConfigs
from .triton import LOG2E, rep_pad


@triton.jit
def _dkdv_step(dk, dv, k, v, kp, t, q_ptr, do_ptr, lse_ptr, delta_ptr, qrow, nq, qpos0, tt, hh, head, d,
               sq_t, sq_h, sl_t, qk_scale, REP: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr):
    """TOK query tokens from t against one key block: dK, dV += (module docstring). Without MASK every
    token sees the whole block; rows past the sequence or the group load zeros and add exact zeros."""
    tok = t + tt
    valid = (tok < nq) & (hh < REP)
    qr = (qrow + tok).to(tl.int64)
    qo = qr[:, None] * sq_t + head[:, None] * sq_h + d[None, :]
    q = tl.load(q_ptr + qo, mask=valid[:, None], other=0.0)
    do = tl.load(do_ptr + qo, mask=valid[:, None], other=0.0)
    lse = tl.load(lse_ptr + qr * sl_t + head, mask=valid, other=0.0)
    delta = tl.load(delta_ptr + qr * sl_t + head, mask=valid, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.math.exp2(s - lse[:, None])
    if MASK:
        p = tl.where(valid[:, None] & (kp[None, :] <= (qpos0 + tok)[:, None]), p, 0.0)
    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dq_step(dq, q, do, lse, delta, j, last, pos, valid, k_ptr, v_ptr, krow, g, d, sk_t, sk_g, qk_scale,
             BLOCK_N: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr):
    """One key block j against a query tile: dQ += dS K (scaled by the caller). Without MASK every row
    sees the whole block (padding rows have dO = 0, so dS = 0)."""
    kp = j * BLOCK_N + tl.arange(0, BLOCK_N)
    krows = (krow + kp).to(tl.int64) * sk_t + g * sk_g
    if MASK:
        kin = kp <= last
        k = tl.load(k_ptr + krows[:, None] + d[None, :], mask=kin[:, None], other=0.0)
        v = tl.load(v_ptr + krows[:, None] + d[None, :], mask=kin[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + krows[:, None] + d[None, :])
        v = tl.load(v_ptr + krows[:, None] + d[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.math.exp2(s - lse[:, None])
    if MASK:
        p = tl.where(valid[:, None] & (kp[None, :] <= pos[:, None]), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    # Per-program tables [NB] int64: key block, its sequence's first key row, keys, first query row, queries
    blk_ptr, krow_ptr, nk_ptr, qrow_ptr, nq_ptr,
    # Strides (elements); q, dO share theirs, k, v, dk, dv theirs, lse and delta [Tq, H] theirs
    sq_t, sq_h, sk_t, sk_g, sl_t,
    qk_scale, scale,
    REP: tl.constexpr, REP_P: tl.constexpr, TOK: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    BLOCK_M: tl.constexpr = TOK * REP_P
    j = tl.load(blk_ptr + pid)
    krow = tl.load(krow_ptr + pid)
    nk = tl.load(nk_ptr + pid)
    qrow = tl.load(qrow_ptr + pid)
    nq = tl.load(nq_ptr + pid)
    qpos0 = nk - nq  # the first query's position
    d = tl.arange(0, D)
    kp = j * BLOCK_N + tl.arange(0, BLOCK_N)
    kin = kp < nk
    krows = (krow + kp).to(tl.int64) * sk_t + g * sk_g
    k = tl.load(k_ptr + krows[:, None] + d[None, :], mask=kin[:, None], other=0.0)
    v = tl.load(v_ptr + krows[:, None] + d[None, :], mask=kin[:, None], other=0.0)
    r = tl.arange(0, BLOCK_M)
    tt = r // REP_P
    hh = r % REP_P
    head = g * REP + hh
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    # rows before the block's first key see none of it; from step t1 on, every token sees all of it (no mask)
    t0 = tl.maximum(j * BLOCK_N - qpos0, 0)
    t1 = t0 + tl.cdiv(tl.maximum(j * BLOCK_N + BLOCK_N - 1 - qpos0 - t0, 0), TOK) * TOK
    for t in range(t0, tl.minimum(t1, nq), TOK):
        dk, dv = _dkdv_step(dk, dv, k, v, kp, t, q_ptr, do_ptr, lse_ptr, delta_ptr, qrow, nq, qpos0, tt, hh, head, d,
                            sq_t, sq_h, sl_t, qk_scale, REP, True, PRECISION)
    for t in range(t1, nq, TOK):
        dk, dv = _dkdv_step(dk, dv, k, v, kp, t, q_ptr, do_ptr, lse_ptr, delta_ptr, qrow, nq, qpos0, tt, hh, head, d,
                            sq_t, sq_h, sl_t, qk_scale, REP, False, PRECISION)
    tl.store(dk_ptr + krows[:, None] + d[None, :], (dk * scale).to(dk_ptr.dtype.element_ty), mask=kin[:, None])
    tl.store(dv_ptr + krows[:, None] + d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=kin[:, None])


@triton.jit
def _dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    # Per-tile tables [NT] int64: first query row, tokens, first position, the sequence's first key row
    row0_ptr, ntok_ptr, pos0_ptr, krow_ptr,
    # Strides (elements), as _dkdv_kernel's
    sq_t, sq_h, sk_t, sk_g, sl_t,
    qk_scale, scale,
    REP: tl.constexpr, REP_P: tl.constexpr, TOK: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
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
    krow = tl.load(krow_ptr + tile)
    valid = (tt < ntok) & (hh < REP)
    pos = pos0 + tt
    head = g * REP + hh
    d = tl.arange(0, D)
    qr = (row0 + tt).to(tl.int64)
    qo = qr[:, None] * sq_t + head[:, None] * sq_h + d[None, :]
    q = tl.load(q_ptr + qo, mask=valid[:, None], other=0.0)
    do = tl.load(do_ptr + qo, mask=valid[:, None], other=0.0)
    lse = tl.load(lse_ptr + qr * sl_t + head, mask=valid, other=0.0)
    delta = tl.load(delta_ptr + qr * sl_t + head, mask=valid, other=0.0)
    last = pos0 + ntok - 1
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    # blocks wholly at or before the first row's position are seen whole by every row: no mask
    full = (pos0 + 1) // BLOCK_N
    for j in range(0, full):
        dq = _dq_step(dq, q, do, lse, delta, j, last, pos, valid, k_ptr, v_ptr, krow, g, d, sk_t, sk_g, qk_scale,
                      BLOCK_N, False, PRECISION)
    for j in range(full, last // BLOCK_N + 1):
        dq = _dq_step(dq, q, do, lse, delta, j, last, pos, valid, k_ptr, v_ptr, krow, g, d, sk_t, sk_g, qk_scale,
                      BLOCK_N, True, PRECISION)
    tl.store(dq_ptr + qo, (dq * scale).to(dq_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _delta_kernel(o_ptr, do_ptr, delta_ptr, R, D: tl.constexpr, BLOCK_R: tl.constexpr):
    """delta[r] = sum_d o[r, d] dO[r, d] in fp32 for BLOCK_R of the R = Tq * H rows (o, dO contiguous)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    inside = r < R
    offs = r[:, None] * D + d[None, :]
    o = tl.load(o_ptr + offs, mask=inside[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offs, mask=inside[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + r, tl.sum(o * do, 1), mask=inside)


def _delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """[Tq, H] fp32 rowsums of o * dO ([Tq, H, D] each), in one pass with one fixed reduction per row."""
    Tq, H, D = o.shape
    o = o.contiguous()
    delta = torch.empty(Tq, H, dtype=torch.float32, device=o.device)
    if delta.numel():
        block = max(1, 8192 // D)
        _delta_kernel[(triton.cdiv(Tq * H, block),)](o, do, delta, Tq * H, D=D, BLOCK_R=block, num_warps=4)
    return delta


def _tables(cq: np.ndarray, ck: np.ndarray, rep: int, cfg: TritonKernelConfigs,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The two launches' tables from the host offsets: ([5, NB] dk/dv rows, [4, NT] dq rows, the
    tokens per step of each). Heaviest programs first (bits do not depend on the order; the grid's tail does)."""
    nq, nk = np.diff(cq), np.diff(ck)
    tok_kv = cfg.attn_bwd_kv_block_m // rep_pad(rep)
    tok_q = cfg.attn_bwd_q_block_m // rep_pad(rep)
    if tok_kv < 1 or tok_q < 1:
        raise ValueError(f"{rep} query heads per key/value head exceed the attention backward's tiles (attn_bwd_"
                         f"kv_block_m {cfg.attn_bwd_kv_block_m}, attn_bwd_q_block_m {cfg.attn_bwd_q_block_m})")
    bn = cfg.attn_bwd_kv_block_n
    nb = (nk + bn - 1) // bn
    seq = np.repeat(np.arange(nk.size), nb)
    j = np.arange(int(nb.sum())) - np.repeat(np.cumsum(nb) - nb, nb)
    work = nq[seq] - np.maximum(j * bn - (nk - nq)[seq], 0)
    o = np.argsort(-work, kind="stable")
    kv = np.stack([j[o], ck[:-1][seq][o], nk[seq][o], cq[:-1][seq][o], nq[seq][o]])
    nt = (nq + tok_q - 1) // tok_q
    seq = np.repeat(np.arange(nq.size), nt)
    i = np.arange(int(nt.sum())) - np.repeat(np.cumsum(nt) - nt, nt)
    pos0 = (nk - nq)[seq] + i * tok_q
    ntok = np.minimum(tok_q, nq[seq] - i * tok_q)
    o = np.argsort(-(pos0 + ntok), kind="stable")
    qt = np.stack([(cq[:-1][seq] + i * tok_q)[o], ntok[o], pos0[o], ck[:-1][seq][o]])
    both = torch.from_numpy(np.concatenate([kv.ravel(), qt.ravel()]).astype(np.int64)).to(device)  # one copy
    return both[:kv.size].view(kv.shape), both[kv.size:].view(qt.shape), tok_kv, tok_q


def attention_backward_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                              do: torch.Tensor, cu_seqlens_q: torch.Tensor | np.ndarray,
                              cu_seqlens_k: torch.Tensor | np.ndarray, *, scale: float,
                              cfg: TritonKernelConfigs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq [Tq, H, D], dk, dv [Tk, G, D] (q's and k's dtypes) of packed causal GQA attention: q, o, do
    [Tq, H, D], k, v [Tk, G, D], lse [Tq, H] fp32 (the forward's), cu_seqlens [S+1] host ints.
    Keys that no query sees get zeros."""
    Tq, H, D = q.shape
    G = k.shape[1]
    rep = H // G
    cq = np.asarray(torch.as_tensor(cu_seqlens_q).cpu(), dtype=np.int64)
    ck = np.asarray(torch.as_tensor(cu_seqlens_k).cpu(), dtype=np.int64)
    q, k, v, do = (x.contiguous() for x in (q, k, v, do))
    delta = _delta(o, do)  # the rows' dO . o in fp32
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if Tq == 0 or k.shape[0] == 0:
        return dq.zero_(), dk, dv
    kv, qt, tok_kv, tok_q = _tables(cq, ck, rep, cfg, q.device)
    lse = lse.contiguous()
    args = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0), scale * LOG2E, scale)
    opts = dict(num_warps=cfg.attn_bwd_warps, num_stages=cfg.attn_bwd_stages)
    if kv.shape[1]:
        _dkdv_kernel[(kv.shape[1], G)](q, k, v, do, lse, delta, dk, dv, *kv, *args, REP=rep, REP_P=rep_pad(rep),
                                       TOK=tok_kv, D=D, BLOCK_N=cfg.attn_bwd_kv_block_n, PRECISION="ieee", **opts)
    if qt.shape[1]:
        _dq_kernel[(qt.shape[1], G)](q, k, v, do, lse, delta, dq, *qt, *args, REP=rep, REP_P=rep_pad(rep),
                                     TOK=tok_q, D=D, BLOCK_N=cfg.attn_bwd_q_block_n, PRECISION="ieee", **opts)
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                run: Callable[[torch.Tensor], torch.Tensor], consts: tuple) -> torch.Tensor:
        # run(lse) is the sampler's launch (it may write k, v into a cache first) with the lse saved
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        out = run(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.consts = consts
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        cu_q, cu_k, scale, cfg = ctx.consts
        dq, dk, dv = attention_backward_triton(q, k, v, out, lse, g, cu_q, cu_k, scale=scale, cfg=cfg)
        nq, nk, nv = ctx.needs_input_grad[:3]
        return dq if nq else None, dk if nk else None, dv if nv else None, None, None


def attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, *, scale: float, cfg: TritonKernelConfigs) -> torch.Tensor:
    """``triton.attention_triton_packed`` (q [Tq, H, D], k, v [Tk, G, D] -> [Tq, H, D]) with the
    gradient of q, k and v (``attention_backward_triton``)."""
    from .triton import attention_triton_packed

    return _Attention.apply(q, k, v, lambda lse: attention_triton_packed(
        q.detach(), k.detach(), v.detach(), cu_seqlens_q, cu_seqlens_k, scale=scale, cfg=cfg, lse=lse),
        (cu_seqlens_q, cu_seqlens_k, scale, cfg))


def attention_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables, cu_seqlens: torch.Tensor, *, scale: float, cfg: TritonKernelConfigs) -> torch.Tensor:
    """The triton backend's cached step with gradients, for a pass from empty (every start_pos 0):
    writes k, v [T, G, D] at ``tables`` (``triton.StepTables``), attends q [T, H, D] with the sampler's
    launch, and differentiates as packed attention over cu_seqlens [S+1] (host)."""
    from .triton import attention_triton

    def run(lse: torch.Tensor) -> torch.Tensor:
        k_cache[tables.write_slot, tables.write_pos] = k.detach()
        v_cache[tables.write_slot, tables.write_pos] = v.detach()
        return attention_triton(q.detach(), k_cache, v_cache, tables.tiles, scale=scale, cfg=cfg, lse=lse)

    return _Attention.apply(q, k, v, run, (cu_seqlens, cu_seqlens, scale, cfg))


__all__ = ["attention_backward_triton", "attention_cached", "attention_packed"]
