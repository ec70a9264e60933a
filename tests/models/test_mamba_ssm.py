"""Model families on the generic causal LM: the registry, and mamba_ssm's published layout.

A mamba_ssm checkpoint (``MambaLMHeadModel``: config.json with ``ssm_cfg``, ``pytorch_model.bin``)
written from the same weights as a Hugging Face one loads onto the same model and gives the same
logits bit for bit; what that layout holds and the model does not cover is refused by name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import aligned_mamba
from aligned_mamba import Contract, ModelLoadError
from aligned_mamba.models import FAMILIES, build_model, family_of, load_checkpoint, load_model
from aligned_mamba.models import mamba_ssm as ms
from aligned_mamba.models.family import Family
from aligned_mamba.models.mamba2 import Mamba2Config, make_tiny, save_checkpoint
from aligned_mamba.models.nemotron_h import NemotronHConfig

SMALL = dict(num_hidden_layers=2, hidden_size=128, num_heads=4, head_dim=64, n_groups=2, state_size=32,
             chunk_size=64, vocab_size=512)


def _seqs(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g) for n in (150, 37, 1)]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.safetensors"])
def test_a_mamba_ssm_checkpoint_gives_the_hugging_face_layouts_bits(tmp_path: Path, tied: bool, weights: str) -> None:
    config, tensors = make_tiny(1, dtype="bfloat16", tie_word_embeddings=tied, **SMALL)
    save_checkpoint(tmp_path / "hf", config, tensors)
    ms_config, ms_tensors = ms.from_hf(config, tensors)
    ms.save_checkpoint(str(tmp_path / "ms"), ms_config, ms_tensors, weights_file=weights)
    raw = json.loads((tmp_path / "ms" / "config.json").read_text())
    assert "architectures" not in raw and raw["ssm_cfg"]["layer"] == "Mamba2"  # as mamba_ssm writes it
    hf = load_model(tmp_path / "hf")
    got = load_model(tmp_path / "ms")
    assert got.family == "mamba_ssm" and hf.family == "mamba2"
    assert got.contract == hf.contract  # chunk size from ssm_cfg, dtype read off the weights
    seqs = _seqs(config.vocab_size)
    for a, b in zip(got.forward(seqs), hf.forward(seqs), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    # and the same advance through the sampler's state: one decode step from a prefill
    cache_a, cache_b = got.new_cache(1), hf.new_cache(1)
    from aligned_mamba.ops.step import Step

    for cache, model in ((cache_a, got), (cache_b, hf)):
        model.advance(cache, Step.make([0], [0], [40]), seqs[0][:40])
    step = Step.make([0], [40], [1])
    assert torch.equal(got.advance(cache_a, step, seqs[0][40:41]), hf.advance(cache_b, step, seqs[0][40:41]))


def test_the_vocab_is_padded_as_mamba_ssm_builds_it(tmp_path: Path) -> None:
    cfg = ms.MambaSSMConfig(d_model=64, n_layer=1, vocab_size=500, d_state=16, headdim=32, chunk_size=32,
                            pad_vocab_size_multiple=16)
    assert cfg.padded_vocab == 512 and ms.expected_shapes(cfg)[ms.EMBEDDING] == (512, 64)
    g = torch.Generator().manual_seed(0)
    tensors = {name: (torch.rand(shape, generator=g) * 0.1).to(torch.float32)
               for name, shape in ms.expected_shapes(cfg).items()}
    ms.save_checkpoint(str(tmp_path), cfg, tensors)
    model = load_model(tmp_path)
    assert model.forward([torch.tensor([1, 2, 499])])[0].shape == (3, 512)
    assert model.contract.chunk_size == 32 and model.contract.model_dtype == "float32"


@pytest.mark.parametrize(("change", "words"), [
    ({"attn_layer_idx": [1]}, "attention layers at attn_layer_idx [1] is not covered"),
    ({"d_intermediate": 256}, "MLP blocks (d_intermediate 256) is not covered"),
    ({"ssm_cfg": {"layer": "Mamba1"}}, "ssm_cfg.layer 'Mamba1' (only Mamba2) is not covered"),
    ({"ssm_cfg": {"layer": "Mamba2", "d_ssm": 64}}, "a partial SSM width"),
    ({"ssm_cfg": {"layer": "Mamba2", "D_has_hdim": True}}, "D_has_hdim true is not covered"),
    ({"ssm_cfg": {"layer": "Mamba2", "mystery": 1}}, "ssm_cfg key(s) ['mystery'] are not understood"),
    ({"rms_norm": False}, "rms_norm false (LayerNorm blocks) is not covered"),
])
def test_what_the_mamba_ssm_layout_holds_and_the_model_does_not_is_refused(tmp_path: Path, change: dict,
                                                                            words: str) -> None:
    config, tensors = make_tiny(1, **SMALL)
    ms_config, ms_tensors = ms.from_hf(config, tensors)
    ms.save_checkpoint(str(tmp_path), ms_config, ms_tensors)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(tmp_path)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_registry_finds_each_family_and_refuses_others() -> None:
    names = [f.name for f in FAMILIES]
    assert names[:2] == ["mamba2", "mamba_ssm"]
    assert family_of({"architectures": ["Mamba2ForCausalLM"]}).name == "mamba2"
    assert family_of({"model_type": "mamba2"}).name == "mamba2"
    assert family_of({"d_model": 8, "n_layer": 1, "ssm_cfg": {}}).name == "mamba_ssm"
    with pytest.raises(ModelLoadError, match="no model family for architectures \\['LlamaForCausalLM'\\]"):
        family_of({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def test_each_family_is_a_short_subclass_of_the_base() -> None:
    """A family states its names and overrides only what differs from ``Family``'s defaults."""
    for family in FAMILIES:
        assert isinstance(family, Family) and type(family) is not Family
        own = {n for n, v in vars(type(family)).items() if callable(v) and not n.startswith("__")}
        assert len(own) <= 8, (family.name, sorted(own))


@pytest.mark.parametrize("limit, want", [([0.001, "Infinity"], (0.001, math.inf)), ([0.0, None], (0.0, math.inf)),
                                         ([0.0, {"__float__": "Infinity"}], (0.0, math.inf)),
                                         (["-inf", 0.1], (-math.inf, 0.1))])
def test_the_hugging_face_families_read_time_step_limit_alike(limit: list, want: tuple[float, float]) -> None:
    """One parser (``hf_config``): Nemotron-H refused transformers' ``{"__float__": ...}`` and "-inf" that
    Mamba2 read, when each family had its own."""
    for config_type in (Mamba2Config, NemotronHConfig):
        assert config_type.from_hf_dict({"time_step_limit": limit}).time_step_limit == want
    for bad in ([1.0, 0.5], [0.0], ["nan", 1.0]):
        for config_type in (Mamba2Config, NemotronHConfig):
            with pytest.raises(ModelLoadError, match=r"config.json: time_step_limit must be two numbers"):
                config_type.from_hf_dict({"time_step_limit": bad})


def test_the_public_entry_point(tmp_path: Path) -> None:
    config, tensors = make_tiny(2, **SMALL)
    save_checkpoint(tmp_path, config, tensors)
    model = aligned_mamba.load_model(tmp_path)
    seqs = _seqs(config.vocab_size)
    want = build_model(config, tensors, Contract(chunk_size=64, model_dtype="bfloat16")).forward(seqs)
    got = model.forward(seqs)
    assert [t.shape for t in got] == [(s.numel(), config.vocab_size) for s in seqs]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    other = aligned_mamba.load_model(tmp_path, Contract(chunk_size=32, model_dtype="bfloat16"))
    assert other.contract.chunk_size == 32
    assert isinstance(model.config, Mamba2Config)


# -- architectures, absent keys and symlinks in both layouts ------------------------------------------------


def _hf(tmp_path: Path, change: dict, drop: tuple[str, ...] = ()) -> Path:
    config, tensors = make_tiny(1, **SMALL)
    save_checkpoint(tmp_path, config, tensors)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in {**raw, **change}.items() if k not in drop}))
    return tmp_path


def _refusal(path: Path) -> str:
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(path)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize(("change", "words"), [
    ({"architectures": ["LlamaForCausalLM"]},
     "architectures ['LlamaForCausalLM'] contradict model_type 'mamba2' (the mamba2 family's architectures are "
     "['Mamba2ForCausalLM'])"),
    ({"architectures": ["Mamba2ForCausalLM", "LlamaForCausalLM"]},
     "architectures ['Mamba2ForCausalLM', 'LlamaForCausalLM'] name classes besides the mamba2 family's "
     "['Mamba2ForCausalLM']; a config names one model"),
    ({"architectures": ["MambaLMHeadModel"]},
     "architectures ['MambaLMHeadModel'] (mamba_ssm) contradict model_type 'mamba2'; a config names one model"),
    ({"architectures": "Mamba2ForCausalLM"}, "architectures must be a list of class names, found 'Mamba2ForCausalLM'"),
])
def test_architectures_that_contradict_the_model_type_are_refused(tmp_path: Path, change: dict, words: str) -> None:
    assert _refusal(_hf(tmp_path, change)) == f"{tmp_path / 'config.json'}: {words}"


@pytest.mark.parametrize("archs", ["absent", None, []])
def test_absent_architectures_are_accepted(tmp_path: Path, archs: object) -> None:
    path = _hf(tmp_path, {} if archs == "absent" else {"architectures": archs},
               drop=("architectures",) if archs == "absent" else ())
    assert load_checkpoint(path)[0] == make_tiny(1, **SMALL)[0]


def test_mamba_ssm_absent_layer_keys_are_named_and_links_checked(tmp_path: Path) -> None:
    config, tensors = make_tiny(1, **SMALL)  # ngroups 2: not the Mamba2 layer's default 1
    ms_config, ms_tensors = ms.from_hf(config, tensors)
    ms.save_checkpoint(str(tmp_path), ms_config, ms_tensors)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["ssm_cfg"]["ngroups"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    message = _refusal(tmp_path)
    assert message.startswith(f"{tmp_path / 'config.json'}: lacks ssm_cfg.ngroups (default 1), so mamba_ssm's "
                              "defaults apply, and then: tensor 'backbone.layers.0.mixer.in_proj.weight'"), message
    # pytorch_model.bin, the layout's own weights file, as a symlink loop
    bin_file = tmp_path / "pytorch_model.bin"
    bin_file.unlink()
    bin_file.symlink_to(bin_file.name)
    assert _refusal(tmp_path) == (f"PyTorch weights {str(bin_file)!r} is a symlink loop (too many levels of "
                                  "symbolic links)")


def test_mamba_ssm_mixed_storage_dtypes_are_refused_on_save_and_load(tmp_path: Path) -> None:
    config, tensors = make_tiny(1, **SMALL)
    ms_config, ms_tensors = ms.from_hf(config, tensors)
    ms_tensors["backbone.norm_f.weight"] = ms_tensors["backbone.norm_f.weight"].float()
    with pytest.raises(ValueError, match="mixed storage dtypes: 'backbone.embedding.weight' in 'tensors' is bfloat16 "
                                         "but 'backbone.norm_f.weight' in 'tensors' is float32"):
        ms.save_checkpoint(str(tmp_path), ms_config, ms_tensors)
    torch.save(ms_tensors, tmp_path / "pytorch_model.bin")  # as some tool might write it
    (tmp_path / "config.json").write_text(json.dumps(ms_config.to_dict()))
    assert _refusal(tmp_path).startswith("mixed storage dtypes: 'backbone.embedding.weight' in ")
