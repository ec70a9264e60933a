"""GPU-only checks of the triton backend as a whole (skipped without a CUDA device; run on the H200): the
model check's cases on the triton backend. Each op kernel's GPU tests live in its op's folder
(tests/ops/linear/test_linear_gemm.py, tests/ops/norm/, tests/ops/conv1d/, tests/ops/logprobs/)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_model_check_on_triton_backend_is_bit_identical():
    from aligned_mamba.check import CASES, compare, make_prompts, run_case
    from aligned_mamba.contract import Contract
    from aligned_mamba.models import build_model
    from aligned_mamba.models.mamba2 import make_tiny

    cfg, tensors = make_tiny(0)
    model = build_model(cfg, tensors, Contract(chunk_size=cfg.chunk_size, backend="triton"))
    prompts = make_prompts(cfg.vocab_size, 300, 3, seed=0)
    for spec in CASES:
        res = run_case(spec, model, prompts, 120, 100, seed=0)
        report = compare(res.rows, model.forward([torch.tensor(t) for t in res.tokens]), model.contract,
                         model.contract)
        assert report.bitwise_equal == spec.exact_replay, (spec.name, report.summary())
