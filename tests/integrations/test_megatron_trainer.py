"""The trainer on a real Megatron-Core MambaModel (``trainer_hooks.megatron.trainer``): it scores the sampler's
logprobs bit for bit, steps through Megatron's forward and backward with fp32 masters, and serves the new
weights, which sample what it scores; it also agrees bit for bit with the reference ``PolicyTrainer``.

The sampler is the reference engine (``SamplerEngine`` over the core's model) under a small token budget, so
prompts are prefilled in unaligned pieces mixed with other requests' decode steps.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from torch_threads import single_thread_by_default  # noqa: E402, F401 (autouse fixture)

from aligned_mamba.contract import Contract  # noqa: E402
from aligned_mamba.engine import SamplerEngine  # noqa: E402
from aligned_mamba.models import build_model  # noqa: E402
from aligned_mamba.models.mamba2 import make_tiny  # noqa: E402
from aligned_mamba.train import PolicyTrainer, weights_digest, weights_from_bytes  # noqa: E402
from trainer_hooks import megatron as hk  # noqa: E402
from trainer_hooks.megatron import trainer as mc  # noqa: E402
from trainer_hooks.megatron.trainer import MegatronTrainer, make_trainer  # noqa: E402
from trainer_hooks.megatron.weights import megatron_to_hf  # noqa: E402

TINY = dict(num_hidden_layers=2, hidden_size=128, num_heads=4, vocab_size=256, chunk_size=32)


@pytest.fixture(scope="module", autouse=True)
def megatron_process() -> None:
    mc.prepare_process()


@pytest.fixture(autouse=True)
def no_hook_left() -> Iterator[None]:
    yield
    if hk.installed() is not None:  # other test files install other contracts in this process
        hk.installed().uninstall()


def tiny(**overrides):
    config, tensors = make_tiny(0, dtype="bfloat16", **TINY, **overrides)
    return config, tensors, Contract.from_hf_config(config.to_hf_dict(), backend="torch", model_dtype="bfloat16")


@pytest.fixture(scope="module")
def setup():
    return tiny()


def sample(config, weights, contract, seed: int):
    """Three requests (prompts 29, 40, 51 tokens, 12 new each) at a 23-token budget: chunked prefill."""
    eng = SamplerEngine(build_model(config, weights, contract), num_slots=3, max_batch_tokens=23, seed=seed)
    reqs = [eng.add_request(list(range(1, 30 + 11 * i)), 12) for i in range(3)]
    eng.run()
    return [torch.tensor(r.tokens) for r in reqs], [r.prompt_len for r in reqs], reqs


def exported(trainer) -> dict[str, torch.Tensor]:
    blob, digest = trainer.export_bytes()
    w = weights_from_bytes(blob)
    assert weights_digest(w) == digest
    return w


def assert_scores_are_sampled(trainer, seqs, prompt_lens, reqs) -> None:
    for lp, r in zip(trainer.token_logprobs(seqs, prompt_lens), reqs):
        assert lp.dtype == torch.float32
        assert torch.equal(lp, torch.tensor(r.sampled_logprobs, dtype=torch.float32))


def test_exports_the_checkpoint_and_scores_the_sampled_logprobs(setup) -> None:
    config, tensors, contract = setup
    tr = make_trainer(config=config, tensors=tensors, contract=contract, lr=1e-3)
    assert isinstance(tr, MegatronTrainer) and tr.version == 0
    blob, digest = tr.export_bytes()
    w = weights_from_bytes(blob)
    # the same names and dtypes (and bits) as the checkpoint, version in the metadata
    assert {k: v.dtype for k, v in w.items()} == {k: v.dtype for k, v in tensors.items()}
    assert digest == weights_digest(tensors)
    (header_len,) = struct.unpack("<Q", blob[:8])  # safetensors: u64 header length, then the JSON header
    assert json.loads(blob[8:8 + header_len])["__metadata__"] == {"format": "pt", "weights_version": "0"}
    seqs, pl, reqs = sample(config, w, contract, 0)
    assert_scores_are_sampled(tr, seqs, pl, reqs)


def test_step_moves_the_served_bits_and_they_sample_what_it_scores(setup) -> None:
    config, tensors, contract = setup
    tr = make_trainer(config=config, tensors=tensors, contract=contract, lr=1e-3)
    seqs, pl, _ = sample(config, exported(tr), contract, 0)
    before = tr.token_logprobs(seqs, pl)
    d0 = tr.export_bytes()[1]
    stats = tr.step(seqs, pl, [1.0, -1.0, 0.5])
    assert stats["weights_version"] == tr.version == 1 and stats["tokens"] == 36 and stats["grad_norm"] > 0
    # mixed precision: the model keeps the checkpoint dtypes, the masters are fp32 and round to the model's bits
    for name, p in tr.params.items():
        assert p.dtype != torch.float32 or tr.master[name].dtype == torch.float32
        assert torch.equal(p.detach(), tr.master[name].detach().to(p.dtype))
    w = exported(tr)
    assert {k: v.dtype for k, v in w.items()} == {k: v.dtype for k, v in tensors.items()}
    assert weights_digest(w) != d0
    after = tr.token_logprobs(seqs, pl)
    assert not all(torch.equal(a, b) for a, b in zip(before, after))
    seqs2, pl2, reqs2 = sample(config, w, contract, 1)
    assert_scores_are_sampled(tr, seqs2, pl2, reqs2)


@pytest.mark.parametrize("tied", [False, True])
def test_agrees_with_the_reference_trainer_bit_for_bit(tied: bool, setup) -> None:
    """Scores are bit-identical by construction (the hook's forward is the core's layer). Steps agree bitwise too
    (measured on torch 2.13 CPU, tied and untied): the backward runs the same ops on the same checkpoint-dtype
    tensors, so the fp32 master gradients, the Adam updates, the served weights and the reported loss /
    grad norm are equal, step after step. Under contract v3 the fp32 residual stream gets its next norm's
    gradient terms and its add's one by one, in an order the hook must keep (``mamba_layer_forward``)."""
    config, tensors, contract = tiny(tie_word_embeddings=True) if tied else setup
    tr = make_trainer(config=config, tensors=tensors, contract=contract, lr=1e-3)
    ref = PolicyTrainer(config, tensors, contract, lr=1e-3)
    if tied:  # the tiny tied model samples near-certain tokens; random sequences give a real gradient
        g = torch.Generator().manual_seed(0)
        seqs, pl = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (50, 33, 7)], [20, 30, 3]
    else:
        seqs, pl, _ = sample(config, tensors, contract, 2)
    for lp, want in zip(tr.token_logprobs(seqs, pl), ref.token_logprobs(seqs, pl)):
        assert torch.equal(lp, want)
    for advantages in ([1.0, -1.0, 0.5], [0.25, 1.0, -2.0]):
        assert tr.step(seqs, pl, advantages) == ref.step(seqs, pl, advantages)
        # the gradients themselves: Adam's first step moves each weight by about lr whatever its gradient's
        # last bits, so equal weights after it do not show equal gradients
        grads = megatron_to_hf({n: m.grad for n, m in tr.master.items()}, config)
        assert grads.keys() <= ref.master.keys()
        for name, g in grads.items():
            assert torch.equal(g, ref.master[name].grad), name
        # (the bytes themselves may differ: safetensors writes the metadata map in no fixed order)
        assert tr.export_bytes()[1] == ref.export_bytes()[1]
        for lp, want in zip(tr.token_logprobs(seqs, pl), ref.token_logprobs(seqs, pl)):
            assert torch.equal(lp, want)


def test_the_step_scores_one_packed_logits_tensor(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's loss reads Megatron's packed logits as the one [sum len_i, vocab] tensor, as ``PolicyTrainer``
    does: no per-sequence split, whose backward would concatenate a logits-sized copy (the bits against the
    reference trainer: the test above)."""
    config, tensors, contract = setup
    tr = make_trainer(config=config, tensors=tensors, contract=contract, lr=1e-3)
    seen = []
    real = mc.reinforce_loss
    monkeypatch.setattr(mc, "reinforce_loss", lambda logits, *a, **k: seen.append(logits) or real(logits, *a, **k))
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (40, 17)]
    tr.step(seqs, [30, 9], [1.0, -0.5])
    assert len(seen) == 1 and isinstance(seen[0], torch.Tensor), type(seen[0])
    assert seen[0].shape == (57, config.vocab_size) and seen[0].grad_fn is not None
    assert "Split" not in type(seen[0].grad_fn).__name__


def test_registered_and_bad_input(setup) -> None:
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="aligned_mamba.trainers") if ep.name == "megatron"]
    assert ep.load() is make_trainer
    config, tensors, contract = setup
    with pytest.raises(ValueError, match="lr"):
        make_trainer(config=config, tensors=tensors, contract=contract, lr=0)
    tr = make_trainer(config=config, tensors=tensors, contract=contract, lr=1e-3)
    with pytest.raises(ValueError, match="same length"):
        tr.step([torch.tensor([1, 2, 3])], [1], [])
    with pytest.raises(ValueError, match="prompt length"):
        tr.step([torch.tensor([1, 2, 3])], [4], [1.0])
    assert tr.version == 0
