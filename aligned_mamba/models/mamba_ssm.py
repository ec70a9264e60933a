"""Mamba2 checkpoints as mamba_ssm publishes them (``MambaLMHeadModel``, e.g. state-spaces/mamba2-*).

config.json: ``d_model``, ``n_layer``, ``vocab_size``, ``ssm_cfg`` (the Mamba2 layer's kwargs) and
the LM's flags; weights ``pytorch_model.bin`` or safetensors, ``backbone.embedding.weight`` for the
embedding. The vocab is padded to ``pad_vocab_size_multiple``, as are the logits. The same weights
give the Hugging Face layout's logits bit for bit. Refused with one line: attention, MLP or Mamba1
layers, ``d_ssm``, ``rmsnorm: false``, ``norm_before_gate``, ``D_has_hdim``, LayerNorm models.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ModelLoadError
from ..layers.mamba2 import Mamba2MixerConfig
from . import checkpoint as ckpt
from .causal_lm import LMShape
from .family import Family
from .registry import register

EMBEDDING = "backbone.embedding.weight"
LM_HEAD = "lm_head.weight"
GATED_NORM_EPS = 1e-5  # mamba_ssm's Mamba2 builds its RMSNormGated with eps=1e-5

# ssm_cfg keys that decide tensor shapes
_SSM_SHAPE_KEYS = ("d_state", "d_conv", "expand", "headdim", "ngroups", "bias", "conv_bias")
# ssm_cfg keys that do not change the forward (initialisation, parallelism, kernel choice)
_SSM_IGNORED = ("conv_init", "A_init_range", "dt_min", "dt_max", "dt_init_floor", "use_mem_eff_path", "layer_idx",
                "process_group", "sequence_parallel", "device", "dtype")


@dataclass(frozen=True)
class MambaSSMConfig:
    """A pure-Mamba2 ``MambaLMHeadModel`` config; ``vocab_size`` unpadded (``padded_vocab``: the
    embedding's rows); ``dtype`` read off the weights (mamba_ssm's config.json states none)."""

    d_model: int
    n_layer: int
    vocab_size: int
    d_state: int = 128
    d_conv: int = 4
    expand: int = 2
    headdim: int = 64
    ngroups: int = 1
    chunk_size: int = 256
    bias: bool = False
    conv_bias: bool = True
    dt_limit: tuple[float, float] = (0.0, math.inf)
    norm_epsilon: float = 1e-5
    residual_in_fp32: bool = True
    fused_add_norm: bool = True
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True
    dtype: str = "float32"

    @property
    def padded_vocab(self) -> int:
        m = self.pad_vocab_size_multiple
        return self.vocab_size + (-self.vocab_size % m)

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    def mixer_config(self) -> Mamba2MixerConfig:
        return Mamba2MixerConfig(hidden_size=self.d_model, num_heads=self.d_inner // self.headdim,
                                 head_dim=self.headdim, state_size=self.d_state, n_groups=self.ngroups,
                                 conv_kernel=self.d_conv, use_bias=self.bias, use_conv_bias=self.conv_bias,
                                 norm_eps=GATED_NORM_EPS, dt_limit=self.dt_limit)

    def lm_shape(self) -> LMShape:
        return LMShape(vocab_size=self.padded_vocab, hidden_size=self.d_model, residual_in_fp32=self.residual_in_fp32,
                       tie_word_embeddings=self.tie_embeddings)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "config.json") -> MambaSSMConfig:
        """From a config.json dict; ModelLoadError (one line) for a key missing, malformed or not covered."""
        for key in ("d_model", "n_layer", "vocab_size"):
            if key not in d:
                raise ModelLoadError(f"{source}: missing {key!r} (a mamba_ssm config needs d_model, n_layer, "
                                     "vocab_size)")
        ssm = d.get("ssm_cfg") or {}
        if not isinstance(ssm, Mapping):
            raise ModelLoadError(f"{source}: ssm_cfg must be an object, found {type(ssm).__name__}")
        refusals = [
            (ssm.get("layer", "Mamba1") != "Mamba2", f"ssm_cfg.layer {ssm.get('layer', 'Mamba1')!r} (only Mamba2)"),
            (bool(d.get("attn_layer_idx")), f"attention layers at attn_layer_idx {d.get('attn_layer_idx')}"),
            (bool(d.get("d_intermediate", 0)), f"MLP blocks (d_intermediate {d.get('d_intermediate')})"),
            (ssm.get("d_ssm") is not None, f"a partial SSM width (ssm_cfg.d_ssm {ssm.get('d_ssm')})"),
            (not ssm.get("rmsnorm", True), "ssm_cfg.rmsnorm false (no gated norm)"),
            (bool(ssm.get("norm_before_gate", False)), "ssm_cfg.norm_before_gate true"),
            (bool(ssm.get("D_has_hdim", False)), "ssm_cfg.D_has_hdim true"),
            (not d.get("rms_norm", True), "rms_norm false (LayerNorm blocks)"),
            (bool(d.get("bidirectional", False)), "bidirectional models"),
        ]
        for refused, what in refusals:
            if refused:
                raise ModelLoadError(f"{source}: {what} is not covered")
        known = {f.name for f in dataclasses.fields(cls)} | {"layer", "d_ssm", "rmsnorm", "norm_before_gate",
                                                            "D_has_hdim"}
        unknown = sorted(k for k in ssm if k not in known and k not in _SSM_IGNORED)
        if unknown:
            raise ModelLoadError(f"{source}: ssm_cfg key(s) {unknown} are not understood; refused rather than ignored")
        kwargs: dict[str, Any] = {k: d[k] for k in ("d_model", "n_layer", "vocab_size", "norm_epsilon",
                                                     "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple",
                                                     "tie_embeddings") if k in d}
        kwargs.update({k: ssm[k] for k in ("d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size", "bias",
                                            "conv_bias") if k in ssm})
        if "dt_limit" in ssm:
            lim = ssm["dt_limit"]
            numbers = isinstance(lim, (list, tuple)) and len(lim) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in lim)
            if not numbers:
                raise ModelLoadError(f"{source}: ssm_cfg.dt_limit must be two numbers, found {lim!r}")
            kwargs["dt_limit"] = (float(lim[0]), float(lim[1]))
        try:
            config = cls(**kwargs)
            config.validate()
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: {exc}") from None
        return config

    def validate(self) -> None:
        for name in ("d_model", "n_layer", "vocab_size", "d_state", "d_conv", "expand", "headdim", "ngroups",
                     "chunk_size", "pad_vocab_size_multiple"):
            v = getattr(self, name)
            if type(v) is not int or v <= 0:
                raise ValueError(f"{name} must be a positive int, found {v!r}")
        for name in ("bias", "conv_bias", "residual_in_fp32", "fused_add_norm", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, found {getattr(self, name)!r}")
        if self.d_inner % self.headdim:
            raise ValueError(f"expand * d_model ({self.d_inner}) is not a multiple of headdim {self.headdim}")
        if (self.d_inner // self.headdim) % self.ngroups:
            raise ValueError(f"{self.d_inner // self.headdim} heads do not split into ngroups {self.ngroups}")
        lo, hi = self.dt_limit
        if math.isnan(lo) or math.isnan(hi) or lo > hi:
            raise ValueError(f"dt_limit must be (lo, hi) with lo <= hi, found {self.dt_limit}")

    def to_dict(self) -> dict[str, Any]:
        """The config.json dict mamba_ssm writes for this model."""
        ssm = {"layer": "Mamba2", "d_state": self.d_state, "d_conv": self.d_conv, "expand": self.expand,
               "headdim": self.headdim, "ngroups": self.ngroups, "chunk_size": self.chunk_size, "bias": self.bias,
               "conv_bias": self.conv_bias, "dt_limit": list(self.dt_limit)}
        return {"d_model": self.d_model, "d_intermediate": 0, "n_layer": self.n_layer, "vocab_size": self.vocab_size,
                "ssm_cfg": ssm, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
                "residual_in_fp32": self.residual_in_fp32, "fused_add_norm": self.fused_add_norm,
                "pad_vocab_size_multiple": self.pad_vocab_size_multiple, "tie_embeddings": self.tie_embeddings,
                "norm_epsilon": self.norm_epsilon}


def defaults_taken(d: Mapping[str, Any]) -> dict[str, Any]:
    """{key: mamba_ssm's default} for each shape-deciding key ``d`` lacks (``ssm_cfg.*`` for the layer's)."""
    defaults = {f.name: f.default for f in dataclasses.fields(MambaSSMConfig)}
    ssm = d.get("ssm_cfg") if isinstance(d.get("ssm_cfg"), Mapping) else {}
    out = {f"ssm_cfg.{k}": defaults[k] for k in _SSM_SHAPE_KEYS if k not in ssm}
    out.update({k: defaults[k] for k in ("pad_vocab_size_multiple", "tie_embeddings") if k not in d})
    return out


def save_checkpoint(path: str, config: MambaSSMConfig, tensors: Mapping[str, torch.Tensor], *,
                    weights_file: str = ckpt.TORCH_FILE) -> None:
    """Write config.json and ``weights_file`` (``pytorch_model.bin`` or safetensors) under ``path``, a
    tied lm_head stored too, as ``MambaLMHeadModel.save_pretrained`` does; ``ValueError`` (one line)
    for what ``load_checkpoint`` refuses."""
    tensors = dict(tensors)
    stored = {k: v for k, v in tensors.items() if k != LM_HEAD or not config.tie_embeddings}
    origin = {k: "tensors" for k in tensors}
    ckpt.validate(expected_shapes(config), stored, origin, ValueError)
    ckpt.storage_dtype(stored, origin, FAMILY.free_dtype, ValueError)  # one dtype, as load_checkpoint asks
    if config.tie_embeddings:
        tensors[LM_HEAD] = tensors[EMBEDDING]
    ckpt.save_files(path, config.to_dict(), tensors, weights_file=weights_file)


def from_hf(config: Any, tensors: Mapping[str, torch.Tensor]) -> tuple[MambaSSMConfig, dict[str, torch.Tensor]]:
    """A Hugging Face-layout Mamba2 renamed to this layout, the same tensors (padding 8, or 1 where the
    vocab is no multiple of 8); ValueError unless its eps is mamba_ssm's gated norm's."""
    pad = 8 if config.vocab_size % 8 == 0 else 1
    out = MambaSSMConfig(d_model=config.hidden_size, n_layer=config.num_hidden_layers, vocab_size=config.vocab_size,
                         d_state=config.state_size, d_conv=config.conv_kernel, expand=config.expand,
                         headdim=config.head_dim, ngroups=config.n_groups, chunk_size=config.chunk_size,
                         bias=config.use_bias, conv_bias=config.use_conv_bias, dt_limit=config.time_step_limit,
                         norm_epsilon=config.layer_norm_epsilon, residual_in_fp32=config.residual_in_fp32,
                         pad_vocab_size_multiple=pad, tie_embeddings=config.tie_word_embeddings, dtype=config.dtype)
    if config.layer_norm_epsilon != GATED_NORM_EPS:
        raise ValueError(f"layer_norm_epsilon {config.layer_norm_epsilon}: mamba_ssm's gated norm has eps "
                         f"{GATED_NORM_EPS}, so this model has no mamba_ssm layout")
    renamed = {("backbone.embedding.weight" if k == "backbone.embeddings.weight" else k): v for k, v in tensors.items()}
    return out, renamed


class MambaSSMFamily(Family):
    """mamba_ssm's ``MambaLMHeadModel`` layout: the base's Mamba2 stack, each block's mixer weights
    listed before its norm, as mamba_ssm orders them."""

    name = "mamba_ssm"
    config_type = MambaSSMConfig
    architectures = ("MambaLMHeadModel",)
    embedding = EMBEDDING
    head = LM_HEAD
    torch_bin = True
    tie_flag = "tie_embeddings"
    defaults_of = "mamba_ssm's"

    def matches(self, d: dict) -> bool:
        return "ssm_cfg" in d and "d_model" in d and "n_layer" in d

    def read_config(self, d: dict, source: str) -> MambaSSMConfig:
        return MambaSSMConfig.from_dict(d, source=source)

    def hf_dict(self, config: MambaSSMConfig) -> dict:
        return config.to_dict()

    def defaults_taken(self, d: Mapping[str, Any]) -> dict[str, Any]:
        return defaults_taken(d)

    def num_layers(self, config: MambaSSMConfig) -> int:
        return config.n_layer

    def norm_eps(self, config: MambaSSMConfig) -> float:
        return config.norm_epsilon

    def block_shapes(self, config: MambaSSMConfig, kind: str) -> dict[str, tuple[int, ...]]:
        mixer = {"mixer." + name: shape for name, shape in config.mixer_config().weight_shapes().items()}
        return {**mixer, "norm.weight": (config.d_model,)}


FAMILY = register(MambaSSMFamily())
expected_shapes = FAMILY.expected_shapes
build = FAMILY.build
