"""Autograd for the triton backend's kernels: the Triton forward, the op's gradient.

Each op the triton backend runs with its own kernels is a ``torch.autograd.Function`` whose forward
calls that kernel unchanged (the same bits as the sampler's, since it is the same launch) and saves
its inputs (log-softmax: its output), and whose backward is the op's gradient at those inputs:

- the scan: ``ssd_backward``, the Triton kernels of ``ops.ssd.triton_backward`` on the chunk grid,
  the gradient of ``ops.ssd.chunk_dense``'s function (the torch backend's scan in dense blocks);
- conv1d + SiLU: a Triton kernel (``conv1d_triton.causal_conv1d_backward_triton``; the windows'
  own gradient, when they require one, from ``ops.conv1d.causal_conv1d_backward``);
- the norms and the gated norm: Triton kernels (``norm_triton.*_backward_triton``, per row block
  partial sums of the weight gradient);
- log-softmax: ``ops.logprobs.log_softmax_backward`` from the saved output, native torch ops;
- the linear layer: the two GEMMs ``grad @ w`` and ``grad.T @ x`` in torch (cuBLAS on a GPU).

They are derivatives of the functions the forward computes, taken at the forward's inputs, so they
differ from the exact derivative of the Triton forward only by rounding (tests/test_triton_backward.py
holds them to an fp64 reference). Gradients are not row-invariant (nothing asks them to be).

Without these, autograd cannot see through a Triton launch: its outputs are fresh tensors written by
raw pointers, with no ``grad_fn``, so every parameter upstream of one silently gets no gradient.

Determinism: no backward here reduces with atomics. The scan's kernels own the rows they write and
leave the cross-program sums to torch reductions, and so does the conv's kernel (per row block
partial sums of its weight gradient); the conv's torch form scatters one value per element per
tap; the embedding's gradient (repeated token ids) runs torch's sorting accumulation
(``torch.use_deterministic_algorithms`` for that one call). Not covered: ``torch.cumsum`` on CUDA,
which torch does not promise deterministic (its row scans along the chunk measured repeatable: two
backwards compare equal on the H200, ``benchmarks/bench_train_h200.py``), and cuBLAS, deterministic
run to run only for one stream and a fixed workspace (``CUBLAS_WORKSPACE_CONFIG=:4096:8``). On the
CPU all of it is deterministic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from . import conv1d as _conv
from . import logprobs as _logprobs
from .configs import TritonKernelConfigs
from .conv1d_triton import causal_conv1d_backward_triton, causal_conv1d_triton
from .linear_triton import linear_triton
from .logprobs_triton import log_softmax_triton
from .norm_triton import (
    add_rms_norm_triton,
    embed_rms_norm_triton,
    gated_rms_norm_backward_triton,
    gated_rms_norm_triton,
    rms_norm_backward_triton,
    rms_norm_triton,
)
from .ssd.chunk import ChunkGrid, Chunks, chunk_grid, dt_softplus, dt_softplus_backward, pack_chunks
from .ssd.plan import step_tables
from .ssd.state import SSDState, SSMParams, Step
from .ssd.triton_backward import chunk_scan_backward
from .triton_math import dt_softplus_triton

Tensor = torch.Tensor


def grad_needed(*tensors: Tensor | None) -> bool:
    """Whether a call must be recorded for autograd: grad mode on and some input requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """torch's deterministic algorithms for the block (warn-only: see the module docstring), then
    the caller's setting back."""
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


def _wanted(ctx: torch.autograd.function.FunctionCtx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    """One gradient per forward input: ``grads`` for the first inputs (None where an input needs none),
    None for the rest (configs and other non-tensor arguments)."""
    needs = ctx.needs_input_grad
    return (*(gr if n else None for gr, n in zip(grads, needs)), *([None] * (len(needs) - len(grads))))


# -- the Functions: forward = the kernel, unchanged; backward = the op's gradient -----------------------


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None, cfg: TritonKernelConfigs) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.bias_dtype = None if b is None else b.dtype
        return linear_triton(x, w, b, cfg)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        nx, nw, nb, _ = ctx.needs_input_grad
        # y = x w^T (+ b): dx = g w, dw = g^T x (cuBLAS), db = the fp32 column sums of g
        return (g @ w if nx else None, (g.t() @ x).to(w.dtype) if nw else None,
                g.to(torch.float32).sum(0).to(ctx.bias_dtype) if nb else None, None)


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, eps: float, out_dtype: torch.dtype, cfg: TritonKernelConfigs) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.consts = (eps, out_dtype, cfg)
        return rms_norm_triton(x, w, eps, out_dtype, cfg)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        eps, out_dtype, cfg = ctx.consts
        dx, dw = rms_norm_backward_triton(x, w, eps, out_dtype, g, cfg)
        return _wanted(ctx, dx.to(x.dtype), dw)


class _EmbedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token_ids: Tensor, embedding: Tensor, w: Tensor, eps: float, dtype: torch.dtype,
                residual_dtype: torch.dtype, cfg: TritonKernelConfigs) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(token_ids, embedding, w)
        ctx.consts = (eps, dtype, residual_dtype, cfg)
        return embed_rms_norm_triton(token_ids, embedding, w, eps, dtype, residual_dtype, cfg, norm_input_dtype=dtype)

    @staticmethod
    def backward(ctx, g_normed: Tensor, g_residual: Tensor) -> tuple[Tensor | None, ...]:
        token_ids, embedding, w = ctx.saved_tensors
        eps, dtype, residual_dtype, cfg = ctx.consts
        residual = embedding[token_ids].to(residual_dtype)
        g, dw = rms_norm_backward_triton(residual.to(dtype), w, eps, dtype, g_normed, cfg, add=g_residual)
        de = None
        if ctx.needs_input_grad[1]:
            with _deterministic():  # repeated token ids: the sorting accumulation, not atomics
                de = torch.zeros(embedding.shape, device=g.device).index_put_((token_ids,), g, accumulate=True)
            de = de.to(embedding.dtype)
        return _wanted(ctx, None, de, dw)


class _AddNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, residual: Tensor, w: Tensor, eps: float, dtype: torch.dtype,
                cfg: TritonKernelConfigs) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(x, residual, w)
        ctx.consts = (eps, dtype, cfg)
        return add_rms_norm_triton(x, residual, w, eps, dtype, cfg, norm_input_dtype=dtype)

    @staticmethod
    def backward(ctx, g_normed: Tensor, g_residual: Tensor) -> tuple[Tensor | None, ...]:
        x, residual, w = ctx.saved_tensors
        eps, dtype, cfg = ctx.consts
        # the norm's input as the forward rounds it (the residual sum in its dtype, then the model dtype)
        g, dw = rms_norm_backward_triton((residual + x).to(dtype), w, eps, dtype, g_normed, cfg, add=g_residual)
        return _wanted(ctx, g.to(x.dtype), g.to(residual.dtype), dw)


class _GatedRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, z: Tensor, w: Tensor, eps: float, n_groups: int, cfg: TritonKernelConfigs) -> Tensor:
        ctx.save_for_backward(y, z, w)
        ctx.consts = (eps, n_groups, cfg)
        return gated_rms_norm_triton(y, z, w, eps, n_groups, cfg)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        y, z, w = ctx.saved_tensors
        eps, n_groups, cfg = ctx.consts
        return _wanted(ctx, *gated_rms_norm_backward_triton(y, z, w, eps, n_groups, g, cfg))


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None, window: Tensor, cu_seqlens: Tensor, slots: Tensor,
                windows: Tensor, cfg: TritonKernelConfigs) -> Tensor:
        # window: windows[slots] as the kernel finds them (it overwrites them in place)
        ctx.save_for_backward(x, w, b, window)
        ctx.consts = (cu_seqlens, cfg)
        return causal_conv1d_triton(x, cu_seqlens, slots, windows, w, b, cfg)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        x, w, b, window = ctx.saved_tensors
        cu_seqlens, cfg = ctx.consts
        if ctx.needs_input_grad[3]:  # the windows' own gradient: the torch form has it
            dx, dwindow, dw, db = _conv.causal_conv1d_backward(x, cu_seqlens, window, w, b, g)
            return _wanted(ctx, dx, dw, db, dwindow)
        dx, dw, db = causal_conv1d_backward_triton(x, cu_seqlens, window, w, b, g, cfg)
        return _wanted(ctx, dx, dw, db)


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, cfg: TritonKernelConfigs) -> Tensor:
        out = log_softmax_triton(logits, cfg)
        ctx.save_for_backward(out)
        ctx.logits_dtype = logits.dtype
        return out

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        (out,) = ctx.saved_tensors
        return _wanted(ctx, _logprobs.log_softmax_backward(out, g, ctx.logits_dtype))


def ssd_backward(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, D: Tensor, dt_bias: Tensor, h0: Tensor,
                 buf_x: Tensor | None, buf_dt: Tensor | None, buf_B: Tensor | None, g: Tensor, needs: tuple[bool, ...],
                 cu_seqlens: Tensor, off: Tensor, grid: ChunkGrid, rows: Tensor | None, chunk_size: int,
                 dt_limit: tuple[float, float], cfg: TritonKernelConfigs) -> tuple[Tensor | None, ...]:
    """The gradient of an advance's y [T, H, P] (``chunk.replay_chunk``'s function, without the state
    writes) against g [T, H, P]: (dx, ddt, dB, dC, dA, dD, ddt_bias, dh0), None where ``needs`` (one
    flag per leaf, in that order) is False.

    The chunk grid is ``pack_chunks`` of the inputs (buffered rows first, from buf_* [S, ...] at the
    step's slots, None when no slot has any) on ``grid`` (the step's ``chunk_grid``), and the scan's
    gradient on it is ``triton_backward.chunk_scan_backward``. The packing's own gradient is written
    out: x's and B's rows are gathered back from the grid; dt's go through ``dt_softplus_backward``,
    and dt_bias also gets the buffered rows' share (the buffers themselves get none). No step of it
    waits on the GPU.
    """
    nx, ndt, nB, nC, nA, nD, nbias, nh0 = needs
    L = chunk_size
    prefix = None if buf_x is None else (buf_x, buf_dt, buf_B, off)
    softplus = dt_softplus_triton if x.is_cuda else dt_softplus  # the same bits
    gy = g if rows is None else g * rows.to(g.device)[:, None, None]  # the forward's y is zero in rows not wanted
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    # Every sequence from a chunk boundary over whole chunks (a trainer's packed sequences of multiples
    # of L): packed row r is row r % L of chunk r // L, so the chunk grid is a transposed view of the
    # rows and packing is one copy per tensor, not a zero fill and a scatter (nor a gather back).
    aligned = prefix is None and cu_seqlens.device.type == "cpu" and bool((lens % L == 0).all())
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    NC = grid.num_chunks
    f32, dev = torch.float32, x.device

    def to_grid(t: Tensor) -> Tensor:  # [T, K, F] -> [NC, K, L, F] fp32 (aligned rows)
        return torch.empty(NC, t.shape[1], L, t.shape[2], device=dev, dtype=f32).copy_(
            t.reshape(NC, L, t.shape[1], t.shape[2]).transpose(1, 2))

    def from_grid(t: Tensor, dtype: torch.dtype) -> Tensor:  # the inverse, in dtype
        out = torch.empty(T, t.shape[1], t.shape[3], device=dev, dtype=dtype)
        out.view(NC, L, t.shape[1], t.shape[3]).copy_(t.transpose(1, 2))
        return out

    at = (grid.row_chunk, slice(None), grid.row_pos)
    if aligned:
        dtc = softplus(dt, dt_bias, dt_limit).view(NC, L, H).transpose(1, 2).contiguous()
        ch = Chunks(x=to_grid(x), dt=dtc, B=to_grid(B), seq=grid.seq, index=grid.index, length=grid.length,
                    row_chunk=grid.row_chunk, row_pos=grid.row_pos)
        Cc, dyc = to_grid(C), to_grid(gy)
    else:
        ch = pack_chunks(x, dt, B, cu_seqlens, L, dt_bias, dt_limit, prefix=prefix, grid=grid, softplus=softplus)
        Cc = torch.zeros(NC, G, L, N, device=dev)
        Cc[at] = C.to(f32)
        dyc = torch.zeros(NC, H, L, P, device=dev)
        dyc[at] = gy.to(f32)
    bf16 = all(t.dtype == torch.bfloat16 for t in (x, B, C, g))
    dxc, ddtc, dBc, dCc, dA, dD, dh0 = chunk_scan_backward(ch, Cc, A, D, h0, dyc, cfg, bf16_operands=bf16,
                                                           first=grid.first, count=grid.count)
    if aligned:
        dx = from_grid(dxc, x.dtype) if nx else None
        dB = from_grid(dBc, B.dtype) if nB else None
        dC = from_grid(dCc, C.dtype) if nC else None
    else:
        dx = dxc[at].to(x.dtype) if nx else None
        dB = dBc[at].to(B.dtype) if nB else None
        dC = dCc[at].to(C.dtype) if nC else None
    ddt = dbias = None
    if ndt or nbias:
        ddt_rows = ddtc.transpose(1, 2).reshape(T, H) if aligned else ddtc[at]
        graw = dt_softplus_backward(dt, dt_bias, dt_limit, ddt_rows)  # [T, H]
        ddt = graw.to(dt.dtype) if ndt else None
        if nbias:
            dbias = graw.sum(0)
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
        # run() is the triton backend's advance over the real state (which it updates); the tensors
        # here are its inputs: h0 and buf_* are copies of the slots' state taken before it runs
        ctx.save_for_backward(x, dt, B, C, A, D, dt_bias, h0, buf_x, buf_dt, buf_B)
        ctx.consts = consts
        return run()

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        x, dt, B, C, A, D, dt_bias, h0, buf_x, buf_dt, buf_B = ctx.saved_tensors
        grads = ssd_backward(x, dt, B, C, A, D, dt_bias, h0, buf_x, buf_dt, buf_B, g, ctx.needs_input_grad[:8],
                             *ctx.consts)
        return (*grads, None, None, None, None, None)


# -- the differentiable ops (the triton backend calls these only when grad_needed) --------------------------


def linear(x: Tensor, w: Tensor, b: Tensor | None, cfg: TritonKernelConfigs) -> Tensor:
    """``linear_triton`` (x [M, K] @ w [N, K]^T + b [N] -> [M, N] in x's dtype) with a cuBLAS backward."""
    return _Linear.apply(x, w, b, cfg)


def rms_norm(x: Tensor, w: Tensor, eps: float, out_dtype: torch.dtype, cfg: TritonKernelConfigs) -> Tensor:
    """``rms_norm_triton``: [M, d] -> [M, d] in ``out_dtype``; backward of ``ops.norm.rms_norm``."""
    return _RmsNorm.apply(x, w, eps, out_dtype, cfg)


def embed_norm(token_ids: Tensor, embedding: Tensor, w: Tensor, eps: float, dtype: torch.dtype,
               residual_dtype: torch.dtype, cfg: TritonKernelConfigs) -> tuple[Tensor, Tensor]:
    """``embed_rms_norm_triton``: token_ids [T] -> (normed [T, d] in ``dtype``, residual [T, d] in
    ``residual_dtype``); backward of the torch backend's ``embed_norm``."""
    return _EmbedNorm.apply(token_ids, embedding, w, eps, dtype, residual_dtype, cfg)


def add_norm(x: Tensor, residual: Tensor, w: Tensor, eps: float, dtype: torch.dtype,
             cfg: TritonKernelConfigs) -> tuple[Tensor, Tensor]:
    """``add_rms_norm_triton``: x, residual [M, d] -> (normed [M, d] in ``dtype``, residual + x [M, d]
    in residual's dtype); backward of the torch backend's ``add_norm``."""
    return _AddNorm.apply(x, residual, w, eps, dtype, cfg)


def gated_rms_norm(y: Tensor, z: Tensor, w: Tensor, eps: float, n_groups: int, cfg: TritonKernelConfigs) -> Tensor:
    """``gated_rms_norm_triton``: y, z [M, d] -> [M, d] in y's dtype; backward of ``ops.norm.gated_rms_norm``."""
    return _GatedRmsNorm.apply(y, z, w, eps, n_groups, cfg)


def conv(x: Tensor, cu_seqlens: Tensor, slots: Tensor, windows: Tensor, w: Tensor, b: Tensor | None,
         cfg: TritonKernelConfigs) -> Tensor:
    """``causal_conv1d_triton`` (x [T, Cd] -> [T, Cd]; windows [num_slots, K-1, Cd] updated in place);
    backward of ``ops.conv1d.causal_conv1d`` from the slots' windows as they were (gradient of the
    windows included, when they require it)."""
    return _Conv.apply(x, w, b, windows[slots], cu_seqlens, slots, windows, cfg)


def log_softmax(logits: Tensor, cfg: TritonKernelConfigs) -> Tensor:
    """``log_softmax_triton``: [M, V] -> [M, V] float32; backward of ``ops.logprobs.log_softmax``."""
    return _LogSoftmax.apply(logits, cfg)


def ssd_advance(run: Callable[[SSDState, Step, Tensor, Tensor, Tensor, Tensor, SSMParams, Tensor | None], Tensor],
                state: SSDState, step: Step, x: Tensor, dt: Tensor, B: Tensor, C: Tensor, params: SSMParams,
                rows: Tensor | None, cfg: TritonKernelConfigs) -> Tensor:
    """``run(state, step, x, dt, B, C, params, rows)`` (the triton backend's advance: y [T, H, P] in
    x's dtype; updates ``state``) with the gradient of the torch backend's advance from the same state:
    of x [T, H, P], dt [T, H], B, C [T, G, N], params.A, D, dt_bias, and of ``state.ssm_state`` at the
    step's slots when it requires grad. The buffered rows (raw inputs of earlier calls) get none."""
    L = state.chunk_size
    dev = x.device
    off = step.start_pos % L  # on the host, as the step's tables are
    # the step's slots and chunk grid on the device, once for all its layers (no layer waits on the GPU)
    _, slots = step_tables(step, dev)
    grid = step.derived(("chunk_grid", L, dev), lambda: chunk_grid(step.cu_seqlens, off, L, dev))
    h0 = state.ssm_state[slots]  # a copy: the advance moves the boundary states in place
    # the buffers are read only where a slot has buffered rows (a trainer's forward from empty has none)
    bufs = (state.buf_x[slots], state.buf_dt[slots], state.buf_B[slots]) if grid.fill else (None,) * 3
    consts = (step.cu_seqlens, off, grid, rows, L, tuple(params.dt_limit), cfg)
    return _SSDAdvance.apply(x, dt, B, C, params.A, params.D, params.dt_bias, h0, *bufs,
                             lambda: run(state, step, x, dt, B, C, params, rows), consts)


__all__ = ["add_norm", "conv", "embed_norm", "gated_rms_norm", "grad_needed", "linear", "log_softmax",
           "rms_norm", "ssd_advance", "ssd_backward"]
