"""The decode step as a CUDA graph: its rows are the eager step's and the single-pass prefill's.

On a GPU (skipped without one): sequences prefilled at random offsets decode step after step
through ``DecodeGraphs`` (batches padded up to a bucket, padding entries in the spare slot, chunk
completions inside the graph) and, from a copy of the same cache, through the eager advance; every
logits row must be ``torch.equal`` between the two and to the row a single-pass prefill of the
whole history gives. On the CPU: what cannot be captured is refused.
"""

from __future__ import annotations

import pytest
import torch

from aligned_mamba import Contract
from aligned_mamba.decode_graph import DecodeGraphs
from aligned_mamba.models import build_model
from aligned_mamba.models.mamba2 import make_tiny
from aligned_mamba.ops.step import Step

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_model_that_cannot_be_captured_is_refused() -> None:
    config, tensors = make_tiny(0, num_hidden_layers=1, hidden_size=64, num_heads=2, head_dim=64, state_size=16,
                                chunk_size=32, vocab_size=64)
    model = build_model(config, tensors, Contract(chunk_size=32))
    with pytest.raises(ValueError, match="triton backend on a CUDA device"):
        DecodeGraphs(model, model.new_cache(2), spare_slot=1)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("side", [False, True], ids=["in-order", "side-completions"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graph_decode_rows_equal_eager_and_prefill(dtype: str, side: bool) -> None:
    chunk = 32
    config, tensors = make_tiny(3, dtype=dtype, num_hidden_layers=2, n_groups=2, chunk_size=chunk, state_size=64)
    model = build_model(config, tensors, Contract(chunk_size=chunk, backend="triton", model_dtype=dtype),
                        device="cuda")
    g = torch.Generator().manual_seed(0)
    B, steps, V = 5, 70, config.vocab_size  # bucket 8: three padding entries; 70 steps cross chunk boundaries
    starts = [int(v) for v in torch.randint(1, 100, (B,), generator=g)]
    hist = [torch.randint(0, V, (s + steps,), generator=g) for s in starts]
    slots = [4, 0, 2, 1, 3]
    cache = model.new_cache(B + 1)
    model.advance(cache, Step.make(slots, [0] * B, starts), torch.cat([h[:s] for h, s in zip(hist, starts)]))
    eager = model.new_cache(B + 1)  # the same states, decoded eagerly
    for a, b in zip(cache.tensors, eager.tensors):
        for k in a:
            b[k].copy_(a[k])
    graphs = DecodeGraphs(model, cache, spare_slot=B, side_completions=side)
    graphs.capture([8])  # ahead of the first step, as an engine does at start-up
    got_g, got_e = [], []
    for k in range(steps):
        pos = [s + k for s in starts]
        ids = torch.stack([h[p] for h, p in zip(hist, pos)])
        got_g.append(graphs.step(slots, pos, ids).clone())
        got_e.append(model.advance(eager, Step.make(slots, pos, [1] * B), ids))
    assert graphs.bucket(B) == 8 and graphs.captured == (8,)
    for a, b in zip(got_g, got_e):
        assert torch.equal(a, b)
    ref = model.forward(hist)  # the trainer's single pass over every history
    for i in range(B):
        want = ref[i][starts[i]:starts[i] + steps]
        assert torch.equal(torch.stack([r[i] for r in got_g]), want), i
