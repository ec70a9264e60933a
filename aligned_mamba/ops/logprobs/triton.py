"""Row-wise log_softmax and token logprobs in Triton (the GPU form of ``ops.logprobs``), and their vocab-sharded form.

A row's vocabulary is cut into VOCAB_SLICES contiguous slices of ceil(V / VOCAB_SLICES) rounded up to a multiple of
16 logits (every slice's loads stay 16-byte vectors), the last short or empty. A program walks each slice in
ascending ``logprobs_block_v`` blocks (a running max and rescaled sum), then joins the slices (``_join``): the max
of their maxes, each sum rescaled to it, the sums added by adjacent pairs, one log; exp and log from ``triton_math``
(no fp contraction). A row's bits depend on the row alone, though not the torch form's (another order). A shard of
k contiguous slices is a subtree of that join, so the sharded form (each rank's slices' (max, sum), all-gathered,
joined by the same function) gives the unsharded bits. A token's logprob is its ``log_softmax_triton`` entry, bit
for bit; a row with +inf gives NaN. Why: docs/design.md, "How the bits are kept", Logprobs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..autograd import grad_needed, wanted
from ..configs import TritonKernelConfigs
from ..triton_math import exp_exact, log_exact
from . import sliced
from .sliced import VOCAB_SLICES


@triton.jit
def _slice_stats(x_row, start, end, BLOCK_V: tl.constexpr):
    """(max, sum of exp(x - max)) of the logits x_row[start:end] (any float dtype), fp32; (-inf, 0) if empty."""
    m = -float("inf")
    s = 0.0
    for v0 in range(start, end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(x_row + cols, mask=cols < end, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # no inf - inf while the slice is all -inf
        s = s * exp_exact(m - m_safe) + tl.sum(exp_exact(x - m_safe), axis=0)
        m = m_new
    return m, s


@triton.jit
def _row_stats(x_row, V, C, SLICES: tl.constexpr, BLOCK_V: tl.constexpr):
    """The (max, sum) of each of the row's SLICES slices of C logits (the last short or empty): two [SLICES]."""
    idx = tl.arange(0, SLICES)
    ms = tl.full([SLICES], -float("inf"), tl.float32)
    ss = tl.zeros([SLICES], tl.float32)
    for i in range(SLICES):
        m, s = _slice_stats(x_row, i * C, tl.minimum((i + 1) * C, V), BLOCK_V)
        ms = tl.where(idx == i, m, ms)
        ss = tl.where(idx == i, s, ss)
    return ms, ss


@triton.jit
def _join(ms, ss, SLICES: tl.constexpr, LEVELS: tl.constexpr):
    """log(sum(exp(x))) of a row from its slices' (max, sum), two [SLICES] fp32: the max of the maxes (exact in any
    order), each sum rescaled to it, the sums added by adjacent pairs (an aligned run of slices is a subtree)."""
    m = tl.max(ms, axis=0)
    m_safe = tl.where(m == -float("inf"), 0.0, m)  # an all -inf row: every sum 0, lse = -inf as the torch op's
    t = ss * exp_exact(ms - m_safe)
    for level in tl.static_range(LEVELS):  # SLICES = 2^LEVELS
        lo, hi = tl.split(tl.reshape(t, (SLICES >> (level + 1), 2)))
        t = lo + hi
    return m_safe + log_exact(tl.sum(t, axis=0))


@triton.jit
def _row_lse(x_row, V, C, SLICES: tl.constexpr, LEVELS: tl.constexpr, BLOCK_V: tl.constexpr):
    """log(sum(exp(x))) of one row of V logits at ``x_row``, fp32."""
    ms, ss = _row_stats(x_row, V, C, SLICES, BLOCK_V)
    return _join(ms, ss, SLICES, LEVELS)


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, V, C, stride_x, stride_out, SLICES: tl.constexpr, LEVELS: tl.constexpr,
                        BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = _row_lse(x_ptr + row * stride_x, V, C, SLICES, LEVELS, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, x - lse, mask=mask)


@triton.jit
def _token_logprobs_kernel(x_ptr, tok_ptr, out_ptr, lse_ptr, V, C, stride_x, SLICES: tl.constexpr,
                           LEVELS: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = _row_lse(x_ptr + row * stride_x, V, C, SLICES, LEVELS, BLOCK_V)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + tok).to(tl.float32)
    tl.store(out_ptr + row, x - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _slice_kernel(x_ptr, stats_ptr, V, C, stride_x, SLICES: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (row, i) writes slice i's max and sum to stats[row, :, i] (the split grid's first launch, and a
    shard's stats)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    m, s = _slice_stats(x_ptr + row * stride_x, i * C, tl.minimum((i + 1) * C, V), BLOCK_V)
    tl.store(stats_ptr + row * 2 * SLICES + i, m)
    tl.store(stats_ptr + row * 2 * SLICES + SLICES + i, s)


@triton.jit
def _stats_lse(stats_ptr, row, SLICES: tl.constexpr, LEVELS: tl.constexpr):
    """``_join`` of a row's stats [2, SLICES] at ``stats_ptr``."""
    idx = tl.arange(0, SLICES)
    ms = tl.load(stats_ptr + row * 2 * SLICES + idx)
    ss = tl.load(stats_ptr + row * 2 * SLICES + SLICES + idx)
    return _join(ms, ss, SLICES, LEVELS)


@triton.jit
def _write_kernel(x_ptr, stats_ptr, out_ptr, V, stride_x, stride_out, SLICES: tl.constexpr, LEVELS: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    """The split log-softmax's second launch: program (row, b) joins the row's stats (each program alike) and
    writes block b of x - lse."""
    row = tl.program_id(0).to(tl.int64)
    lse = _stats_lse(stats_ptr, row, SLICES, LEVELS)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, x - lse, mask=mask)


@triton.jit
def _join_token_kernel(x_ptr, stats_ptr, tok_ptr, out_ptr, lse_ptr, stride_x, SLICES: tl.constexpr,
                       LEVELS: tl.constexpr):
    """The split token logprob's second launch: a row's lse from its stats, its token's entry x - lse."""
    row = tl.program_id(0).to(tl.int64)
    lse = _stats_lse(stats_ptr, row, SLICES, LEVELS)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + tok).to(tl.float32)
    tl.store(out_ptr + row, x - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _join_kernel(stats_ptr, lse_ptr, SLICES: tl.constexpr, LEVELS: tl.constexpr):
    """A row's lse from every shard's slices, stats [M, 2, SLICES] in vocabulary order."""
    row = tl.program_id(0).to(tl.int64)
    tl.store(lse_ptr + row, _stats_lse(stats_ptr, row, SLICES, LEVELS))


@triton.jit
def _log_softmax_bwd_kernel(out_ptr, g_ptr, dx_ptr, V, stride_out, stride_g, stride_gv, stride_dx,
                            BLOCK_V: tl.constexpr):
    """Row r of dx = g - exp(out) * sum(g) in fp32 (the sum over the row's blocks in order), rounded to dx's dtype;
    g read at its strides (a broadcast g, from ``logprobs.sum()``, where it lies)."""
    row = tl.program_id(0).to(tl.int64)
    s = 0.0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        s += tl.sum(tl.load(g_ptr + row * stride_g + cols * stride_gv, mask=cols < V, other=0.0).to(tl.float32),
                    axis=0)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        g = tl.load(g_ptr + row * stride_g + cols * stride_gv, mask=mask, other=0.0).to(tl.float32)
        o = tl.load(out_ptr + row * stride_out + cols, mask=mask, other=0.0)
        tl.store(dx_ptr + row * stride_dx + cols, (g - tl.exp(o) * s).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _token_logprobs_bwd_kernel(x_ptr, tok_ptr, lse_ptr, g_ptr, dx_ptr, V, stride_x, stride_dx, BLOCK_V: tl.constexpr):
    """Row r of the token logprob's gradient: dx = onehot(tok) g - exp(x - lse) g, the log-softmax backward's
    bits for a gradient that is g at tok and zero elsewhere (its row sum is g), rounded to dx's dtype."""
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    s = tl.load(g_ptr + row).to(tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        o = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32) - lse
        g = tl.where(cols == tok, s, 0.0)
        tl.store(dx_ptr + row * stride_dx + cols, (g - tl.exp(o) * s).to(dx_ptr.dtype.element_ty), mask=mask)


def token_logprobs_backward_triton(logits: torch.Tensor, token_ids: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                                   dtype: torch.dtype, cfg: TritonKernelConfigs) -> torch.Tensor:
    """The gradient of ``token_logprobs_triton`` against g [M] from its inputs and lse [M] fp32, no logits-sized
    fp32 tensor: logits [M, V] -> [M, V] in ``dtype``; ``log_softmax_backward_triton``'s bits for the scattered g."""
    x = _rows(logits)
    M, V = x.shape
    dx = torch.empty(M, V, dtype=dtype, device=x.device)
    if M and V:
        _token_logprobs_bwd_kernel[(M,)](x, token_ids.contiguous(), lse, g.contiguous(), dx, V, x.stride(0),
                                         dx.stride(0), BLOCK_V=cfg.logprobs_block_v,
                                         num_warps=cfg.logprobs_num_warps)
    return dx


def log_softmax_backward_triton(out: torch.Tensor, g: torch.Tensor, dtype: torch.dtype,
                                cfg: TritonKernelConfigs) -> torch.Tensor:
    """``sliced.log_softmax_backward`` in one pass a row, no logits-sized fp32 temporaries: out [M, V] float32
    (log_softmax's output), g [M, V] -> [M, V] in ``dtype`` (deterministic; the sum's order is not torch's)."""
    M, V = out.shape
    if g.shape != (M, V):
        raise ValueError(f"g must be [{M}, {V}] like log_softmax's output, got {tuple(g.shape)}")
    dx = torch.empty(M, V, dtype=dtype, device=out.device)
    if M and V:
        _log_softmax_bwd_kernel[(M,)](out, g, dx, V, out.stride(0), g.stride(0), g.stride(1), dx.stride(0),
                                      BLOCK_V=cfg.logprobs_block_v, num_warps=cfg.logprobs_num_warps)
    return dx


# a slice's width is a multiple of this many logits: its start is as aligned as the row's
SLICE_ALIGN = 16


def _slice_width(V: int, slices: int) -> int:
    """The logits a slice: ceil(V / slices) rounded up to a multiple of SLICE_ALIGN."""
    return -(-V // (slices * SLICE_ALIGN)) * SLICE_ALIGN


def _slicing(slices: int) -> dict[str, int]:
    """The kernels' constexprs for ``slices`` (a power of two) slices a row: SLICES and LEVELS = log2(SLICES)."""
    return dict(SLICES=slices, LEVELS=slices.bit_length() - 1)


def split(M: int, cfg: TritonKernelConfigs) -> bool:
    """Whether a call of M rows runs a program per row and slice (``logprobs_split_max_m``): more programs where
    M rows alone would leave most SMs idle; the bits are the one-program form's (the same slices, the same join)."""
    return 0 < M <= cfg.logprobs_split_max_m


def _rows(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [M, V], got {tuple(logits.shape)}")
    return logits if logits.stride(1) == 1 else logits.contiguous()


def log_softmax_triton(logits: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
    """logits [M, V] (any float dtype, rows may be strided) -> [M, V] float32 logprobs."""
    x = _rows(logits)
    M, V = x.shape
    out = torch.empty(M, V, dtype=torch.float32, device=x.device)
    if M and V and split(M, cfg):
        stats, grid = slice_stats_triton(x, VOCAB_SLICES, cfg), (M, triton.cdiv(V, cfg.logprobs_block_v))
        _write_kernel[grid](x, stats, out, V, x.stride(0), out.stride(0), **_slicing(VOCAB_SLICES),
                            BLOCK_V=cfg.logprobs_block_v, num_warps=cfg.logprobs_num_warps, enable_fp_fusion=False)
    elif M and V:
        _log_softmax_kernel[(M,)](x, out, V, _slice_width(V, VOCAB_SLICES), x.stride(0), out.stride(0),
                                  **_slicing(VOCAB_SLICES), BLOCK_V=cfg.logprobs_block_v,
                                  num_warps=cfg.logprobs_num_warps, enable_fp_fusion=False)
    return out


def token_logprobs_triton(logits: torch.Tensor, token_ids: torch.Tensor, cfg: TritonKernelConfigs, *,
                          return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax_triton(logits, cfg)[r, token_ids[r]]``'s bits without writing the row: logits [M, V] (any
    float dtype), token_ids [M] int32/int64 on the device, in [0, V) (unchecked) -> [M] float32 (+ lse [M] if asked)."""
    x = _rows(logits)
    M, V = x.shape
    if token_ids.shape != (M,):
        raise ValueError(f"token_ids {tuple(token_ids.shape)} must be [{M}]")
    out = torch.empty(M, dtype=torch.float32, device=x.device)
    lse = torch.empty(M, dtype=torch.float32, device=x.device)
    if M and V and split(M, cfg):
        stats = slice_stats_triton(x, VOCAB_SLICES, cfg)
        _join_token_kernel[(M,)](x, stats, token_ids.contiguous(), out, lse, x.stride(0), **_slicing(VOCAB_SLICES),
                                 num_warps=1, enable_fp_fusion=False)
    elif M and V:
        _token_logprobs_kernel[(M,)](x, token_ids.contiguous(), out, lse, V, _slice_width(V, VOCAB_SLICES), x.stride(0),
                                     **_slicing(VOCAB_SLICES), BLOCK_V=cfg.logprobs_block_v,
                                     num_warps=cfg.logprobs_num_warps, enable_fp_fusion=False)
    return (out, lse) if return_lse else out


# -- autograd: forward = the kernel, unchanged; backward = ``log_softmax_backward_triton`` from the output ----


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
        out = log_softmax_triton(logits, cfg)
        ctx.save_for_backward(out)
        ctx.logits_dtype, ctx.cfg = logits.dtype, cfg
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (out,) = ctx.saved_tensors
        return wanted(ctx, log_softmax_backward_triton(out, g, ctx.logits_dtype, ctx.cfg))


def log_softmax(logits: torch.Tensor, temperature: float = 1.0, *, cfg: TritonKernelConfigs) -> torch.Tensor:
    """The op's signature (``sliced.log_softmax``): [..., V] -> [..., V] float32 logprobs of logits /
    temperature, by the kernel on a CUDA tensor (the torch form elsewhere)."""
    if not logits.is_cuda:
        return sliced.log_softmax(logits, temperature)
    if temperature != 1.0:
        logits = sliced.scale(logits, temperature)
    rows = logits.reshape(-1, logits.shape[-1])
    out = _LogSoftmax.apply(rows, cfg) if grad_needed(logits) else log_softmax_triton(rows, cfg)
    return out.reshape(logits.shape)


class _TokenLogprobs(torch.autograd.Function):
    """The token logprob without a logits-sized fp32 tensor held: saves the logits (the caller's), the ids and
    lse [M], where log-softmax then gather would hold its fp32 output and the gather's fp32 gradient."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, token_ids: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
        out, lse = token_logprobs_triton(logits, token_ids, cfg, return_lse=True)
        ctx.save_for_backward(logits, token_ids, lse)
        ctx.cfg = cfg
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, token_ids, lse = ctx.saved_tensors
        return wanted(ctx, token_logprobs_backward_triton(logits, token_ids, lse, g, logits.dtype, ctx.cfg))


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, *,
                   cfg: TritonKernelConfigs) -> torch.Tensor:
    """The op's signature (``sliced.token_logprobs``): [..., V], [...] ids in [0, V) -> [...] float32, the
    kernel's ``log_softmax`` entries at the ids on a CUDA tensor (the torch form elsewhere)."""
    if not logits.is_cuda:
        return sliced.token_logprobs(logits, token_ids, temperature)
    sliced.check_token_inputs(logits, token_ids)  # the kernel reads at the id unchecked
    V = logits.shape[-1]
    ids = token_ids.to(device=logits.device, dtype=torch.int64)
    if temperature != 1.0:
        logits = sliced.scale(logits, temperature)
    rows, ids = logits.reshape(-1, V), ids.reshape(-1)
    out = _TokenLogprobs.apply(rows, ids, cfg) if grad_needed(logits) else token_logprobs_triton(rows, ids, cfg)
    return out.reshape(token_ids.shape)


# -- the vocab-sharded form: each rank's slices' (max, sum) all-gathered and joined as one row's -----------------


def check_shards(vocab: int, shard_index: int, shard_count: int) -> None:
    """``sliced.check_shards``, and (one line) a vocabulary whose shards are not whole slices of this form: V a
    multiple of VOCAB_SLICES * SLICE_ALIGN (128) at more than one shard."""
    sliced.check_shards(vocab, shard_index, shard_count)
    if shard_count > 1 and vocab % (VOCAB_SLICES * SLICE_ALIGN):
        raise ValueError(f"vocabulary {vocab} refused for {shard_count} shards on the triton backend: the sharded "
                         f"log-softmax needs V a multiple of {VOCAB_SLICES * SLICE_ALIGN} (pad the vocabulary, as "
                         "Megatron does)")


def slice_stats_triton(logits: torch.Tensor, slices: int, cfg: TritonKernelConfigs) -> torch.Tensor:
    """Each row's ``slices`` slices (widths ``_slice_width``), a program each: logits [M, V] (any float dtype) ->
    [M, 2, slices] float32, their maxes ([:, 0]) and sums of exp(x - max) ([:, 1])."""
    x = _rows(logits)
    M, V = x.shape
    stats = torch.empty(M, 2, slices, dtype=torch.float32, device=x.device)
    if M:
        _slice_kernel[(M, slices)](x, stats, V, _slice_width(V, slices), x.stride(0), SLICES=slices,
                                   BLOCK_V=cfg.logprobs_block_v, num_warps=cfg.logprobs_num_warps,
                                   enable_fp_fusion=False)
    return stats


def lse_of_stats_triton(stats: torch.Tensor) -> torch.Tensor:
    """A row's lse from all its slices' stats [M, 2, VOCAB_SLICES] fp32 (vocabulary order) -> [M] float32, the bits
    ``token_logprobs_triton`` returns as lse."""
    M = stats.shape[0]
    if stats.shape[1:] != (2, VOCAB_SLICES) or stats.dtype != torch.float32:
        raise ValueError(f"stats must be [M, 2, {VOCAB_SLICES}] float32, got {tuple(stats.shape)} {stats.dtype}")
    lse = torch.empty(M, dtype=torch.float32, device=stats.device)
    if M:
        _join_kernel[(M,)](stats.contiguous(), lse, **_slicing(VOCAB_SLICES), num_warps=1, enable_fp_fusion=False)
    return lse


def token_logprobs_sharded_triton(logits: torch.Tensor, token_ids: torch.Tensor, shard_index: int, shard_count: int,
                                  all_gather: sliced.AllGather, cfg: TritonKernelConfigs
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_logprobs_triton`` of the unsharded rows from this shard's logits [M, V / S] (any float dtype) and the
    global ids [M] in [0, V) (unchecked): (logprobs [M], this shard's ids [M] (-1 where another shard owns the id),
    lse [M]), float32 logprobs and lse with the unsharded bits on every shard. Two all-gathers: [M, 2, 8 / S] stats
    and [M] candidates."""
    x = _rows(logits)
    M, v = x.shape
    check_shards(v * shard_count, shard_index, shard_count)
    parts = sliced._gathered(all_gather, slice_stats_triton(x, VOCAB_SLICES // shard_count, cfg), shard_count)
    lse = lse_of_stats_triton(parts.permute(1, 2, 0, 3).reshape(M, 2, VOCAB_SLICES))
    ids = token_ids.to(device=x.device, dtype=torch.int64)
    local = (ids - shard_index * v).clamp(0, v - 1)
    # every shard offers its entry at the id (clamped where another owns it), as the kernel forms it; the owner's kept
    cands = sliced._gathered(all_gather, x.gather(1, local[:, None]).squeeze(1).to(torch.float32) - lse, shard_count)
    owner = torch.div(ids, v, rounding_mode="floor")
    mine = torch.where(owner == shard_index, local, torch.full_like(local, -1))
    return cands.gather(0, owner[None]).squeeze(0), mine, lse


class _ShardedTokenLogprobs(_TokenLogprobs):
    """The sharded token logprob; its backward is ``_TokenLogprobs``'s on this shard's entries (the id where this
    shard owns it, else -1), so each shard's gradient is its columns of the unsharded gradient, bit for bit."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, token_ids: torch.Tensor, shard_index: int, shard_count: int,
                all_gather: sliced.AllGather, cfg: TritonKernelConfigs) -> torch.Tensor:
        out, mine, lse = token_logprobs_sharded_triton(logits, token_ids, shard_index, shard_count, all_gather, cfg)
        ctx.save_for_backward(logits, mine, lse)
        ctx.cfg = cfg
        return out


def token_logprobs_sharded(local_logits: torch.Tensor, token_ids: torch.Tensor, shard_index: int, shard_count: int,
                           all_gather: sliced.AllGather, temperature: float = 1.0, *,
                           cfg: TritonKernelConfigs) -> torch.Tensor:
    """The op's signature (``sliced.token_logprobs_sharded``): this shard's [..., V / S] logits, [...] global ids ->
    [...] float32, ``token_logprobs``'s bits on every shard (the kernels on a CUDA tensor, the torch form elsewhere);
    differentiable, each shard's gradient its own columns of the unsharded one."""
    if not local_logits.is_cuda:
        return sliced.token_logprobs_sharded(local_logits, token_ids, shard_index, shard_count, all_gather,
                                             temperature)
    sliced.check_temperature(temperature)
    v = local_logits.shape[-1]
    check_shards(v * shard_count, shard_index, shard_count)
    ids = sliced.sharded_ids(local_logits, token_ids, shard_count)
    if temperature != 1.0:
        local_logits = sliced.scale(local_logits, temperature)
    out = _ShardedTokenLogprobs.apply(local_logits.reshape(-1, v), ids.reshape(-1), shard_index, shard_count,
                                      all_gather, cfg)
    return out.reshape(ids.shape)
