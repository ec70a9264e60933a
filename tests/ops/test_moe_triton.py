"""The MoE expert kernels on the CPU through the Triton interpreter: logic, invariance, accuracy, gradients.

Tiny shapes and small tiles, so that a few dozen tokens cross several row tiles of one expert. A
token's MoE output (router, routed experts, shared expert) must be the same bits whether it is
routed alone or among many tokens, in any order; the stock per-expert GEMM (``F.linear`` over an
expert's rows, what transformers runs) changes a row's bits with the rows beside it, so the check
can fail. The interpreter proves the logic (tables, masks, tiles, the backward's walks); the GPU's
bits are tests/ops/test_moe_triton_gpu.py's. Everything here is fp32: the interpreter computes bf16
wrongly (the bf16 floor is the GPU test's).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import interpreted  # before triton: it switches the Triton interpreter on
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

interpreted.require()
pytestmark = pytest.mark.interpreter

from aligned_mamba.layers.moe import MoE, MoEConfig  # noqa: E402
from aligned_mamba.ops.backend import TritonBackend  # noqa: E402
from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.moe import dispatch, experts_naive, route  # noqa: E402
from aligned_mamba.ops.moe import triton as moe_triton  # noqa: E402
from aligned_mamba.ops.moe.naive import combine  # noqa: E402
from aligned_mamba.ops.moe.triton import combine_triton, experts_triton  # noqa: E402

# small tiles: an expert's tokens span several row tiles, a weight several K blocks
CFG = dataclasses.replace(TritonKernelConfigs(), moe_block_m=16, moe_block_n=32, moe_block_k=16,
                          moe_wgrad_block_n=32, moe_wgrad_block_k=16, moe_wgrad_block_t=16)
D, F, E = 48, 40, 16
ROUTINGS = {"top2": dict(num_experts_per_tok=2), "top6": dict(num_experts_per_tok=6),
            "top2-groups": dict(num_experts_per_tok=2, n_group=4, topk_group=2),
            "top6-groups": dict(num_experts_per_tok=6, n_group=4, topk_group=2)}


def _interpreted_backend() -> TritonBackend:
    """The triton backend on the CPU with the expert kernels interpreted (its other ops run the CPU
    backend's forms under the interpreter, as always)."""
    be = TritonBackend(TritonKernelConfigs(), torch.device("cpu"))
    return be.replace(moe_experts=functools.partial(moe_triton.moe_experts, cfg=CFG), stacked_experts=True)


def _layer(routing: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> MoE:
    c = MoEConfig(hidden_size=D, n_routed_experts=E, moe_intermediate_size=F, moe_shared_expert_intermediate_size=24,
                  routed_scaling_factor=2.5, **ROUTINGS[routing])
    g = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(*s, generator=g) / (s[-1] ** 0.5) for k, s in c.weight_shapes().items()}
    tensors["gate.e_score_correction_bias"] = torch.rand(E, generator=g) * 0.1
    return MoE(c, tensors, "", backend=_interpreted_backend(), dtype=dtype)


def _rows(T: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _routed(T: int, k: int, seed: int, dtype: torch.dtype = torch.float32, **groups: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g).to(dtype)
    up = (torch.randn(E, F, D, generator=g) / D ** 0.5).to(dtype)
    down = (torch.randn(E, D, F, generator=g) / F ** 0.5).to(dtype)
    experts, weights = route(torch.sigmoid(torch.randn(T, E, generator=g)), torch.zeros(E), top_k=k, **groups)
    return h, experts, weights, up, down


def test_dispatch_tables_cover_each_experts_rows_once() -> None:
    experts, _ = route(torch.rand(37, E, generator=torch.Generator().manual_seed(3)), torch.zeros(E), top_k=6)
    d = dispatch(experts, E, block_m=16)
    flat = experts.reshape(-1)
    assert torch.equal(flat[d.perm], torch.sort(flat).values)  # sorted by expert
    for e in range(E):  # an expert's rows in ascending token order (the stable sort)
        toks = d.token[d.offsets[e]:d.offsets[e + 1]]
        assert torch.equal(toks, torch.sort(toks).values)
    assert torch.equal(d.perm[d.pos.reshape(-1)], torch.arange(flat.numel()))
    covered = torch.zeros(flat.numel(), dtype=torch.int64)
    for e, r0, r1 in zip(d.tile_expert.tolist(), d.tile_row0.tolist(), d.tile_row1.tolist()):
        rows = torch.arange(r0, min(r1, r0 + 16))
        covered[rows] += 1
        assert bool((flat[d.perm[rows]] == e).all())
    assert bool((covered == 1).all())


@pytest.mark.parametrize("k", [1, 2, 6])
def test_combine_kernel_has_the_torch_combines_bits(k: int) -> None:
    """One pass over a token's k rows: the same fp32 products and sums, in the same order, as the
    torch form's combine (so the layer's bits do not depend on which form combined)."""
    g = torch.Generator().manual_seed(k)
    T, R = 9, 9 * k
    y = torch.randn(R, 2100, generator=g)  # two column blocks, the second masked
    pos = torch.randperm(R, generator=g).view(T, k)
    w = torch.rand(T, k, generator=g) * 3
    cfg = dataclasses.replace(CFG, moe_combine_block_d=2048)
    assert torch.equal(combine_triton(y, pos, w, torch.float32, cfg), combine([y[pos[:, j]] for j in range(k)], w,
                                                                            torch.float32))


@settings(max_examples=10, deadline=None)
@given(routing=st.sampled_from(sorted(ROUTINGS)), T=st.integers(2, 48), seed=st.integers(0, 2 ** 16), data=st.data())
def test_a_tokens_moe_output_does_not_depend_on_the_other_tokens(routing: str, T: int, seed: int, data) -> None:
    """The whole layer (fp32 router, grouped expert kernels, shared expert): a row's bits alone, among a
    drawn subset in a drawn order, and among all T rows are the same."""
    layer = _layer(routing)
    x = _rows(T, seed)
    full = layer.advance(None, None, x)
    picked = data.draw(st.lists(st.integers(0, T - 1), min_size=1, max_size=min(T, 24), unique=True))
    idx = torch.tensor(picked)
    assert torch.equal(layer.advance(None, None, x[idx]), full[idx])
    one = picked[0]
    assert torch.equal(layer.advance(None, None, x[one:one + 1])[0], full[one])


def test_stock_per_expert_gemm_rows_depend_on_the_batch() -> None:
    """The baseline: the same experts through ``F.linear`` over each expert's rows (transformers' loop)
    give some rows other bits alone than among 96 rows; the kernels give every row its bits."""
    h, experts, weights, up, down = _routed(96, 6, seed=5)

    def stock(rows: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(rows.numel(), D)
        for e in range(E):
            t, j = torch.nonzero(experts[rows] == e, as_tuple=True)
            a = torch.relu(torch.nn.functional.linear(h[rows][t], up[e])) ** 2
            out.index_add_(0, t, torch.nn.functional.linear(a, down[e]) * weights[rows][t, j, None])
        return out

    every = torch.arange(96)
    full_stock, full = stock(every), experts_triton(h, experts, weights, up, down, CFG)
    differ = sum(not torch.equal(stock(torch.tensor([t]))[0], full_stock[t]) for t in range(96))
    assert differ > 0, "the stock per-expert GEMM gave every row its bits: the check below cannot fail"
    for t in range(96):
        assert torch.equal(experts_triton(h[t:t + 1], experts[t:t + 1], weights[t:t + 1], up, down, CFG)[0], full[t])


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_fp32_matches_the_fp64_reference(routing: str) -> None:
    r = ROUTINGS[routing]
    groups = {k: v for k, v in r.items() if k != "num_experts_per_tok"}
    h, experts, weights, up, down = _routed(40, r["num_experts_per_tok"], seed=len(routing), **groups)
    out = experts_triton(h, experts, weights, up, down, CFG)
    ref = experts_naive(h.double(), experts, weights.double(), up.double(), down.double())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


def _grads(h, experts, weights, up, down, fn, g):
    leaves = [t.detach().clone().requires_grad_() for t in (h, weights, up, down)]
    fn(leaves[0], experts, leaves[1], leaves[2], leaves[3]).backward(g)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("k", [2, 6])
def test_gradients_match_autograd_of_the_reference(k: int) -> None:
    """d h, d weights (the router's path), d up_w, d down_w against torch autograd of the fp64 reference."""
    h, experts, weights, up, down = _routed(40, k, seed=k)
    g = torch.randn(40, D, generator=torch.Generator().manual_seed(1))
    ours = _grads(h, experts, weights, up, down, lambda *a: experts_triton(*a, CFG), g)
    ref = _grads(h.double(), experts, weights.double(), up.double(), down.double(), experts_naive, g.double())
    for name, a, b in zip(("h", "weights", "up_w", "down_w"), ours, ref):
        assert a.dtype == (torch.float32), name
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-6, name
    # an expert no token chose gets an exact zero gradient
    unused = sorted(set(range(E)) - set(experts.unique().tolist()))
    for e in unused:
        assert not ours[2][e].any() and not ours[3][e].any()


def test_fused_backward_has_the_unfused_ops_bits() -> None:
    """The backward's kernels (the combine's backward, the squared ReLU's derivative in the data GEMM's
    epilogue, the input gradient's slot-order sum) give the torch ops' bits for d h, d up_w, d down_w
    (d weights: a reduction of another order, equal to rounding)."""
    from moe_unfused import unfused_backward

    h, experts, weights, up, down = _routed(40, 6, seed=11)
    g = torch.randn(40, D, generator=torch.Generator().manual_seed(12))
    ours = _grads(h, experts, weights, up, down, lambda *a: experts_triton(*a, CFG), g)
    ref = unfused_backward(h, experts, weights, up, down, g, CFG)
    for name, a, b in zip(("h", "up_w", "down_w"), (ours[0], ours[2], ours[3]), ref):
        assert torch.equal(a, b), name
    torch.testing.assert_close(ours[1], ref[3], rtol=1e-5, atol=1e-6)


def test_backward_is_deterministic_and_reaches_the_router() -> None:
    """Two backwards through the whole layer give the same bits; the router's weight gets a gradient
    (through the routing weights) and so does every chosen expert."""
    layer = _layer("top6-groups")
    for w in (layer.gate_w, layer.up_w, layer.down_w):
        w.requires_grad_()
    x = _rows(40, 7)
    g = torch.randn(40, D, generator=torch.Generator().manual_seed(2))
    runs = []
    for _ in range(2):
        for w in (layer.gate_w, layer.up_w, layer.down_w):
            w.grad = None
        layer.advance(None, None, x).backward(g)
        runs.append([w.grad.clone() for w in (layer.gate_w, layer.up_w, layer.down_w)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert all(bool(t.abs().sum() > 0) for t in runs[0])


def test_bad_input_is_refused_in_one_line() -> None:
    h, experts, weights, up, down = _routed(4, 2, seed=0)
    with pytest.raises(ValueError, match=r"\[E, f, d\]"):
        experts_triton(h, experts, weights, up.transpose(1, 2), down, CFG)
    with pytest.raises(ValueError, match="must both be"):
        experts_triton(h, experts[:, :1], weights, up, down, CFG)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        experts_triton(h.double(), experts, weights, up.double(), down.double(), CFG)


def test_bench_moe_dry_run(tmp_path) -> None:
    """benchmarks/bench_moe_h200.py's CPU dry run: every path that needs no CUDA runs; our rows alone equal
    our rows in the batch, two backwards of the kernels agree."""
    import json
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = tmp_path / "moe.json"
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_moe_h200.py"), "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=600, cwd=root)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [c["tokens"] for c in res["layer"]] == [1, 12, 40] and all(c["bitwise"] for c in res["layer"])
    assert res["backward"][0]["ours_grads_repeat_equal"]
