"""Every field of the triton backend's kernel configs reaches a launch.

The contract's fingerprint covers ``TritonKernelConfigs``; that is honest only if each field is
applied. Here every Triton kernel launch is recorded instead of run (name, grid, the scalar and
constexpr arguments, the tensors' shapes, the descriptors' blocks) over a workload that touches
every op and every GEMM regime; then each field in turn is set to another accepted value and the
launches must change. A field that no launch reads fails here (a config must never be
fingerprinted and not applied), and so would a launch that ignored its config. Nothing executes,
so the shapes are the real ones and the test takes a second.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from aligned_mamba.ops.attention import triton as at  # noqa: E402
from aligned_mamba.ops.attention import triton_backward as ab  # noqa: E402
from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.conv1d import triton as ct  # noqa: E402
from aligned_mamba.ops.elementwise import triton as et  # noqa: E402
from aligned_mamba.ops.linear import triton as lt  # noqa: E402
from aligned_mamba.ops.linear import triton_tree as tt  # noqa: E402
from aligned_mamba.ops.logprobs import triton as lpt  # noqa: E402
from aligned_mamba.ops.moe import dispatch, route  # noqa: E402
from aligned_mamba.ops.moe import triton as mt  # noqa: E402
from aligned_mamba.ops.norm import triton as nt  # noqa: E402
from aligned_mamba.ops.ssd import triton_backward, triton_chunk, triton_decode  # noqa: E402
from aligned_mamba.ops.ssd.chunk import chunk_grid, pack_chunks  # noqa: E402
from aligned_mamba.ops.ssd.state import SSDState, SSMParams  # noqa: E402
from aligned_mamba.ops.step import Step  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32

# fields whose other values need others first (the configs refuse a value no launch would read)
PREREQUISITES: dict[str, dict[str, Any]] = {
    "linear_decode_persistent": {"linear_decode_tma": True},
    "linear_decode_programs_per_sm": {"linear_decode_tma": True, "linear_decode_persistent": True},
    "linear_mid_programs_per_sm": {"linear_mid_persistent": True},
    "linear_mid_persistent": {"linear_mid_programs_per_sm": 1},
    "linear_mid_tma": {"linear_mid_persistent": False, "linear_mid_programs_per_sm": 1},
    "linear_tma": {"linear_persistent": False, "linear_epi_split": 1},
    "conv_block_t": {"conv_walk": False},  # the tile kernel's rows (widths above 4, or the walk off)
}
SINGLE_VALUED = {"dot_precision"}  # "ieee" is the only value the kernels implement


def _alternative(cfg: TritonKernelConfigs, name: str) -> Any:
    """Another value of ``name`` that the configs accept (with its prerequisites)."""
    v = getattr(cfg, name)
    if isinstance(v, bool):
        cands = [not v]
    elif name == "silu":
        cands = ["device" if v == "ieee" else "ieee"]
    elif isinstance(v, str):
        cands = ["round" if v == "split2" else "split2"]
    elif name.endswith("_max_m"):
        cands = [v // 2, v // 4, 0] if v else [64]  # 0 (off) halves to itself
    elif name == "linear_fill_programs":
        cands = [0]
    elif name == "attn_split_n":  # 0 (no split) doubles to itself
        cands = [4 * cfg.attn_block_n]
    else:
        cands = [v * 2, v // 2, v + 1, v - 1]
    for c in cands:
        try:
            dataclasses.replace(cfg, **{name: c})
        except ValueError:
            continue
        return c
    raise AssertionError(f"no accepted alternative to {name}={v!r}")


def _describe(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return ("tensor", a.dtype, tuple(a.shape), a.stride())
    if hasattr(a, "block_shape"):  # a TMA descriptor
        return ("desc", tuple(a.block_shape), tuple(a.shape))
    if isinstance(a, (int, float, str, bool, type(None))):
        return a
    return type(a).__name__


def _workload(cfg: TritonKernelConfigs) -> None:
    """Every op of the triton backend at shapes that reach each GEMM regime (and the fill rule)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    K = 256
    # mid: a persistent grid, one just above its tile threshold, the large tile (an lm_head), one just
    # above its threshold and one below (the CPU counts 4 SMs)
    for M, N, dtype in [(1, 16384, BF16), (12, 16384, BF16), (64, 16384, BF16), (64, 160, BF16),
                        (200, 16384, BF16), (200, 1536, BF16), (200, 160, BF16), (8192, 1024, BF16), (8192, 64, BF16),
                        (100, 1024, F32)]:
        x, w = torch.empty(M, K, dtype=dtype), torch.empty(N, K, dtype=dtype)
        lt.linear_triton(x, w, None, cfg)
    # the row-parallel tree GEMM (row_parallel_slices 8 at TP 1, and a rank's subtree at TP 2) at a large tile
    x, w = torch.empty(8192, K, dtype=BF16), torch.empty(1024, K, dtype=BF16)
    tt.linear_tree_triton(x, w, None, 8, BF16, cfg)
    tt.linear_tree_triton(x, w, None, 4, F32, cfg)
    tt.linear_tree_triton(x[:12], w, None, 8, BF16, cfg)  # a decode batch (the split grid's rows)
    D = 2048
    x, res, wn = r(64, D), r(64, D, dtype=F32), r(D, dtype=F32)
    nt.rms_norm_triton(x, wn, 1e-5, BF16, cfg)
    nt.add_rms_norm_triton(x, res, wn, 1e-5, BF16, cfg)
    nt.embed_rms_norm_triton(torch.zeros(64, dtype=torch.int64), r(100, D), wn, 1e-5, BF16, F32, cfg)
    nt.gated_rms_norm_triton(x, r(64, D), wn, 1e-5, 4, cfg)
    nt.rms_norm_backward_triton(x, wn, 1e-5, BF16, x, cfg)
    nt.gated_rms_norm_backward_triton(x, r(64, D), wn, 1e-5, 4, x, cfg)
    Cd, W = 1024, 4
    cu = torch.tensor([0, 300, 301], dtype=torch.int64)
    slots = torch.tensor([0, 1], dtype=torch.int64)
    ct.causal_conv1d_triton(r(301, Cd), cu, slots, r(2, W - 1, Cd), r(Cd, W), r(Cd), cfg)
    ct.causal_conv1d_backward_triton(r(301, Cd), cu, r(2, W - 1, Cd), r(Cd, W), r(Cd), r(301, Cd), cfg)
    for M in (4, 48, 100):  # the split grid's rows (up to logprobs_split_max_m) and one program a row
        lpt.log_softmax_triton(r(M, 50280), cfg)
    et.relu2_triton(r(64, 3000), cfg)
    et.relu2_backward_triton(r(64, 3000), r(64, 3000), cfg)
    # attention: a prefill beside a chunk continuing from the cache, then a decode step
    Hq, Gk, Dh = 8, 2, 128
    kc = torch.empty(3, 512, Gk, Dh, dtype=BF16)
    st = at.step_tables(torch.tensor([0, 2]), torch.tensor([0, 100]), torch.tensor([0, 300, 390]), Hq // Gk, cfg,
                        "cpu")
    at.attention_triton(r(390, Hq, Dh), kc, kc, st.tiles, scale=0.1, cfg=cfg)
    dt = at.decode_step_tables(torch.tensor([0, 1]), torch.tensor([300, 5]))
    at.attention_triton(r(2, Hq, Dh), kc, kc, dt.tiles, scale=0.1, cfg=cfg)
    # MoE: the router GEMM and the routing kernel (with its tables for a few rows, without for many), the
    # grouped expert GEMMs (up with the squared ReLU, down) through the decode and the large tile, an
    # expert weight gradient, the combine's backward
    for T in (64, 600):  # the router's small tile; its large tile
        mt.router_logits_triton(r(T, 256), r(16, 256, dtype=F32), cfg)
    for T in (64, 100, 400):  # one program; routing then one tables program; past that, torch's tables
        mt.route_triton(r(T, 16, dtype=F32), torch.zeros(16), top_k=6, cfg=cfg)
        experts, weights = route(torch.rand(T, 16, generator=g), torch.zeros(16), top_k=6)
        h = r(T, 256)
        mt.experts_triton(h, experts, weights, r(16, 512, 256), r(16, 256, 512), cfg)
    mt.expert_wgrad(r(100 * 6, 512), h, dispatch(experts, 16, cfg.moe_block_m), 16, cfg, gather=True)
    mt.combine_backward(h, r(400 * 6, 256), weights, dispatch(experts, 16, cfg.moe_block_m), cfg)
    # its backward over two packed sequences (the second's queries its last 90 positions)
    cq, ck = torch.tensor([0, 300, 390]), torch.tensor([0, 300, 490])
    ab.attention_backward_triton(r(390, Hq, Dh), r(490, Gk, Dh), r(490, Gk, Dh), r(390, Hq, Dh), r(390, Hq, dtype=F32),
                                 r(390, Hq, Dh), cq, ck, scale=0.1, cfg=cfg)
    H, P, G, N, L = 4, 64, 2, 128, 256
    params = SSMParams(A=-torch.ones(H), D=torch.ones(H), dt_bias=torch.zeros(H))
    for dtype in (BF16, F32):
        state = SSDState.allocate(3, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=L, dtype=dtype)
        for step in (Step.make([0, 2], [0, 100], [700, 90]), Step.make([0, 1, 2], [700, 5, 190], [1, 1, 1])):
            T = int(step.cu_seqlens[-1])
            args = (r(T, H, P, dtype=dtype), r(T, H, dtype=dtype), r(T, G, N, dtype=dtype), r(T, G, N, dtype=dtype))
            triton_chunk.replay_chunk_triton(state, step, *args, params, cfg=cfg)
            if bool((step.lengths == 1).all()):
                triton_decode.replay_decode_triton(state, step, *args, params, cfg=cfg)
    # the scan's backward on a chunk grid of two sequences
    T, cu = 300, torch.tensor([0, 280, 300])
    ch = pack_chunks(r(T, H, P), r(T, H), r(T, G, N), cu, L, params.dt_bias, (0.0, math.inf))
    NC = ch.x.shape[0]
    grid = chunk_grid(cu, None, L, "cpu")
    triton_backward.chunk_scan_backward(ch, torch.zeros(NC, G, L, N), params.A, params.D, torch.zeros(2, H, P, N),
                                        torch.zeros(NC, H, L, P), cfg, bf16_operands=True, first=grid.first,
                                        count=grid.count)


def _launches(cfg: TritonKernelConfigs, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    trace: list[tuple] = []

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        trace.append((self.fn.__name__, tuple(grid) if not callable(grid) else "fn",
                      tuple(_describe(a) for a in args), tuple(sorted((k, _describe(v)) for k, v in kwargs.items()))))

    with monkeypatch.context() as m:
        m.setattr(type(lt._linear_tma_kernel), "run", record)  # the one class of every kernel
        _workload(cfg)
    return trace


@pytest.fixture(scope="module")
def base() -> TritonKernelConfigs:
    return TritonKernelConfigs()


def test_the_trace_is_a_function_of_the_configs(base: TritonKernelConfigs, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _launches(base, monkeypatch), _launches(base, monkeypatch)
    names = {t[0] for t in a}
    assert a == b and len(a) > 20
    for kernel in ("_linear_tma_kernel", "_linear_ptr_kernel", "_log_softmax_kernel"):
        assert kernel in names, names


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(TritonKernelConfigs)])
def test_every_field_reaches_a_launch(name: str, base: TritonKernelConfigs, monkeypatch: pytest.MonkeyPatch) -> None:
    if name in SINGLE_VALUED:
        with pytest.raises(ValueError, match="refused"):
            dataclasses.replace(base, **{name: "tf32"})
        return
    before = dataclasses.replace(base, **PREREQUISITES.get(name, {}))
    after = dataclasses.replace(before, **{name: _alternative(before, name)})
    assert _launches(before, monkeypatch) != _launches(after, monkeypatch), \
        f"{name} changed from {getattr(before, name)!r} to {getattr(after, name)!r} and no launch changed"


def test_attention_backward_launches_that_gave_wrong_gradients_are_refused(base: TritonKernelConfigs) -> None:
    with pytest.raises(ValueError, match="attn_bwd_kv_block_m 32 with attn_bwd_stages 2 refused") as exc:
        dataclasses.replace(base, attn_bwd_kv_block_m=32, attn_bwd_stages=2)
    assert "\n" not in str(exc.value)
    dataclasses.replace(base, attn_bwd_kv_block_m=32, attn_bwd_stages=1)  # one stage: the same bits every run


def test_a_value_no_launch_would_read_is_refused(base: TritonKernelConfigs) -> None:
    bad: list[Callable[[], Any]] = [
        lambda: dataclasses.replace(base, linear_decode_persistent=True),  # decode tiles use pointer loads
        lambda: dataclasses.replace(base, linear_mid_persistent=False, linear_mid_programs_per_sm=2),
        lambda: dataclasses.replace(base, linear_persistent=False, linear_tma=False),  # epi_split 2 needs TMA
    ]
    for make in bad:
        with pytest.raises(ValueError, match="refused"):
            make()
