"""Nemotron-H's MoE layer: a token's result never depends on which other tokens share its experts.

The property: every row of the layer's output, computed in a call with any other rows (any number,
any order, any routing of theirs), equals the row computed alone, bit for bit. The baseline it
prevents: transformers' own ``NemotronHMoE`` (its experts' ``F.linear`` over however many rows an
expert got) gives a row other bits alone than in a batch. Routing follows transformers' router.
Model-level checks (engine schedules against the trainer, fp32 logits against transformers in fp64)
run over the MoE layouts of tests/models/test_nemotron_h.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aligned_mamba import Contract
from aligned_mamba.errors import ModelLoadError
from aligned_mamba.layers.moe import MoE, MoEConfig, route
from aligned_mamba.models.nemotron_h import make_tiny_hybrid
from aligned_mamba.ops.backend import resolve

PREFIX = "backbone.layers.1.mixer."
SHAPE = dict(hidden_size=256, vocab_size=256, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
             moe_intermediate_size=256)


def _layer(dtype: str, **over) -> tuple[MoE, object, dict]:
    cfg, tensors = make_tiny_hybrid(0, pattern="ME", dtype=dtype, **{**SHAPE, **over})
    layer = MoE(cfg.moe_config(), tensors, PREFIX, backend=resolve(Contract(chunk_size=64, model_dtype=dtype)),
                dtype=getattr(torch, dtype))
    return layer, cfg, tensors


def _rows(T: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(T, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(seed)).to(dtype)


@settings(max_examples=12, deadline=None)
@given(dtype=st.sampled_from(["bfloat16", "float32"]), latent=st.booleans(), T=st.integers(2, 300),
       seed=st.integers(0, 2 ** 16), data=st.data())
def test_a_rows_result_does_not_depend_on_the_other_rows(dtype, latent, T, seed, data):
    layer, _, _ = _layer(dtype, **({"moe_latent_size": 64} if latent else {}))
    x = _rows(T, seed, layer.dtype)
    full = layer.advance(None, None, x)
    picked = data.draw(st.lists(st.integers(0, T - 1), min_size=1, max_size=min(T, 40), unique=True))
    idx = torch.tensor(picked)  # a subset, in a drawn order
    assert torch.equal(layer.advance(None, None, x[idx]), full[idx])
    one = picked[0]
    assert torch.equal(layer.advance(None, None, x[one:one + 1])[0], full[one])
    # the rows wanted from a larger call (the model's ``rows``) are those rows' bits too
    rows = torch.zeros(T, dtype=torch.bool)
    rows[idx] = True
    assert torch.equal(layer.advance(None, None, x, rows), full[rows])


def _transformers_moe(cfg, tensors, dtype: torch.dtype):
    transformers = pytest.importorskip("transformers")
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    hc = transformers.NemotronHConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"})
    m = hf.NemotronHMoE(hc).to(dtype).eval()
    t, E = tensors, cfg.n_routed_experts
    with torch.no_grad():
        m.gate.weight.copy_(t[PREFIX + "gate.weight"].float())
        m.gate.e_score_correction_bias.copy_(t[PREFIX + "gate.e_score_correction_bias"])
        for name in ("up_proj", "down_proj"):
            getattr(m.experts, name).copy_(torch.stack([t[f"{PREFIX}experts.{e}.{name}.weight"] for e in range(E)]))
            getattr(m.shared_experts, name).weight.copy_(t[f"{PREFIX}shared_experts.{name}.weight"])
    return m


def test_transformers_moe_rows_depend_on_the_batch_ours_do_not():
    """fp32: transformers' NemotronHMoE gives a row other bits alone than among 300 rows (the mismatch a
    sampler that decodes one token meets against a trainer that scores all); ours gives the same
    bits, and computes transformers' function (to fp32 rounding)."""
    layer, cfg, tensors = _layer("float32")
    m = _transformers_moe(cfg, tensors, torch.float32)
    x = _rows(300, 1, torch.float32)
    ours = layer.advance(None, None, x)
    with torch.no_grad():
        theirs = m(x[None])[0]
        theirs_alone = [m(x[i:i + 1][None])[0][0] for i in range(0, 300, 7)]
    ours_alone = [layer.advance(None, None, x[i:i + 1])[0] for i in range(0, 300, 7)]
    differ = sum(not torch.equal(a, theirs[i]) for a, i in zip(theirs_alone, range(0, 300, 7)))
    assert differ > len(theirs_alone) // 2, f"transformers' rows differ alone vs batched in only {differ}"
    assert all(torch.equal(a, ours[i]) for a, i in zip(ours_alone, range(0, 300, 7)))
    assert float((ours - theirs).abs().max()) < 1e-5 * float(theirs.abs().max())


def test_routing_is_transformers_router():
    """The same experts (as sets) and weights as transformers' NemotronHTopkRouter, group limit and
    scaling included, on random rows; the experts come back in ascending order."""
    layer, cfg, tensors = _layer("float32", routed_scaling_factor=2.5)
    m = _transformers_moe(cfg, tensors, torch.float32)
    x = _rows(200, 2, torch.float32)
    with torch.no_grad():
        _, w_hf, i_hf = m.gate(x)
    scores = torch.sigmoid(x @ tensors[PREFIX + "gate.weight"].float().t())
    experts, weights = route(scores, layer.score_bias, cfg.moe_config())
    order = torch.sort(i_hf, dim=-1)
    assert torch.equal(experts, order.values)
    assert torch.allclose(weights, w_hf.gather(1, order.indices), rtol=1e-6, atol=0)
    assert bool((experts[:, 1:] > experts[:, :-1]).all())


def test_route_ties_and_groups():
    """Equal scores go to the lower expert; experts outside the chosen groups are never taken even when
    they score higher than the chosen ones."""
    c = MoEConfig(hidden_size=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=4,
                  moe_shared_expert_intermediate_size=4, n_group=4, topk_group=1, norm_topk_prob=False)
    flat = torch.full((1, 8), 0.5)
    assert route(flat, torch.zeros(8), c)[0].tolist() == [[0, 1]]
    # group 1 (experts 2, 3) has the best pair sum; expert 6 alone scores highest
    s = torch.tensor([[0.1, 0.1, 0.8, 0.8, 0.0, 0.0, 0.95, 0.0]])
    experts, weights = route(s, torch.zeros(8), c)
    assert experts.tolist() == [[2, 3]] and torch.equal(weights, s[:, 2:4])


def test_moe_config_and_device_refusals():
    with pytest.raises(ValueError, match="not divisible by n_group"):
        MoEConfig(hidden_size=8, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=4,
                  moe_shared_expert_intermediate_size=4, n_group=4)
    with pytest.raises(ValueError, match="num_experts_per_tok 5"):
        MoEConfig(hidden_size=8, n_routed_experts=8, num_experts_per_tok=5, moe_intermediate_size=4,
                  moe_shared_expert_intermediate_size=4, n_group=4, topk_group=2)
    from aligned_mamba.ops.backend import TritonBackend
    from aligned_mamba.ops.configs import TritonKernelConfigs

    # the grouped expert kernels have no bias term: mlp_bias MoE layers stay refused on a CUDA device
    # (checked before any weight moves, so no GPU is needed here)
    cfg, tensors = make_tiny_hybrid(0, pattern="ME", dtype="bfloat16", mlp_bias=True, **SHAPE)
    gpu = TritonBackend(TritonKernelConfigs(), torch.device("cuda"))
    assert gpu.stacked_experts
    with pytest.raises(ModelLoadError, match="MoE expert biases on a CUDA device are refused"):
        MoE(cfg.moe_config(), tensors, PREFIX, backend=gpu, dtype=torch.bfloat16)


def test_a_replaced_linear_reaches_the_experts():
    """``Backend.replace(linear=...)``: the experts' torch form runs the new linear, not the table's old one."""
    layer, _, _ = _layer("float32")
    backend, calls = layer.backend, []

    def counting(x, w, *a, **k):
        calls.append(tuple(w.shape))
        return backend.linear(x, w, *a, **k)

    layer.backend = backend.replace(linear=counting)
    layer.advance(None, None, _rows(5, 1, torch.float32))
    expert_shapes = {tuple(w.shape) for w in (*layer.up_w, *layer.down_w)}
    assert expert_shapes & set(calls), f"the experts ran the table's old linear (new linear saw {calls})"


def _sharded(group, rows: torch.Tensor, swap: bool) -> tuple[torch.Tensor, int]:
    """One rank's MoE layer (bf16, row_parallel_slices 4) over ``rows``: (its output, the all-gathers it
    made). ``swap``: the experts' row-parallel sum wrapped (the per-expert path, one all-gather each)."""
    from aligned_mamba.layers.moe import shard_weights
    from aligned_mamba.ops.linear.sliced import row_parallel_linear
    from aligned_mamba.parallel import TPGroup

    cfg, tensors = make_tiny_hybrid(0, pattern="ME", dtype="bfloat16", **SHAPE)
    calls = [0]

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return group.all_gather(x)

    tp = TPGroup(group.rank, group.size, counted)
    layer = MoE(cfg.moe_config(), shard_weights(cfg.moe_config(), tensors, PREFIX, tp), PREFIX,
                backend=resolve(Contract(chunk_size=64, model_dtype="bfloat16", row_parallel_slices=4)),
                dtype=torch.bfloat16, tp=tp, slices=4)
    if swap:
        layer = layer.with_row_parallel(lambda *a, **k: row_parallel_linear(*a, **k))
    out = layer.advance(None, None, rows)
    return out, calls[0]


@pytest.mark.parametrize("size", [2, 4])
def test_the_experts_share_one_all_gather_at_tp(size: int) -> None:
    """At TP > 1 every expert's down-projection subtree rides one all-gather for the layer (and one for the
    shared expert), not one per expert with rows: the same bits as expert by expert, and as TP 1."""
    from aligned_mamba.parallel import TPGroup, threads

    rows = _rows(24, 3, torch.bfloat16)
    one = threads(_sharded, size, rows, False)
    each = threads(_sharded, size, rows, True)
    alone = _sharded(TPGroup.single(), rows, False)[0]
    used = _layer("bfloat16")[0].route_rows(rows)[0].unique().numel()
    for (a, n1), (b, n2) in zip(one, each):
        assert torch.equal(a, b) and torch.equal(a, alone)
        assert (n1, n2) == (2, used + 1)
