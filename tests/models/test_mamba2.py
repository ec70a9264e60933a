"""Hugging Face checkpoints as the installed transformers writes and reads them, both ways.

(a) transformers' ``Mamba2ForCausalLM`` (random init, fp32 and bf16) -> ``save_pretrained`` -> our
loader; (b) our ``save_checkpoint`` -> ``Mamba2ForCausalLM.from_pretrained``. Either way our fp32
logits must agree with transformers' own forward in fp64 as closely as transformers' own fp32
forward does.

The reference. On a CPU without mamba_ssm / causal_conv1d transformers runs its pure-torch path
(``torch_forward``'s fallbacks in modeling_mamba2.py), which ``model.double()`` runs in fp64 except
where it casts on purpose: its RMSNorms and chunk scan compute in fp32 (``.to(torch.float32)``,
``.float()``), and ``Mamba2ForCausalLM`` returns fp32 logits, so the reference takes the fp64
backbone output through the fp64 lm_head itself. The tolerance is stated against a measured floor:
transformers' own fp32 forward's error against that reference (about 5e-7, mean |err| / mean
|ref|, some 8 fp32 unit roundoffs); ours may be at most ``FLOOR_FACTOR`` times it, and never more
than ``FP32_TOL``.

transformers' torch path normalises the gated RMSNorm over the whole SSM width whatever
``n_groups``; mamba_ssm (and this library) normalise each group on its own. The round trips run
n_groups=1, where the two agree; ``test_n_groups_above_one_differs_only_by_the_gated_norm`` shows
that with more groups the gated norm's grouping is the whole difference.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from aligned_mamba import Contract
from aligned_mamba.models import load_model
from aligned_mamba.models.mamba2 import make_tiny, save_checkpoint

transformers = pytest.importorskip("transformers")
modeling_mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")

SHAPE = dict(vocab_size=96, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=1,
             num_hidden_layers=2, conv_kernel=4, expand=2, chunk_size=16)
LENGTHS = (40, 17, 1)  # 40 tokens span three 16-token chunks: the inter-chunk recurrence is exercised
FLOOR_FACTOR = 4.0
FP32_TOL = 4e-6


def _sequences(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def _hf_model(dtype: torch.dtype, seed: int = 0, **overrides: int) -> torch.nn.Module:
    """transformers' random init, then every norm weight, conv bias and D moved off its constant
    init (ones / zeros), so that a dropped or misplaced one cannot agree by accident."""
    cfg = transformers.Mamba2Config(**{**SHAPE, **overrides}, use_cache=False)
    assert cfg.time_step_limit == (0.0, math.inf)  # the default, written as {"__float__": "Infinity"}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.Mamba2ForCausalLM(cfg).eval()
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", "norm_f.weight", "conv1d.bias", ".D")):
                    p.add_(0.2 * torch.rand(p.shape, generator=g) - 0.1)
    return model.to(dtype)


@torch.no_grad()
def _hf_logits(model: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor:
    """[len, vocab] in the model's dtype: the backbone, then its lm_head (``.logits`` is always fp32)."""
    hidden = model.backbone(seq[None]).last_hidden_state[0]
    return hidden @ model.lm_head.weight.T


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).abs().mean() / ref.abs().mean()).item()


def _assert_close_to_reference(ours: list[torch.Tensor], hf: torch.nn.Module) -> None:
    """Our fp32 logits against transformers' fp64 forward, next to transformers' own fp32 floor."""
    ref_model, floor_model = copy.deepcopy(hf).double(), copy.deepcopy(hf).float()
    for seq, got in zip(_sequences(hf.config.vocab_size), ours, strict=True):
        assert got.dtype == torch.float32 and got.shape == (seq.numel(), hf.config.vocab_size)
        ref = _hf_logits(ref_model, seq)
        floor = _rel(_hf_logits(floor_model, seq), ref)
        err = _rel(got, ref)
        assert err <= FLOOR_FACTOR * floor and err <= FP32_TOL, (
            f"{seq.numel()} tokens: ours {err:.3e} vs transformers' fp32 floor {floor:.3e}")


def _strict_json(text: str) -> dict:
    def refuse(name: str) -> None:
        raise AssertionError(f"config.json holds a bare {name}: not strict JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformers_save_pretrained_loads_with_its_logits(tmp_path: Path, dtype: str) -> None:
    hf = _hf_model(getattr(torch, dtype))
    hf.save_pretrained(tmp_path)  # safetensors, config.json as transformers writes it
    assert (tmp_path / "model.safetensors").is_file()
    raw = _strict_json((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["Mamba2ForCausalLM"] and raw["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    model = load_model(tmp_path)  # the checkpoint's own contract: its chunk size and stored dtype
    assert model.family == "mamba2" and model.config.dtype == dtype
    assert model.contract.model_dtype == dtype and model.contract.chunk_size == SHAPE["chunk_size"]
    assert model.config.time_step_limit == (0.0, math.inf)
    fp32 = Contract(chunk_size=SHAPE["chunk_size"], model_dtype="float32")
    ours = load_model(tmp_path, fp32, cast=dtype != "float32").forward(_sequences(SHAPE["vocab_size"]))
    # bf16 weights widen exactly, so transformers' fp32/fp64 copies hold the same values as ours
    _assert_close_to_reference(ours, hf)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_our_checkpoint_loads_in_transformers_with_our_logits(tmp_path: Path, dtype: str) -> None:
    config, tensors = make_tiny(3, dtype=dtype, **SHAPE)
    save_checkpoint(tmp_path, config, tensors)
    raw = _strict_json((tmp_path / "config.json").read_text())
    assert raw["torch_dtype"] == dtype
    hf, info = transformers.Mamba2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                              output_loading_info=True)
    assert {k: list(v) for k, v in info.items() if v} == {}  # no missing, unexpected or mismatched keys
    assert hf.config.time_step_limit[1] == math.inf and hf.config.chunk_size == SHAPE["chunk_size"]
    for name, t in tensors.items():  # transformers holds exactly our values (bf16 widened exactly)
        assert torch.equal(hf.state_dict()[name], t.float()), name
    fp32 = Contract(chunk_size=SHAPE["chunk_size"], model_dtype="float32")
    ours = load_model(tmp_path, fp32, cast=dtype != "float32").forward(_sequences(config.vocab_size))
    _assert_close_to_reference(ours, hf.eval())


def _grouped_gated_norm(groups: int):
    """transformers' MambaRMSNormGated.forward with the mean taken per group, as mamba_ssm's
    RMSNormGated(group_size=d_inner // ngroups) does (dtypes handled as transformers does)."""

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        if gate is not None:
            h = h * torch.nn.functional.silu(gate.to(torch.float32))
        h = h.unflatten(-1, (groups, -1))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.flatten(-2).to(dtype)

    return forward


def test_n_groups_above_one_differs_only_by_the_gated_norm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = _hf_model(torch.float32, n_groups=2)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path).forward(_sequences(SHAPE["vocab_size"]))
    ref = _hf_logits(copy.deepcopy(hf).double(), _sequences(SHAPE["vocab_size"])[0])
    assert _rel(ours[0], ref) > 1e-2  # transformers' torch path: one norm over both groups
    monkeypatch.setattr(modeling_mamba2.MambaRMSNormGated, "forward", _grouped_gated_norm(2))
    _assert_close_to_reference(ours, hf)
