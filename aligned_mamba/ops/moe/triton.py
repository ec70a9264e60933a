"""The routed experts on the GPU: a row-invariant grouped GEMM over experts and its backward.

Forward (``ops.moe``'s signature): ``grouped.dispatch`` sorts the (token, slot) pairs by expert;
``_grouped_gemm_kernel`` computes up = h @ up_w[e]^T with the squared ReLU fused (the rounded up
projection and its activation both stored), then y = act @ down_w[e]^T; ``_combine_kernel`` sums
each token's y rows in fp32 in ascending expert order and rounds once (``naive.combine``'s bits).

Row invariance: a program owns a tile of ``moe_block_m`` consecutive sorted rows of ONE expert and
``moe_block_n`` output columns; each output element is ``tl.dot``'s fp32 accumulation over K in
``moe_block_k`` steps, ascending, all inside that program (no split-K, no atomics), rounded once.
Rows past the expert's last are masked (loaded as zeros, not stored). A row's bits therefore do
not depend on which or how many rows share its tile (the tensor-core property ``ops.linear.triton``
rests on), so a token's expert output is the same alone or among 4096 tokens. With moe_block_k
equal to linear_block_k, an expert row has the bits of ``linear_triton`` on that row.

Backward (``ExpertsFunction``): dy = round(g w), the data gradients by the same grouped kernel
over the transposed weights, the squared ReLU's derivative 2 relu(u) in fp32, and each expert's
weight gradient by ``_expert_wgrad_kernel``: one program per weight tile, walking that expert's
sorted rows in blocks of ``moe_wgrad_block_t`` in ascending order. The routing weights' gradient
and the sum of a token's k input gradients are fixed-order torch ops. No atomics anywhere: two
backwards give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import AlignedMambaError
from ..configs import TritonKernelConfigs
from .grouped import Dispatch, dispatch


@triton.jit
def _grouped_gemm_kernel(
    # Pointers to matrices
    a_ptr, b_ptr, c_ptr, u_ptr,
    # The sorted rows' A rows [R] and the row tiles [NT] (int64)
    arow_ptr, tile_expert_ptr, tile_row0_ptr, tile_row1_ptr,
    # Sizes and strides (elements)
    N, K, stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    # Meta-parameters
    GATHER: tl.constexpr, RELU2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """c[r, n] = sum_k a[arow(r), k] b[e, n, k] for the sorted rows r of tile program_id(0) (expert e)
    and columns n of block program_id(1); arow(r) = arow_ptr[r] if GATHER else r. RELU2: u = the
    rounded product, c = relu(u)^2 in fp32 rounded once."""
    tile = tl.program_id(0)
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
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = a_ptr + ar[:, None].to(tl.int64) * stride_am
    b_cols = b_ptr + e.to(tl.int64) * stride_be + rn[None, :].to(tl.int64) * stride_bn
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
    tl.store(c_ptr + offs, c, mask=mask)


@triton.jit
def _expert_wgrad_kernel(
    # Pointers to matrices
    g_ptr, x_ptr, dw_ptr,
    # The sorted rows' x rows [R], the experts' sorted row offsets [E + 1] (int64)
    xrow_ptr, offsets_ptr,
    # Sizes and strides (elements)
    N, K, stride_g, stride_x, stride_dwe,
    # Meta-parameters
    GATHER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dw[e, n, k] = sum_r g[r, n] x[xrow(r), k] over expert e's sorted rows r, ascending in blocks of
    BLOCK_T, one program per (e, n block, k block); xrow(r) = xrow_ptr[r] if GATHER else r."""
    e = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
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
    # Pointers: y [R, d] (sorted rows), pos [T, k] int64, w [T, k] fp32, out [T, d]
    y_ptr, pos_ptr, w_ptr, out_ptr,
    d, stride_y, stride_out,
    # Meta-parameters
    K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[t] = round(0 + y[pos[t, 0]] w[t, 0] + ... + y[pos[t, K-1]] w[t, K-1]) in fp32, one product
    and one sum rounded at a time (no FMA: the launch turns fusion off), the bits of ``naive.combine``."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < d
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(pos_ptr + t * K + j)
        w = tl.load(w_ptr + t * K + j)
        y = tl.load(y_ptr + r * stride_y + cols, mask=cmask, other=0.0).to(tl.float32)
        acc = acc + y * w
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def combine_triton(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
                   cfg: TritonKernelConfigs) -> torch.Tensor:
    """``naive.combine([y[pos[:, j]] for j], weights, dtype)`` in one pass: y [R, d] (sorted rows),
    pos [T, k] int64, weights [T, k] fp32 -> [T, d] in ``dtype``."""
    T, k = pos.shape
    y, pos, weights = y.contiguous(), pos.contiguous(), weights.to(torch.float32).contiguous()
    out = torch.empty(T, y.shape[1], dtype=dtype, device=y.device)
    if out.numel():
        grid = (T, triton.cdiv(y.shape[1], cfg.moe_combine_block_d))
        _combine_kernel[grid](y, pos, weights, out, y.shape[1], y.stride(0), out.stride(0), K=k,
                              BLOCK_D=cfg.moe_combine_block_d, num_warps=4, enable_fp_fusion=False)
    return out


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, d: Dispatch, cfg: TritonKernelConfigs, *, gather: bool,
                 transpose_b: bool = False, relu2: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sorted rows r of expert e: c[r] = a[row(r)] @ b[e]^T (b [E, N, K]), or a[row(r)] @ b[e] with
    ``transpose_b`` (b [E, K, N]); row(r) = d.token[r] if ``gather`` else r. a [*, K] and b in one
    dtype (bf16 or fp32), a's rows may be strided. Returns (c [R, N], u [R, N] or None) in a's dtype;
    with ``relu2``, u is the product and c relu(u)^2."""
    if a.stride(1) != 1:
        a = a.contiguous()
    b = b.contiguous()
    N, K = (b.shape[2], b.shape[1]) if transpose_b else (b.shape[1], b.shape[2])
    sbn, sbk = (1, N) if transpose_b else (K, 1)
    R = d.token.numel()
    c = torch.empty(R, N, dtype=a.dtype, device=a.device)
    u = torch.empty_like(c) if relu2 else None
    if R == 0 or N == 0:
        return c, u
    grid = (d.tile_row0.numel(), triton.cdiv(N, cfg.moe_block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, u if relu2 else c, d.token, d.tile_expert, d.tile_row0, d.tile_row1,
        N, K, a.stride(0), b.stride(0), sbn, sbk, N,
        GATHER=gather, RELU2=relu2, BLOCK_M=d.block_m, BLOCK_N=cfg.moe_block_n, BLOCK_K=cfg.moe_block_k,
        PRECISION="ieee", num_warps=cfg.moe_warps, num_stages=cfg.moe_stages,
        enable_fp_fusion=False)
    return c, u


def expert_wgrad(g: torch.Tensor, x: torch.Tensor, d: Dispatch, num_experts: int, cfg: TritonKernelConfigs, *,
                 gather: bool) -> torch.Tensor:
    """dw [E, N, K] in g's dtype: dw[e] = g[rows of e]^T @ x[row(r)] summed over e's sorted rows in
    ascending order (row(r) = d.token[r] if ``gather`` else r). g [R, N], x [*, K] in one dtype."""
    g, x = g.contiguous(), x.contiguous()
    N, K = g.shape[1], x.shape[1]
    dw = torch.empty(num_experts, N, K, dtype=g.dtype, device=g.device)
    if dw.numel() == 0:
        return dw
    c = cfg
    grid = (num_experts, triton.cdiv(N, c.moe_wgrad_block_n), triton.cdiv(K, c.moe_wgrad_block_k))
    _expert_wgrad_kernel[grid](
        g, x, dw, d.token, d.offsets, N, K, g.stride(0), x.stride(0), N * K,
        GATHER=gather, BLOCK_N=c.moe_wgrad_block_n, BLOCK_K=c.moe_wgrad_block_k, BLOCK_T=c.moe_wgrad_block_t,
        PRECISION="ieee", num_warps=c.moe_wgrad_warps, enable_fp_fusion=False)
    return dw


def _check(h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, up_w: torch.Tensor,
           down_w: torch.Tensor) -> None:
    T, d = h.shape
    if up_w.dim() != 3 or down_w.shape != (up_w.shape[0], d, up_w.shape[1]) or up_w.shape[2] != d:
        raise ValueError(f"experts_triton: h {tuple(h.shape)}, up_w {tuple(up_w.shape)} [E, f, d] and down_w "
                         f"{tuple(down_w.shape)} [E, d, f] do not match")
    if experts.shape != weights.shape or experts.shape[0] != T:
        raise ValueError(f"experts_triton: experts {tuple(experts.shape)} and weights {tuple(weights.shape)} "
                         f"must both be [{T}, k]")
    if not (h.dtype == up_w.dtype == down_w.dtype) or h.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"experts_triton: h {h.dtype}, up_w {up_w.dtype}, down_w {down_w.dtype} must all be "
                         "bfloat16 or float32")


def _forward(h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, up_w: torch.Tensor,
             down_w: torch.Tensor, cfg: TritonKernelConfigs) -> tuple[torch.Tensor, tuple]:
    d = dispatch(experts, up_w.shape[0], cfg.moe_block_m)
    act, u = grouped_gemm(h, up_w, d, cfg, gather=True, relu2=True)
    y, _ = grouped_gemm(act, down_w, d, cfg, gather=False)
    return combine_triton(y, d.pos, weights, h.dtype, cfg), (d, u, act, y)


def experts_triton(h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, up_w: torch.Tensor,
                   down_w: torch.Tensor, cfg: TritonKernelConfigs) -> torch.Tensor:
    """The routed experts (``ops.moe``'s signature): h [T, d], up_w [E, f, d], down_w [E, d, f] in the
    model dtype (bf16 or fp32), experts [T, k] int64 (ascending, distinct per row), weights [T, k]
    fp32 -> [T, d] in h's dtype; no host synchronisation. Differentiable in h, weights, up_w, down_w
    (``ExpertsFunction``)."""
    _check(h, experts, weights, up_w, down_w)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (h, weights, up_w, down_w)):
        return ExpertsFunction.apply(h, experts, weights, up_w, down_w, cfg)
    return _forward(h, experts, weights, up_w, down_w, cfg)[0]


class ExpertsFunction(torch.autograd.Function):
    """The kernels' forward (the inference path's bits) and its deterministic backward."""

    @staticmethod
    def forward(ctx, h, experts, weights, up_w, down_w, cfg):  # type: ignore[override]
        out, (d, u, act, y) = _forward(h, experts, weights, up_w, down_w, cfg)
        ctx.save_for_backward(h, weights, up_w, down_w, u, act, y)
        ctx.dispatch, ctx.cfg = d, cfg
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        h, weights, up_w, down_w, u, act, y = ctx.saved_tensors
        d, cfg = ctx.dispatch, ctx.cfg
        T, k = weights.shape
        E = up_w.shape[0]
        f32 = torch.float32
        g32 = g.to(f32)
        # out = round(sum_j w_j y_j): d w_j = <g, y_j>, d y_j = round(g w_j) (the combine's own gradient)
        yk = y[d.pos.reshape(-1)].view(T, k, -1).to(f32)
        d_weights = (g32[:, None, :] * yk).sum(-1)
        w_sorted = weights.reshape(-1)[d.perm]
        dy = (g32[d.token] * w_sorted[:, None]).to(h.dtype)
        d_act, _ = grouped_gemm(dy, down_w, d, cfg, gather=False, transpose_b=True)
        d_down = expert_wgrad(dy, act, d, E, cfg, gather=False)
        r = torch.relu(u.to(f32))
        gr = d_act.to(f32) * r
        d_u = (gr + gr).to(h.dtype)  # d relu(u)^2 = 2 relu(u) du
        d_h_sorted, _ = grouped_gemm(d_u, up_w, d, cfg, gather=False, transpose_b=True)
        d_up = expert_wgrad(d_u, h, d, E, cfg, gather=True)
        parts = d_h_sorted[d.pos]  # [T, k, d]: token t's k input gradients, summed in slot order
        acc = parts[:, 0].to(f32)
        for j in range(1, k):
            acc = acc + parts[:, j].to(f32)
        return acc.to(h.dtype), None, d_weights, d_up, d_down, None


def moe_experts(h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, up_w: torch.Tensor,
                down_w: torch.Tensor, up_b: object = None, down_b: object = None, *,
                cfg: TritonKernelConfigs) -> torch.Tensor:
    """The backend's ``moe_experts`` signature: ``experts_triton``; expert biases are refused (the
    grouped kernels have no bias term)."""
    if up_b is not None or down_b is not None:
        raise AlignedMambaError("MoE expert biases on a CUDA device are refused: the grouped expert kernels have "
                                "no bias term (mlp_bias MoE checkpoints run on the torch backend)")
    return experts_triton(h, experts, weights, up_w, down_w, cfg)


__all__ = ["ExpertsFunction", "combine_triton", "expert_wgrad", "experts_triton", "grouped_gemm", "moe_experts"]
