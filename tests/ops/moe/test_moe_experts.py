"""The MoE expert kernels (``ops.moe.triton``): logic, invariance, accuracy, gradients, and their sm_90 code.

- interpreter (the Triton interpreter, CPU): tiny shapes and small tiles, so that a few dozen tokens
  cross several row tiles of one expert. A token's MoE output (router, routed experts, shared expert)
  must be the same bits whether it is routed alone or among many tokens, in any order; the stock
  per-expert GEMM (``F.linear`` over an expert's rows, what transformers runs) changes a row's bits
  with the rows beside it, so the check can fail. The interpreter proves the logic (tables, masks,
  tiles, the backward's walks). Everything is fp32: the interpreter computes bf16 wrongly (the bf16
  floor is the GPU tests').
- gpu (skipped without CUDA; run on the H200): a token's MoE layer output (fp32 router, grouped expert
  GEMMs, shared expert) is the same bits routed alone, among 64 and among 4096 tokens, top-k 2 and 6,
  with and without groups; the stock layer (fp32 cuBLAS router, ``torch._grouped_mm`` experts, cuBLAS
  shared expert) changes some rows' bits between those calls at Nemotron-3-Nano's shape, so the check
  can fail. The kernels' expert rows equal the triton backend's row-invariant linear (and relu2) on
  the same rows: the grouped GEMM has the linear's K block and dot. Accuracy against fp64 at the bf16
  floor (within 1.5x of the stock GEMMs' own error); gradients against autograd of the fp64
  reference, within 1.5x of the stock's; two backwards equal. Whole MoE hybrids: every exact-replay
  case of ``check`` gives 0 differing rows, the baseline differs; CUDA-graph decode rows equal the
  trainer's single pass.
- compile (sm_90, the H200, offline, no GPU, to PTX: ptxas is left to the GPU tests): every variant
  the launchers use, with the backend's pinned configs: the grouped GEMM with the fused squared ReLU
  (up), plain (down, and both data gradients over transposed weights, the first with the squared
  ReLU's derivative), and the expert weight gradient with and without a gathered operand, the
  weighted combine and the plain sum, the combine's backward, the few-row path (the decode tile, the
  fp32 router GEMM on its small and large tiles, the routing kernel with and without its dispatch
  tables, and the tables alone). bf16 dots run on tensor cores, warpgroup MMA for the grouped GEMM's
  large tile; nothing is contracted into an FMA.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import interpreted  # noqa: F401  (the interpreter on, before triton is imported; tests/ops/conftest.py)
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sm90_offline import run_sm90_script

from aligned_mamba.layers.moe import MoE, MoEConfig
from aligned_mamba.ops.backend import TritonBackend
from aligned_mamba.ops.configs import TritonKernelConfigs
from aligned_mamba.ops.moe import dispatch, experts_naive, route
from aligned_mamba.ops.moe import triton as moe_triton
from aligned_mamba.ops.moe.naive import combine
from aligned_mamba.ops.moe.triton import combine_triton, experts_triton

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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
def test_experts_read_in_place_give_the_stacks_bits() -> None:
    """Each expert's own weights through their addresses (``ExpertTable``): every grouped GEMM form (up with
    the gather and the squared ReLU, down, both transposed data gradients) gives the stacked weights' bits;
    weights the kernels cannot read in place (not 16-byte aligned) are stacked for the call, same bits."""
    h, experts, weights, up, down = _routed(40, 6, seed=5)
    d = moe_triton.dispatch(experts, E, CFG.moe_block_m)
    ups, downs = list(up.unbind(0)), list(down.unbind(0))
    assert moe_triton.ExpertTable.readable(ups) and moe_triton.ExpertTable.readable(downs)
    act, u = moe_triton.grouped_gemm(h, up, d, CFG, gather=True, relu2=True)
    y, _ = moe_triton.grouped_gemm(act, down, d, CFG, gather=False)
    for b, bt, a, kw in ((up, ups, h, dict(gather=True, relu2=True)), (down, downs, act, dict(gather=False)),
                         (down, downs, y, dict(gather=False, transpose_b=True, drelu2=u)),
                         (up, ups, act, dict(gather=False, transpose_b=True))):
        want = moe_triton.grouped_gemm(a, b, d, CFG, **kw)
        got = moe_triton.grouped_gemm(a, moe_triton.ExpertTable.of(bt), d, CFG, **kw)
        assert all(x is y is None or torch.equal(x, y) for x, y in zip(got, want)), kw
    # one fp32 element off 16 bytes: not readable in place, stacked for the call
    flat = torch.empty(up.numel() + 1)
    shifted = list(flat[1:].view_as(up).copy_(up).unbind(0))
    assert not moe_triton.ExpertTable.readable(shifted)
    assert torch.equal(experts_triton(h, experts, weights, shifted, downs, CFG),
                       experts_triton(h, experts, weights, up, down, CFG))


def _layer_step(layer: MoE, leaves: list[torch.Tensor], x: torch.Tensor,
                g: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """The layer's forward and backward to its expert weights' ``leaves``: (the output and each leaf's
    gradient, the bytes the autograd graph saved for the backward outside the leaves' own storage)."""
    own = {w.untyped_storage().data_ptr() for w in leaves}
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer.advance(None, None, x)
    return [out.detach(), *torch.autograd.grad(out, leaves, g)], sum(saved)


@pytest.mark.interpreter
def test_a_trainers_expert_parameters_are_not_kept_stacked_for_the_backward() -> None:
    """Expert weights that require gradients (a trainer's, as the Megatron hook passes its parameters) stay
    a list: the kernels read each where it lies (``ExpertTable``), so the graph keeps
    no second copy of every expert weight for the backward, as a stack made at build (still made for weights
    without gradients) did. Output and each expert's gradient: the stacked launch's bits."""
    import copy

    c = MoEConfig(hidden_size=D, n_routed_experts=E, moe_intermediate_size=F, moe_shared_expert_intermediate_size=24,
                  **ROUTINGS["top6"])
    g = torch.Generator().manual_seed(3)
    tensors = {k: torch.randn(*s, generator=g) / (s[-1] ** 0.5) for k, s in c.weight_shapes().items()}
    tensors["gate.e_score_correction_bias"] = torch.zeros(E)
    names = [f"experts.{e}.{p}_proj.weight" for p in ("up", "down") for e in range(E)]
    x, dy = _rows(40, 4), torch.randn(40, D, generator=g)
    leaves = {k: v.clone().requires_grad_() for k, v in tensors.items() if k in names}
    listed = MoE(c, {**tensors, **leaves}, "", backend=_interpreted_backend(), dtype=torch.float32)
    assert isinstance(listed.up_w, list)
    ours, kept = _layer_step(listed, [leaves[k] for k in names], x, dy)
    # the baseline: the stack of the leaves as the build made it before, the gradients flowing through it
    stacked = copy.copy(listed)
    base = [v.clone().requires_grad_() for v in (tensors[k] for k in names)]
    stacked.up_w, stacked.down_w = torch.stack(base[:E]), torch.stack(base[E:])
    theirs, kept_stacked = _layer_step(stacked, base, x, dy)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    expert_bytes = sum(tensors[k].numel() * 4 for k in names)
    assert kept < expert_bytes <= kept_stacked, (kept, expert_bytes, kept_stacked)


@pytest.mark.interpreter
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


@pytest.mark.interpreter
def test_sliced_layer_on_the_kernels_backend_gives_tp1s_bits_at_tp2_and_4(monkeypatch) -> None:
    """Under row_parallel_slices 4 the layer runs expert by expert, each expert an MLP whose down projection
    is the tree GEMM, also on the triton backend (every op its kernel here), whose grouped kernels have no
    sliced tree: TP 2 and 4 (ranks as threads, each holding its channels of every expert and of the shared
    expert) give TP 1's bits; stock tensor parallelism (each rank's partial rounded, then summed) differs."""
    import threading

    from triton.runtime import interpreter

    from aligned_mamba.baseline import stock_row_parallel
    from aligned_mamba.layers.moe import shard_weights
    from aligned_mamba.parallel import TPGroup, threads

    one_at_a_time, launch = threading.Lock(), interpreter.GridExecutor.__call__

    def serialised(self, *args, **kwargs):  # the interpreter patches triton.language for each launch
        with one_at_a_time:
            return launch(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", serialised)
    be = TritonBackend(CFG, torch.device("cpu"), kernels=True)
    c = MoEConfig(hidden_size=D, n_routed_experts=8, moe_intermediate_size=32, moe_shared_expert_intermediate_size=16,
                  routed_scaling_factor=2.5, num_experts_per_tok=2)
    g = torch.Generator().manual_seed(4)
    tensors = {k: torch.randn(*s, generator=g) / (s[-1] ** 0.5) for k, s in c.weight_shapes().items()}
    x = _rows(12, 5)

    def rank(group: TPGroup, stock: bool = False) -> torch.Tensor:
        layer = MoE(c, shard_weights(c, tensors, "", group), "", backend=be, dtype=torch.float32, tp=group, slices=4)
        return (layer.with_row_parallel(stock_row_parallel) if stock else layer).advance(None, None, x)

    one = rank(TPGroup.single())
    assert torch.equal(one, MoE(c, tensors, "", backend=be, dtype=torch.float32, slices=4).advance(None, None, x))
    for size in (2, 4):
        assert all(torch.equal(out, one) for out in threads(rank, size)), size
    assert int((threads(rank, 2, True)[0] != rank(TPGroup.single(), True)).any(dim=1).sum()) > 0


@pytest.mark.interpreter
def test_bad_input_is_refused_in_one_line() -> None:
    h, experts, weights, up, down = _routed(4, 2, seed=0)
    with pytest.raises(ValueError, match=r"\[E, f, d\]"):
        experts_triton(h, experts, weights, up.transpose(1, 2), down, CFG)
    with pytest.raises(ValueError, match="must both be"):
        experts_triton(h, experts[:, :1], weights, up, down, CFG)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        experts_triton(h.double(), experts, weights, up.double(), down.double(), CFG)


@pytest.mark.interpreter
def test_bench_moe_dry_run(tmp_path) -> None:
    """benchmarks/bench_moe_h200.py's CPU dry run: every path that needs no CUDA runs; our rows alone equal
    our rows in the batch, two backwards of the kernels agree."""
    import json
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = tmp_path / "moe.json"
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_moe_h200.py"), "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=600, cwd=root)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [c["tokens"] for c in res["layer"]] == [1, 12, 40] and all(c["bitwise"] for c in res["layer"])
    assert res["backward"][0]["ours_grads_repeat_equal"]


# -- gpu ----------------------------------------------------------------------------------------


BF16 = torch.bfloat16
GPU_D, GPU_F, GPU_E = 1024, 512, 64
GPU_ROUTINGS = {"top2": dict(num_experts_per_tok=2), "top6": dict(num_experts_per_tok=6),
            "top2-groups": dict(num_experts_per_tok=2, n_group=8, topk_group=4),
            "top6-groups": dict(num_experts_per_tok=6, n_group=8, topk_group=4)}


def _gpu_backend():
    from aligned_mamba.contract import Contract
    from aligned_mamba.ops.backend import resolve
    return resolve(Contract(chunk_size=64, backend="triton", model_dtype="bfloat16"), "cuda")


def _gpu_layer(routing: str, seed: int = 0):
    from aligned_mamba.layers.moe import MoE, MoEConfig

    c = MoEConfig(hidden_size=GPU_D, n_routed_experts=GPU_E, moe_intermediate_size=GPU_F,
                  moe_shared_expert_intermediate_size=768, routed_scaling_factor=2.5, **GPU_ROUTINGS[routing])
    g = torch.Generator().manual_seed(seed)
    tensors = {k: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(BF16) for k, s in c.weight_shapes().items()}
    tensors["gate.e_score_correction_bias"] = torch.rand(GPU_E, generator=g) * 0.1
    return MoE(c, tensors, "", backend=_gpu_backend(), dtype=BF16)


def _gpu_routed(T: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    from aligned_mamba.ops.moe import route

    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(T, GPU_D, generator=g, device="cuda").to(BF16)
    up = (torch.randn(GPU_E, GPU_F, GPU_D, generator=g, device="cuda") / GPU_D ** 0.5).to(BF16)
    down = (torch.randn(GPU_E, GPU_D, GPU_F, generator=g, device="cuda") / GPU_F ** 0.5).to(BF16)
    experts, weights = route(torch.sigmoid(torch.randn(T, GPU_E, generator=g, device="cuda")),
                             torch.zeros(GPU_E, device="cuda"), top_k=k)
    return h, experts, weights, up, down


def _stock(h, experts, weights, up, down):
    """The stock path: cuBLAS ``F.linear`` over each expert's rows, the same roundings and combine."""
    from aligned_mamba.ops.elementwise import relu2
    from aligned_mamba.ops.moe import experts_grouped
    return experts_grouped(h, experts, weights, up, down, linear=lambda x, w, b=None: torch.nn.functional.linear(x, w),
                           relu2=relu2)


@pytest.mark.gpu
@pytest.mark.parametrize("routing", sorted(GPU_ROUTINGS))
def test_a_tokens_moe_output_is_the_same_alone_among_64_and_among_4096(routing: str) -> None:
    layer = _gpu_layer(routing)
    x = torch.randn(4096, GPU_D, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda").to(BF16)
    full = layer.advance(None, None, x)
    pick = torch.randperm(4096, generator=torch.Generator().manual_seed(2))[:64].cuda()
    assert torch.equal(layer.advance(None, None, x[pick]), full[pick])
    for t in pick[:16].tolist():
        assert torch.equal(layer.advance(None, None, x[t:t + 1])[0], full[t])


def _stock_layer(w: dict, c, x: torch.Tensor) -> torch.Tensor:
    """The stock MoE layer on the same weights (``bench_moe_h200.Stock``'s grouped form): the router as
    fp32 cuBLAS ``F.linear`` + sigmoid + ``torch.topk``, the experts through ``torch._grouped_mm`` over
    the tokens sorted by expert, the shared expert through cuBLAS, torch's weighted sum."""
    import torch.nn.functional as F

    E, k = c.n_routed_experts, c.num_experts_per_tok
    scores = torch.sigmoid(F.linear(x.float(), w["gate.weight"].float()))
    idx = torch.topk(scores + w["gate.e_score_correction_bias"], k, dim=-1).indices
    wt = scores.gather(1, idx)
    wt = wt / (wt.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
    up = torch.stack([w[f"experts.{e}.up_proj.weight"] for e in range(E)])
    down = torch.stack([w[f"experts.{e}.down_proj.weight"] for e in range(E)])
    flat = idx.reshape(-1)
    order = torch.argsort(flat)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    a = torch.square(torch.relu(torch._grouped_mm(x[order // k], up.transpose(1, 2), offs=offs)))
    y = torch.empty(flat.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    y[order] = torch._grouped_mm(a, down.transpose(1, 2), offs=offs)
    routed = (y.view(-1, k, x.shape[1]).float() * wt[..., None]).sum(1).to(x.dtype)
    shared = F.linear(torch.square(torch.relu(F.linear(x, w["shared_experts.up_proj.weight"]))),
                      w["shared_experts.down_proj.weight"])
    return routed + shared


@pytest.mark.gpu
def test_stock_layer_rows_depend_on_the_batch_at_nanos_shape() -> None:
    """The baseline the test above prevents, at Nemotron-3-Nano-30B-A3B's MoE shape (hidden 2688, 128
    experts top-6, width 1856, shared expert 3712): the stock layer gives some of 8 tokens other bits
    alone than among 64 or 4096 tokens; ours gives every one the same. (On the H200 a per-expert cuBLAS
    loop, and torch._grouped_mm alone, kept every sampled row's bits at this file's smaller shape.)"""
    from aligned_mamba.layers.moe import MoE, MoEConfig

    c = MoEConfig(hidden_size=2688, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
                  moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5)
    g = torch.Generator(device="cuda").manual_seed(0)
    w = {n: (torch.randn(*s, generator=g, device="cuda") / s[-1] ** 0.5).to(BF16) for n, s in c.weight_shapes().items()}
    w["gate.e_score_correction_bias"] = torch.rand(128, generator=g, device="cuda") * 0.01
    layer = MoE(c, w, "", backend=_gpu_backend(), dtype=BF16)
    x = torch.randn(4096, 2688, generator=g, device="cuda").to(BF16)
    stock_differ = ours_differ = 0
    with torch.no_grad():
        for T in (64, 4096):
            stock, ours = _stock_layer(w, c, x[:T]), layer.advance(None, None, x[:T])
            for t in range(8):
                stock_differ += not torch.equal(_stock_layer(w, c, x[t:t + 1])[0], stock[t])
                ours_differ += not torch.equal(layer.advance(None, None, x[t:t + 1])[0], ours[t])
    assert ours_differ == 0
    assert stock_differ > 0


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 4096])
def test_expert_rows_equal_the_triton_linear(T: int) -> None:
    """The grouped kernels' output equals the torch form run with the backend's linear_triton and
    relu2_triton over each expert's rows (the same K block and dot, so the same row bits)."""
    from aligned_mamba.ops.moe import experts_grouped
    from aligned_mamba.ops.moe.triton import experts_triton

    be = _gpu_backend()
    h, experts, weights, up, down = _gpu_routed(T, 6, seed=T)
    ours = experts_triton(h, experts, weights, up, down, be.configs)
    assert torch.equal(ours, experts_grouped(h, experts, weights, up, down, linear=be.linear, relu2=be.relu2))


@pytest.mark.gpu
def test_gpu_combine_kernel_has_the_torch_combines_bits() -> None:
    from aligned_mamba.ops.moe.naive import combine
    from aligned_mamba.ops.moe.triton import combine_triton

    g = torch.Generator(device="cuda").manual_seed(4)
    T, k = 4096, 6
    y = torch.randn(T * k, GPU_D, generator=g, device="cuda").to(BF16)
    pos = torch.randperm(T * k, generator=g, device="cuda").view(T, k)
    w = torch.rand(T, k, generator=g, device="cuda")
    ref = combine([y[pos[:, j]] for j in range(k)], w, BF16)
    assert torch.equal(combine_triton(y, pos, w, BF16, _gpu_backend().configs), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [64, 4096])
def test_bf16_accuracy_is_at_the_bf16_floor(T: int) -> None:
    from aligned_mamba.ops.moe import experts_grouped
    from aligned_mamba.ops.moe.triton import experts_triton

    h, experts, weights, up, down = _gpu_routed(T, 6, seed=10 + T)
    f64 = torch.float64
    ref = experts_grouped(h.to(f64), experts, weights.to(f64), up.to(f64), down.to(f64),
                          linear=lambda x, w, b=None: x @ w.T, relu2=lambda u: torch.relu(u) ** 2)
    err = ((experts_triton(h, experts, weights, up, down, _gpu_backend().configs).to(f64) - ref).norm() / ref.norm())
    floor = (_stock(h, experts, weights, up, down).to(f64) - ref).norm() / ref.norm()
    assert err.item() < 1.5 * floor.item(), (err.item(), floor.item())


@pytest.mark.gpu
def test_gradients_against_fp64_and_deterministic() -> None:
    from aligned_mamba.ops.moe import experts_naive
    from aligned_mamba.ops.moe.triton import experts_triton

    cfg = _gpu_backend().configs
    T = 256
    h, experts, weights, up, down = _gpu_routed(T, 6, seed=7)
    g = torch.randn(T, GPU_D, generator=torch.Generator(device="cuda").manual_seed(8), device="cuda").to(BF16)
    ours = _grads(h, experts, weights, up, down, lambda *a: experts_triton(*a, cfg), g)
    again = _grads(h, experts, weights, up, down, lambda *a: experts_triton(*a, cfg), g)
    assert all(torch.equal(a, b) for a, b in zip(ours, again))
    stock = _grads(h, experts, weights, up, down, _stock, g)
    f64 = torch.float64
    ref = _grads(h.to(f64), experts, weights.to(f64), up.to(f64), down.to(f64), experts_naive, g.to(f64))
    for name, a, s, r in zip(("h", "weights", "up_w", "down_w"), ours, stock, ref):
        err = ((a.to(f64) - r).norm() / r.norm()).item()
        floor = ((s.to(f64) - r).norm() / r.norm()).item()
        assert err < 1.5 * floor + 1e-6, (name, err, floor)


@pytest.mark.gpu
def test_backward_at_4096_tokens_is_deterministic() -> None:
    from aligned_mamba.ops.moe.triton import experts_triton

    cfg = _gpu_backend().configs
    h, experts, weights, up, down = _gpu_routed(4096, 6, seed=9)
    g = torch.randn(4096, GPU_D, generator=torch.Generator(device="cuda").manual_seed(9), device="cuda").to(BF16)
    runs = [_grads(h, experts, weights, up, down, lambda *a: experts_triton(*a, cfg), g) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [64, 4096])
def test_gpu_fused_backward_has_the_unfused_ops_bits(T: int) -> None:
    """In bf16, where every rounding shows: the backward's kernels (the combine's backward, the squared
    ReLU's derivative in the data GEMM's epilogue, the input gradient's slot-order sum) give the bits
    of those steps as torch ops for d h, d up_w, d down_w; d weights (another reduction order) within
    fp32 rounding. The derivative of the product unrounded (fp32) gives other d h bits."""
    from moe_unfused import unfused_backward

    from aligned_mamba.ops.moe.triton import experts_triton

    cfg = _gpu_backend().configs
    h, experts, weights, up, down = _gpu_routed(T, 6, seed=10)
    g = torch.randn(T, GPU_D, generator=torch.Generator(device="cuda").manual_seed(10), device="cuda").to(BF16)
    ours = _grads(h, experts, weights, up, down, lambda *a: experts_triton(*a, cfg), g)
    ref = unfused_backward(h, experts, weights, up, down, g, cfg)
    for name, a, b in zip(("h", "up_w", "down_w"), (ours[0], ours[2], ours[3]), ref):
        assert torch.equal(a, b), name
    torch.testing.assert_close(ours[1], ref[3], rtol=1e-5, atol=1e-5)
    assert not torch.equal(unfused_backward(h, experts, weights, up, down, g, cfg, unrounded=True)[0], ref[0])


HYBRIDS = {
    "moe_top2": dict(pattern="MEM*E", num_experts_per_tok=2),
    "moe_top6_groups": dict(pattern="M*EME", n_routed_experts=16, num_experts_per_tok=6, n_group=4, topk_group=2),
}
SMALL = dict(hidden_size=256, vocab_size=512, mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=32,
             intermediate_size=512, chunk_size=64, moe_intermediate_size=256, moe_shared_expert_intermediate_size=384,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64)


def _hybrid(layout: str):
    from aligned_mamba.contract import Contract
    from aligned_mamba.models import build_model
    from aligned_mamba.models.nemotron_h import make_tiny_hybrid

    over = dict(HYBRIDS[layout])
    cfg, tensors = make_tiny_hybrid(12, dtype="bfloat16", pattern=over.pop("pattern"), **{**SMALL, **over})
    return build_model(cfg, tensors, Contract(chunk_size=cfg.chunk_size, backend="triton", model_dtype="bfloat16"),
                       device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(HYBRIDS))
def test_moe_hybrid_check_on_triton_backend_is_bit_identical(layout: str) -> None:
    from check_cases import assert_every_case

    assert_every_case(_hybrid(layout))


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 64, 256])
def test_moe_hybrid_graph_decode_rows_equal_the_single_pass(B: int) -> None:
    from check_cases import assert_graph_decode_equals_single_pass

    assert_graph_decode_equals_single_pass(_hybrid("moe_top6_groups"), B, steps=24, max_start=600)


# -- compile ------------------------------------------------------------------------------------


_COMPILE = r"""
import inspect, json, os
os.environ.pop("TRITON_INTERPRET", None)
import torch
from triton.compiler import ASTSource
from sm90_offline import compile_until
from aligned_mamba.ops.configs import TritonKernelConfigs
from aligned_mamba.ops.moe import triton as mt

cfg = TritonKernelConfigs()
i64 = "*i64"
done = {}


def comp(fn, types, consts, warps, stages, div16=(), fusion=False):
    # as a launch specializes them: pointers and ints that are multiples of 16 (Nemotron-3-Nano's
    # sizes and strides are) get divisibility 16, an int equal to 1 is a constant
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in inspect.signature(fn.fn).parameters}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, v) in enumerate(sig.items())
             if v.startswith("*") or n in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    # the checks read the PTX and the shared memory (known before the PTX): no ptxas
    k = compile_until(src, dict(num_warps=warps, num_stages=stages, enable_fp_fusion=fusion), until="ptx")
    ptx = k.asm["ptx"]
    return dict(fma=ptx.count("fma.rn.f32"), wgmma="wgmma" in ptx, mma="mma.sync" in ptx,
                shared=k.metadata.shared, cp_async=ptx.count("cp.async"))


for dt in ("bf16", "fp32"):
    # up (gathered rows, the squared ReLU), down, and the data gradients (weights read transposed)
    # (the first data gradient with the squared ReLU's derivative in its epilogue)
    for name, gather, relu2, drelu2, unit in (("up", True, True, False, "stride_bk"),
                                              ("down", False, False, False, "stride_bk"),
                                              ("data-grad", False, False, False, "stride_bn"),
                                              ("data-grad drelu2", False, False, True, "stride_bn")):
        t = {n: f"*{dt}" for n in ("a_ptr", "b_ptr", "c_ptr", "u_ptr")}
        t.update(arow_ptr=i64, tile_expert_ptr=i64, tile_row0_ptr=i64, tile_row1_ptr=i64)
        c = dict(GATHER=gather, RELU2=relu2, DRELU2=drelu2, BLOCK_M=cfg.moe_block_m, BLOCK_N=cfg.moe_block_n,
                 BLOCK_K=cfg.moe_block_k, PRECISION="ieee", B_TABLE=False, **{unit: 1})
        div = {"N", "K", "stride_am", "stride_be", "stride_bn", "stride_bk", "stride_cm"} - {unit}
        done[f"{dt} grouped {name}"] = comp(mt._grouped_gemm_kernel, t, c, cfg.moe_warps, cfg.moe_stages, div)
        if name in ("up", "data-grad"):  # a trainer's experts read in place through their addresses
            done[f"{dt} grouped {name} table"] = comp(mt._grouped_gemm_kernel, {**t, "b_ptr": i64},
                                                      {**c, "B_TABLE": True}, cfg.moe_warps, cfg.moe_stages, div)
    for gather in (True, False):
        t = {n: f"*{dt}" for n in ("g_ptr", "x_ptr", "dw_ptr")}
        t.update(xrow_ptr=i64, offsets_ptr=i64)
        c = dict(GATHER=gather, BLOCK_N=cfg.moe_wgrad_block_n, BLOCK_K=cfg.moe_wgrad_block_k,
                 BLOCK_T=cfg.moe_wgrad_block_t, PRECISION="ieee")
        done[f"{dt} wgrad gather={gather}"] = comp(mt._expert_wgrad_kernel, t, c, cfg.moe_wgrad_warps, 3,
                                                   ("N", "K", "stride_g", "stride_x", "stride_dwe"))
    t = dict(y_ptr=f"*{dt}", pos_ptr=i64, w_ptr="*fp32", out_ptr=f"*{dt}", add_ptr=f"*{dt}")
    # with the shared expert's rows added, or not; unweighted (the input gradient's sum)
    for k, add, wtd in ((2, False, True), (6, False, True), (6, True, True), (6, False, False)):
        done[f"{dt} combine k={k} add={add} weighted={wtd}"] = comp(
            mt._combine_kernel, t, dict(K=k, BLOCK_D=cfg.moe_combine_block_d, HAS_ADD=add, WEIGHTED=wtd), 4, 1)
    t = dict(g_ptr=f"*{dt}", y_ptr=f"*{dt}", token_ptr=i64, perm_ptr=i64, w_ptr="*fp32", dy_ptr=f"*{dt}",
             dw_ptr="*fp32")
    done[f"{dt} combine-bwd"] = comp(mt._combine_bwd_kernel, t, dict(BLOCK_D=cfg.moe_combine_block_d), 4, 1)
    # the few-row tiles: up and down through the decode tile (mma on 16 rows)
    bm, bn, warps, stages = mt.gemm_tile(1, torch.bfloat16 if dt == "bf16" else torch.float32, cfg)
    for name, gather, relu2 in (("up", True, True), ("down", False, False)):
        t = {n: f"*{dt}" for n in ("a_ptr", "b_ptr", "c_ptr", "u_ptr")}
        t.update(arow_ptr=i64, tile_expert_ptr=i64, tile_row0_ptr=i64, tile_row1_ptr=i64)
        c = dict(GATHER=gather, RELU2=relu2, DRELU2=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg.moe_block_k,
                 PRECISION="ieee", B_TABLE=False, stride_bk=1)
        done[f"{dt} decode {name}"] = comp(mt._grouped_gemm_kernel, t, c, warps, stages,
                                          {"N", "K", "stride_am", "stride_be", "stride_bn", "stride_cm"})
    # the router GEMM (fp32 weights, x in the model dtype), launched as the triton linear is (fusion on)
    t = dict(x_ptr=f"*{dt}", w_ptr="*fp32", out_ptr="*fp32")
    for name, bt, bn, warps in (("router", cfg.moe_router_block_t, cfg.moe_router_block_n, cfg.moe_router_warps),
                                ("large router", cfg.moe_router_large_block_t, cfg.moe_router_large_block_n,
                                 cfg.moe_router_large_warps)):
        c = dict(BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=cfg.linear_fp32_block_k)
        done[f"{dt} {name}"] = comp(mt._router_kernel, t, c, warps, 2, ("K", "stride_x", "stride_w"), fusion=True)
# the routing kernel: Nemotron-3-Nano's 128 experts top-6 (with and without groups), with the tables or not
t = dict(logits_ptr="*fp32", bias_ptr="*fp32", scale="fp32")
t.update({n: i64 for n in ("experts_ptr", "token_ptr", "perm_ptr", "pos_ptr", "offsets_ptr", "tile_expert_ptr",
                           "tile_row0_ptr", "tile_row1_ptr")})
t["weights_ptr"] = "*fp32"
for ng, tg, route, disp in ((1, 1, True, True), (1, 1, True, False), (8, 4, True, True), (8, 4, True, False),
                            (1, 1, False, True)):
    c = dict(E=128, E_PAD=128, N_GROUP=ng, TOPK_GROUP=tg, K=6, NORM=True, BLOCK_T=cfg.moe_route_block_t,
             ROUTE=route, DISPATCH=disp, TILE_M=cfg.moe_decode_block_m if route else cfg.moe_block_m, BLOCK_P=64)
    done[f"route groups={ng} route={route} dispatch={disp}"] = comp(mt._route_kernel, t, c, cfg.moe_route_warps, 1)
print(json.dumps(done))
"""


@pytest.mark.compile
@pytest.mark.slow
def test_moe_kernels_compile_for_sm90(sm90_cache):
    done = run_sm90_script(_COMPILE, sm90_cache)
    assert len(done) == 2 * 17 + 5, sorted(done)
    for name, r in done.items():
        if name.startswith("route") or name.endswith("router"):  # no dots on tensor cores: fp32 or none
            assert r["shared"] <= 227 * 1024, (name, r)
            assert name.endswith("router") or r["fma"] == 0, (name, r)  # the sigmoid's steps each rounded
            continue
        if name.startswith("bf16") or "combine" in name:  # (an fp32 model's IEEE dot is FMAs by construction)
            assert r["fma"] == 0, (name, r)  # the combine's products and sums each rounded
            assert "combine" in name or r["wgmma"] or r["mma"], (name, r)  # tensor cores
        if name.startswith("bf16 grouped"):
            assert r["wgmma"], (name, r)  # the 64-row tile runs on Hopper's warpgroup MMA
        if name.startswith("bf16 decode"):
            assert r["mma"] or r["wgmma"], (name, r)  # 16 rows: mma
        if name in ("bf16 grouped up", "bf16 grouped down", "bf16 decode up", "bf16 decode down"):
            assert r["cp_async"], (name, r)  # the K loop's loads are pipelined (moe_stages)
        if name.endswith(" table"):  # weights read in place: the stacked launch's loads and dots
            assert {**r, "cp_async": 0} == {**done[name[:-len(" table")]], "cp_async": 0}, (name, r)
            assert r["cp_async"] == done[name[:-len(" table")]]["cp_async"], (name, r)
        assert r["shared"] <= 227 * 1024, (name, r)  # fits an H200 SM's shared memory
