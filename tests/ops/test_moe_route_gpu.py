"""The MoE layer's few-token path on a GPU (skipped without CUDA; run on the H200).

Without gradients the triton backend routes with two launches (``router_logits_triton``,
``route_triton``, the dispatch tables too for a few rows) and runs a few rows through the decode tile
of the grouped GEMM. A trainer records gradients and takes the router kernel, then torch ops (the
elementwise sigmoid, ``naive.route``, ``dispatch``): both must give the same bits, or a sampler's
tokens would be scored with other routing. So: the routing kernel's experts, weights and tables equal
the torch ops', the layer's rows equal with and without gradients at 1, 64, 256 and 4096 tokens, a
decode-tile row equals its large-tile row (16-row mma against 128-row warpgroup MMA); the layer
captures into a CUDA graph (no host synchronisation); the router kernel's logits equal the triton
linear's (which ran the router before it).
"""

from __future__ import annotations

import functools

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16
ROUTINGS = {"top6": dict(num_experts_per_tok=6), "top2-groups": dict(num_experts_per_tok=2, n_group=8, topk_group=4),
            "top6-groups": dict(num_experts_per_tok=6, n_group=8, topk_group=4)}


def _backend():
    from aligned_mamba.contract import Contract
    from aligned_mamba.ops.backend import resolve
    return resolve(Contract(chunk_size=64, backend="triton", model_dtype="bfloat16"), "cuda")


@functools.cache
def _layer(routing: str, hidden: int = 2688, width: int = 1856, shared: int = 3712):
    """Nemotron-3-Nano-30B-A3B's MoE block shape by default (128 experts), random bf16 weights (one
    layer per routing for the whole file: about 2.6 GB each)."""
    from aligned_mamba.layers.moe import MoE, MoEConfig

    c = MoEConfig(hidden_size=hidden, n_routed_experts=128, moe_intermediate_size=width,
                  moe_shared_expert_intermediate_size=shared, routed_scaling_factor=2.5, **ROUTINGS[routing])
    g = torch.Generator(device="cuda").manual_seed(0)
    w = {n: (torch.randn(*s, generator=g, device="cuda") / s[-1] ** 0.5).to(BF16) for n, s in c.weight_shapes().items()}
    w["gate.e_score_correction_bias"] = torch.rand(128, generator=g, device="cuda") * 0.01
    return MoE(c, w, "", backend=_backend(), dtype=BF16)


def _x(T: int, hidden: int = 2688, seed: int = 1) -> torch.Tensor:
    return torch.randn(T, hidden, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda").to(BF16)


def _torch_route(layer, x):
    """The trainer's routing: the router kernel, then torch's sigmoid and ``naive.route``."""
    from aligned_mamba.layers.moe import route
    from aligned_mamba.ops import elementwise as ew
    from aligned_mamba.ops.moe.triton import router_logits_triton

    logits = router_logits_triton(x, layer.gate_w, layer.backend.configs)
    return route(ew.sigmoid(logits), layer.score_bias, layer.config)


@pytest.mark.parametrize("T", [1, 5, 64, 333, 4096])
def test_router_kernel_logits_equal_the_triton_linear(T: int) -> None:
    """The router kernel's small fp32 tiles give the triton linear's bits (its dot, its K block): the
    routing of a triton contract is what it was when the linear ran the router."""
    from aligned_mamba.ops.moe.triton import router_logits_triton

    layer = _layer("top6")
    x = _x(T)
    ours = router_logits_triton(x, layer.gate_w, layer.backend.configs)
    assert torch.equal(ours, layer.backend.linear(x.float(), layer.gate_w))


@pytest.mark.parametrize("T", [1, 333, 4096])
def test_router_kernel_rows_do_not_depend_on_its_tile(T: int) -> None:
    """The router's small tile and its large tile (chosen by the row count) give the same logits: each
    logit is one FMA chain over K whatever the tile holds beside it, so the tile may follow the size.
    cuBLAS's fp32 GEMM of the same rows (another summation order) gives other bits: the check can fail."""
    import dataclasses

    from aligned_mamba.ops.moe.triton import router_logits_triton

    layer = _layer("top6")
    x = _x(T, seed=3)
    cfg = layer.backend.configs
    small = router_logits_triton(x, layer.gate_w, dataclasses.replace(cfg, moe_router_large_rows=0))
    large = router_logits_triton(x, layer.gate_w, dataclasses.replace(cfg, moe_router_large_rows=1))
    assert torch.equal(small, large)
    if T > 1:
        assert not torch.equal(torch.nn.functional.linear(x.float(), layer.gate_w), small)


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("T", [1, 64, 256, 4096])
def test_routing_kernel_equals_the_torch_routing(routing: str, T: int) -> None:
    from aligned_mamba.ops.moe import dispatch

    layer = _layer(routing)
    x = _x(T, seed=T)
    with torch.no_grad():
        experts, weights, d = layer._route_kernels(x, with_dispatch=True)
    ref_e, ref_w = _torch_route(layer, x)
    assert torch.equal(experts, ref_e) and torch.equal(weights, ref_w)
    if d is not None:
        ref = dispatch(ref_e, 128, d.block_m)
        for name in ("token", "perm", "pos", "offsets", "tile_expert", "tile_row0", "tile_row1"):
            assert torch.equal(getattr(d, name), getattr(ref, name)), name
    assert (d is not None) == (T * layer.config.num_experts_per_tok <= layer.backend.configs.moe_dispatch_max_rows)


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_layer_rows_equal_with_and_without_gradients(routing: str) -> None:
    """The sampler's path (kernels, decode tile for few rows) against the trainer's (gradients recorded:
    the torch routing ops, the large tile): the same bits at 1, 64 and 4096 tokens."""
    layer = _layer(routing)
    for T in (1, 64, 256, 4096):
        x = _x(T, seed=T + 1)
        with torch.no_grad():
            ours = layer.advance(None, None, x)
        xg = x.clone().requires_grad_()
        trainer = layer.advance(None, None, xg)
        assert trainer.requires_grad
        assert torch.equal(ours, trainer.detach()), T


@pytest.mark.parametrize("T", [1, 8, 64])
def test_decode_tile_rows_equal_the_large_tile_rows(T: int) -> None:
    """A few rows through the decode tile (16 rows, mma) equal the same rows among 4096 tokens through the
    large tile (warpgroup MMA), and a K-split of the same GEMM (the baseline) does not."""
    import dataclasses

    from aligned_mamba.ops.moe import dispatch, route
    from aligned_mamba.ops.moe.triton import experts_triton, gemm_tile, grouped_gemm

    cfg = _backend().configs
    E, d, f = 128, 2688, 1856
    g = torch.Generator(device="cuda").manual_seed(T)
    h = torch.randn(4096, d, generator=g, device="cuda").to(BF16)
    up = (torch.randn(E, f, d, generator=g, device="cuda") / d ** 0.5).to(BF16)
    down = (torch.randn(E, d, f, generator=g, device="cuda") / f ** 0.5).to(BF16)
    experts, weights = route(torch.sigmoid(torch.randn(4096, E, generator=g, device="cuda")),
                             torch.zeros(E, device="cuda"), top_k=6)
    assert gemm_tile(T * 6, BF16, cfg)[0] != gemm_tile(4096 * 6, BF16, cfg)[0]
    full = experts_triton(h, experts, weights, up, down, cfg)
    few = experts_triton(h[:T], experts[:T], weights[:T], up, down, cfg)
    assert torch.equal(few, full[:T])
    # the baseline: the up projection of these rows with K in two halves, partials added in fp32
    one_cfg = dataclasses.replace(cfg, moe_decode_max_rows=0)
    dd = dispatch(experts[:T], E, cfg.moe_block_m)
    one, _ = grouped_gemm(h[:T], up, dd, one_cfg, gather=True)
    lo = h[:T, :d // 2].contiguous()
    hi = h[:T, d // 2:].contiguous()
    a, _ = grouped_gemm(lo, up[..., :d // 2].contiguous(), dd, one_cfg, gather=True)
    b, _ = grouped_gemm(hi, up[..., d // 2:].contiguous(), dd, one_cfg, gather=True)
    assert not torch.equal((a.float() + b.float()).to(BF16), one)


@pytest.mark.parametrize("T", [1, 64])
def test_layer_captures_into_a_cuda_graph(T: int) -> None:
    """The few-token path syncs nothing with the host: it captures, and its replay on new rows gives the
    eager rows."""
    layer = _layer("top6-groups")
    x = _x(T, seed=3)
    with torch.no_grad():
        layer.advance(None, None, x)  # compile outside the capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layer.advance(None, None, x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer.advance(None, None, x)
        x.copy_(_x(T, seed=4))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, layer.advance(None, None, x))
