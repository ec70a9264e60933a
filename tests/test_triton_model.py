"""The model on the Triton backend (the interpreter here, in fp32): the engine's schedules give the
trainer's bits, as on the torch backend. On a GPU machine the same test runs compiled."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from aligned_mamba.check import CASES, compare, make_prompts, run_case  # noqa: E402
from aligned_mamba.contract import Contract  # noqa: E402
from aligned_mamba.models import build_model  # noqa: E402
from aligned_mamba.models.mamba2 import make_tiny  # noqa: E402


@pytest.mark.parametrize("case", ["decode", "chunked_prefill_unaligned"])
def test_triton_backend_engine_matches_trainer(case):
    # fp32 layers under a state or chunk size of 64 are refused on the GPU (see the next test); the
    # interpreter runs the small shape (its fp32 arithmetic is numpy's)
    cuda = torch.cuda.is_available()
    chunk = 64 if cuda else 32
    cfg, tensors = make_tiny(0, dtype="float32", num_hidden_layers=1, hidden_size=64, num_heads=2, head_dim=64,
                             state_size=64 if cuda else 16, chunk_size=chunk, vocab_size=64)
    model = build_model(cfg, tensors, Contract(chunk_size=chunk, backend="triton", model_dtype="float32"))
    prompts = make_prompts(cfg.vocab_size, 50 if cuda else 40, 2, seed=0)  # decode crosses a chunk end
    res = run_case(next(c for c in CASES if c.name == case), model, prompts, 20, 13, seed=0)
    report = compare(res.rows, model.forward([torch.tensor(t) for t in res.tokens]), model.contract, model.contract)
    assert report.rows > 0 and report.bitwise_equal, report.summary()


def test_fp32_small_state_is_refused_on_the_gpu_backend():
    """Where the GPU decode's bits are not promised (fp32, state or chunk size < 64), the layer refuses to
    build; the backend object is made for a CUDA device without touching one (the refusal comes first)."""
    from aligned_mamba.errors import ModelLoadError
    from aligned_mamba.layers.mamba2 import Mamba2Mixer
    from aligned_mamba.ops.backend import TritonBackend
    from aligned_mamba.ops.configs import TritonKernelConfigs

    cfg, tensors = make_tiny(0, dtype="float32", num_hidden_layers=1, hidden_size=64, num_heads=2, head_dim=64,
                             state_size=16, chunk_size=32, vocab_size=64)
    gpu = TritonBackend(TritonKernelConfigs(), torch.device("cuda"))
    with pytest.raises(ModelLoadError, match="state_size 16 and chunk_size 32 are refused on the triton GPU"):
        Mamba2Mixer(cfg.mixer_config(), tensors, "backbone.layers.0.mixer.", backend=gpu, dtype=torch.float32,
                    chunk_size=32)
    big, big_tensors = make_tiny(0, dtype="float32", num_hidden_layers=1, hidden_size=64, num_heads=2, head_dim=64,
                                 state_size=64, chunk_size=32, vocab_size=64)
    with pytest.raises(ModelLoadError, match="state_size 64 and chunk_size 32 are refused"):
        Mamba2Mixer(big.mixer_config(), big_tensors, "backbone.layers.0.mixer.", backend=gpu, dtype=torch.float32,
                    chunk_size=32)
    if not torch.cuda.is_available():  # bf16 passes the check and stops only at the missing device
        with pytest.raises((RuntimeError, AssertionError)) as bf16:
            Mamba2Mixer(cfg.mixer_config(), tensors, "backbone.layers.0.mixer.", backend=gpu, dtype=torch.bfloat16,
                        chunk_size=32)
        assert "refused" not in str(bf16.value)
