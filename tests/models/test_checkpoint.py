"""Checkpoint round trips, the embedded tiny model, and every load error (fast, CPU only)."""

from __future__ import annotations

import functools
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save, save_file

from aligned_mamba import Contract
from aligned_mamba.errors import ModelLoadError
from aligned_mamba.models import build_model, load_checkpoint, load_model
from aligned_mamba.models.mamba2 import Mamba2Config, expected_shapes, make_tiny, save_checkpoint

LAYER0 = "backbone.layers.0.mixer."

# (dtype, overrides) covering both storage dtypes and the shape variants the model must support.
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("bfloat16", {}),
    ("float32", {}),
    ("bfloat16", {"n_groups": 2}),
    ("bfloat16", {"num_heads": 16, "head_dim": 32}),
    ("float32", {"chunk_size": 64, "num_hidden_layers": 3}),
    ("bfloat16", {"tie_word_embeddings": True}),
    ("float32", {"use_bias": True, "use_conv_bias": False, "time_step_limit": (0.0, 0.1)}),
]


@functools.cache
def _tiny_cached(seed: int, **overrides: Any) -> tuple[Mamba2Config, dict[str, torch.Tensor]]:
    return make_tiny(seed, **overrides)


def tiny(seed: int = 0, **overrides: Any) -> tuple[Mamba2Config, dict[str, torch.Tensor]]:
    """make_tiny, cached across tests; a fresh dict, but the tensors are shared: replace them, never write into them."""
    config, tensors = _tiny_cached(seed, **overrides)
    return config, dict(tensors)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, t in a.items():
        assert t.dtype == b[name].dtype, name
        assert torch.equal(t, b[name]), name


def write_raw(path: Path, config: Mamba2Config | dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """A checkpoint written without save_checkpoint's validation, to build broken ones."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = config.to_hf_dict() if isinstance(config, Mamba2Config) else config
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("dtype", "overrides"), VARIANTS)
def test_round_trip_is_exact(tmp_path: Path, dtype: str, overrides: dict[str, Any]) -> None:
    config, tensors = tiny(3, dtype=dtype, **overrides)
    save_checkpoint(tmp_path / "ckpt", config, tensors)
    config2, tensors2 = load_checkpoint(tmp_path / "ckpt")
    assert config2 == config
    assert_same(tensors, tensors2)
    assert tensors.keys() == expected_shapes(config).keys()
    assert ("lm_head.weight" in tensors) == (not config.tie_word_embeddings)
    for name, t in tensors.items():
        fp32 = name.endswith((".A_log", ".D", ".dt_bias"))
        assert t.dtype == (torch.float32 if fp32 else config.torch_dtype), name


def test_config_json_round_trip_and_derived_sizes(tmp_path: Path) -> None:
    config, tensors = tiny(n_groups=2)
    save_checkpoint(tmp_path, config, tensors)
    text = (tmp_path / "config.json").read_text()

    def refuse(name: str) -> None:
        raise AssertionError(f"config.json holds a bare {name}: not strict JSON")

    d = json.loads(text, parse_constant=refuse)  # strict JSON: the inf time-step limit as transformers tags it
    assert d["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    assert d["model_type"] == "mamba2" and d["architectures"] == ["Mamba2ForCausalLM"]
    assert d["torch_dtype"] == "bfloat16"
    assert Mamba2Config.from_hf_dict(d) == config
    assert config.intermediate_size == 512
    assert config.conv_dim == 512 + 2 * 2 * 128
    assert config.in_proj_size == 512 + config.conv_dim + 8
    assert config.torch_dtype is torch.bfloat16


def test_from_hf_dict_defaults_and_spellings() -> None:
    default = Mamba2Config.from_hf_dict({})
    assert default == Mamba2Config()
    assert (default.num_heads, default.head_dim, default.n_groups, default.dtype) == (128, 64, 8, "float32")
    assert default.time_step_limit == (0.0, math.inf)
    for hi in (None, "Infinity", "inf", float("inf")):
        assert Mamba2Config.from_hf_dict({"time_step_limit": [0.0, hi]}).time_step_limit == (0.0, math.inf)
    assert Mamba2Config.from_hf_dict({"dtype": "bfloat16"}).dtype == "bfloat16"
    assert Mamba2Config.from_hf_dict({"torch_dtype": "torch.bfloat16"}).dtype == "bfloat16"
    assert Mamba2Config.from_hf_dict({"time_step_limit": [0.001, 0.1]}).time_step_limit == (0.001, 0.1)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"hidden_size": 0}, "hidden_size must be a positive int"),
        ({"vocab_size": 512.5}, "vocab_size must be a positive int"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers must be a positive int"),
        ({"head_dim": 32}, "num_heads * head_dim"),
        ({"n_groups": 3}, "divisible by n_groups"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"torch_dtype": "float16"}, "dtype 'float16' is not supported"),
        ({"torch_dtype": "bfloat16", "dtype": "float32"}, "disagree"),
        ({"time_step_limit": [0.1, 0.01]}, "lo <= hi"),
        ({"time_step_limit": [0.0]}, "time_step_limit must be two numbers"),
        ({"time_step_limit": "none"}, "time_step_limit must be two numbers"),
        ({"layer_norm_epsilon": -1.0}, "layer_norm_epsilon"),
        ({"use_bias": "no"}, "use_bias must be true or false"),
        ({"model_type": "mamba"}, "architectures ['Mamba2ForCausalLM'] (mamba2) contradict model_type 'mamba'"),
    ],
)
def test_bad_config_values(tmp_path: Path, change: dict[str, Any], words: str) -> None:
    config, tensors = tiny()
    write_raw(tmp_path, {**config.to_hf_dict(), **change}, tensors)
    message = load_error(tmp_path)
    assert words in message and "config.json" in message


def test_make_tiny_is_deterministic_and_realistic() -> None:
    config, a = make_tiny(0)
    _, b = make_tiny(0)
    _, c = tiny(1)
    assert_same(a, b)
    assert not torch.equal(a["backbone.embeddings.weight"], c["backbone.embeddings.weight"])
    assert not torch.equal(a[LAYER0 + "A_log"], c[LAYER0 + "A_log"])
    for i in range(config.num_hidden_layers):
        p = f"backbone.layers.{i}.mixer."
        A = -torch.exp(a[p + "A_log"])
        assert A.min() >= -16.0 and A.max() <= -1.0
        dt = torch.nn.functional.softplus(a[p + "dt_bias"].double())
        assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-1 * (1 + 1e-5)
        assert torch.equal(a[p + "D"], torch.ones(config.num_heads))
        assert not torch.equal(a[p + "norm.weight"], torch.ones_like(a[p + "norm.weight"]))
    std = a[LAYER0 + "in_proj.weight"].float().std().item()
    assert abs(std - 1 / math.sqrt(config.hidden_size)) < 0.1 / math.sqrt(config.hidden_size)
    # bf16 is fp32 generation cast once: same seed in fp32 rounds to the bf16 tensors exactly.
    _, f32 = make_tiny(0, dtype="float32")
    assert_same(a, {k: v if v.dtype == a[k].dtype else v.to(a[k].dtype) for k, v in f32.items()})


def test_make_tiny_golden_digest() -> None:
    """Pins the exact bits of the default model, so a platform or torch change that alters them is caught."""
    _, tensors = tiny(0)
    assert hashlib.sha256(save(tensors)).hexdigest() == GOLDEN_SHA256


GOLDEN_SHA256 = "4c9981309a02ce25615b0929a729e7be3fc1865685d8f15ba478448438f2821d"


def test_make_tiny_rejects_inconsistent_overrides() -> None:
    with pytest.raises(ValueError, match=r"num_heads \* head_dim .*override"):
        make_tiny(head_dim=32)
    with pytest.raises(ValueError, match="divisible by n_groups"):
        make_tiny(n_groups=3)
    with pytest.raises(TypeError, match="unknown config fields: bogus"):
        make_tiny(bogus=1)


def test_sharded_index_loading(tmp_path: Path) -> None:
    config, tensors = tiny(5, num_hidden_layers=3)
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(tmp_path / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard_names, shard))
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config2, tensors2 = load_checkpoint(tmp_path)
    assert config2 == config
    assert_same(tensors, tensors2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    assert "model-00002-of-00002.safetensors" in load_error(tmp_path)


def test_tied_embeddings_accept_equal_lm_head_and_refuse_different(tmp_path: Path) -> None:
    config, tensors = tiny(tie_word_embeddings=True)
    emb = tensors["backbone.embeddings.weight"]
    _, loaded = load_checkpoint(write_raw(tmp_path / "eq", config, {**tensors, "lm_head.weight": emb.clone()}))
    assert "lm_head.weight" not in loaded
    message = load_error(write_raw(tmp_path / "ne", config, {**tensors, "lm_head.weight": emb + 1}))
    assert "lm_head.weight differs" in message


def test_missing_path_and_not_a_directory(tmp_path: Path) -> None:
    assert "does not exist" in load_error(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in load_error(tmp_path / "file")


def test_missing_and_invalid_config(tmp_path: Path) -> None:
    config, tensors = tiny()
    write_raw(tmp_path, config, tensors)
    (tmp_path / "config.json").unlink()
    assert "config file" in (m := load_error(tmp_path)) and "missing" in m
    (tmp_path / "config.json").write_text("{not json")
    assert "not valid JSON" in load_error(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    assert "expected a JSON object" in load_error(tmp_path)


def test_no_or_unreadable_safetensors(tmp_path: Path) -> None:
    config, tensors = tiny()
    write_raw(tmp_path, config, tensors)
    (tmp_path / "model.safetensors").unlink()
    assert "no weights (model.safetensors, model.safetensors.index.json)" in load_error(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!garbage!")
    assert "cannot read safetensors file" in load_error(tmp_path)


def test_missing_tensor(tmp_path: Path) -> None:
    config, tensors = tiny()
    del tensors[LAYER0 + "D"]
    del tensors["lm_head.weight"]  # untied: a missing head is a missing tensor
    message = load_error(write_raw(tmp_path, config, tensors))
    assert "2 missing tensor(s)" in message and LAYER0 + "D" in message and "lm_head.weight" in message


def test_unexpected_tensor(tmp_path: Path) -> None:
    config, tensors = tiny()
    tensors["backbone.layers.7.mixer.D"] = torch.ones(8)
    message = load_error(write_raw(tmp_path, config, tensors))
    assert "1 unexpected tensor(s)" in message and "backbone.layers.7.mixer.D" in message


def test_mis_shaped_tensor_names_both_shapes(tmp_path: Path) -> None:
    config, tensors = tiny()
    tensors[LAYER0 + "D"] = torch.ones(8, 64)  # a per-channel D is not the HF layout
    message = load_error(write_raw(tmp_path, config, tensors))
    assert LAYER0 + "D" in message and "expected shape [8]" in message and "found [8, 64]" in message


def test_fp16_and_other_dtypes_refused(tmp_path: Path) -> None:
    config, tensors = tiny()
    tensors[LAYER0 + "in_proj.weight"] = tensors[LAYER0 + "in_proj.weight"].half()
    message = load_error(write_raw(tmp_path / "fp16", config, tensors))
    assert "float16" in message and "refused" in message and LAYER0 + "in_proj.weight" in message
    tensors[LAYER0 + "in_proj.weight"] = tensors[LAYER0 + "in_proj.weight"].double()
    assert "only bfloat16 and float32" in load_error(write_raw(tmp_path / "fp64", config, tensors))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_refused(tmp_path: Path, bad: float) -> None:
    config, tensors = tiny()
    tensors[LAYER0 + "out_proj.weight"] = tensors[LAYER0 + "out_proj.weight"].clone()
    tensors[LAYER0 + "out_proj.weight"][3, 5] = bad
    message = load_error(write_raw(tmp_path, config, tensors))
    assert LAYER0 + "out_proj.weight" in message and "1 non-finite" in message


def test_save_refuses_what_would_not_load(tmp_path: Path) -> None:
    config, tensors = tiny()
    tensors[LAYER0 + "D"] = torch.ones(9)
    with pytest.raises(ValueError, match="expected shape"):
        save_checkpoint(tmp_path, config, tensors)
    assert not (tmp_path / "model.safetensors").exists()


# -- what real inputs get: the storage dtype, absent config keys, symlinks ---------------------------


def test_a_config_dtype_that_is_not_the_stored_one_is_refused(tmp_path: Path) -> None:
    config, tensors = tiny()  # bf16 weights (the per-head A_log, D, dt_bias in fp32)
    cfg = config.to_hf_dict()
    message = load_error(write_raw(tmp_path / "a", {**cfg, "torch_dtype": "float32"}, tensors))
    assert message.endswith("config.json: torch_dtype is 'float32' but the weights are stored in bfloat16 "
                            f"('backbone.embeddings.weight' in '{tmp_path / 'a' / 'model.safetensors'}'); correct "
                            "torch_dtype or convert the weights")
    # transformers 5 writes the key "dtype"; the message names the key the file has
    del cfg["torch_dtype"]
    _, f32 = tiny(dtype="float32")
    message = load_error(write_raw(tmp_path / "b", {**cfg, "dtype": "bfloat16"}, f32))
    assert "config.json: dtype is 'bfloat16' but the weights are stored in float32" in message


def test_without_a_config_dtype_the_stored_one_is_the_models(tmp_path: Path) -> None:
    config, tensors = tiny()
    cfg = config.to_hf_dict()
    del cfg["torch_dtype"]  # transformers would assume float32 and run this bf16 checkpoint in fp32
    write_raw(tmp_path, cfg, tensors)
    loaded, _ = load_checkpoint(tmp_path)
    assert loaded == config and loaded.dtype == "bfloat16"
    assert load_model(tmp_path).contract.model_dtype == "bfloat16"


def test_mixed_storage_dtypes_are_refused_but_per_head_fp32_is_not(tmp_path: Path) -> None:
    config, tensors = tiny()
    tensors[LAYER0 + "in_proj.weight"] = tensors[LAYER0 + "in_proj.weight"].float()
    message = load_error(write_raw(tmp_path / "mixed", config, tensors))
    assert message.startswith("mixed storage dtypes: 'backbone.embeddings.weight' in ")
    assert f"is bfloat16 but '{LAYER0}in_proj.weight' in " in message and "is float32" in message
    # A_log, D, dt_bias may be bf16 or fp32 in a bf16 checkpoint: the model computes with them in fp32
    config, tensors = tiny()
    tensors[LAYER0 + "A_log"] = tensors[LAYER0 + "A_log"].bfloat16()
    loaded, got = load_checkpoint(write_raw(tmp_path / "per_head", config, tensors))
    assert loaded.dtype == "bfloat16" and got[LAYER0 + "A_log"].dtype == torch.bfloat16
    assert got["backbone.layers.1.mixer.A_log"].dtype == torch.float32


def test_save_refuses_a_config_dtype_the_tensors_do_not_have(tmp_path: Path) -> None:
    config, _ = tiny(dtype="float32")
    _, bf16 = tiny()
    with pytest.raises(ValueError, match="config dtype 'float32' but the tensors are bfloat16"):
        save_checkpoint(tmp_path, config, bf16)
    assert not (tmp_path / "config.json").exists()


def test_a_contract_dtype_other_than_the_stored_one_needs_cast(tmp_path: Path) -> None:
    config, tensors = tiny(num_hidden_layers=1)
    save_checkpoint(tmp_path, config, tensors)
    fp32 = Contract(chunk_size=config.chunk_size, model_dtype="float32")
    with pytest.raises(ModelLoadError) as info:
        load_model(tmp_path, fp32)
    assert str(info.value) == (f"{str(tmp_path)!r} stores bfloat16 weights but the contract's model_dtype is "
                               "float32; aligned_mamba.models.load_model(..., cast=True) computes in float32 from "
                               "them, or use a bfloat16 contract")
    model = load_model(tmp_path, fp32, cast=True)
    assert model.dtype == torch.float32 and model.config.dtype == "bfloat16"  # both recorded
    seq = torch.arange(40) % config.vocab_size
    assert torch.equal(model.forward([seq])[0], build_model(config, tensors, fp32).forward([seq])[0])


@pytest.mark.parametrize(("absent", "overrides", "words"), [
    (["num_hidden_layers"], {}, "lacks num_hidden_layers (default 64), so transformers' Mamba2Config defaults "
                                "apply, and then: 549 missing tensor(s): 'backbone.layers.3.norm.weight'"),
    (["hidden_size"], {}, "lacks hidden_size (default 4096), so transformers' Mamba2Config defaults apply, and "
                          "then: num_heads * head_dim (8 * 64 = 512) must equal intermediate_size"),
    (["vocab_size"], {}, "lacks vocab_size (default 32768), so transformers' Mamba2Config defaults apply, and then: "
                         "tensor 'backbone.embeddings.weight'"),
    (["n_groups"], {}, "lacks n_groups (default 8), so"),
    (["tie_word_embeddings"], {"tie_word_embeddings": True},
     "lacks tie_word_embeddings (default False), so transformers' Mamba2Config defaults apply, and then: 1 missing "
     "tensor(s): 'lm_head.weight'"),
    (["head_dim", "num_heads"], {}, "lacks num_heads (default 128), head_dim (default 64), so"),
])
def test_absent_shape_keys_are_named_when_the_tensors_disagree(tmp_path: Path, absent: list[str],
                                                               overrides: dict[str, Any], words: str) -> None:
    config, tensors = tiny(**overrides)
    cfg = {k: v for k, v in config.to_hf_dict().items() if k not in absent}
    message = load_error(write_raw(tmp_path, cfg, tensors))
    assert message.startswith(f"{tmp_path / 'config.json'}: {words}"), message


def test_absent_shape_keys_whose_defaults_fit_are_accepted_and_present_ones_are_not_blamed(tmp_path: Path) -> None:
    config, tensors = tiny()  # state_size 128, conv_kernel 4, expand 2: transformers' defaults
    cfg = {k: v for k, v in config.to_hf_dict().items() if k not in ("state_size", "conv_kernel", "expand")}
    assert load_checkpoint(write_raw(tmp_path / "ok", cfg, tensors))[0] == config
    message = load_error(write_raw(tmp_path / "present", {**config.to_hf_dict(), "num_hidden_layers": 2}, tensors))
    assert message.startswith("9 unexpected tensor(s)") and "lacks" not in message


def _loop(link: Path) -> None:
    """``link`` as one half of a two-link loop."""
    other = link.with_name(link.name + ".other")
    link.symlink_to(other.name)
    other.symlink_to(link.name)


@pytest.mark.parametrize(("name", "what"), [("config.json", "config file"),
                                            ("model.safetensors", "safetensors file")])
def test_symlink_loops_and_broken_links_are_named(tmp_path: Path, name: str, what: str) -> None:
    config, tensors = tiny()
    write_raw(tmp_path, config, tensors)
    (tmp_path / name).unlink()
    _loop(tmp_path / name)
    assert load_error(tmp_path) == (f"{what} {str(tmp_path / name)!r} is a symlink loop (too many levels of "
                                    "symbolic links)")
    (tmp_path / name).unlink()
    (tmp_path / name).symlink_to("gone")
    assert load_error(tmp_path) == (f"{what} {str(tmp_path / name)!r} is a broken symlink: its target 'gone' does "
                                    "not exist")


def test_a_looping_checkpoint_folder_or_shard_is_named_and_real_links_load(tmp_path: Path) -> None:
    _loop(tmp_path / "ckpt")
    assert load_error(tmp_path / "ckpt") == (f"checkpoint path {str(tmp_path / 'ckpt')!r} is a symlink loop (too many "
                                             "levels of symbolic links)")
    # a Hugging Face cache snapshot: every file a symlink to a blob
    config, tensors = tiny()
    write_raw(tmp_path / "blobs", config, tensors)
    snap = tmp_path / "snapshot"
    snap.mkdir()
    for f in ("config.json", "model.safetensors"):
        (snap / f).symlink_to(tmp_path / "blobs" / f)
    assert load_checkpoint(snap)[0] == config
    # a shard the index lists that loops
    shard = "model-00001-of-00001.safetensors"
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(tensors, shard)}))
    _loop(snap / shard)
    assert load_error(snap) == f"shard {str(snap / shard)!r} is a symlink loop (too many levels of symbolic links)"
    (snap / "model.safetensors.index.json").unlink()
    (snap / "model.safetensors").mkdir()
    assert load_error(snap) == f"safetensors file {str(snap / 'model.safetensors')!r} is not a regular file"
