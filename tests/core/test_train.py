"""The policy-gradient trainer: scores the sampler's bits, steps, and serves versioned weights."""

import pytest
import torch
from torch_threads import single_thread_by_default  # noqa: F401 (autouse fixture)

from aligned_mamba.contract import Contract
from aligned_mamba.engine import SamplerEngine
from aligned_mamba.models import build_model
from aligned_mamba.models.mamba2 import make_tiny
from aligned_mamba.train import PolicyTrainer, weights_digest, weights_from_bytes


@pytest.fixture(scope="module")
def setup():
    cfg, t = make_tiny(0, num_hidden_layers=2, hidden_size=128, num_heads=4, vocab_size=256, chunk_size=32)
    c = Contract.from_hf_config(cfg.to_hf_dict(), backend="torch", model_dtype="bfloat16")
    return cfg, t, c


def _sample(cfg, weights, c, seed):
    eng = SamplerEngine(build_model(cfg, weights, c), num_slots=3, max_batch_tokens=23, seed=seed)
    reqs = [eng.add_request(list(range(1, 30 + 11 * i)), 12) for i in range(3)]
    eng.run()
    return [torch.tensor(r.tokens) for r in reqs], [r.prompt_len for r in reqs], reqs


def test_scores_are_the_sampler_logprobs_and_a_step_moves_them(setup):
    cfg, t, c = setup
    tr = PolicyTrainer(cfg, t, c, lr=1e-3)
    seqs, pl, reqs = _sample(cfg, tr.weights(), c, 0)
    before = tr.token_logprobs(seqs, pl)
    for lp, r in zip(before, reqs):
        assert torch.equal(lp, torch.tensor(r.sampled_logprobs, dtype=torch.float32))
    d0 = weights_digest(tr.weights())
    stats = tr.step(seqs, pl, [1.0, -1.0, 0.5])
    assert stats["weights_version"] == 1 and stats["tokens"] == 36 and stats["grad_norm"] > 0
    after = tr.token_logprobs(seqs, pl)
    assert weights_digest(tr.weights()) != d0
    assert not all(torch.equal(a, b) for a, b in zip(before, after))  # the update reached the served bits
    # the new weights, shipped as bytes, sample what the trainer scores
    blob, digest = tr.export_bytes()
    w = weights_from_bytes(blob)
    assert weights_digest(w) == digest
    seqs2, pl2, reqs2 = _sample(cfg, w, c, 1)
    for lp, r in zip(tr.token_logprobs(seqs2, pl2), reqs2):
        assert torch.equal(lp, torch.tensor(r.sampled_logprobs, dtype=torch.float32))


def test_every_side_reads_the_contract_backends_logprob(setup, monkeypatch):
    """The engine's reported logprobs, the trainer's scores, ``check``'s comparison and
    ``aligned_mamba.token_logprobs`` all take the contract backend's log-softmax (on a GPU the triton
    backend's kernels, whose order is not the torch form's). With its log-softmax and token logprobs swapped
    for others on the contract's backend, every side moves with them; the torch form's logprobs, which a side reading
    ``ops.logprobs`` directly would report, differ, so the comparison can fail."""
    import aligned_mamba
    from aligned_mamba.check import compare_logprobs
    from aligned_mamba.integrations import ScenarioResult
    from aligned_mamba.ops import logprobs
    from aligned_mamba.ops.backend import resolve

    cfg, t, c = setup
    be = resolve(c, "cpu")
    monkeypatch.setattr(be, "log_softmax", lambda x, temperature=1.0: logprobs.log_softmax(x, temperature) - 0.5)
    monkeypatch.setattr(be, "token_logprobs",
                        lambda x, ids, temperature=1.0: logprobs.token_logprobs(x, ids, temperature) - 0.5)
    tr = PolicyTrainer(cfg, t, c, lr=1e-3)
    seqs, pl, reqs = _sample(cfg, tr.weights(), c, 0)
    scored = tr.token_logprobs(seqs, pl)
    logits = tr.forward(seqs)
    for lp, r, lg, seq, p in zip(scored, reqs, logits, seqs, pl):
        reported = torch.tensor(r.sampled_logprobs, dtype=torch.float32)
        assert torch.equal(lp, reported)
        assert torch.equal(aligned_mamba.token_logprobs(lg[p - 1:-1], seq[p:], contract=c), reported)
        assert not torch.equal(logprobs.token_logprobs(lg[p - 1:-1], seq[p:]), reported)
    got = ScenarioResult("s", [s.tolist() for s in seqs], [], [r.sampled_logprobs for r in reqs], 1, 0, 0.0, 0, {})
    assert compare_logprobs(got, logits, 12, c)["mismatched_logprobs"] == 0
    assert compare_logprobs(got, logits, 12, None)["mismatched_logprobs"] == 36


def test_positive_advantage_raises_the_sampled_logprob(setup):
    cfg, t, c = setup
    tr = PolicyTrainer(cfg, t, c, lr=1e-3)
    seqs, pl, _ = _sample(cfg, tr.weights(), c, 2)
    base = sum(float(lp.sum()) for lp in tr.token_logprobs(seqs, pl))
    for _ in range(3):
        tr.step(seqs, pl, [1.0, 1.0, 1.0])
    assert sum(float(lp.sum()) for lp in tr.token_logprobs(seqs, pl)) > base


def test_bad_input(setup):
    cfg, t, c = setup
    with pytest.raises(ValueError, match="lr"):
        PolicyTrainer(cfg, t, c, lr=0)
    tr = PolicyTrainer(cfg, t, c)
    with pytest.raises(ValueError, match="same length"):
        tr.step([torch.tensor([1, 2, 3])], [1], [])
    with pytest.raises(ValueError, match="prompt length"):
        tr.step([torch.tensor([1, 2, 3])], [4], [1.0])


def test_a_diverged_step_is_stopped_before_its_weights_leave(setup):
    """Weights that overflow: the sampler stops with the reason, the next step (loss NaN) is not
    applied, and weights holding NaN or inf are never exported."""
    from aligned_mamba.errors import RuntimeFailure, TrainingDiverged

    cfg, t, c = setup
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="finite number > 0"):
            PolicyTrainer(cfg, t, c, lr=bad)
    seqs, plens, _ = _sample(cfg, t, c, seed=0)
    tr = PolicyTrainer(cfg, t, c, lr=3e37)  # finite; Adam's first step moves every weight by ~3e37
    tr.step(seqs, plens, [1.0, -1.0, 0.5])
    with pytest.raises(RuntimeFailure, match="non-finite logits at engine step .* diverged update"):
        _sample(cfg, tr.weights(), c, seed=1)
    with pytest.raises(TrainingDiverged, match=r"training step 2 diverged: loss nan.*not applied, weights v1 kept"):
        tr.step(seqs, plens, [1.0, -1.0, 0.5])
    assert tr.version == 1
    with torch.no_grad():
        next(iter(tr.master.values())).view(-1)[0] = float("inf")
    with pytest.raises(TrainingDiverged, match=r"weights v1 hold non-finite values in 1 tensor\(s\).*not exported"):
        tr.export_bytes()
    sane = PolicyTrainer(cfg, t, c, lr=1e-3)  # the same step at a sane rate exports
    sane.step(seqs, plens, [1.0, -1.0, 0.5])
    assert sane.export_bytes()[1]


def _consumers(t: torch.Tensor, node) -> set[str]:
    """The names of the autograd nodes, on t's gradient's way, that take their input from ``node``."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn is node or fn in seen:
            continue
        seen.add(fn)
        nxt = [f for f, _ in fn.next_functions]
        if any(f is node for f in nxt):
            names.add(type(fn).__name__)
        todo.extend(nxt)
    return names


def test_the_trainers_logits_gradient_is_one_tensor_with_the_split_forms_bits(setup):
    """The trainer scores packed logits (``forward(..., packed=True)``) in one call over every row: no
    split (its backward concatenates the gradients into a copy) and no per-sequence slice (its backward
    zero-fills a logits-sized tensor), 1.5 GiB each at 16384 tokens of a 50k vocabulary. One sequence's
    unpacked forward is the advance's rows too. The logprobs and every weight gradient are the
    per-sequence form's bits; that form, the baseline, passes through both copies."""
    from aligned_mamba.train import generated_logprobs, reinforce_loss

    cfg, t, c = setup
    leaves = {k: v.detach().clone().requires_grad_() for k, v in t.items()}
    model = build_model(cfg, leaves, c)
    seqs = [torch.arange(1, 30) % cfg.vocab_size, torch.arange(7, 50) % cfg.vocab_size]
    pl, adv = [5, 11], [1.0, -0.5]
    lists = model.forward(seqs)
    packed = model.forward(seqs, packed=True)
    (one,) = model.forward(seqs[:1])
    assert "Split" not in type(one.grad_fn).__name__
    assert torch.equal(torch.cat(lists), packed.detach())
    with torch.no_grad():
        lp_list = generated_logprobs(lists, seqs, pl, contract=c)
        lp_packed = generated_logprobs(packed, seqs, pl, contract=c)
    assert all(torch.equal(a, b) for a, b in zip(lp_list, lp_packed, strict=True))
    loss_list, n_list = reinforce_loss(lists, seqs, pl, adv, contract=c)
    loss_packed, n_packed = reinforce_loss(packed, seqs, pl, adv, contract=c)
    assert n_list == n_packed == 24 + 32 and torch.equal(loss_list, loss_packed)
    # what reads the logits: the baseline splits them and slices each sequence's rows
    split = lists[0].grad_fn
    assert _consumers(loss_list, split.next_functions[0][0]) == {"SplitWithSizesBackward0"}
    assert _consumers(loss_list, split) == {"SliceBackward0"}
    assert not any(n.startswith(("Split", "Slice")) for n in _consumers(loss_packed, packed.grad_fn))
    names = sorted(leaves)
    g_list = torch.autograd.grad(loss_list, [leaves[k] for k in names], retain_graph=True)  # shared casts
    g_packed = torch.autograd.grad(loss_packed, [leaves[k] for k in names])
    assert all(torch.equal(a, b) for a, b in zip(g_list, g_packed))
    with pytest.raises(ValueError, match="packed logits"):
        reinforce_loss(packed[1:], seqs, pl, adv, contract=c)
    with pytest.raises(ValueError, match="2 sequences but 1 prompt lengths"):
        generated_logprobs(packed, seqs, pl[:1], contract=c)
    with pytest.raises(ValueError, match="2 sequences but 1 logits tensors"):
        generated_logprobs(lists[:1], seqs, pl, contract=c)
