"""The model on the Triton backend (the interpreter here, in fp32): the engine's schedules give the
trainer's bits, as on the torch backend. On a GPU machine the same test runs compiled."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.interpreter

from aligned_mamba.check import CASES, compare, make_prompts, run_case  # noqa: E402
from aligned_mamba.contract import Contract  # noqa: E402
from aligned_mamba.models import build_model  # noqa: E402
from aligned_mamba.models.mamba2 import make_tiny  # noqa: E402


@pytest.mark.parametrize("case", ["decode", "chunked_prefill_unaligned"])
def test_triton_backend_engine_matches_trainer(case):
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
