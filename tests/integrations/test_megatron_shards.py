"""Per-rank shards of a Megatron state dict (``megatron_shards``): the layout written out by hand from
megatron-core 0.16.1's MambaMixer / parallel linears, exact round trips at TP 2 and 4, and the refusals.
(That the layout is Megatron's own is checked against a TP model's ``sharded_state_dict`` in
test_megatron_tp.py.)"""

from __future__ import annotations

import pytest
import torch

from aligned_mamba import ModelLoadError
from aligned_mamba.models.mamba2 import make_tiny
from aligned_mamba.models.nemotron_h import make_tiny_hybrid
from trainer_hooks.megatron.shards import hf_to_megatron_shard, merge_megatron, shard_megatron, tp_problems
from trainer_hooks.megatron.weights import hf_to_megatron

MAMBA = dict(hidden_size=64, num_heads=8, head_dim=16, state_size=16, num_hidden_layers=2, vocab_size=96,
             conv_kernel=4, chunk_size=16, n_groups=4)
HYBRID = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=128, ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=4,
              chunk_size=16)


def test_mamba_layout_by_hand() -> None:
    """Rank 1 of 2: in_proj is [z | x | B | C | dt] of its own heads and groups, not rows 1/2 .. 1 of TP 1."""
    config, hf = make_tiny(0, **MAMBA)
    mg = hf_to_megatron(hf, config)
    H, P, G, N = 8, 16, 4, 16
    w = mg["decoder.layers.0.mixer.in_proj.weight"]
    z, x, B, C, dt = (w[:H * P], w[H * P:2 * H * P], w[2 * H * P:2 * H * P + G * N],
                      w[2 * H * P + G * N:2 * H * P + 2 * G * N], w[2 * H * P + 2 * G * N:])
    s = shard_megatron(mg, config, 1, 2)
    want = torch.cat([z[64:], x[64:], B[32:], C[32:], dt[4:]])
    assert torch.equal(s["decoder.layers.0.mixer.in_proj.weight"], want)
    assert not torch.equal(want, w[w.shape[0] // 2:])  # the naive contiguous half is another tensor
    conv = mg["decoder.layers.0.mixer.conv1d.weight"]
    assert torch.equal(s["decoder.layers.0.mixer.conv1d.weight"],
                       torch.cat([conv[64:128], conv[128 + 32:128 + 64], conv[128 + 64 + 32:]]))
    for name in ("A_log", "D", "dt_bias"):
        assert torch.equal(s[f"decoder.layers.0.mixer.{name}"], mg[f"decoder.layers.0.mixer.{name}"][4:])
    assert torch.equal(s["decoder.layers.0.mixer.norm.weight"], mg["decoder.layers.0.mixer.norm.weight"][64:])
    out = "decoder.layers.1.mixer.out_proj.weight"
    assert torch.equal(s[out], mg[out][:, 64:])
    assert torch.equal(s["embedding.word_embeddings.weight"], mg["embedding.word_embeddings.weight"][48:])
    assert torch.equal(s["output_layer.weight"], mg["output_layer.weight"][48:])
    assert torch.equal(s["decoder.final_norm.weight"], mg["decoder.final_norm.weight"])
    assert s["decoder.layers.0.mixer.A_log"].dtype == torch.float32  # dtypes kept
    assert list(s) == list(mg)


def test_hybrid_layout_by_hand() -> None:
    config, hf = make_tiny_hybrid(0, pattern="M*M-", **HYBRID)
    mg = hf_to_megatron(hf, config)
    s = shard_megatron(mg, config, 1, 2)
    qkv = mg["decoder.layers.1.self_attention.linear_qkv.weight"]  # 2 groups of [2 q heads | k | v] x 16 rows
    assert torch.equal(s["decoder.layers.1.self_attention.linear_qkv.weight"], qkv[64:])
    assert torch.equal(s["decoder.layers.1.self_attention.linear_proj.weight"],
                       mg["decoder.layers.1.self_attention.linear_proj.weight"][:, 32:])
    assert torch.equal(s["decoder.layers.3.mlp.linear_fc1.weight"], mg["decoder.layers.3.mlp.linear_fc1.weight"][64:])
    fc2 = "decoder.layers.3.mlp.linear_fc2.weight"
    assert torch.equal(s[fc2], mg[fc2][:, 64:])
    assert torch.equal(s["decoder.layers.1.input_layernorm.weight"], mg["decoder.layers.1.input_layernorm.weight"])


def test_moe_layout_by_hand() -> None:
    """A MoE layer at TP 2 as Megatron shards it (expert TP = TP): every expert's and the shared expert's
    fc1 rows and fc2 columns of the rank's channels, the router and its expert bias whole; and back."""
    config, hf = make_tiny_hybrid(0, pattern="ME", **HYBRID)
    mg = hf_to_megatron(hf, config)
    shards = [shard_megatron(mg, config, r, 2) for r in range(2)]
    for expert in ("experts.local_experts.0", "experts.local_experts.7", "shared_experts"):
        fc1, fc2 = (f"decoder.layers.1.mlp.{expert}.linear_fc{i}.weight" for i in (1, 2))
        half = mg[fc1].shape[0] // 2
        assert torch.equal(shards[1][fc1], mg[fc1][half:]) and torch.equal(shards[1][fc2], mg[fc2][:, half:])
    for name in ("decoder.layers.1.mlp.router.weight", "decoder.layers.1.mlp.router.expert_bias"):
        assert all(torch.equal(s[name], mg[name]) for s in shards), name
    back = merge_megatron(shards, config)
    assert all(torch.equal(back[n], t) for n, t in mg.items())


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("hybrid", [False, True], ids=["mamba2", "hybrid"])
def test_round_trip_is_exact(size: int, hybrid: bool) -> None:
    config, hf = (make_tiny_hybrid(1, pattern="M*M-", **dict(HYBRID, num_key_value_heads=4)) if hybrid
                  else make_tiny(1, **MAMBA))
    mg = hf_to_megatron(hf, config)
    shards = [hf_to_megatron_shard(hf, config, r, size) for r in range(size)]
    for name, t in mg.items():
        assert sum(s[name].numel() for s in shards) == t.numel() * (1 if any(
            s[name].shape != t.shape for s in shards) else size), name
    back = merge_megatron(shards, config)
    assert list(back) == list(mg)
    for name, t in mg.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_refusals() -> None:
    config, hf = make_tiny(0, **dict(MAMBA, n_groups=1))
    assert any("n_groups 1" in p for p in tp_problems(config, 2))
    with pytest.raises(ModelLoadError, match="n_groups 1 is not a multiple of TP 2") as info:
        hf_to_megatron_shard(hf, config, 0, 2)
    assert "\n" not in str(info.value)
    assert tp_problems(config, 1) == []
    config, hf = make_tiny(0, **dict(MAMBA, vocab_size=90))
    with pytest.raises(ModelLoadError, match="vocab_size 90"):
        hf_to_megatron_shard(hf, config, 0, 4)
    config, hf = make_tiny(0, **MAMBA)
    with pytest.raises(ModelLoadError, match="Mamba heads"):
        hf_to_megatron_shard(hf, config, 0, 16)
    with pytest.raises(ModelLoadError, match="rank 2"):
        hf_to_megatron_shard(hf, config, 2, 2)
    moe, _ = make_tiny_hybrid(0, pattern="ME", **HYBRID)
    assert tp_problems(moe, 2) == []  # experts shard by channels (expert TP = TP)
    moe, _ = make_tiny_hybrid(0, pattern="ME", moe_intermediate_size=66, **HYBRID)
    assert any("MoE expert width 66" in p for p in tp_problems(moe, 4))
    shards = [hf_to_megatron_shard(hf, config, r, 2) for r in range(2)]
    shards[1]["decoder.final_norm.weight"] = shards[1]["decoder.final_norm.weight"] + 1
    with pytest.raises(ModelLoadError, match="replicated"):
        merge_megatron(shards, config)
    shards[1]["decoder.final_norm.weight"] = shards[0]["decoder.final_norm.weight"]
    shards[1]["decoder.layers.0.mixer.out_proj.weight"] = shards[1]["decoder.layers.0.mixer.out_proj.weight"][:, :8]
    with pytest.raises(ModelLoadError, match="not 2 shards"):
        merge_megatron(shards, config)
