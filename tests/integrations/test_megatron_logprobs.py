"""Megatron's logprobs: ``trainer_hooks.megatron.token_logprobs`` on a real megatron-core MambaModel's output
logits ([b, s, V] and [s, b, V]) equals ``aligned_mamba.token_logprobs`` on the reference model's rows, bit for
bit, at temperature 1.0 and 0.7; and ``MegatronTrainer.token_logprobs`` at a temperature equals the reference
trainer's. Stock ``torch.log_softmax`` on the same logits differs (so the equality can fail)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from torch_threads import single_thread_by_default  # noqa: E402, F401 (autouse fixture)

import aligned_mamba  # noqa: E402
from aligned_mamba.contract import Contract  # noqa: E402
from aligned_mamba.models import build_model  # noqa: E402
from aligned_mamba.models.mamba2 import make_tiny  # noqa: E402
from aligned_mamba.train import PolicyTrainer  # noqa: E402
from trainer_hooks import megatron as hk  # noqa: E402
from trainer_hooks.megatron import trainer as mc  # noqa: E402

TINY = dict(num_hidden_layers=2, hidden_size=128, num_heads=4, vocab_size=512, chunk_size=32)


@pytest.fixture(scope="module", autouse=True)
def megatron_process() -> None:
    mc.prepare_process()


@pytest.fixture(autouse=True)
def no_hook_left() -> Iterator[None]:
    yield
    if hk.installed() is not None:  # other test files install other contracts in this process
        hk.installed().uninstall()


@pytest.fixture(scope="module")
def setup():
    config, tensors = make_tiny(0, dtype="bfloat16", **TINY)
    contract = Contract.from_hf_config(config.to_hf_dict(), backend="torch", model_dtype="bfloat16")
    return config, tensors, contract


def _batch(vocab: int, b: int = 3, s: int = 70) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, s] token ids and Megatron's labels (the next token at each position; the last wraps around)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_megatron_logits_give_the_contracts_logprobs(setup, temperature: float) -> None:
    config, tensors, contract = setup
    ids, labels = _batch(config.vocab_size)
    ref_rows = torch.stack(build_model(config, tensors, contract).forward(list(ids)))  # [b, s, V]
    want = aligned_mamba.token_logprobs(ref_rows, labels, temperature)

    hk.install(contract)
    model = mc.build_mamba_model(config, contract.model_dtype)
    mc.load_hf_weights(model, config, tensors)
    model.train()  # as a loss function sees them: training forward, autograd recording
    logits = model(ids, None, attention_mask=None)  # MambaModel returns [b, s, V]
    assert tuple(logits.shape) == (*ids.shape, config.vocab_size)
    got = hk.token_logprobs(logits, labels, temperature)
    assert got.dtype == torch.float32 and torch.equal(got.detach(), want)
    # the output layer's [s, b, V] layout, inferred from the shapes or stated
    assert torch.equal(hk.token_logprobs(logits.transpose(0, 1), labels, temperature).detach(), want)
    sb = logits.transpose(0, 1).contiguous()
    assert torch.equal(hk.token_logprobs(sb, labels, temperature, sequence_first=True).detach(), want)
    # a loss reads it: the gradient reaches the parameters
    (-got.mean()).backward()
    assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())
    # the contrast: stock torch.log_softmax on the same (equal) logits rounds differently somewhere
    stock = torch.log_softmax(logits.detach().float() / temperature, -1).gather(-1, labels[..., None])[..., 0]
    assert int((stock != want).sum()) > 0


def test_megatron_token_logprobs_bad_layouts(setup) -> None:
    logits = torch.zeros(4, 4, 16)
    with pytest.raises(ValueError, match="layout ambiguous"):
        hk.token_logprobs(logits, torch.zeros(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"logits \[s, b, V\] or \[b, s, V\]"):
        hk.token_logprobs(torch.zeros(4, 16), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="shape mismatch"):
        hk.token_logprobs(torch.zeros(2, 5, 16), torch.zeros(3, 5, dtype=torch.int64))


def test_megatron_trainer_scores_at_a_temperature_as_the_reference_trainer(setup) -> None:
    config, tensors, contract = setup
    tr = mc.make_trainer(config=config, tensors=tensors, contract=contract, lr=1e-3)
    ref = PolicyTrainer(config, tensors, contract, lr=1e-3)
    g = torch.Generator().manual_seed(3)
    seqs, pl = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (50, 33)], [20, 3]
    for t in (1.0, 0.7):
        for lp, want, seq, p, rows in zip(tr.token_logprobs(seqs, pl, t), ref.token_logprobs(seqs, pl, t), seqs, pl,
                                          ref.forward(seqs)):
            assert torch.equal(lp, want)
            assert torch.equal(want, aligned_mamba.token_logprobs(rows[p - 1 : -1], seq[p:], t))
    cold = ref.token_logprobs(seqs, pl, 1.0)
    assert not all(torch.equal(a, b) for a, b in zip(cold, ref.token_logprobs(seqs, pl, 0.7)))
