"""The row-parallel tree GEMM on the GPU (skipped without CUDA; run on the H200).

At the row-parallel layers' shapes (out_proj of mamba2-1.3b and 2.7b, Nemotron-H-8B's o_proj and
fc2), bf16: TP k (each rank's launch over its K columns giving its fp32 subtree, the subtrees joined
by the tree's top, the bias, one rounding) gives TP 1's bits (one launch: the whole tree), for 2 to
16 slices, in both loop forms and both stacks; a row's bits do not depend on how many rows share the call; one slice
is today's GEMM bit for bit; the split-slices grid gives the pinned form's bits, eager and in CUDA-graph
replays; the stock all-reduce of the ranks' rounded GEMMs differs. Then the model: the triton
backend's logits rows at TP 2 and 4 equal TP 1 under row_parallel_slices 4 (Mamba2 with n_groups 1
and 8, a hybrid), and stock TP 2 differs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = [("mamba2-1.3b out_proj", 4096, 2048), ("mamba2-2.7b out_proj", 5120, 2560),
          ("nemotron-h-8b o_proj", 4096, 4096), ("nemotron-h-8b fc2", 21504, 4096)]


def _cfg():
    from aligned_mamba.ops.configs import TritonKernelConfigs

    return TritonKernelConfigs()


def _other(**fields):
    import dataclasses

    return dataclasses.replace(_cfg(), **fields)


def _operands(K: int, N: int, M: int = 2048, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
    b = (torch.randn(N, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    return x, w, b


def _tp(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, slices: int, size: int) -> torch.Tensor:
    """TP ``size``: every rank's subtree launch, all-gathered (stacked in rank order), the top, bias, rounding."""
    from aligned_mamba.ops.linear import triton_tree as tt
    from aligned_mamba.ops.logprobs.sliced import pair_tree

    kl = x.shape[1] // size
    subs = [tt.linear_tree_triton(x[:, r * kl:(r + 1) * kl], w[:, r * kl:(r + 1) * kl].contiguous(), None,
                                  slices // size, torch.float32, _cfg()) for r in range(size)]
    return (pair_tree(torch.stack(subs, -1)) + b.to(torch.float32)).to(x.dtype)


@pytest.mark.parametrize("name,K,N", SHAPES, ids=[s[0] for s in SHAPES])
def test_gpu_every_tp_degree_gives_tp1s_bits(name: str, K: int, N: int) -> None:
    from aligned_mamba.ops.linear import triton as lt
    from aligned_mamba.ops.linear import triton_tree as tt

    x, w, b = _operands(K, N)
    bad = []
    for M in (1, 64, 2048):
        for s in (2, 4, 8, 16):
            one = tt.linear_tree_triton(x[:M], w, b, s, torch.bfloat16, _cfg())
            # the other loop form (a K loop per slice, or the loops flattened) and the other stack (in
            # registers at a halved tile, or in global memory at the regime's tile): the same bits
            for name, other in (("loops", _other(linear_tree_flatten=not _cfg().linear_tree_flatten)),
                                ("stack", _other(linear_tree_global_stack=not _cfg().linear_tree_global_stack))):
                if not torch.equal(tt.linear_tree_triton(x[:M], w, b, s, torch.bfloat16, other), one):
                    bad.append((M, s, name))
            size = 2
            while size <= s:
                if not torch.equal(_tp(x[:M], w, b, s, size), one):
                    bad.append((M, s, size))
                size *= 2
        # one slice: today's GEMM, the same bits
        if not torch.equal(tt.linear_tree_triton(x[:M], w, b, 1, torch.bfloat16, _cfg()),
                           lt.linear_triton(x[:M], w, b, _cfg())):
            bad.append((M, 1, 1))
    assert not bad, bad


@pytest.mark.parametrize("name,K,N", SHAPES, ids=[s[0] for s in SHAPES])
def test_gpu_the_split_grid_gives_the_pinned_forms_bits(name: str, K: int, N: int) -> None:
    from aligned_mamba.ops.linear import triton_tree as tt

    x, w, b = _operands(K, N, M=256)
    on = _other(linear_tree_split_grid_max_m=256)
    bad = []
    for M in (1, 17, 64, 256):
        for s in (2, 4, 8, 16):
            one = tt.linear_tree_triton(x[:M], w, b, s, torch.bfloat16, _cfg())
            # forced, and chosen by the configs; then a rank's fp32 subtree at TP 2
            if not torch.equal(tt.linear_tree_triton(x[:M], w, b, s, torch.bfloat16, _cfg(), split=True), one):
                bad.append((M, s, "forced"))
            if not torch.equal(tt.linear_tree_triton(x[:M], w, b, s, torch.bfloat16, on), one):
                bad.append((M, s, "configs"))
            kl = K // 2
            xs, ws = x[:M, :kl], w[:, :kl].contiguous()
            sub = tt.linear_tree_triton(xs, ws, None, s // 2, torch.float32, _cfg())
            if not torch.equal(tt.linear_tree_triton(xs, ws, None, s // 2, torch.float32, _cfg(), split=s > 2), sub):
                bad.append((M, s, "subtree"))
    assert not bad, bad


def test_gpu_the_split_grids_counters_survive_cuda_graph_replays() -> None:
    # the finisher resets its tile's counter: replay after replay (and an eager call between them, on
    # the capture's stream and on the default one) gives the pinned form's bits
    from aligned_mamba.ops.linear import triton_tree as tt

    K, N = SHAPES[0][1:]
    x, w, b = _operands(K, N, M=64)
    want = {s: tt.linear_tree_triton(x, w, b, s, torch.bfloat16, _cfg()) for s in (4, 8)}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in (4, 8):  # compiled, and the stream's counters allocated, before the capture
            tt.linear_tree_triton(x, w, b, s, torch.bfloat16, _cfg(), split=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = {s: tt.linear_tree_triton(x, w, b, s, torch.bfloat16, _cfg(), split=True) for s in (4, 8)}
    torch.cuda.current_stream().wait_stream(stream)
    for i in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(outs[s], want[s]) for s in (4, 8)), i
        assert torch.equal(tt.linear_tree_triton(x, w, b, 8, torch.bfloat16, _cfg(), split=True), want[8]), i


@pytest.mark.parametrize("name,K,N", SHAPES[:3], ids=[s[0] for s in SHAPES[:3]])
def test_gpu_tree_rows_do_not_depend_on_m_and_sit_at_the_bf16_floor(name: str, K: int, N: int) -> None:
    from aligned_mamba.ops.linear import triton_tree as tt

    x, w, b = _operands(K, N, M=8192)
    for s in (2, 8):
        full = tt.linear_tree_triton(x, w, b, s, torch.bfloat16, _cfg())
        bad = []
        for i, M in enumerate((1, 3, 17, 64, 255, 1000, 4097)):
            start = [0, (8192 - M) // 2, 8192 - M][i % 3]
            part = tt.linear_tree_triton(x[start:start + M], w, b, s, torch.bfloat16, _cfg())
            bad.append((M, int((part != full[start:start + M]).any(dim=1).sum())))
        assert all(n == 0 for _, n in bad), (s, bad)
        ref = x[:512].double() @ w.double().T + b.double()
        floor = ((ref.to(torch.bfloat16).double() - ref).norm() / ref.norm()).item()
        err = ((full[:512].double() - ref).norm() / ref.norm()).item()
        assert err <= 1.02 * floor, (s, err, floor)


def test_gpu_the_all_reduce_it_replaces_differs() -> None:
    from aligned_mamba.ops.linear import triton as lt
    from aligned_mamba.ops.linear import triton_tree as tt

    x, w, b = _operands(4096, 2048, M=256)
    one = tt.linear_tree_triton(x, w, b, 8, torch.bfloat16, _cfg())
    for size in (2, 4):
        kl = 4096 // size
        parts = [lt.linear_triton(x[:, r * kl:(r + 1) * kl], w[:, r * kl:(r + 1) * kl].contiguous(), None, _cfg())
                 for r in range(size)]
        stock = parts[0]
        for p in parts[1:]:
            stock = stock + p
        stock = stock + b
        assert torch.equal(_tp(x, w, b, 8, size), one)
        assert int((stock != one).any(dim=1).sum()) > 0, size


@pytest.mark.parametrize("name", ["g1", "g8", "hybrid"])
def test_gpu_model_rows_at_tp_2_and_4_equal_tp_1(name: str) -> None:
    from aligned_mamba import tp_reference
    from aligned_mamba.contract import Contract
    from aligned_mamba.models.mamba2 import make_tiny
    from aligned_mamba.models.nemotron_h import make_tiny_hybrid
    from aligned_mamba.parallel import TPGroup, threads

    if name == "hybrid":
        config, tensors = make_tiny_hybrid(2, pattern="M*M-", chunk_size=32)
    else:
        config, tensors = make_tiny(0 if name == "g1" else 1, hidden_size=128, num_heads=8, head_dim=32,
                                    state_size=32, n_groups=1 if name == "g1" else 8, num_hidden_layers=2,
                                    chunk_size=32)
    c = Contract(32, backend="triton", row_parallel_slices=4)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 512, (n,), generator=g) for n in (45, 7, 70)]
    one = tp_reference.forward(TPGroup.single(), config, tensors, c, seqs)
    assert one[0].is_cuda
    for size in (2, 4):
        # rank 0 alone first, every gather its own tensor repeated: the kernels of this degree compile
        # here, not in the rank threads at once
        tp_reference.forward(TPGroup(0, size, lambda t, k=size: t.unsqueeze(0).repeat(k, *[1] * t.dim())), config,
                             tensors, c, seqs)
        for rank_rows in threads(tp_reference.forward, size, config, tensors, c, seqs):
            assert all(torch.equal(a, b) for a, b in zip(rank_rows, one)), (name, size)
    stock_one = tp_reference.forward(TPGroup.single(), config, tensors, c, seqs, True)
    stock_two = threads(tp_reference.forward, 2, config, tensors, c, seqs, True)[0]
    assert sum(int((a != b).any(dim=-1).sum()) for a, b in zip(stock_one, stock_two)) > 0
