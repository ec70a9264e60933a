"""The routed experts' backward as separate torch ops around the grouped GEMM kernels (the form
before the combine's backward, the squared ReLU's derivative and the input gradient's sum moved into
kernels): the tests hold the fused backward to these bits."""

from __future__ import annotations

import torch


def unfused_backward(h, experts, weights, up, down, g, cfg, *, unrounded: bool = False) -> tuple[torch.Tensor, ...]:
    """(d h, d up, d down, d weights) of ``experts_triton(h, experts, weights, up, down, cfg)`` for the
    output gradient g [T, d]: each fp32 op of the chain in torch, the GEMMs through the kernels.
    ``unrounded``: the squared ReLU's derivative taken of an fp32 product dy @ down, not of the product
    rounded to the model dtype (what an epilogue on the accumulator would do: the tests' baseline)."""
    from aligned_mamba.ops.moe import dispatch
    from aligned_mamba.ops.moe.triton import expert_wgrad, gemm_tile, grouped_gemm

    T, k = weights.shape
    E, f32 = up.shape[0], torch.float32
    d = dispatch(experts, E, gemm_tile(experts.numel(), h.dtype, cfg)[0])
    act, u = grouped_gemm(h, up, d, cfg, gather=True, relu2=True)
    y, _ = grouped_gemm(act, down, d, cfg, gather=False)
    g32 = g.to(f32)
    d_weights = (g32[:, None, :] * y[d.pos.reshape(-1)].view(T, k, -1).to(f32)).sum(-1)
    dy = (g32[d.token] * weights.reshape(-1)[d.perm][:, None]).to(h.dtype)
    if unrounded:
        d_act, _ = grouped_gemm(dy.to(f32), down.to(f32), d, cfg, gather=False, transpose_b=True)
    else:
        d_act, _ = grouped_gemm(dy, down, d, cfg, gather=False, transpose_b=True)
    gr = d_act.to(f32) * torch.relu(u.to(f32))
    d_u = (gr + gr).to(h.dtype)
    d_h_sorted, _ = grouped_gemm(d_u, up, d, cfg, gather=False, transpose_b=True)
    parts = d_h_sorted[d.pos]
    acc = parts[:, 0].to(f32)
    for j in range(1, k):
        acc = acc + parts[:, j].to(f32)
    return (acc.to(h.dtype), expert_wgrad(d_u, h, d, E, cfg, gather=True), expert_wgrad(dy, act, d, E, cfg,
                                                                                         gather=False), d_weights)
