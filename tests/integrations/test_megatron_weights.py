"""Megatron-Core <-> Hugging Face Mamba2 weight conversion: exact round trips and strict refusals.

The Megatron names are written out here from the megatron-core 0.16.1 state dict (not derived from the
module under test), so a renaming mistake on both sides cannot cancel out.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

from aligned_mamba import Contract, ModelLoadError
from aligned_mamba.models import build_model, load_checkpoint
from aligned_mamba.models.mamba2 import Mamba2Config, make_tiny
from trainer_hooks.megatron.weights import export_hf_checkpoint, hf_to_megatron, import_hf_checkpoint, megatron_to_hf

SMALL = dict(hidden_size=64, num_heads=4, head_dim=32, state_size=16, num_hidden_layers=2, vocab_size=96,
             conv_kernel=3, chunk_size=16)
CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "groups2": dict(n_groups=2),
    "tied": dict(tie_word_embeddings=True),
    "bias": dict(use_bias=True, dtype="float32"),
    "no_conv_bias": dict(use_conv_bias=False),
    "small_all": dict(SMALL, n_groups=2, use_bias=True, tie_word_embeddings=True, dtype="float32"),
}
_MIXER = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias", "norm.weight",
          "out_proj.weight", "out_proj.bias")


@functools.cache
def _tiny(name: str) -> tuple[Mamba2Config, dict[str, torch.Tensor]]:
    """make_tiny per named config, cached: tests must never write into the tensors."""
    return make_tiny(0, **CONFIGS[name])


def tiny(name: str) -> tuple[Mamba2Config, dict[str, torch.Tensor]]:
    config, tensors = _tiny(name)
    return config, dict(tensors)


def megatron_dict(config: Mamba2Config, hf: dict[str, torch.Tensor], *, te: bool) -> dict[str, torch.Tensor]:
    """The Megatron state dict of ``hf``, built from the literal megatron-core names."""
    sd = {"embedding.word_embeddings.weight": hf["backbone.embeddings.weight"]}
    for i in range(config.num_hidden_layers):
        norm = f"decoder.layers.{i}.mixer.in_proj.layer_norm_weight" if te else f"decoder.layers.{i}.norm.weight"
        sd[norm] = hf[f"backbone.layers.{i}.norm.weight"]
        for leaf in _MIXER:
            if f"backbone.layers.{i}.mixer.{leaf}" in hf:
                sd[f"decoder.layers.{i}.mixer.{leaf}"] = hf[f"backbone.layers.{i}.mixer.{leaf}"]
    sd["decoder.final_norm.weight"] = hf["backbone.norm_f.weight"]
    if "lm_head.weight" in hf:
        sd["output_layer.weight"] = hf["lm_head.weight"]
    return sd


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same keys; every tensor equal bit for bit with the same dtype (and, for a renaming, the same object)."""
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name
        assert got[name] is t, f"{name} was copied"


def refused(fn: Callable[[], object], *fragments: str) -> str:
    """Run ``fn``; it must raise ModelLoadError with a one-line message containing every fragment."""
    with pytest.raises(ModelLoadError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg, msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    return msg


@pytest.mark.parametrize("te", [False, True], ids=["plain_norm", "te_fused_norm"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trips_are_exact(name: str, te: bool) -> None:
    config, hf = tiny(name)
    snapshot = {k: v.clone() for k, v in hf.items()}
    want_mg = megatron_dict(config, hf, te=te)

    mg = hf_to_megatron(hf, config, te_fused_norm=te)  # HF -> Megatron -> HF
    assert_same(mg, want_mg)
    assert_same(megatron_to_hf(mg, config), hf)
    assert list(megatron_to_hf(mg, config)) == list(hf)  # expected_shapes order, like load_checkpoint

    # Megatron (as a model's state_dict gives it, with TE/fp8 _extra_state entries) -> HF -> Megatron
    with_extra: dict[str, Any] = {"decoder.layers.0.mixer.in_proj._extra_state": io.BytesIO(b"fp8"),
                                  "output_layer._extra_state": None, **want_mg,
                                  "decoder.final_norm._extra_state": torch.empty(0)}
    back = megatron_to_hf(with_extra, config)
    assert_same(back, hf)
    assert_same(hf_to_megatron(back, config, te_fused_norm=te), want_mg)
    assert not any("_extra_state" in k for k in hf_to_megatron(back, config, te_fused_norm=te))

    # Neither direction wrote into its inputs.
    for k, v in snapshot.items():
        assert torch.equal(hf[k], v) and hf[k].dtype == v.dtype, k


def test_layout_and_dtypes() -> None:
    """Names are exactly megatron-core's; tied has no output_layer; A_log/D/dt_bias stay fp32 in a bf16 model."""
    config, hf = tiny("tied")
    mg = hf_to_megatron(hf, config)
    assert "output_layer.weight" not in mg and "lm_head.weight" not in megatron_to_hf(mg, config)
    assert mg["decoder.layers.0.mixer.conv1d.weight"].shape == (config.conv_dim, 1, config.conv_kernel)
    assert mg["decoder.layers.2.mixer.in_proj.weight"].shape == (config.in_proj_size, config.hidden_size)
    assert mg["decoder.layers.1.mixer.A_log"].dtype == torch.float32
    assert mg["decoder.layers.1.mixer.in_proj.weight"].dtype == torch.bfloat16
    config, hf = tiny("bias")
    mg = hf_to_megatron(hf, config)
    assert {"decoder.layers.0.mixer.in_proj.bias", "decoder.layers.0.mixer.out_proj.bias"} <= set(mg)


@pytest.mark.parametrize("te", [False, True], ids=["plain_norm", "te_fused_norm"])
@pytest.mark.parametrize("name", ["bf16", "small_all"])
def test_through_files_and_logits(tmp_path, name: str, te: bool) -> None:
    overrides = dict(CONFIGS[name], **({} if name == "small_all" else SMALL))  # small shapes keep the forward fast
    config, hf = make_tiny(1, **overrides)
    mg = megatron_dict(config, hf, te=te)

    export_hf_checkpoint(mg, config, tmp_path / "ckpt")
    loaded_config, loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded_config == config
    assert sorted(loaded) == sorted(hf)
    for k, v in hf.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k

    imported_config, imported = import_hf_checkpoint(tmp_path / "ckpt", te_fused_norm=te)
    assert imported_config == config
    assert sorted(imported) == sorted(mg)
    for k, v in mg.items():
        assert imported[k].dtype == v.dtype and torch.equal(imported[k], v), k

    contract = Contract(chunk_size=config.chunk_size, model_dtype=config.dtype)
    tokens = torch.randint(0, config.vocab_size, (37,), generator=torch.Generator().manual_seed(0))
    want = build_model(config, hf, contract).forward([tokens])[0]
    got = build_model(config, megatron_to_hf(imported, config), contract).forward([tokens])[0]
    assert torch.isfinite(want).all()
    assert torch.equal(got, want)


def test_tied_output_copy_is_accepted_only_when_equal() -> None:
    config, hf = tiny("tied")
    mg = megatron_dict(config, hf, te=False)
    emb = hf["backbone.embeddings.weight"]
    assert_same(megatron_to_hf({**mg, "output_layer.weight": emb.clone()}, config), hf)
    assert_same(hf_to_megatron({**hf, "lm_head.weight": emb.clone()}, config), mg)
    refused(lambda: megatron_to_hf({**mg, "output_layer.weight": emb + 1}, config),
            "'output_layer.weight'", "tie_word_embeddings")
    refused(lambda: hf_to_megatron({**hf, "lm_head.weight": emb[:-1]}, config), "'lm_head.weight'",
            f"{[config.vocab_size - 1, config.hidden_size]}")


def test_megatron_refusals() -> None:
    config, hf = tiny("groups2")
    mg = megatron_dict(config, hf, te=False)
    c = config
    w = mg["decoder.layers.1.mixer.in_proj.weight"]

    def without(key: str) -> dict[str, torch.Tensor]:
        return {k: v for k, v in mg.items() if k != key}

    def replaced(key: str, value: Any) -> dict[str, Any]:
        return {**mg, key: value}

    def convert(sd: dict[str, Any]) -> Callable[[], object]:
        return lambda: megatron_to_hf(sd, config)

    refused(convert(replaced("decoder.layers.0.mixer.bogus", w)), "unknown", "'decoder.layers.0.mixer.bogus'")
    refused(convert(replaced("decoder.layers.3.norm.weight", mg["decoder.layers.0.norm.weight"])),
            "'decoder.layers.3.norm.weight'", "3 layer(s)")
    refused(convert({"module." + k: v for k, v in mg.items()}), "'module.embedding.word_embeddings.weight'", "unwrap")
    refused(convert(replaced("decoder.layers.1.self_attention.linear_qkv.weight", w)), "linear_qkv", "hybrid")
    refused(convert(replaced("decoder.layers.0.mixer.in_proj.bias", w[:, 0])), "in_proj.bias", "use_bias=False")
    refused(convert(without("decoder.layers.2.mixer.A_log")),
            "'decoder.layers.2.mixer.A_log'", "'backbone.layers.2.mixer.A_log'", f"[{c.num_heads}]")
    refused(convert(without("output_layer.weight")), "lacks 'output_layer.weight'", "'lm_head.weight'")
    refused(convert(replaced("decoder.layers.0.mixer.in_proj.layer_norm_weight", mg["decoder.layers.0.norm.weight"])),
            "twice", "'decoder.layers.0.norm.weight'", "'decoder.layers.0.mixer.in_proj.layer_norm_weight'")
    refused(convert(replaced("decoder.final_norm.weight", [1.0] * c.hidden_size)),
            "'decoder.final_norm.weight'", "list")

    # Wrong shapes name the key and both shapes.
    conv = mg["decoder.layers.0.mixer.conv1d.weight"]
    refused(convert(replaced("decoder.layers.0.mixer.conv1d.weight", conv[:, 0, :])),
            "'decoder.layers.0.mixer.conv1d.weight'", f"expected shape {[c.conv_dim, 1, c.conv_kernel]}",
            f"found {[c.conv_dim, c.conv_kernel]}")
    refused(convert(replaced("decoder.layers.0.mixer.D", torch.ones(c.intermediate_size))),  # D_has_hdim
            "'decoder.layers.0.mixer.D'", f"[{c.num_heads}]", f"[{c.intermediate_size}]")
    # A TP=2 rank's in_proj holds half the rows ([z|x|B|C|dt] of its own heads and groups); TP=4 out_proj columns.
    refused(convert(replaced("decoder.layers.1.mixer.in_proj.weight", w[: c.in_proj_size // 2])),
            "'decoder.layers.1.mixer.in_proj.weight'", f"{[c.in_proj_size, c.hidden_size]}",
            f"{[c.in_proj_size // 2, c.hidden_size]}", "TP=2", "TP=1")
    out = mg["decoder.layers.0.mixer.out_proj.weight"]
    refused(convert(replaced("decoder.layers.0.mixer.out_proj.weight", out[:, : c.intermediate_size // 4])),
            "TP=4", f"{[c.hidden_size, c.intermediate_size // 4]}")
    # Megatron pads the vocabulary; the config must say the padded size.
    emb = mg["embedding.word_embeddings.weight"]
    padded = torch.cat([emb, emb[:128]])
    refused(convert(replaced("embedding.word_embeddings.weight", padded)),
            f"{[c.vocab_size + 128, c.hidden_size]}", f"vocab_size={c.vocab_size + 128}")


def test_hf_refusals(tmp_path) -> None:
    config, hf = tiny("bf16")
    c = config
    refused(lambda: hf_to_megatron({**hf, "backbone.layers.0.mixer.out_proj.bias": torch.zeros(c.hidden_size)},
                                   config), "'backbone.layers.0.mixer.out_proj.bias'", "use_bias=False")
    refused(lambda: hf_to_megatron({k: v for k, v in hf.items() if k != "backbone.norm_f.weight"}, config),
            "'backbone.norm_f.weight'", "'decoder.final_norm.weight'", f"[{c.hidden_size}]")
    refused(lambda: hf_to_megatron({**hf, "backbone.layers.1.mixer.dt_bias": torch.zeros(c.num_heads + 1)}, config),
            "'backbone.layers.1.mixer.dt_bias'", f"[{c.num_heads}]", f"[{c.num_heads + 1}]")
    # export refuses what save_checkpoint would, as the same error type, and writes nothing
    mg = megatron_dict(config, hf, te=False)
    half = {**mg, "decoder.layers.0.mixer.out_proj.weight": mg["decoder.layers.0.mixer.out_proj.weight"].half()}
    refused(lambda: export_hf_checkpoint(half, config, tmp_path / "x"), "float16")
    assert not (tmp_path / "x" / "model.safetensors").exists()
    refused(lambda: import_hf_checkpoint(tmp_path / "missing"), "does not exist")
