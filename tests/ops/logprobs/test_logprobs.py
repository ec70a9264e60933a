"""The contract's logprob function: ``aligned_mamba.token_logprobs`` (input checks, position invariance,
the contrast with stock ``torch.log_softmax``) and its vocab-sharded form (``ops.logprobs.log_softmax_sharded``:
any power-of-two shard count dividing VOCAB_SLICES gives the unsharded bits). The Triton kernels:
tests/ops/logprobs/test_logprobs_triton.py."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

import aligned_mamba
from aligned_mamba import Contract
from aligned_mamba.ops.logprobs import sliced as L
from aligned_mamba.parallel import threads

V = 50280  # mamba-130m's vocabulary: rows of realistic width


def _rows(seed: int, n: int = 48, v: int = V, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits shaped like a model's (bf16, spread ~3, a per-row offset) and token ids."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g) * 3 + torch.randn(n, 1, generator=g) * 5).to(dtype)
    return x, torch.randint(v, (n,), generator=g)


def _stock(x: torch.Tensor, ids: torch.Tensor, t: float = 1.0) -> torch.Tensor:
    return torch.log_softmax(x.float() / t, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


# ------------------------------------------------------------------------------------------------
# aligned_mamba.token_logprobs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_contract_differs_from_stock_log_softmax(temperature: float) -> None:
    """The contrast that makes the equality tests able to fail: stock torch.log_softmax().gather rounds
    differently from the contract's function on some tokens of realistic rows (both are accurate)."""
    x, ids = _rows(0)
    ours, stock = aligned_mamba.token_logprobs(x, ids, temperature), _stock(x, ids, temperature)
    assert ours.dtype == torch.float32 and ours.shape == ids.shape
    assert int((ours != stock).sum()) > 0
    assert float((ours - stock).abs().max()) < 1e-4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_row_has_the_same_bits_alone_in_a_batch_and_at_another_position(temperature: float) -> None:
    x, ids = _rows(1, n=24)
    full = aligned_mamba.token_logprobs(x, ids, temperature)
    for i in (0, 5, 23):
        alone = aligned_mamba.token_logprobs(x[i : i + 1], ids[i : i + 1], temperature)
        assert torch.equal(alone, full[i : i + 1])
        # the row moved to the front of a differently sized batch, and inside a [B, T, V] layout
        moved = torch.cat([x[i : i + 1], x[:7]])
        moved_ids = torch.cat([ids[i : i + 1], ids[:7]])
        assert torch.equal(aligned_mamba.token_logprobs(moved, moved_ids, temperature)[0], full[i])
    bt = aligned_mamba.token_logprobs(x.view(4, 6, V), ids.view(4, 6), temperature)
    assert torch.equal(bt.view(-1), full)
    # a strided (non-contiguous) view of the same rows
    assert torch.equal(aligned_mamba.token_logprobs(x[::2], ids[::2], temperature), full[::2])


def test_temperature_is_one_fp32_division() -> None:
    x, ids = _rows(2, n=8)
    scaled = x.float() / torch.tensor(0.7, dtype=torch.float32)
    assert torch.equal(aligned_mamba.token_logprobs(x, ids, 0.7), aligned_mamba.token_logprobs(scaled, ids))
    assert torch.equal(aligned_mamba.token_logprobs(x, ids, 1), aligned_mamba.token_logprobs(x.float(), ids))


@pytest.mark.parametrize(
    ("logits", "ids", "temperature", "error", "match"),
    [
        (torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 1.0, TypeError, "floating-point"),
        (torch.zeros(2, 8), torch.zeros(3, dtype=torch.int64), 1.0, ValueError, r"shape mismatch: token_ids \[3\]"),
        (torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.int64), 1.0, ValueError, "shape mismatch"),
        (torch.zeros(2, 8), torch.tensor([0, 8]), 1.0, ValueError, r"out of range \[0, 8\)"),
        (torch.zeros(2, 8), torch.tensor([-1, 0]), 1.0, ValueError, "out of range"),
        (torch.zeros(2, 8), torch.tensor([0.0, 1.0]), 1.0, TypeError, "integer tensor"),
        (torch.zeros(2, 8), torch.tensor([True, False]), 1.0, TypeError, "integer tensor"),
        (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), 0.0, ValueError, "temperature"),
        (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), -1.0, ValueError, "temperature"),
        (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), math.inf, ValueError, "temperature"),
        (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), math.nan, ValueError, "temperature"),
        (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), "1", TypeError, "temperature"),
        ([[0.0, 1.0]], torch.zeros(1, dtype=torch.int64), 1.0, TypeError, "torch tensors"),
        (torch.zeros(2, 0), torch.zeros(2, dtype=torch.int64), 1.0, ValueError, "V >= 1"),
        (torch.zeros(2, 8, device="meta"), torch.zeros(2, dtype=torch.int64, device="meta"), 1.0, ValueError,
         "meta-device"),
    ],
)
def test_bad_input_is_refused_in_one_line(logits, ids, temperature, error, match) -> None:
    with pytest.raises(error, match=match) as e:
        aligned_mamba.token_logprobs(logits, ids, temperature)
    assert "\n" not in str(e.value)


def test_empty_leading_shape_gives_an_empty_result() -> None:
    out = aligned_mamba.token_logprobs(torch.zeros(0, 8), torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0,) and out.dtype == torch.float32


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_ids_range_is_read_once_a_call(backend, monkeypatch) -> None:
    """The public function and the backend's form do not both read the ids' range from the device (on CUDA, each
    read is a sync), and the one read is a single ``tolist``, not a min and a max apart."""
    reads = []
    real = torch.Tensor.tolist

    def counted(t):
        reads.append(tuple(t.shape))
        return real(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    monkeypatch.setattr(torch.Tensor, "__int__", lambda t: pytest.fail("an id read with int()"), raising=False)
    logits, ids = torch.randn(3, 40), torch.tensor([0, 39, 7])
    out = aligned_mamba.token_logprobs(logits, ids, contract=Contract(chunk_size=16, backend=backend))
    assert reads == [(2,)]
    assert torch.equal(out, L.token_logprobs(logits, ids))


# ------------------------------------------------------------------------------------------------
# The vocab-sharded form
# ------------------------------------------------------------------------------------------------


def _ranks(fn: Callable[[int, Callable], torch.Tensor], shards: int) -> list[torch.Tensor]:
    """Run fn(rank, all_gather) for every rank at once (``parallel.threads``): all_gather hands every
    rank's tensor to every rank, as a list in rank order."""
    return threads(lambda g: fn(g.rank, lambda t: list(g.all_gather(t).unbind(0))), shards)


@pytest.mark.parametrize("v", [V, 1024, 8])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sharded_log_softmax_gives_the_unsharded_bits(v: int, temperature: float) -> None:
    x, ids = _rows(3, n=32, v=v)
    full = L.log_softmax(x, temperature)
    full_tok = L.token_logprobs(x, ids, temperature)
    for shards in (1, 2, 4, 8):
        parts = x.chunk(shards, -1)
        got = _ranks(lambda r, ag, p=parts, s=shards: L.log_softmax_sharded(p[r], r, s, ag, temperature), shards)
        assert torch.equal(torch.cat(got, -1), full), shards
        toks = _ranks(lambda r, ag, p=parts, s=shards: L.token_logprobs_sharded(p[r], ids, r, s, ag, temperature),
                      shards)
        for t in toks:  # every rank holds every token's logprob
            assert torch.equal(t, full_tok), shards


def test_an_all_reduce_of_shard_sums_would_differ() -> None:
    """The mismatch the fixed tree prevents: combining per-shard sums the way Megatron's vocab-parallel
    cross entropy does (a local torch.sum of exp, then a sum across ranks) rounds differently."""
    x, _ = _rows(4, n=64)
    xf = x.float()
    m = xf.amax(-1, keepdim=True)
    e = torch.exp(xf - m)
    for shards in (2, 4, 8):
        sums = torch.stack([p.sum(-1) for p in e.chunk(shards, -1)]).sum(0)
        assert not torch.equal(sums, L.sliced_sum(e)), shards
    naive = xf - (m + torch.log(torch.stack([p.sum(-1) for p in e.chunk(2, -1)]).sum(0)).unsqueeze(-1))
    assert not torch.equal(naive, L.log_softmax(x))
    # and the stock halving tree over the slice sums (x[i] + x[i + n/2]) is not shard-aligned
    halves = aligned_mamba.ops.reduce.tree_sum(L._slice_sums(e, L.VOCAB_SLICES))
    assert not torch.equal(halves, L.sliced_sum(e))


def test_the_sharded_sum_is_accurate() -> None:
    x, _ = _rows(5, n=8)
    ref = torch.log_softmax(x.double(), -1)
    assert float((L.log_softmax(x).double() - ref).abs().max()) < 1e-5


@pytest.mark.parametrize(
    ("v", "shards", "index", "match"),
    [
        (1024, 3, 0, "power of two"),
        (1024, 16, 0, "power of two dividing"),
        (1020, 2, 0, "multiple of the contract's 8 slices"),
        (1024, 2, 2, "shard_index 2"),
    ],
)
def test_unshardable_layouts_are_refused(v: int, shards: int, index: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        L.log_softmax_sharded(torch.zeros(4, v // shards), index, shards, lambda t: [t] * shards)


def test_an_all_gather_that_returns_the_wrong_count_is_refused() -> None:
    with pytest.raises(ValueError, match="all_gather returned 1 tensors"):
        L.log_softmax_sharded(torch.zeros(4, 64), 0, 2, lambda t: [t])


def test_the_native_loop_and_the_torch_form_sum_the_same_tree() -> None:
    """The slices are tree_sum rows, so the C loop (ops/native_cpu.c) and the torch form agree bit for bit."""
    from aligned_mamba.ops import native

    if native.library() is None:
        pytest.skip(f"native CPU ops {native.status()}")
    x, _ = _rows(6, n=16)
    with_native = L.log_softmax(x, 0.7)
    with native.off():
        assert torch.equal(L.log_softmax(x, 0.7), with_native)
