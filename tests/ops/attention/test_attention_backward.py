"""The Triton attention's backward (``ops.attention.triton_backward``): logic, accuracy, determinism.

- interpreter (the Triton interpreter, CPU): fp32 and tiny shapes. The gradients of q, k and v
  (packed variable-length sequences, queries the last positions of their sequences, GQA 1 to 16)
  match the fp64 reference's to fp32 rounding; two backwards give the same bits; saving the
  log-sum-exp leaves the forward's bits as they were; the cached step (keys written into a slot cache,
  the sampler's launch) has the packed form's gradient.
- gpu (skipped without CUDA; run on the H200): bf16 gradients against fp64 within 1.5x of SDPA's
  backward; whole hybrids train with the sampler's bits (deterministic gradients, every weight gets
  one) and match the CPU torch backend's gradients; training over keys an earlier call cached is
  refused.
- compile (sm_90, the H200, offline, no GPU, to PTX): the backward's kernels (and relu2's backward)
  in the configurations the backend launches: no FMA contraction in bf16, warpgroup MMA.
"""


from __future__ import annotations

import dataclasses
import math

import interpreted  # noqa: F401  (before triton: it switches the Triton interpreter on; tests/ops/conftest.py)
import pytest
import torch
from attention_cases import BF16, HYBRIDS, SMALL, assert_the_kernels_compile_for_sm90, gpu_cfg, gpu_qkv, hybrid

from aligned_mamba.ops.attention import attention_naive
from aligned_mamba.ops.attention import triton_backward as tb
from aligned_mamba.ops.attention.triton import attention_triton_packed, step_tables
from aligned_mamba.ops.configs import TritonKernelConfigs

# small blocks so that a few dozen tokens cross several key blocks and tiles in both kernels
CFG = dataclasses.replace(TritonKernelConfigs(), attn_block_n=16, attn_block_m=32, attn_decode_block_m=16,
                          attn_bwd_kv_block_n=16, attn_bwd_kv_block_m=16, attn_bwd_stages=1, attn_bwd_q_block_m=32,
                          attn_bwd_q_block_n=16)
RTOL = 1e-5  # fp32 against fp64: measured 1.8e-7 .. 3e-7 (relative norm)


def _cu(ns: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()], dtype=torch.int64)


def _inputs(nq: list[int], nk: list[int], H: int, G: int, D: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(sum(nq), H, D, generator=g), torch.randn(sum(nk), G, D, generator=g),
            torch.randn(sum(nk), G, D, generator=g), torch.randn(sum(nq), H, D, generator=g))


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.detach().double() - ref.detach()).norm() / ref.detach().norm())


@pytest.mark.interpreter
@pytest.mark.parametrize("H,G,D,nq,nk", [
    (4, 2, 64, [37, 5, 20], [37, 5, 20]),     # prefill, three sequences
    (3, 1, 64, [10, 1, 20], [30, 9, 20]),     # queries the last positions (a chunk after cached keys)
    (16, 1, 32, [9, 0], [9, 4]),              # 16 query heads per key/value head; a sequence with no query
    (2, 2, 128, [21], [21]),                  # head_dim 128
    (2, 1, 32, [70], [70]),                   # many unmasked steps in both kernels
])
def test_gradients_match_the_fp64_reference(H: int, G: int, D: int, nq: list[int], nk: list[int]) -> None:
    _check_gradients(H, G, D, nq, nk, CFG)


@pytest.mark.interpreter
@pytest.mark.parametrize("split", [16, 32])
@pytest.mark.parametrize("H,G,D,nq,nk", [
    (4, 2, 64, [37, 5, 20], [37, 5, 20]),     # prefill, three sequences
    (3, 1, 64, [10, 1, 20], [40, 9, 20]),     # a chunk after cached keys (the split at an earlier position)
])
def test_gradients_under_a_split_match_the_fp64_reference(H: int, G: int, D: int, nq: list[int], nk: list[int],
                                                          split: int) -> None:
    """Split keys (``attn_split_n``): the forward's lse is the folded state's, and the backward that
    reads it still gives the fp64 gradients."""
    _check_gradients(H, G, D, nq, nk, dataclasses.replace(CFG, attn_split_n=split))


def _check_gradients(H: int, G: int, D: int, nq: list[int], nk: list[int], cfg: TritonKernelConfigs) -> None:
    q, k, v, w = _inputs(nq, nk, H, G, D, seed=H + D)
    cq, ck = _cu(nq), _cu(nk)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = tb.attention_packed(*leaves, cq, ck, scale=D ** -0.5, cfg=cfg)
    got = torch.autograd.grad(out, leaves, w, retain_graph=True)
    again = torch.autograd.grad(out, leaves, w)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "two backwards gave different bits"
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = attention_naive(*ref_leaves, cq, ck, scale=D ** -0.5)
    want = torch.autograd.grad(ref, ref_leaves, w.double())
    errs = [_rel(a, b) for a, b in zip(got, want)]
    assert all(e < RTOL for e in errs), errs
    assert _rel(out, ref) < RTOL


@pytest.mark.interpreter
def test_saving_the_lse_keeps_the_forwards_bits() -> None:
    q, k, v, _ = _inputs([40, 3], [40, 17], 4, 1, 64, seed=3)
    cq, ck = _cu([40, 3]), _cu([40, 17])
    plain = attention_triton_packed(q, k, v, cq, ck, scale=0.125, cfg=CFG)
    lse = torch.empty(q.shape[0], q.shape[1])
    with_lse = attention_triton_packed(q, k, v, cq, ck, scale=0.125, cfg=CFG, lse=lse)
    assert torch.equal(plain, with_lse)
    # log2 of the softmax denominator in units of q.k * scale * log2(e): logsumexp(q.k * scale) / ln 2
    s = k[:6, 0].double() @ q[5, 0].double() * 0.125  # row 5 (position 5) of head 0 sees keys 0..5
    assert abs(float(torch.logsumexp(s, 0)) / math.log(2) - float(lse[5, 0])) < 1e-5


@pytest.mark.interpreter
def test_the_cached_step_has_the_packed_forms_gradient() -> None:
    """Two sequences from empty in slots 2 and 0 of a cache: the output is the sampler's launch's (the
    cache holds the keys afterwards) and the gradients are the packed form's."""
    H, G, D, ns = 4, 2, 64, [29, 11]
    q, k, v, w = _inputs(ns, ns, H, G, D, seed=9)
    cu = _cu(ns)
    kc = torch.full((3, 32, G, D), float("nan"))
    vc = kc.clone()
    t = step_tables(torch.tensor([2, 0]), torch.tensor([0, 0]), cu, H // G, CFG, "cpu")
    a = [x.clone().requires_grad_() for x in (q, k, v)]
    out = tb.attention_cached(*a, kc, vc, t, cu, scale=D ** -0.5, cfg=CFG)
    assert torch.equal(kc[2, :29], k[:29]) and torch.equal(vc[0, :11], v[29:])
    b = [x.clone().requires_grad_() for x in (q, k, v)]
    packed = tb.attention_packed(*b, cu, cu, scale=D ** -0.5, cfg=CFG)
    assert torch.equal(out.detach(), packed.detach())
    ga, gb = torch.autograd.grad(out, a, w), torch.autograd.grad(packed, b, w)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))


@pytest.mark.interpreter
def test_a_wrong_backward_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference comparison can fail: a backward that forgets the group's other query heads
    (GQA's sum over heads) is far from fp64."""
    H, G, D, ns = 4, 1, 32, [19]
    q, k, v, w = _inputs(ns, ns, H, G, D, seed=1)
    cu = _cu(ns)
    real = tb.attention_backward_triton

    def one_head(q, k, v, o, lse, do, *args, **kw):
        keep = torch.zeros_like(do)
        keep[:, 0] = do[:, 0]
        dq, dk, dv = real(q, k, v, o, lse, keep, *args, **kw)
        return real(q, k, v, o, lse, do, *args, **kw)[0], dk, dv

    monkeypatch.setattr(tb, "attention_backward_triton", one_head)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    got = torch.autograd.grad(tb.attention_packed(*leaves, cu, cu, scale=D ** -0.5, cfg=CFG), leaves, w)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(attention_naive(*ref_leaves, cu, cu, scale=D ** -0.5), ref_leaves, w.double())
    assert _rel(got[1], want[1]) > 0.1 and _rel(got[0], want[0]) < RTOL


# -- gpu ----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_training_attention_over_cached_keys_is_refused_in_one_line() -> None:
    """A step that continues a sequence from keys an earlier call cached cannot give those keys a
    gradient (the cache is outside the autograd graph): refused, not silently dropped."""
    from aligned_mamba.errors import AlignedMambaError
    from aligned_mamba.ops.backend import resolve
    from aligned_mamba.ops.step import Step

    model = hybrid("attention_first_gqa1_d64")
    be = resolve(model.contract, "cuda")
    q, k, v = gpu_qkv(8, 4, 4, 64, seed=0)
    q.requires_grad_(True)
    cache = torch.zeros(1, 16, 4, 64, dtype=BF16, device="cuda")
    with pytest.raises(AlignedMambaError, match="cached by an earlier call") as exc:
        be.attention(q, k, v, cache, cache.clone(), Step.make([0], [4], [8]), scale=0.125)
    assert "\n" not in str(exc.value)
    be.attention(q, k, v, cache, cache.clone(), Step.from_empty([8]), scale=0.125).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.gpu
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
    q, k, v = gpu_qkv(sum(ns), H, G, D, seed=H * G + D)
    w = torch.randn(q.shape, generator=torch.Generator(device="cuda").manual_seed(3), device="cuda").to(BF16)
    cu = torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attention_packed(*leaves, cu, cu, scale=scale, cfg=gpu_cfg())
    assert torch.equal(out.detach(), attention_triton_packed(q, k, v, cu, cu, scale=scale, cfg=gpu_cfg()))
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


def _leaves(tensors: dict, device: str) -> dict:
    return {k: v.to(device).clone().requires_grad_() for k, v in tensors.items()}


def _loss(logits: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    return -sum(torch.log_softmax(lg.float(), -1).gather(-1, t[:, None].to(lg.device)).sum()
                for lg, t in zip(logits, targets))


@pytest.mark.gpu
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


@pytest.mark.gpu
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


# -- compile ------------------------------------------------------------------------------------


@pytest.mark.compile
@pytest.mark.slow
def test_attention_backward_kernels_compile_for_sm90(sm90_cache):
    assert_the_kernels_compile_for_sm90("backward", sm90_cache)
