"""The Triton attention's backward on the CPU through the Triton interpreter: logic, accuracy, determinism.

fp32 and tiny shapes. The gradients of q, k and v (packed variable-length sequences, queries the
last positions of their sequences, GQA 1 to 16) match the fp64 reference's to fp32 rounding; two
backwards give the same bits; saving the log-sum-exp leaves the forward's bits as they were; the
cached step (keys written into a slot cache, the sampler's launch) has the packed form's gradient.
The GPU's bf16 figures are tests/ops/test_attention_gpu.py's.
"""

from __future__ import annotations

import dataclasses
import math

import interpreted  # before triton: it switches the Triton interpreter on
import pytest
import torch

interpreted.require()
pytestmark = pytest.mark.interpreter

from aligned_mamba.ops.attention import attention_naive  # noqa: E402
from aligned_mamba.ops.attention import triton_backward as tb  # noqa: E402
from aligned_mamba.ops.attention.triton import attention_triton_packed, step_tables  # noqa: E402
from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402

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


@pytest.mark.parametrize("H,G,D,nq,nk", [
    (4, 2, 64, [37, 5, 20], [37, 5, 20]),     # prefill, three sequences
    (3, 1, 64, [10, 1, 20], [30, 9, 20]),     # queries the last positions (a chunk after cached keys)
    (16, 1, 32, [9, 0], [9, 4]),              # 16 query heads per key/value head; a sequence with no query
    (2, 2, 128, [21], [21]),                  # head_dim 128
    (2, 1, 32, [70], [70]),                   # many unmasked steps in both kernels
])
def test_gradients_match_the_fp64_reference(H: int, G: int, D: int, nq: list[int], nk: list[int]) -> None:
    _check_gradients(H, G, D, nq, nk, CFG)


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
