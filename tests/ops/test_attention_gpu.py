"""The Triton attention and relu2 on a GPU (skipped without CUDA; run on the H200).

- bf16 rows are the same bits in a prefill, chunks continuing from the cache, decode steps and beside
  other sequences, at head_dim 64 and 128 and GQA 1 to 16; torch's SDPA (the stock path) changes a
  row's bits between a prefill and a decode step, so the check can fail.
- accuracy against fp64 at the bf16 floor: within 1.5x of SDPA's own error on the same inputs.
- whole hybrid models (attention first, last, two in a row; GQA 1, 4, 8; head_dim 64 and 128): every
  exact-replay case of ``check`` gives 0 differing rows, the baseline differs; CUDA-graph decode
  rows equal the trainer's single pass.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16


def _cfg():
    from aligned_mamba.ops.configs import TritonKernelConfigs
    return TritonKernelConfigs()


def _qkv(T: int, H: int, G: int, D: int, seed: int, dtype: torch.dtype = BF16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(T, n, D, generator=g, device="cuda").to(dtype) for n in (H, G, G))


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,G", [(8, 8), (16, 4), (32, 8), (16, 1)])
def test_rows_equal_across_schedules_bf16(H: int, G: int, D: int) -> None:
    from aligned_mamba.ops.attention.triton import attention_triton, decode_tiles, prefill_tiles

    cfg, n, scale = _cfg(), 3000, D ** -0.5
    q, k, v = _qkv(n, H, G, D, seed=H + G + D)
    kc = torch.full((4, 4096, G, D), float("nan"), dtype=BF16, device="cuda")  # unwritten rows: garbage
    vc = kc.clone()
    kc[2, :n], vc[2, :n] = k, v
    slot = torch.tensor([2], device="cuda")

    def prefill(lo: int, hi: int) -> torch.Tensor:
        t = prefill_tiles([0, hi - lo], [lo], [2], H // G, cfg, "cuda")
        return attention_triton(q[lo:hi], kc, vc, t, scale=scale, cfg=cfg)

    full = prefill(0, n)
    assert torch.isfinite(full).all()
    cuts = [0, 1000, 1001, 1777, n]
    assert torch.equal(torch.cat([prefill(a, b) for a, b in zip(cuts, cuts[1:])]), full)
    # decode steps at many positions, one launch each and all in one launch (a batch of 64 slots' rows)
    pos = torch.tensor([0, 1, 63, 64, 65, 127, 128, 1000, 2047, 2048, 2999], device="cuda")
    one = torch.stack([attention_triton(q[p:p + 1], kc, vc, decode_tiles(slot, pos[i:i + 1]), scale=scale,
                                        cfg=cfg)[0] for i, p in enumerate(pos.tolist())])
    assert torch.equal(one, full[pos])
    many = attention_triton(q[pos], kc, vc, decode_tiles(slot.expand(pos.numel()), pos), scale=scale,
                            cfg=cfg)  # an expanded slot table too
    assert torch.equal(many, full[pos])
    # beside another sequence in one packed prefill
    q2, k2, v2 = _qkv(777, H, G, D, seed=99)
    kc[0, :777], vc[0, :777] = k2, v2
    t = prefill_tiles([0, 777, 777 + n], [0, 0], [0, 2], H // G, cfg, "cuda")
    both = attention_triton(torch.cat([q2, q]), kc, vc, t, scale=scale, cfg=cfg)
    assert torch.equal(both[777:], full)


def test_the_eager_baseline_rows_change_with_the_schedule() -> None:
    """The mismatch the kernel prevents: the eager baseline (``attention_stock``: model-dtype matmuls
    whose shapes follow the call, cuBLAS here) gives a row other bits in a decode step than in the
    prefill. (torch's SDPA flash kernel kept a decode row's bits at these shapes on the H200:
    benchmarks/bench_hybrid_h200.py records ``stock_bitwise``.)"""
    from aligned_mamba.ops.attention import attention_stock

    H, G, D, n = 32, 8, 128, 2048
    q, k, v = _qkv(n, H, G, D, seed=5)
    cu = torch.tensor([0, n])
    full = attention_stock(q, k, v, cu, cu, scale=D ** -0.5)
    differ = sum(not torch.equal(attention_stock(q[p:p + 1], k[:p + 1], v[:p + 1], torch.tensor([0, 1]),
                                                 torch.tensor([0, p + 1]), scale=D ** -0.5)[0], full[p])
                 for p in range(1, n, 97))
    assert differ > 0


@pytest.mark.parametrize("split", [0, 512])
@pytest.mark.parametrize("D", [64, 128])
def test_accuracy_at_the_bf16_floor(D: int, split: int) -> None:
    import dataclasses

    import torch.nn.functional as F

    from aligned_mamba.ops.attention import attention_naive
    from aligned_mamba.ops.attention.triton import attention_triton_packed

    H, G, ns = 16, 4, [1500, 37, 700]
    q, k, v = _qkv(sum(ns), H, G, D, seed=D)
    cu = torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()])
    cfg = dataclasses.replace(_cfg(), attn_split_n=split)  # split keys (attn_split_n): the same floor
    ours = attention_triton_packed(q, k, v, cu, cu, scale=D ** -0.5, cfg=cfg)
    ref = attention_naive(q.double(), k.double(), v.double(), cu, cu, scale=D ** -0.5)
    stock = torch.cat([F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1)[None] for x in (q, k, v)),
                                                      is_causal=True, enable_gqa=True)[0].transpose(0, 1)
                       for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])

    def err(x: torch.Tensor) -> float:
        return ((x.double() - ref).norm() / ref.norm()).item()

    assert math.isfinite(err(ours)) and err(ours) <= 1.5 * err(stock) + 1e-4, (err(ours), err(stock))
    decode = attention_triton_packed(q[cu[1:] - 1], k, v, torch.arange(len(ns) + 1), cu, scale=D ** -0.5,
                                     cfg=cfg, decode=True)
    assert torch.equal(decode, ours[cu[1:] - 1])


def test_relu2_kernel_has_the_torch_forms_bits() -> None:
    from aligned_mamba.ops.elementwise import relu2
    from aligned_mamba.ops.elementwise.triton import relu2_triton

    x = torch.randn(333, 5000, device="cuda").to(BF16) * 4
    assert torch.equal(relu2_triton(x, _cfg()), relu2(x))
    assert torch.equal(relu2_triton(x[100:101], _cfg()), relu2(x)[100:101])


HYBRIDS = {
    "attention_first_gqa1_d64": dict(pattern="*M-M", num_attention_heads=4, num_key_value_heads=4, head_dim=64),
    "attention_last_gqa4_d128": dict(pattern="M-M*", num_attention_heads=8, num_key_value_heads=2, head_dim=128),
    "two_attention_gqa8_d64": dict(pattern="M**-M", num_attention_heads=8, num_key_value_heads=1, head_dim=64,
                                   n_groups=2),
}
SMALL = dict(hidden_size=256, vocab_size=512, mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=32,
             intermediate_size=512, chunk_size=64)


def _hybrid(layout: str, **configs):
    """The layout's bf16 hybrid on the triton backend; ``configs`` replace kernel config fields."""
    import dataclasses

    from aligned_mamba.contract import Contract
    from aligned_mamba.models import build_model
    from aligned_mamba.models.nemotron_h import make_tiny_hybrid

    over = dict(HYBRIDS[layout])
    cfg, tensors = make_tiny_hybrid(11, dtype="bfloat16", pattern=over.pop("pattern"), **{**SMALL, **over})
    contract = Contract(chunk_size=cfg.chunk_size, backend="triton", model_dtype="bfloat16",
                        kernel_configs=dataclasses.replace(_cfg(), **configs))
    return build_model(cfg, tensors, contract, device="cuda")


@pytest.mark.parametrize("layout", sorted(HYBRIDS))
def test_hybrid_check_on_triton_backend_is_bit_identical(layout: str) -> None:
    from check_cases import assert_every_case

    assert_every_case(_hybrid(layout))


@pytest.mark.parametrize("B", [1, 64])
def test_hybrid_graph_decode_rows_equal_the_single_pass(B: int) -> None:
    from check_cases import assert_graph_decode_equals_single_pass

    assert_graph_decode_equals_single_pass(_hybrid("two_attention_gqa8_d64"), B, steps=40, max_start=900)


def test_training_attention_over_cached_keys_is_refused_in_one_line() -> None:
    """A step that continues a sequence from keys an earlier call cached cannot give those keys a
    gradient (the cache is outside the autograd graph): refused, not silently dropped."""
    from aligned_mamba.errors import AlignedMambaError
    from aligned_mamba.ops.backend import resolve
    from aligned_mamba.ops.step import Step

    model = _hybrid("attention_first_gqa1_d64")
    be = resolve(model.contract, "cuda")
    q, k, v = _qkv(8, 4, 4, 64, seed=0)
    q.requires_grad_(True)
    cache = torch.zeros(1, 16, 4, 64, dtype=BF16, device="cuda")
    with pytest.raises(AlignedMambaError, match="cached by an earlier call") as exc:
        be.attention(q, k, v, cache, cache.clone(), Step.make([0], [4], [8]), scale=0.125)
    assert "\n" not in str(exc.value)
    be.attention(q, k, v, cache, cache.clone(), Step.from_empty([8]), scale=0.125).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# -- the backward ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,G", [(16, 4), (32, 8), (16, 1), (8, 8)])
def test_backward_accuracy_at_the_bf16_floor(H: int, G: int, D: int) -> None:
    """bf16 gradients of q, k, v over packed sequences against fp64: within 1.5x of SDPA's backward
    on the same inputs (its error is the bf16 floor); two backwards give the same bits; saving the
    log-sum-exp leaves the forward's bits."""
    import torch.nn.functional as F

    from aligned_mamba.ops.attention import attention_naive
    from aligned_mamba.ops.attention.triton import attention_triton_packed
    from aligned_mamba.ops.attention.triton_backward import attention_packed

    ns, scale, rep = [700, 37, 300], D ** -0.5, H // G
    q, k, v = _qkv(sum(ns), H, G, D, seed=H * G + D)
    w = torch.randn(q.shape, generator=torch.Generator(device="cuda").manual_seed(3), device="cuda").to(BF16)
    cu = torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attention_packed(*leaves, cu, cu, scale=scale, cfg=_cfg())
    assert torch.equal(out.detach(), attention_triton_packed(q, k, v, cu, cu, scale=scale, cfg=_cfg()))
    ours = torch.autograd.grad(out, leaves, w, retain_graph=True)
    again = torch.autograd.grad(out, leaves, w)
    assert all(torch.equal(a, b) for a, b in zip(ours, again)), "two backwards gave different bits"
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = torch.autograd.grad(attention_naive(*ref_leaves, cu, cu, scale=scale), ref_leaves, w.double())
    st_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    parts = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in st_leaves)
        o = F.scaled_dot_product_attention(qs, ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1),
                                           is_causal=True, scale=scale)
        parts.append(o[0].transpose(0, 1))
    stock = torch.autograd.grad(torch.cat(parts), st_leaves, w)

    def err(x: torch.Tensor, r: torch.Tensor) -> float:
        return ((x.double() - r).norm() / r.norm()).item()

    for name, a, b, r in zip("qkv", ours, stock, ref):
        assert math.isfinite(err(a, r)) and err(a, r) <= 1.5 * err(b, r) + 1e-4, (name, err(a, r), err(b, r))


def test_relu2_backward_is_the_torch_forms_gradient() -> None:
    from aligned_mamba.ops.elementwise import relu2
    from aligned_mamba.ops.elementwise.triton import relu2 as relu2_fn

    x = (torch.randn(333, 5000, device="cuda") * 4).to(BF16)
    x[0, :2] = torch.tensor([0.0, -0.0])
    g = torch.randn(x.shape, device="cuda").to(BF16)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = relu2_fn(a, _cfg()), relu2(b)
    assert torch.equal(ya, yb)
    (ga,), (gb,) = torch.autograd.grad(ya, a, g), torch.autograd.grad(yb, b, g)
    assert torch.equal(ga, gb)
    assert not torch.equal(ga, (2 * x.float() * g.float()).clamp_min(0).to(BF16)), "the check is vacuous"


@pytest.mark.parametrize("hidden,inter,bias", [(4096, 21504, False), (256, 512, True)])
def test_fused_mlp_has_the_composed_ops_bits(hidden: int, inter: int, bias: bool) -> None:
    """The MLP with relu2 in the up GEMM's epilogue gives every row the bits of linear, relu2, linear
    (each row of a call of M rows, M across the decode, mid and large tiles); relu2 of the unrounded
    accumulator (one rounding fewer) differs, so the comparison can fail."""
    from aligned_mamba.ops.elementwise.triton import relu2_triton
    from aligned_mamba.ops.linear.triton import linear_triton
    from aligned_mamba.ops.linear.triton_relu2 import linear_relu2_triton, mlp_relu2

    cfg = _cfg()
    g = torch.Generator(device="cuda").manual_seed(hidden)
    up = (torch.randn(inter, hidden, device="cuda", generator=g) / hidden ** 0.5).to(BF16)
    down = (torch.randn(hidden, inter, device="cuda", generator=g) / inter ** 0.5).to(BF16)
    ub, db = ((0.1 * torch.randn(n, device="cuda", generator=g)) if bias else None for n in (inter, hidden))
    x = torch.randn(4096, hidden, device="cuda", generator=g).to(BF16)
    for M in (1, 5, 16, 17, 64, 200, 256, 1000, 4096):
        u = linear_triton(x[:M], up, ub, cfg)
        h = relu2_triton(u, cfg)
        fh, fu = linear_relu2_triton(x[:M], up, ub, cfg, keep_pre=True)
        assert torch.equal(fu, u) and torch.equal(fh, h), M
        assert torch.equal(linear_relu2_triton(x[:M], up, ub, cfg)[0], h), M
        assert torch.equal(mlp_relu2(x[:M], up, ub, down, db, cfg=cfg), linear_triton(h, down, db, cfg)), M
    acc = x[:256].float() @ up.float().T + (0 if ub is None else ub)
    assert not torch.equal(torch.relu(acc).square().to(BF16), linear_relu2_triton(x[:256], up, ub, cfg)[0])


def _leaves(tensors: dict, device: str) -> dict:
    return {k: v.to(device).clone().requires_grad_() for k, v in tensors.items()}


def _loss(logits: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    return -sum(torch.log_softmax(lg.float(), -1).gather(-1, t[:, None].to(lg.device)).sum()
                for lg, t in zip(logits, targets))


def test_hybrid_trains_on_the_gpu_with_the_samplers_bits() -> None:
    """bf16 hybrid (two attention layers in a row, GQA 8) on the triton backend with gradients on:
    the logits equal the no-grad pass and the sampler's rows (a prefill, a chunk, then decode steps);
    two forward+backward runs give bit-identical gradients, every weight gets one."""
    from aligned_mamba.contract import Contract
    from aligned_mamba.models import build_model
    from aligned_mamba.models.nemotron_h import make_tiny_hybrid
    from aligned_mamba.ops.step import Step

    over = dict(HYBRIDS["two_attention_gqa8_d64"])
    cfg, tensors = make_tiny_hybrid(11, dtype="bfloat16", pattern=over.pop("pattern"), **{**SMALL, **over})
    contract = Contract(chunk_size=cfg.chunk_size, backend="triton", model_dtype="bfloat16")
    g = torch.Generator().manual_seed(4)
    lens = (300, 129, 77)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lens]
    targets = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lens]
    names = sorted(tensors)
    runs = []
    for _ in range(2):
        leaves = _leaves(tensors, "cuda")
        logits = build_model(cfg, leaves, contract, device="cuda").forward(seqs)
        runs.append((logits, torch.autograd.grad(_loss(logits, targets), [leaves[k] for k in names])))
    model = build_model(cfg, tensors, contract, device="cuda")
    with torch.no_grad():
        plain = model.forward(seqs)
        cache, s0 = model.new_cache(1, max_len=lens[0]), seqs[0]
        rows = [model.advance(cache, Step.make([0], [0], [150]), s0[:150]),
                model.advance(cache, Step.make([0], [150], [70]), s0[150:220])]
        rows += [model.advance(cache, Step.make([0], [t], [1]), s0[t:t + 1]) for t in range(220, lens[0])]
    logits, grads = runs[0]
    assert all(torch.equal(a.detach(), b) for a, b in zip(logits, plain)), "grad mode changed the logits' bits"
    assert torch.equal(logits[0].detach(), torch.cat(rows)), "the trainer's logits are not the sampler's rows"
    assert all(torch.equal(a, b) for a, b in zip(grads, runs[1][1])), "two runs gave different gradients"
    assert all(float(x.abs().max()) > 0 for x in grads), [k for k, x in zip(names, grads) if not x.abs().max()]


def test_hybrid_gradients_match_the_cpu_torch_backend() -> None:
    """fp32 hybrid (attention first, last and in a row): the triton backend's parameter gradients on
    the GPU against the torch backend's on the CPU (another arithmetic of the same function)."""
    from aligned_mamba.contract import Contract
    from aligned_mamba.models import build_model
    from aligned_mamba.models.nemotron_h import make_tiny_hybrid

    cfg, tensors = make_tiny_hybrid(5, dtype="float32", pattern="*M-**M-*", **{**SMALL, "num_attention_heads": 8,
                                    "num_key_value_heads": 2, "head_dim": 64})
    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (200, 65, 9)]
    targets = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (200, 65, 9)]
    names = sorted(tensors)
    got = {}
    for backend, dev in (("triton", "cuda"), ("torch", "cpu")):
        leaves = _leaves(tensors, dev)
        contract = Contract(chunk_size=cfg.chunk_size, backend=backend, model_dtype="float32")
        loss = _loss(build_model(cfg, leaves, contract, device=dev).forward(seqs), targets)
        got[backend] = [x.cpu() for x in torch.autograd.grad(loss, [leaves[k] for k in names])]
    errs = {k: ((a.double() - b.double()).norm() / b.double().norm()).item()
            for k, a, b in zip(names, got["triton"], got["torch"])}
    assert all(e < 1e-4 for e in errs.values()), errs


# -- a paged KV cache ------------------------------------------------------------------------------------


def _scattered_pages(B: int, max_len: int, page: int, seed: int):
    """A KVPages for B slots whose free list is shuffled, so consecutive blocks of a slot land on
    scattered pages (and slots interleave)."""
    from aligned_mamba.layers.attention import KVPages

    pages = KVPages(B, max_len, page, B * -(-max_len // page) + 1, "cuda")
    order = torch.randperm(pages.num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    pages.free = order
    return pages


def _write_context(pages, kp: torch.Tensor, vp: torch.Tensor, slots: torch.Tensor, ctx: torch.Tensor,
                   cu: torch.Tensor, k: torch.Tensor, v: torch.Tensor, P: int):
    """The contexts' keys and values (packed rows ``cu[i] ..`` of k, v) written into pages through the
    block table, as the prefill writes them; returns each written key's (sequence, position, packed row)."""
    from aligned_mamba.ops.attention.blocked import page_index

    pages.ensure(slots.numpy(), ctx.numpy())
    seq = torch.repeat_interleave(torch.arange(len(ctx)), ctx)
    pos = torch.cat([torch.arange(int(c)) for c in ctx])
    src = (cu[:-1][seq] + pos).cuda()
    pg, off = page_index(pages.table, slots[seq].cuda(), pos.cuda(), P)
    kp[pg, off], vp[pg, off] = k[src], v[src]
    return seq, pos, src


@pytest.mark.parametrize("B", [1, 64, 256])
def test_paged_decode_in_a_cuda_graph_equals_the_prefill_rows(B: int) -> None:
    """Nemotron-H-8B's attention shape (32 heads, 8 KV heads, D 128, bf16): B sequences at random
    contexts (up to 16k at batch 1) decode 5 steps through one captured graph that writes the new
    keys into pages found through the block table and attends over the pages; pages are handed out
    on the host between replays. Every row equals the single packed prefill's row over the whole
    history (slot-cache addressing); the baseline, a key block of 128, differs."""
    import dataclasses

    from aligned_mamba.ops.attention.blocked import page_index
    from aligned_mamba.ops.attention.triton import attention_triton, attention_triton_packed, decode_tiles

    H, G, D, P, steps, scale = 32, 8, 128, 256, 5, 128 ** -0.5
    cfg = _cfg()
    g = torch.Generator().manual_seed(B)
    top = 16000 if B == 1 else (4000 if B <= 64 else 1500)
    ctx = torch.randint(1, top, (B,), generator=g)
    n = ctx + steps
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)])
    q, k, v = _qkv(int(cu[-1]), H, G, D, seed=B)
    full = attention_triton_packed(q, k, v, cu, cu, scale=scale, cfg=cfg)
    slots = torch.randperm(B, generator=g)
    pages = _scattered_pages(B, int(n.max()), P, seed=B)
    kp = torch.full((pages.num_pages, P, G, D), float("nan"), dtype=BF16, device="cuda")
    vp = kp.clone()
    _write_context(pages, kp, vp, slots, ctx, cu, k, v, P)
    # the graph's static buffers
    qs, ks, vs = q[:B].clone(), k[:B].clone(), v[:B].clone()
    sl, ps = slots.cuda(), ctx.cuda().clone()

    def step(c=cfg) -> torch.Tensor:
        pg, off = page_index(pages.table, sl, ps, P)
        kp[pg, off], vp[pg, off] = ks, vs
        return attention_triton(qs, kp, vp, decode_tiles(sl, ps), scale=scale, cfg=c, block_table=pages.table)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile before capture (writes the first step's keys, which the replay rewrites)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    got = []
    for t in range(steps):
        at = cu[:-1] + ctx + t  # each sequence's packed row of this step's token
        pages.ensure(slots.numpy(), (ctx + t + 1).numpy())
        for buf, src in ((qs, q), (ks, k), (vs, v)):
            buf.copy_(src[at.cuda()])
        ps.copy_((ctx + t).cuda())
        graph.replay()
        got.append(out.clone())
        assert torch.equal(got[-1], full[at.cuda()]), t
    # the baseline: another key block (pages of 256 take it) gives the long rows other bits
    other = step(dataclasses.replace(cfg, attn_block_n=128))
    long_rows = (ctx + steps - 1 > 128).cuda()
    assert bool(long_rows.any()) and not torch.equal(other[long_rows], got[-1][long_rows])


def test_paged_prefill_chunks_equal_the_slot_caches_rows() -> None:
    """The chunked-prefill continuation over pages (the prefill tile, host-built tiles, the device
    table): chunks of one sequence and two sequences side by side give the slot cache's bits."""
    from aligned_mamba.ops.attention.blocked import page_index
    from aligned_mamba.ops.attention.triton import attention_triton, prefill_tiles

    H, G, D, P, n, scale = 16, 4, 64, 128, 3000, 64 ** -0.5
    cfg = _cfg()
    q, k, v = _qkv(n, H, G, D, seed=17)
    kc = torch.full((2, n, G, D), float("nan"), dtype=BF16, device="cuda")
    vc = kc.clone()
    kc[1], vc[1] = k, v
    pages = _scattered_pages(2, n, P, seed=3)
    pages.ensure([1], [n])
    kp = torch.full((pages.num_pages, P, G, D), float("nan"), dtype=BF16, device="cuda")
    vp = kp.clone()
    pg, off = page_index(pages.table, torch.ones(n, dtype=torch.int64, device="cuda"),
                         torch.arange(n, device="cuda"), P)
    kp[pg, off], vp[pg, off] = k, v
    cuts = [0, 700, 701, 2222, n]
    for a, b in zip(cuts, cuts[1:]):
        t = prefill_tiles([0, b - a], [a], [1], H // G, cfg, "cuda")
        assert torch.equal(attention_triton(q[a:b], kp, vp, t, scale=scale, cfg=cfg, block_table=pages.table),
                           attention_triton(q[a:b], kc, vc, t, scale=scale, cfg=cfg)), (a, b)


@pytest.mark.parametrize("B", [1, 64, 256])
def test_hybrid_graph_decode_over_pages_equals_the_single_pass(B: int) -> None:
    from check_cases import assert_graph_decode_equals_single_pass

    assert_graph_decode_equals_single_pass(_hybrid("two_attention_gqa8_d64"), B, steps=40, max_start=900,
                                           page_size=64)


def test_the_engine_preempts_when_pages_run_short_and_keeps_the_bits() -> None:
    """The reference engine on the GPU (triton backend, a paged KV cache, decode steps in CUDA graphs)
    with 3 slots over 8 pages of 64 keys, fewer than its requests need together: it preempts the newest
    request whenever a step needs more pages than are free and recomputes it later, and every request's
    tokens and rows are those of an engine with pages to spare and the trainer's single pass. The
    baseline, the single pass of the same weights with a key block of 128, differs on the long rows."""
    from aligned_mamba.engine import SamplerEngine

    model = _hybrid("two_attention_gqa8_d64")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, SMALL["vocab_size"], (n,), generator=g).tolist() for n in (70, 300, 150, 20)]

    def run(num_pages: int | None):
        e = SamplerEngine(model, num_slots=3, max_batch_tokens=96, max_len=384, page_size=64, num_pages=num_pages)
        assert e.graphs is not None
        reqs = [e.add_request(p, 40) for p in prompts]
        e.run()
        assert e.cache.pages.pages_free == e.cache.pages.num_pages - 1  # the graphs' spare slot keeps one
        return reqs

    roomy, tight = run(None), run(8)
    assert sum(r.preemptions for r in tight) > 0 and sum(r.preemptions for r in roomy) == 0
    with torch.no_grad():
        ref = model.forward([torch.tensor(r.tokens[:-1]) for r in tight])
        other = _hybrid("two_attention_gqa8_d64", attn_block_n=128).forward([torch.tensor(r.tokens[:-1])
                                                                             for r in tight])
    differ = 0
    for a, b, want, base in zip(roomy, tight, ref, other):
        assert a.tokens == b.tokens
        pos = [p for p, _ in b.rows]
        got = torch.stack([x for _, x in b.rows])
        assert torch.equal(got, want[pos]), b.req_id
        assert torch.equal(torch.stack([x for _, x in a.rows]), want[[p for p, _ in a.rows]]), a.req_id
        differ += int((got != base[pos]).any(-1)[torch.tensor(pos, device=got.device) >= 128].sum())
    assert differ > 0, "a key block of 128 gave the long rows the same bits: the check cannot fail"


# -- split keys (attn_split_n) ------------------------------------------------------------------------------


@pytest.mark.parametrize("B", [1, 64])
@pytest.mark.parametrize("split", [1024, 2048])
def test_split_decode_in_cuda_graphs_equals_the_prefill_rows(split: int, B: int) -> None:
    """Nemotron-H-8B's attention shape (32 heads, 8 KV heads, D 128, bf16) under ``attn_split_n``: B
    sequences at contexts up to 16k (the first ones just before a split boundary, so their 5 steps
    end on a split's last key and then on the next one's first; the rest random) decode 5 steps
    through captured graphs, over a slot cache and over shuffled pages: every row equals the single
    packed prefill's row (the fold in the prefill program). The baseline, decode rows without a
    split (``attn_split_n`` 0), differs on rows past the first split."""
    import dataclasses

    from aligned_mamba.ops.attention.blocked import page_index
    from aligned_mamba.ops.attention.triton import attention_triton, attention_triton_packed, decode_tiles

    H, G, D, P, steps, scale = 32, 8, 128, 256, 5, 128 ** -0.5
    cfg = dataclasses.replace(_cfg(), attn_split_n=split)
    g = torch.Generator().manual_seed(B + split)
    ctx = torch.randint(1, 16384, (B,), generator=g)
    edge = torch.tensor([16384, 8 * split, split, 2 * split])[:B] - 2  # positions k*S - 2 .. k*S + 2
    ctx[:edge.numel()] = edge
    n = ctx + steps
    max_len = int(n.max())
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)])
    q, k, v = _qkv(int(cu[-1]), H, G, D, seed=B)
    full = attention_triton_packed(q, k, v, cu, cu, scale=scale, cfg=cfg)
    slots = torch.randperm(B, generator=g)
    kc = torch.full((B, max_len, G, D), float("nan"), dtype=BF16, device="cuda")
    vc = kc.clone()
    pages = _scattered_pages(B, max_len, P, seed=B)
    kp = torch.full((pages.num_pages, P, G, D), float("nan"), dtype=BF16, device="cuda")
    vp = kp.clone()
    seq, pos, src = _write_context(pages, kp, vp, slots, ctx, cu, k, v, P)
    kc[slots[seq].cuda(), pos.cuda()], vc[slots[seq].cuda(), pos.cuda()] = k[src], v[src]
    qs, ks, vs = q[:B].clone(), k[:B].clone(), v[:B].clone()
    sl, ps = slots.cuda(), ctx.cuda().clone()

    def slot_step(c=cfg) -> torch.Tensor:
        kc[sl, ps], vc[sl, ps] = ks, vs
        return attention_triton(qs, kc, vc, decode_tiles(sl, ps), scale=scale, cfg=c)

    def paged_step(c=cfg) -> torch.Tensor:
        pg, off = page_index(pages.table, sl, ps, P)
        kp[pg, off], vp[pg, off] = ks, vs
        return attention_triton(qs, kp, vp, decode_tiles(sl, ps), scale=scale, cfg=c, block_table=pages.table)

    graphs, outs = [], []
    for fn in (slot_step, paged_step):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # compile before capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(fn())
        graphs.append(graph)
    for t in range(steps):
        at = (cu[:-1] + ctx + t).cuda()
        pages.ensure(slots.numpy(), (ctx + t + 1).numpy())
        for buf, x in ((qs, q), (ks, k), (vs, v)):
            buf.copy_(x[at])
        ps.copy_((ctx + t).cuda())
        for graph, out, name in zip(graphs, outs, ("slot", "paged")):
            graph.replay()
            assert torch.equal(out, full[at]), (name, t)
    plain = slot_step(dataclasses.replace(_cfg(), attn_split_n=0))  # no split, whatever the default
    late = (ctx + steps - 1 >= split).cuda()
    assert bool(late.any()) and not torch.equal(plain[late], outs[0][late])
    assert torch.equal(plain[~late], outs[0][~late])  # one split: its partial alone, the same bits


@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("B", [1, 64])
def test_hybrid_graph_decode_under_a_split_equals_the_single_pass(B: int, page_size: int | None) -> None:
    """A hybrid whose contract splits keys every 256 positions (contexts up to 940 cross up to three
    boundaries): ``DecodeGraphs``'s rows, slot cache or pages, equal the trainer's single pass."""
    from check_cases import assert_graph_decode_equals_single_pass

    assert_graph_decode_equals_single_pass(_hybrid("two_attention_gqa8_d64", attn_split_n=256), B, steps=40,
                                           max_start=900, page_size=page_size)
