"""Model level: the sampler engine's logits rows equal the trainer's one-pass rows, bitwise.

For checkpoints of several shapes (groups > 1, head_dim != 64, chunk sizes 32 to 256, several
layers, tied embeddings, biases), prompts and generations that cross chunk boundaries at
unaligned points, every exact-replay case of ``aligned-mamba check`` gives 0 differing rows, and
the baseline (recurrent decode) differs. On the Triton backend (the interpreter without a GPU, in
fp32; compiled on a GPU) the engine's schedules give the trainer's bits too.
"""

from __future__ import annotations

import pytest
import torch

from aligned_mamba.check import CASES, compare, make_prompts, run_case
from aligned_mamba.contract import Contract
from aligned_mamba.models import CausalLM, build_model, load_checkpoint, load_model
from aligned_mamba.models.mamba2 import make_tiny, save_checkpoint

SHAPES = {
    "groups2_chunk64": dict(num_hidden_layers=2, n_groups=2, chunk_size=64, state_size=32),
    "headdim32_chunk32": dict(num_hidden_layers=3, num_heads=8, head_dim=32, chunk_size=32, state_size=16),
    "chunk128_tied": dict(num_hidden_layers=2, chunk_size=128, tie_word_embeddings=True, state_size=32),
    "chunk256_bias": dict(num_hidden_layers=2, chunk_size=256, use_bias=True, n_groups=4, state_size=16),
}


def build(overrides: dict, dtype: str) -> CausalLM:
    cfg, tensors = make_tiny(1, dtype=dtype, hidden_size=128, **{"num_heads": 4, "head_dim": 64, **overrides})
    return build_model(cfg, tensors, Contract(chunk_size=cfg.chunk_size, model_dtype=dtype))


def case_report(model: CausalLM, case_name: str, prompt_len: int, gen_len: int, budget: int, requests: int = 3):
    spec = next(c for c in CASES if c.name == case_name)
    prompts = make_prompts(model.shape.vocab_size, prompt_len, requests, seed=5)
    res = run_case(spec, model, prompts, gen_len, budget, seed=5)
    trainer_logits = model.forward([torch.tensor(t) for t in res.tokens])
    return compare(res.rows, trainer_logits, model.contract, model.contract), res


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_exact_replay_cases_are_bit_identical(shape, dtype):
    model = build(SHAPES[shape], dtype)
    L = model.contract.chunk_size
    prompt_len, gen_len = L + L // 2 + 7, L // 2 + 11  # both cross chunk boundaries, unaligned
    budget = L // 2 + 5  # splits prompts off the chunk grid
    for case in ("decode", "chunked_prefill_unaligned", "preempt_recompute", "mixed_batch"):
        report, res = case_report(model, case, prompt_len, gen_len, budget)
        assert report.rows > 0
        assert report.bitwise_equal, f"{shape}/{dtype}/{case}: {report.summary()}"
        if case == "preempt_recompute":
            assert res.preemptions > 0
    if dtype == "float32":  # the baseline shows the mismatch at once in fp32
        report, _ = case_report(model, "baseline_recurrent_decode", prompt_len, gen_len, budget)
        assert report.mismatched_rows > report.rows // 2, report.summary()


def test_baseline_differs_in_bf16_on_the_default_model():
    cfg, tensors = make_tiny(0)
    model = build_model(cfg, tensors, Contract(chunk_size=cfg.chunk_size))
    report, _ = case_report(model, "baseline_recurrent_decode", 300, 200, 100, requests=2)
    assert report.mismatched_rows > 0, report.summary()


def test_checkpoint_files_give_the_same_bits(tmp_path):
    """Load through Hugging Face files (bf16 and fp32 storage) and run the engine on them."""
    for dtype in ("bfloat16", "float32"):
        cfg, tensors = make_tiny(2, dtype=dtype, num_hidden_layers=2, hidden_size=128, num_heads=4, chunk_size=64)
        save_checkpoint(tmp_path / dtype, cfg, tensors)
        cfg2, tensors2 = load_checkpoint(tmp_path / dtype)
        model = build_model(cfg2, tensors2, Contract.from_hf_config(tmp_path / dtype))
        report, _ = case_report(model, "chunked_prefill_unaligned", 100, 40, 37, requests=2)
        assert report.bitwise_equal, report.summary()
        # the public entry point: the checkpoint's own contract, the trainer's logits per sequence
        public = load_model(tmp_path / dtype)
        seq = torch.arange(50) % cfg.vocab_size
        assert public.contract == model.contract and torch.equal(public.forward([seq])[0], model.forward([seq])[0])


def test_engine_joins_and_leaves_and_seeded_sampling():
    """Requests finishing and joining reorder the batch; sampled tokens depend on logits only."""
    model = build(SHAPES["groups2_chunk64"], "bfloat16")
    r1, res1 = case_report(model, "mixed_batch", 90, 30, 23)
    r2, res2 = case_report(model, "decode", 90, 30, 23)
    assert r1.bitwise_equal and r2.bitwise_equal
    # same logits -> same sampled tokens, whatever the schedule (both list the requests in prompt order)
    assert res1.tokens == res2.tokens


def test_trainer_forward_is_packing_invariant():
    model = build(SHAPES["headdim32_chunk32"], "bfloat16")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.shape.vocab_size, (n,), generator=g) for n in (45, 70, 3)]
    together = model.forward(seqs)
    for s, t in zip(seqs, together):
        assert torch.equal(model.forward([s])[0], t)


def test_replay_state_size_per_sequence():
    """fp32 boundary state + chunk_size rows of x, raw dt and B (bf16) + conv window; no C buffer."""
    model = build(SHAPES["chunk128_tied"], "bfloat16")
    c, L = model.config, model.contract.chunk_size
    per_layer = (c.num_heads * c.head_dim * c.state_size * 4 + L * c.num_heads * c.head_dim * 2
                 + L * c.num_heads * 2 + L * c.n_groups * c.state_size * 2 + (c.conv_kernel - 1) * c.conv_dim * 2)
    assert model.new_cache(3).bytes_per_slot() == per_layer * c.num_hidden_layers
    assert model.state_bytes_per_sequence() == per_layer * c.num_hidden_layers


def test_state_size_off_the_gemm_alignment_is_refused():
    from aligned_mamba.errors import ModelLoadError

    cfg, tensors = make_tiny(0, state_size=10)
    with pytest.raises(ModelLoadError, match="state_size 10"):
        build_model(cfg, tensors, Contract(chunk_size=cfg.chunk_size))


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["decode", "chunked_prefill_unaligned"])
def test_triton_backend_engine_matches_trainer(case):
    pytest.importorskip("triton")
    # state 16, chunk 32: the K loops of one block, where a chunk completion once rounded otherwise on
    # the GPU (tests/ops/ssd/test_triton_compile.py); the interpreter's fp32 arithmetic is numpy's
    chunk = 32
    cfg, tensors = make_tiny(0, dtype="float32", num_hidden_layers=1, hidden_size=64, num_heads=2, head_dim=64,
                             state_size=16, chunk_size=chunk, vocab_size=64)
    model = build_model(cfg, tensors, Contract(chunk_size=chunk, backend="triton", model_dtype="float32"))
    prompts = make_prompts(cfg.vocab_size, 40, 2, seed=0)  # decode crosses a chunk end
    res = run_case(next(c for c in CASES if c.name == case), model, prompts, 20, 13, seed=0)
    report = compare(res.rows, model.forward([torch.tensor(t) for t in res.tokens]), model.contract, model.contract)
    assert report.rows > 0 and report.bitwise_equal, report.summary()
