"""Attention over a paged KV cache in the model and the reference engine (CPU).

A cache made with ``page_size`` keeps attention's keys in pages handed out as sequences grow and
given back when they finish (``KVPages``); every logits row must be the slot cache's bits (the same
keys, found through the block table) and the trainer's one pass, under an engine schedule that
preempts, chunks prefills unaligned to the pages and reuses freed pages. The pages really move: the
block table's pages are not the identity, and a table that points one block at the wrong page
changes the rows (the check can fail). Refusals: a full pool, a page the key block does not divide.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aligned_mamba import Contract
from aligned_mamba.engine import SamplerEngine
from aligned_mamba.errors import RuntimeFailure
from aligned_mamba.models import build_model
from aligned_mamba.models.nemotron_h import make_tiny_hybrid
from aligned_mamba.ops.step import Step

SHAPE = dict(hidden_size=64, vocab_size=64, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
             intermediate_size=64, chunk_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _model(pattern: str = "M*-*"):
    cfg, tensors = make_tiny_hybrid(3, dtype="float32", pattern=pattern, **SHAPE)
    return build_model(cfg, tensors, Contract(chunk_size=16))


def _run(model, page_size: int | None, num_pages: int | None = None, preempt: bool = True):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 37, 20, 11)]
    e = SamplerEngine(model, num_slots=3, max_batch_tokens=13, max_len=80, page_size=page_size, num_pages=num_pages)
    reqs = [e.add_request(p, 25) for p in prompts]
    moved = False
    while e.has_work():
        e.step()
        if e.cache.pages is not None:
            held = e.cache.pages.held
            moved |= any(e.cache.pages.host[s, :held[s]].tolist() != list(range(held[s])) for s in range(3))
        if preempt and e.steps == 9:
            e.preempt(e.running[0])
    return e, reqs, moved


def test_paged_engine_rows_equal_the_slot_caches_and_the_trainers() -> None:
    model = _model()
    slot_e, slot_reqs, _ = _run(model, None)
    e, reqs, moved = _run(model, 8, num_pages=24)
    assert moved, "every slot held pages 0, 1, 2, ...: the table was never exercised"
    assert sum(r.preemptions for r in reqs) == 1
    ref = model.forward([torch.tensor(r.tokens[:-1]) for r in reqs])
    for a, b, want in zip(slot_reqs, reqs, ref):
        assert a.tokens == b.tokens
        assert torch.equal(torch.stack([x for _, x in a.rows]), torch.stack([x for _, x in b.rows]))
        assert torch.equal(torch.stack([x for _, x in b.rows]), want[[p for p, _ in b.rows]])
    assert e.cache.pages.pages_free == 24 and not e.cache.pages.held.any(), "finished requests keep pages"
    assert slot_e.cache.pages is None  # the torch backend keeps its slot cache by default


def test_a_wrong_page_changes_the_rows() -> None:
    """The baseline: one block of a sequence read from another page gives other rows."""
    model = _model("M*")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (40,), generator=g)
    rows = []
    for swap in (False, True):
        cache = model.new_cache(2, max_len=48, page_size=8)
        model.advance(cache, Step.make([1, 0], [0, 0], [30, 7]), torch.cat([ids[:30], ids[:7]]))
        if swap:  # slot 1's second block pointed at a page of slot 0's
            cache.pages.table[1, 1] = int(cache.pages.host[0, 0])
        rows.append(model.advance(cache, Step.make([1], [30], [1]), ids[30:31]))
    assert not torch.equal(rows[0], rows[1])


def test_reset_gives_pages_back_and_a_full_pool_is_refused() -> None:
    model = _model("M*")
    cache = model.new_cache(2, max_len=48, page_size=8, num_pages=4)
    ids = torch.zeros(25, dtype=torch.int64)
    model.advance(cache, Step.make([0], [0], [25]), ids)  # 4 pages
    assert cache.pages.pages_free == 0
    with pytest.raises(RuntimeFailure, match="out of pages") as e:
        model.advance(cache, Step.make([1], [0], [1]), ids[:1])
    assert "\n" not in str(e.value)
    cache.reset([0])
    assert cache.pages.pages_free == 4
    model.advance(cache, Step.make([1], [0], [1]), ids[:1])
    with pytest.raises(ValueError, match="holds 48 per sequence"):
        model.advance(cache, Step.make([1], [1], [48]), torch.zeros(48, dtype=torch.int64))


def test_a_page_the_key_block_does_not_divide_is_refused_at_start() -> None:
    pytest.importorskip("triton")
    from aligned_mamba.ops.configs import TritonKernelConfigs

    cfg, tensors = make_tiny_hybrid(3, dtype="float32", pattern="M*", **SHAPE)
    model = build_model(cfg, tensors, Contract(chunk_size=16, backend="triton", model_dtype="float32",
                                               kernel_configs=dataclasses.replace(TritonKernelConfigs(),
                                                                                         attn_block_n=32)))
    with pytest.raises(ValueError, match="must divide the page size") as e:
        model.new_cache(2, max_len=64, page_size=48)
    assert "\n" not in str(e.value)
    assert model.new_cache(2, max_len=64, page_size=64).pages.page_size == 64


@pytest.mark.interpreter
def test_the_triton_backends_engine_pages_attention_by_default() -> None:
    """The reference engine on the triton backend (the Triton interpreter here: the scan's kernels,
    the other ops' CPU stand-ins) keeps attention in pages and gives the trainer's rows."""
    pytest.importorskip("triton")
    from aligned_mamba.engine import PAGE_SIZE

    cfg, tensors = make_tiny_hybrid(3, dtype="float32", pattern="M*", **{**SHAPE, "chunk_size": 32})
    model = build_model(cfg, tensors, Contract(chunk_size=32, backend="triton", model_dtype="float32"))
    e = SamplerEngine(model, num_slots=2, max_batch_tokens=13, max_len=300)
    assert e.cache.pages is not None and e.cache.pages.page_size == PAGE_SIZE
    g = torch.Generator().manual_seed(2)
    reqs = [e.add_request(torch.randint(0, 64, (n,), generator=g).tolist(), 6) for n in (260, 9)]
    e.run()
    ref = model.forward([torch.tensor(r.tokens[:-1]) for r in reqs])
    for r, want in zip(reqs, ref):
        assert torch.equal(torch.stack([x for _, x in r.rows]), want[[p for p, _ in r.rows]])
    assert e.cache.pages.pages_free == e.cache.pages.num_pages


def test_the_engine_preempts_when_pages_run_short_and_keeps_the_bits() -> None:
    """Three slots over 9 pages of 8 tokens (one request's worth at most): the engine preempts the
    newest request whenever a step needs more pages than are free, and every request's tokens and
    rows are those of an engine with pages to spare, and the trainer's."""
    model = _model()
    roomy, roomy_reqs, _ = _run(model, 8, preempt=False)
    tight, reqs, _ = _run(model, 8, num_pages=9, preempt=False)
    assert sum(r.preemptions for r in reqs) > 0 and sum(r.preemptions for r in roomy_reqs) == 0
    ref = model.forward([torch.tensor(r.tokens[:-1]) for r in reqs])
    for a, b, want in zip(roomy_reqs, reqs, ref):
        assert a.tokens == b.tokens
        assert torch.equal(torch.stack([x for _, x in b.rows]), want[[p for p, _ in b.rows]])
    assert tight.cache.pages.pages_free == 9
    with pytest.raises(ValueError, match="needs more KV pages"):
        tight.add_request([1] * 70, 5)
