"""Gradients through the shared ops, checked against float64 autograd of the sequential reference.

The position-invariant transcendentals (``ops.elementwise``) are built from IEEE basic ops and bit
tricks, so autograd through them would be wrong (before the analytic backward: dt, A and dt_bias
gradients of the scan were off by a relative 1.0). These tests hold every gradient of the chunked scan
and of a whole tiny Mamba2 model (fp32 model dtype) to the fp64 reference, and check that turning
gradients on changes no forward bit.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from fp64_reference import GRAD_RTOL, MODEL, reference_logits_fp64, rel_err
from torch_threads import single_thread_by_default  # noqa: F401 (autouse fixture)

from aligned_mamba import Contract
from aligned_mamba.models import build_model
from aligned_mamba.models.mamba2 import make_tiny
from aligned_mamba.ops import elementwise as ew
from aligned_mamba.ops.logprobs import log_softmax
from aligned_mamba.ops.ssd import SSMParams, ssd_chunk, ssd_naive

# -- elementwise ---------------------------------------------------------------------------------------

_CASES = {
    "exp": (ew.exp, torch.exp, lambda x: x),
    "log": (ew.log, torch.log, lambda x: x.abs() + 1e-3),
    "log1p": (ew.log1p, torch.log1p, lambda x: x.abs() * 0.04 - 0.5),
    "softplus": (ew.softplus, F.softplus, lambda x: x),
    "sigmoid": (ew.sigmoid, torch.sigmoid, lambda x: x),
    "silu": (ew.silu, F.silu, lambda x: x),
}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_elementwise_gradient_and_forward_bits(name: str) -> None:
    fn, ref_fn, domain = _CASES[name]
    g = torch.Generator().manual_seed(3)
    x = domain(torch.rand(20000, generator=g) * 60 - 30)
    xg = x.clone().requires_grad_()
    y = fn(xg)
    assert torch.equal(y.detach(), fn(x)), "a grad-requiring input changed forward bits"
    w = torch.randn(x.shape, generator=g)
    (y * w).sum().backward()
    xd = x.double().requires_grad_()
    (ref_fn(xd) * w.double()).sum().backward()
    # each gradient within 1e-5 of its fp64 value, relative, or within 1e-7 of the largest gradient (about one
    # fp32 ulp at that scale): near a zero of the derivative (silu' at x = -1.28) the fp32 formula cancels
    err = (xg.grad.double() - xd.grad).abs() / (xd.grad.abs() + 1e-2 * xd.grad.abs().max())
    assert float(err.max()) < 1e-5, (name, float(err.max()))


def test_exp_gradient_is_zero_where_clamped() -> None:
    x = torch.tensor([-1e4, -200.0, 100.0, float("-inf")], requires_grad=True)
    ew.exp(x).sum().backward()
    assert torch.equal(x.grad, torch.zeros(4))


@pytest.mark.parametrize("dt_limit", [(0.0, math.inf), (0.3, 2.5)], ids=["no-limit", "limit"])
def test_dt_softplus_backward_is_autograds(dt_limit) -> None:
    """``chunk.dt_softplus_backward`` (the triton backend's written-out gradient of the packing's dt)
    equals torch autograd through ``dt_softplus``, clamped rows and rows above the threshold included;
    a dropped clamp mask is caught."""
    from aligned_mamba.ops.ssd.chunk import dt_softplus, dt_softplus_backward

    g = torch.Generator().manual_seed(3)
    dt = torch.cat([torch.randn(60, 4, generator=g) * 3, torch.full((2, 4), 30.0)])
    bias, gy = torch.randn(4, generator=g) * 0.5, torch.randn(62, 4, generator=g)
    leaves = (dt.clone().requires_grad_(), bias.clone().requires_grad_())
    want = torch.autograd.grad((dt_softplus(*leaves, dt_limit) * gy).sum(), leaves)
    got = dt_softplus_backward(dt, bias, dt_limit, gy)
    assert torch.equal(got, want[0]) and torch.allclose(got.sum(0), want[1], rtol=1e-6, atol=1e-6)
    if dt_limit != (0.0, math.inf):
        assert not torch.equal(dt_softplus_backward(dt, bias, (0.0, math.inf), gy), want[0])


# -- the chunked scan ----------------------------------------------------------------------------------

SCAN_LEAVES = ("x", "dt", "A", "B", "C", "D", "dt_bias", "h0")


def _scan_inputs(seed: int, lens: list[int], H: int = 4, P: int = 8, G: int = 2,
                 N: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T, S = sum(lens), len(lens)
    return dict(x=torch.randn(T, H, P, generator=g), dt=torch.rand(T, H, generator=g) * 3 - 2,
                A=-torch.exp(torch.rand(H, generator=g) * 2.7), B=torch.randn(T, G, N, generator=g),
                C=torch.randn(T, G, N, generator=g), D=torch.randn(H, generator=g),
                dt_bias=torch.randn(H, generator=g) * 0.5, h0=torch.randn(S, H, P, N, generator=g) * 0.3)


@pytest.mark.parametrize("chunk,lens", [(32, [61, 30, 9]), (16, [1, 47, 16])])
def test_chunk_scan_gradients_match_fp64_reference(chunk: int, lens: list[int]) -> None:
    leaves = _scan_inputs(chunk, lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    g = torch.Generator().manual_seed(7)
    wy = torch.randn(leaves["x"].shape, generator=g)
    wh = torch.randn(leaves["h0"].shape, generator=g)

    a = {k: v.clone().requires_grad_() for k, v in leaves.items()}
    y, h = ssd_chunk(a["x"], a["dt"], a["B"], a["C"], SSMParams(a["A"], a["D"], a["dt_bias"]), cu, a["h0"],
                     chunk_size=chunk, final="end", row_tile=16)
    ((y * wy).sum() + (h * wh).sum()).backward()
    y_plain, h_plain = ssd_chunk(leaves["x"], leaves["dt"], leaves["B"], leaves["C"],
                                 SSMParams(leaves["A"], leaves["D"], leaves["dt_bias"]), cu, leaves["h0"],
                                 chunk_size=chunk, final="end", row_tile=16)
    assert torch.equal(y.detach(), y_plain) and torch.equal(h.detach(), h_plain), "grad mode changed forward bits"

    b = {k: v.double().requires_grad_() for k, v in leaves.items()}
    yr, hr = ssd_naive(b["x"], b["dt"], b["B"], b["C"], SSMParams(b["A"], b["D"], b["dt_bias"]), cu, b["h0"])
    ((yr * wy.double()).sum() + (hr * wh.double()).sum()).backward()
    errs = {k: rel_err(a[k].grad, b[k].grad) for k in SCAN_LEAVES}
    assert all(e < GRAD_RTOL for e in errs.values()), errs


# -- a whole tiny model --------------------------------------------------------------------------------



def test_tiny_model_gradients_match_fp64_reference() -> None:
    config, tensors = make_tiny(0, dtype="float32", **MODEL)
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (40, 17, 5)]
    targets = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (40, 17, 5)]

    leaves = {k: v.clone().requires_grad_() for k, v in tensors.items()}
    model = build_model(config, leaves, Contract(chunk_size=config.chunk_size, model_dtype="float32"))
    logits = model.forward(seqs)
    with torch.no_grad():
        plain = build_model(config, tensors, model.contract).forward(seqs)
    assert all(torch.equal(a.detach(), b) for a, b in zip(logits, plain)), "grad mode changed forward bits"
    # the policy-gradient shape of loss: logprobs of chosen tokens through the shared log_softmax
    loss = -sum(log_softmax(lg).gather(-1, t[:, None]).sum() for lg, t in zip(logits, targets))
    loss.backward()

    ref = {k: v.double().requires_grad_() for k, v in tensors.items()}
    ref_logits = [reference_logits_fp64(config, ref, s) for s in seqs]
    assert max(rel_err(a.detach(), b.detach()) for a, b in zip(logits, ref_logits)) < 1e-5
    ref_loss = -sum(torch.log_softmax(lg, -1).gather(-1, t[:, None]).sum() for lg, t in zip(ref_logits, targets))
    ref_loss.backward()
    assert math.isclose(float(loss.detach()), float(ref_loss.detach()), rel_tol=1e-5)
    errs = {k: rel_err(leaves[k].grad, ref[k].grad) for k in tensors}
    assert all(e < GRAD_RTOL for e in errs.values()), {k: e for k, e in errs.items() if e >= GRAD_RTOL}


# -- an output recomputed in the backward instead of saved -----------------------------------------------


@pytest.mark.parametrize("hooked", [True, False], ids=["recomputed", "saved (baseline)"])
def test_recomputed_output_is_freed_after_the_forward_and_gives_the_same_gradient(hooked: bool) -> None:
    """A consumer saves two views of an op's output (as the scan saves x, B, C of the conv's): under
    ``recomputed_in_backward`` the output is freed once the forward drops it, and the backward, from the
    recomputed output (twice, with retain_graph), gives the saved path's gradient bit for bit; without
    it (the baseline) the saved views hold the output to the backward."""
    import weakref

    from aligned_mamba.ops.autograd import recomputed_in_backward

    a = torch.randn(64, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    calls = []

    def again() -> torch.Tensor:
        calls.append(1)
        return a.detach().sin()

    def loss() -> tuple[torch.Tensor, weakref.ref]:
        out = a.sin()  # sin saves its input, not its output
        with recomputed_in_backward(out, again) if hooked else contextlib.nullcontext():
            y = (out[:, :3] * out[:, 2:5]).sum()
        return y, weakref.ref(out)

    y, ref = loss()
    assert (ref() is None) == hooked
    g1 = torch.autograd.grad(y, a, retain_graph=True)[0]
    g2 = torch.autograd.grad(y, a)[0]
    plain = a.sin()
    want = torch.autograd.grad((plain[:, :3] * plain[:, 2:5]).sum(), a)[0]
    assert torch.equal(g1, want) and torch.equal(g2, want)
    assert len(calls) == (2 if hooked else 0)  # one recompute per backward, shared by both views


@pytest.mark.parametrize("knob", ["recompute", "recompute_conv", "hold_conv_outputs"])
def test_tiny_model_gradients_the_same_bits_with_the_mixers_recompute(knob: str, monkeypatch) -> None:
    """The mixer's backward runs the conv and the gated norm again (``Mamba2Mixer.recompute``) rather
    than hold their outputs: every gradient has the bits of the run that holds them, both, the conv's
    alone (``recompute_conv``) or the conv's in the layers a budget covers (``hold_conv_outputs``)."""
    from aligned_mamba.layers.mamba2 import Mamba2Mixer, hold_conv_outputs

    config, tensors = make_tiny(0, dtype="float32", **MODEL)
    g = torch.Generator().manual_seed(12)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (40, 9)]
    targets = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (40, 9)]

    def grads() -> list[torch.Tensor]:
        leaves = {k: v.clone().requires_grad_() for k, v in tensors.items()}
        contract = Contract(chunk_size=config.chunk_size, model_dtype="float32")
        logits = build_model(config, leaves, contract).forward(seqs)
        loss = -sum(log_softmax(lg).gather(-1, t[:, None]).sum() for lg, t in zip(logits, targets))
        return list(torch.autograd.grad(loss, [leaves[k] for k in sorted(leaves)]))

    assert Mamba2Mixer.recompute and Mamba2Mixer.recompute_conv
    again = grads()
    if knob == "hold_conv_outputs":
        with hold_conv_outputs(49 * config.mixer_config().conv_dim * 4) as left:  # the first layer's 49 rows
            held = grads()
        assert left[0] == 0
    else:
        monkeypatch.setattr(Mamba2Mixer, knob, False)
        held = grads()
    assert all(torch.equal(u, v) for u, v in zip(again, held))


def test_recomputed_output_leaves_enclosing_hooks_the_other_saved_tensors() -> None:
    """Inside an enclosing ``saved_tensors_hooks`` block (activation offloading, say), the tensors that
    are not views of the recomputed output still go through the enclosing hooks."""
    from aligned_mamba.ops.autograd import recomputed_in_backward

    a = torch.randn(8, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    b = torch.randn(8, 3, generator=torch.Generator().manual_seed(2), requires_grad=True)
    seen = []

    def pack(t):
        seen.append(tuple(t.shape))
        return t.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = a.sin()
        with recomputed_in_backward(out, lambda: a.detach().sin()):
            y = (out[:, :3] * b).sum()
    assert seen == [(8, 4), (8, 3)]  # sin's input a, then b (out's view is the recomputed one)
    ga, gb = torch.autograd.grad(y, (a, b))
    plain = a.sin()
    want = torch.autograd.grad((plain[:, :3] * b).sum(), (a, b))
    assert torch.equal(ga, want[0]) and torch.equal(gb, want[1])


def _spy_recomputes(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the outputs the Mamba2 mixer hands to ``recomputed_in_backward``, in call order."""
    from aligned_mamba.layers import mamba2 as m2

    calls = []
    real = m2.recomputed_in_backward

    def spy(out, recompute):
        calls.append(tuple(out.shape))
        return real(out, recompute)

    monkeypatch.setattr(m2, "recomputed_in_backward", spy)
    return calls


def test_mixer_leaves_its_outputs_to_an_enclosing_hooks_block(monkeypatch) -> None:
    """Inside a ``saved_tensors_hooks`` block (checkpointing, offloading) the mixer does not recompute
    (its recompute would hold inputs the block may release): no ``recomputed_in_backward`` there, two a
    layer outside (the baseline), one with ``recompute_conv`` off (the gated norm's)."""
    from aligned_mamba.layers import mamba2 as m2

    config, tensors = make_tiny(0, dtype="float32", **MODEL)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(13)) for n in (9, 4)]
    calls = _spy_recomputes(monkeypatch)
    leaves = {k: v.clone().requires_grad_() for k, v in tensors.items()}
    contract = Contract(chunk_size=config.chunk_size, model_dtype="float32")
    build_model(config, leaves, contract).forward(seqs)
    assert len(calls) == 2 * config.num_hidden_layers
    calls.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        build_model(config, leaves, contract).forward(seqs)
    assert not calls
    # the conv's output held (recompute_conv off): the gated norm's output alone is recomputed
    monkeypatch.setattr(m2.Mamba2Mixer, "recompute_conv", False)
    build_model(config, leaves, contract).forward(seqs)
    assert calls == [(sum(map(len, seqs)), config.intermediate_size)] * config.num_hidden_layers


def test_hold_conv_outputs_spends_its_budget_layer_by_layer(monkeypatch) -> None:
    """``hold_conv_outputs``: the first layers whose conv output (T x conv_dim x 4 bytes in fp32) fits in
    what is left of the budget hold it (the gated norm's recompute alone), the rest recompute both; the
    budget closes with the block. Bad budgets are refused."""
    from aligned_mamba.layers import mamba2 as m2

    config, tensors = make_tiny(0, dtype="float32", **MODEL)
    assert config.num_hidden_layers >= 2
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(14)) for n in (9, 4)]
    T, d = sum(map(len, seqs)), config.intermediate_size
    per_layer = T * config.mixer_config().conv_dim * 4
    calls = _spy_recomputes(monkeypatch)
    leaves = {k: v.clone().requires_grad_() for k, v in tensors.items()}
    contract = Contract(chunk_size=config.chunk_size, model_dtype="float32")
    conv = config.mixer_config().conv_dim
    with m2.hold_conv_outputs(per_layer + per_layer - 1) as left:  # one layer fits, not two
        build_model(config, leaves, contract).forward(seqs)
    assert left[0] == per_layer - 1
    assert [w for _, w in calls] == [d] + [conv, d] * (config.num_hidden_layers - 1)
    calls.clear()
    build_model(config, leaves, contract).forward(seqs)  # the budget closed with its block
    assert [w for _, w in calls] == [conv, d] * config.num_hidden_layers
    calls.clear()
    with torch.no_grad(), m2.hold_conv_outputs(per_layer) as left:  # nothing to hold without gradients
        build_model(config, leaves, contract).forward(seqs)
    assert left[0] == per_layer and not calls
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="budget_bytes"), m2.hold_conv_outputs(bad):
            pass
