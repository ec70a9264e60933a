"""GPU-only checks of the triton backend (skipped without a CUDA device; run on the H200)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_linear_rows_do_not_depend_on_the_call(dtype):
    from aligned_mamba.ops.configs import TritonKernelConfigs
    from aligned_mamba.ops.linear.triton import linear_triton

    cfg = TritonKernelConfigs()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 768, generator=g).to("cuda", dtype)
    w = torch.randn(1600, 768, generator=g).to("cuda", dtype)
    full = linear_triton(x, w, None, cfg)
    for m in (1, 2, 7, 16, 17, 100):
        for start in (0, 5, 333):
            assert torch.equal(linear_triton(x[start:start + m], w, None, cfg), full[start:start + m]), (m, start)


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
