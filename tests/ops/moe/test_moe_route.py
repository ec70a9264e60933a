"""The MoE layer's few-token path: routing and dispatch in one kernel, the decode tile of the grouped GEMM.

- interpreter (the Triton interpreter, CPU): ``route_triton`` must give
  ``naive.route(elementwise.sigmoid(logits))``'s experts and weights bit for bit (ties included: they
  go to the lower index) and, from the same program, ``grouped.dispatch``'s tables; the experts' rows
  through the decode tile must equal the large tile's, so a token's output does not depend on how
  many tokens share its call (which path it takes). The baseline: a few-token GEMM that splits K in
  two (as a decode GEMM does to fill a GPU) gives other bits. fp32 throughout (the interpreter
  computes bf16 wrongly).
- gpu (skipped without CUDA; run on the H200): without gradients the triton backend routes with two
  launches (``router_logits_triton``, ``route_triton``, the dispatch tables too for a few rows) and
  runs a few rows through the decode tile of the grouped GEMM. A trainer records gradients and takes
  the router kernel, then torch ops (the elementwise sigmoid, ``naive.route``, ``dispatch``): both
  must give the same bits, or a sampler's tokens would be scored with other routing. So: the routing
  kernel's experts, weights and tables equal the torch ops', the layer's rows equal with and without
  gradients at 1, 64, 256 and 4096 tokens, a decode-tile row equals its large-tile row (16-row mma
  against 128-row warpgroup MMA); the layer captures into a CUDA graph (no host synchronisation); the
  router kernel's logits equal the triton linear's (which ran the router before it).
"""

from __future__ import annotations

import dataclasses
import functools

import interpreted  # noqa: F401  (the interpreter on, before triton is imported; tests/ops/conftest.py)
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aligned_mamba.ops import elementwise as ew
from aligned_mamba.ops.configs import TritonKernelConfigs
from aligned_mamba.ops.moe import dispatch, route
from aligned_mamba.ops.moe import triton as mt

CFG = TritonKernelConfigs()
D, F, E = 48, 40, 16
TABLES = ("token", "perm", "pos", "offsets", "tile_expert", "tile_row0", "tile_row1")
# (experts, top-k, groups, groups kept)
ROUTINGS = [(16, 2, 1, 1), (16, 6, 1, 1), (16, 6, 4, 2), (24, 3, 3, 2), (32, 8, 8, 3), (128, 6, 1, 1),
            (128, 6, 8, 4)]


def _logits(T: int, E: int, seed: int, ties: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 2
    bias = torch.rand(E, generator=g) * 0.05
    if ties:  # equal scores across experts and groups: the lower index must win
        logits[:, 1::3] = logits[:, :1]
        bias[::2] = 0.0
    return logits, bias


@pytest.mark.interpreter
@settings(max_examples=25, deadline=None)
@given(routing=st.sampled_from(ROUTINGS), T=st.integers(1, 90), seed=st.integers(0, 2 ** 16), ties=st.booleans(),
       norm=st.booleans())
def test_route_kernel_gives_the_torch_routes_bits_and_tables(routing, T: int, seed: int, ties: bool,
                                                             norm: bool) -> None:
    E, k, ng, tg = routing
    logits, bias = _logits(T, E, seed, ties)
    kw = dict(top_k=k, n_group=ng, topk_group=tg, norm_topk_prob=norm, routed_scaling_factor=2.5)
    experts, weights, d = mt.route_triton(logits, bias, cfg=CFG, **kw)
    ref_e, ref_w = route(ew.sigmoid(logits), bias, **kw)
    assert torch.equal(experts, ref_e)
    assert torch.equal(weights, ref_w)
    if T * k <= CFG.moe_dispatch_max_rows:  # in the routing program, or in a second one past decode_max_rows
        ref = dispatch(ref_e, E, d.block_m)
        for name in TABLES:
            assert torch.equal(getattr(d, name), getattr(ref, name)), name
    else:
        assert d is None


@pytest.mark.interpreter
def test_route_kernel_past_one_program() -> None:
    """Rows past one row block route in several programs, then one program writes the tables (here the
    large tile's); past moe_dispatch_max_rows, and with ``with_dispatch=False``, no tables."""
    logits, bias = _logits(400, 16, 1, True)
    ref_e, ref_w = route(ew.sigmoid(logits), bias, top_k=6, n_group=4, topk_group=2)
    for T, wd, tables in ((300, True, True), (400, True, False), (40, False, False)):
        e, w, d = mt.route_triton(logits[:T], bias, top_k=6, n_group=4, topk_group=2, cfg=CFG, with_dispatch=wd)
        assert torch.equal(e, ref_e[:T]) and torch.equal(w, ref_w[:T])
        assert (d is not None) == tables
        if tables:
            assert d.block_m == CFG.moe_block_m
            ref = dispatch(ref_e[:T], 16, d.block_m)
            for name in TABLES:
                assert torch.equal(getattr(d, name), getattr(ref, name)), name


@pytest.mark.interpreter
def test_route_kernel_refuses_bad_input_in_one_line() -> None:
    logits, bias = _logits(4, 16, 0, False)
    with pytest.raises(ValueError, match="float32"):
        mt.route_triton(logits.double(), bias, top_k=2, cfg=CFG)
    with pytest.raises(ValueError, match="top_k"):
        mt.route_triton(logits, bias, top_k=17, cfg=CFG)
    with pytest.raises(ValueError, match="groups"):
        mt.route_triton(logits, bias, top_k=2, n_group=3, cfg=CFG)
    with pytest.raises(ValueError, match="kept groups"):
        mt.route_triton(logits, bias, top_k=5, n_group=4, topk_group=1, cfg=CFG)
    with pytest.raises(ValueError, match="float32"):
        mt.router_logits_triton(logits, torch.zeros(16, 4, dtype=torch.float64), CFG)


@pytest.mark.interpreter
def test_router_kernel_is_the_fp32_gemm() -> None:
    """The router GEMM kernel against fp64 (its bits against the triton linear's are the GPU test's: the
    interpreter's dot is numpy's)."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(21, 200, generator=g), torch.randn(40, 200, generator=g)
    out = mt.router_logits_triton(x, w, CFG)
    ref = x.double() @ w.double().T
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.interpreter
def test_combine_with_the_shared_rows_added_is_the_torch_add() -> None:
    """The combine's pass adding the shared expert's rows: the bits of the combine, then torch's add."""
    from aligned_mamba.ops.moe.naive import combine

    g = torch.Generator().manual_seed(6)
    T, k = 9, 6
    y = torch.randn(T * k, 300, generator=g)
    pos = torch.randperm(T * k, generator=g).view(T, k)
    w, add = torch.rand(T, k, generator=g) * 3, torch.randn(T, 300, generator=g)
    ref = combine([y[pos[:, j]] for j in range(k)], w, torch.float32) + add
    cfg = dataclasses.replace(CFG, moe_combine_block_d=128)  # three column blocks, the last masked
    assert torch.equal(mt.combine_triton(y, pos, w, torch.float32, cfg, add), ref)
    with pytest.raises(ValueError, match="add"):
        mt.combine_triton(y, pos, w, torch.float32, cfg, add[:, :5])


@pytest.mark.interpreter
def test_router_gradients_are_the_torch_gemms() -> None:
    """``router_logits`` under autograd: the kernel's forward, the gradients of ``x.float() @ w.T``."""
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(13, 64, generator=g).requires_grad_(), torch.randn(16, 64, generator=g).requires_grad_()
    gy = torch.randn(13, 16, generator=g)
    out = mt.router_logits(x, w, CFG)
    assert out.requires_grad and torch.equal(out.detach(), mt.router_logits_triton(x.detach(), w.detach(), CFG))
    dx, dw = torch.autograd.grad(out, (x, w), gy)
    rx, rw = torch.autograd.grad(x.float() @ w.T, (x, w), gy)
    assert torch.equal(dx, rx) and torch.equal(dw, rw)


@pytest.mark.interpreter
@pytest.mark.parametrize("routing", [dict(num_experts_per_tok=6), dict(num_experts_per_tok=2, n_group=4, topk_group=2)])
def test_layer_rows_equal_with_and_without_gradients(routing: dict) -> None:
    """A sampler's call (no gradients: the routing kernel, its tables, the decode tile, the shared rows
    added in the combine) and a trainer's (gradients: torch's sigmoid and routing ops, the torch
    dispatch, the experts' autograd Function): the same rows at 1, 7 and 90 tokens."""
    import functools

    from aligned_mamba.layers.moe import MoE, MoEConfig
    from aligned_mamba.ops.backend import TritonBackend

    be = TritonBackend(CFG, torch.device("cpu"))
    be = be.replace(moe_experts=functools.partial(mt.moe_experts, cfg=CFG), stacked_experts=True)
    c = MoEConfig(hidden_size=D, n_routed_experts=E, moe_intermediate_size=F, moe_shared_expert_intermediate_size=24,
                  routed_scaling_factor=2.5, **routing)
    g = torch.Generator().manual_seed(3)
    tensors = {k: torch.randn(*s, generator=g) / (s[-1] ** 0.5) for k, s in c.weight_shapes().items()}
    tensors["gate.e_score_correction_bias"] = torch.rand(E, generator=g) * 0.1
    layer = MoE(c, tensors, "", backend=be, dtype=torch.float32)
    for T in (1, 7, 90):
        x = torch.randn(T, D, generator=g)
        with torch.no_grad():
            sampler = layer.advance(None, None, x)
        trainer = layer.advance(None, None, x.clone().requires_grad_())
        assert trainer.requires_grad and torch.equal(sampler, trainer.detach()), T



def _experts(T: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g)
    up = torch.randn(E, F, D, generator=g) / D ** 0.5
    down = torch.randn(E, D, F, generator=g) / F ** 0.5
    experts, weights = route(torch.sigmoid(torch.randn(T, E, generator=g)), torch.zeros(E), top_k=k)
    return h, experts, weights, up, down


@pytest.mark.interpreter
@settings(max_examples=6, deadline=None)
@given(k=st.sampled_from([1, 2, 6]), T=st.integers(1, 12), seed=st.integers(0, 2 ** 16), data=st.data())
def test_a_tokens_rows_on_the_few_token_path_equal_the_many_token_path(k: int, T: int, seed: int, data) -> None:
    """T tokens through the decode tile with the routing kernel's tables equal the same tokens' rows in
    a call of 96 tokens through the large tile (its own tables), whatever tokens share the experts."""
    big = dataclasses.replace(CFG, moe_block_m=32, moe_block_n=32, moe_block_k=16)  # k * 96 > 512 rows
    small = dataclasses.replace(big, moe_decode_block_m=16, moe_decode_block_n=16)
    h, experts, weights, up, down = _experts(96, k, seed)
    full = mt.experts_triton(h, experts, weights, up, down, big)
    rows = torch.tensor(data.draw(st.lists(st.integers(0, 95), min_size=T, max_size=T, unique=True)))
    d = dispatch(experts[rows], E, small.moe_decode_block_m)
    few = mt.experts_triton(h[rows], experts[rows], weights[rows], up, down, small, dispatch=d)
    assert torch.equal(few, full[rows])


@pytest.mark.interpreter
def test_a_k_split_few_token_gemm_differs() -> None:
    """The baseline: the up projection of a few rows with K summed in two halves (a split-K decode GEMM)
    gives some rows other bits than the kernel's one ascending K loop; the kernel's rows are the same in
    both paths (the test above), so that check can fail."""
    g = torch.Generator().manual_seed(9)
    K = 1024
    h, w = torch.randn(64, K, generator=g), torch.randn(E, 256, K, generator=g) / K ** 0.5
    experts = torch.arange(64).remainder(E)[:, None]
    d = dispatch(experts, E, 16)
    one, _ = mt.grouped_gemm(h, w, d, CFG, gather=True)
    lo, _ = mt.grouped_gemm(h[:, :K // 2], w[..., :K // 2].contiguous(), d, CFG, gather=True)
    hi, _ = mt.grouped_gemm(h[:, K // 2:], w[..., K // 2:].contiguous(), d, CFG, gather=True)
    split = lo + hi  # the same kernel on each half of K, the partial sums added
    assert not torch.equal(split, one)
    assert torch.allclose(split, one, rtol=1e-4, atol=1e-4)


@pytest.mark.interpreter
@pytest.mark.parametrize("T", [1, 64])
def test_a_decode_steps_layer_is_seven_launches(T: int) -> None:
    """The whole layer without gradients on the triton backend (every op's kernel, interpreted): the
    router GEMM, the routing with its tables, up and down, the shared expert's up with relu2 in its
    epilogue and its down, the combine with the shared rows added; no torch op besides. Past one row
    block (64 tokens) the tables are a second launch of the routing kernel. (It was about 86 launches:
    the sigmoid's torch form, sorts, the dispatch's torch ops, the add.)"""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    from aligned_mamba.layers.moe import MoE, MoEConfig
    from aligned_mamba.ops.backend import TritonBackend

    c = MoEConfig(hidden_size=D, n_routed_experts=E, num_experts_per_tok=6, moe_intermediate_size=F,
                  moe_shared_expert_intermediate_size=32, routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(*s, generator=g) / s[-1] ** 0.5 for k, s in c.weight_shapes().items()}
    layer = MoE(c, tensors, "", backend=TritonBackend(CFG, torch.device("cpu"), kernels=True), dtype=torch.float32)
    x = torch.randn(T, D, generator=g)
    kernels: collections.Counter = collections.Counter()
    ops: collections.Counter = collections.Counter()
    inside = [False]
    free = {"empty", "empty_like", "empty_strided", "new_empty", "view", "_unsafe_view", "reshape", "slice",
            "select", "unsqueeze", "t", "transpose", "alias", "detach", "as_strided", "expand", "lift_fresh"}

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0] and func.overloadpacket.__name__ not in free:
                ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    run = type(mt._route_kernel).run

    def counted(self, *a, **k):
        kernels[self.fn.__name__] += 1
        inside[0] = True
        try:
            return run(self, *a, **k)
        finally:
            inside[0] = False

    with torch.no_grad():
        layer.advance(None, None, x)
        type(mt._route_kernel).run = counted
        try:
            with Ops():
                layer.advance(None, None, x)
        finally:
            type(mt._route_kernel).run = run
    assert not ops, ops
    routes = 1 if T <= CFG.moe_route_block_t else 2
    assert sum(kernels.values()) == 6 + routes, kernels
    assert kernels["_route_kernel"] == routes and kernels["_grouped_gemm_kernel"] == 2, kernels


# -- gpu ----------------------------------------------------------------------------------------


BF16 = torch.bfloat16
GPU_ROUTINGS = {"top6": dict(num_experts_per_tok=6),
                "top2-groups": dict(num_experts_per_tok=2, n_group=8, topk_group=4),
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
                  moe_shared_expert_intermediate_size=shared, routed_scaling_factor=2.5, **GPU_ROUTINGS[routing])
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


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 64, 333, 4096])
def test_router_kernel_logits_equal_the_triton_linear(T: int) -> None:
    """The router kernel's small fp32 tiles give the triton linear's bits (its dot, its K block): the
    routing of a triton contract is what it was when the linear ran the router."""
    from aligned_mamba.ops.moe.triton import router_logits_triton

    layer = _layer("top6")
    x = _x(T)
    ours = router_logits_triton(x, layer.gate_w, layer.backend.configs)
    assert torch.equal(ours, layer.backend.linear(x.float(), layer.gate_w))


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("routing", sorted(GPU_ROUTINGS))
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


@pytest.mark.gpu
@pytest.mark.parametrize("routing", sorted(GPU_ROUTINGS))
def test_gpu_layer_rows_equal_with_and_without_gradients(routing: str) -> None:
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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
