"""The whole-model benchmark's stock hybrid (benchmarks/stock_hybrid.py) computes the project's model:
in fp32 on the CPU, with torch stand-ins for mamba_ssm's GPU kernels, its forward gives the torch
backend's logits and its decode step, token by token from empty, its own forward's rows."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from aligned_mamba import Contract  # noqa: E402
from aligned_mamba.models import build_model  # noqa: E402
from aligned_mamba.models.nemotron_h import NemotronHConfig  # noqa: E402
from benchmarks.bench_model_h200 import ref_chunk_scan, ref_state_update  # noqa: E402
from benchmarks.stock_hybrid import LazyWeights, StockHybrid, stock_forward, stock_weights  # noqa: E402


def _ssu(state, *args, state_batch_indices=None, **kw):
    return ref_state_update(state, *args, state_batch_indices=torch.arange(state.shape[0]), **kw)


def _gated_norm(y, w, b, z, eps, group_size, norm_before_gate):
    g = y.float() * F.silu(z.float())
    shape = g.shape
    g = g.view(*shape[:-1], -1, group_size)
    return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).view(shape).to(y.dtype) * w


def _add_norm(x, w, b, residual=None, prenorm=True, eps=1e-5):
    r = x if residual is None else x + residual
    return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * w, r


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_stock_hybrid_forward_and_decode_are_the_model() -> None:
    config = NemotronHConfig(hybrid_override_pattern="MEM*E-M", vocab_size=256, hidden_size=64,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                             ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, chunk_size=16,
                             n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                             moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, dtype="float32")
    weights = LazyWeights(config, 0, device="cpu")
    model = build_model(config, weights, Contract(chunk_size=16, backend="torch", model_dtype="float32"),
                        device="cpu")
    assert not any(".experts." in name for name in weights.kept)  # drawn on each read, never held
    p = stock_weights(config, model, weights)
    kernels = (ref_chunk_scan, _gated_norm, _add_norm, _ssu)
    ids = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = torch.stack(model.forward(list(ids)))
        stock = stock_forward(config, p, ids, kernels)
        assert _rel(stock, ours) < 1e-5
        # the check can fail: another routing scale is another model
        scaled = stock_forward(dataclasses.replace(config, routed_scaling_factor=1.0), p, ids, kernels)
        assert _rel(scaled, ours) > 1e-2
        dec = StockHybrid(config, p, kernels)
        state = dec.new_state(2, 40, zero=True)
        rows = torch.stack([dec.step(state, ids[:, t], t) for t in range(ids.shape[1])], dim=1)
    assert _rel(rows, stock) < 1e-5
