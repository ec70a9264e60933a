"""Megatron-Core ``MambaModel`` state dict (TP=1, PP=1, unwrapped) <-> Hugging Face Mamba2 / Nemotron-H tensors.

Trainers export weights to rollout workers in the HF layout and import HF checkpoints to start training. Every
tensor is renamed, the same object (no copy, no cast: a round trip is exact): ``decoder.layers.{i}.<rest>`` <->
``backbone.layers.{i}.<rest>`` and the fixed names; in_proj's rows are [z | x | B | C | dt] on both sides. The
exception is a hybrid attention layer's linear_qkv, its rows grouped per key/value head g ([q of g's query heads
| k_g | v_g], ``SelfAttention.get_query_key_value_tensors``): split into and joined from q, k, v (new tensors,
the same bits). The hybrid layers' names: ``_HYBRID_NORM``, ``_HYBRID_MIXER``, ``_MOE_NAMES``.

Layer norms are read under the plain or the Transformer Engine name (fused into the next linear);
``_extra_state`` keys are dropped and never produced. Refused in one line (``ModelLoadError``, naming the key
and both shapes): unknown, missing or doubled keys, wrong shapes (a TP shard, a padded vocabulary the config
does not state), and a stored output layer unequal to the tied embedding (an equal copy is dropped).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from aligned_mamba.errors import ModelLoadError
from aligned_mamba.models import load_checkpoint, nemotron_h
from aligned_mamba.models.mamba2 import EMBEDDING, LM_HEAD, Mamba2Config, expected_shapes, save_checkpoint
from aligned_mamba.models.nemotron_h import NemotronHConfig

__all__ = ["export_hf_checkpoint", "hf_to_megatron", "hybrid_hf_to_megatron", "hybrid_megatron_to_hf", "join_qkv",
           "import_hf_checkpoint", "megatron_names", "megatron_to_hf", "split_qkv"]

MEGATRON_EMBEDDING = "embedding.word_embeddings.weight"
MEGATRON_OUTPUT = "output_layer.weight"
MEGATRON_FINAL_NORM = "decoder.final_norm.weight"
EXTRA_STATE_SUFFIX = "_extra_state"
TE_NORM = "mixer.in_proj.layer_norm_weight"  # Transformer Engine fuses the pre-mixer norm into in_proj

_HF_LAYER = re.compile(r"backbone\.layers\.(\d+)\.(.+)")
_FIXED_HF_TO_MEGATRON = {
    EMBEDDING: MEGATRON_EMBEDDING,
    "backbone.norm_f.weight": MEGATRON_FINAL_NORM,
    LM_HEAD: MEGATRON_OUTPUT,
}


def megatron_to_hf(state_dict: Mapping[str, Any], config: Mamba2Config | NemotronHConfig) -> dict[str, torch.Tensor]:
    """A TP=1 Megatron state dict -> the input tensors under ``config``'s HF names, in ``expected_shapes`` order
    (tied: no ``lm_head.weight``); a ``NemotronHConfig`` goes to ``hybrid_megatron_to_hf``."""
    if isinstance(config, NemotronHConfig):
        return hybrid_megatron_to_hf(state_dict, config)
    shapes = expected_shapes(config)
    hf_to_mg = _name_map(config, te_fused_norm=False)
    mg_to_hf = {mg: hf for hf, mg in hf_to_mg.items()}
    for i in range(config.num_hidden_layers):  # the TE spelling of the same layer norm
        mg_to_hf[f"decoder.layers.{i}.{TE_NORM}"] = f"backbone.layers.{i}.norm.weight"
    tied_output: torch.Tensor | None = None
    out: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}  # HF name -> the Megatron key it came from, for messages
    for key, value in state_dict.items():
        if key.rsplit(".", 1)[-1] == EXTRA_STATE_SUFFIX:
            continue  # TE/fp8 bookkeeping (often a BytesIO or None), not a weight
        if key == MEGATRON_OUTPUT and config.tie_word_embeddings:
            tied_output = _tensor(key, value)  # checked against the embedding once that is known
            continue
        hf = mg_to_hf.get(key)
        if hf is None:
            raise ModelLoadError(f"unknown Megatron state-dict key {key!r}{_unknown_hint(key, config)}")
        if hf in out:
            raise ModelLoadError(
                f"Megatron state dict gives {hf!r} twice: as {source[hf]!r} and as {key!r}; keep only one"
            )
        tensor = _tensor(key, value)
        _check_shape(key, hf, tensor, shapes[hf], megatron_side=True)
        out[hf] = tensor
        source[hf] = key
    _refuse_missing([hf for hf in shapes if hf not in out], shapes,
                    lambda hf: f"Megatron state dict lacks {hf_to_mg[hf]!r} (HF {hf!r}")
    if tied_output is not None:
        _check_tied(MEGATRON_OUTPUT, tied_output, MEGATRON_EMBEDDING, out[EMBEDDING])
    return {hf: out[hf] for hf in shapes}


def _refuse_missing(missing: list[str], shapes: Mapping[str, Any], lacks: Any) -> None:
    """One line naming the first missing HF tensor (``lacks(hf)``: the line's start, up to its shape) and the count
    of the others."""
    if missing:
        first = missing[0]
        raise ModelLoadError(f"{lacks(first)}, shape {list(shapes[first])})"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))


def hf_to_megatron(
    tensors: Mapping[str, Any], config: Mamba2Config | NemotronHConfig, *, te_fused_norm: bool = False
) -> dict[str, torch.Tensor]:
    """HF tensors -> a TP=1 Megatron state dict of the same objects (``te_fused_norm``: layer norms under the TE
    names; no ``_extra_state``: load with ``strict=False``); a ``NemotronHConfig`` goes to ``hybrid_hf_to_megatron``."""
    if isinstance(config, NemotronHConfig):
        return hybrid_hf_to_megatron(tensors, config, te_fused_norm=te_fused_norm)
    shapes = expected_shapes(config)
    names = _name_map(config, te_fused_norm=te_fused_norm)
    lm_head: torch.Tensor | None = None
    for key, value in tensors.items():
        if key == LM_HEAD and config.tie_word_embeddings:
            lm_head = _tensor(key, value)
            continue
        if key not in shapes:
            raise ModelLoadError(f"unknown HF Mamba2 tensor {key!r} for this config{_unknown_hint(key, config)}")
        _check_shape(key, names[key], _tensor(key, value), shapes[key], megatron_side=False)
    _refuse_missing([hf for hf in shapes if hf not in tensors], shapes,
                    lambda hf: f"HF tensors lack {hf!r} (Megatron {names[hf]!r}")
    if lm_head is not None:
        _check_tied(LM_HEAD, lm_head, EMBEDDING, tensors[EMBEDDING])
    return {names[hf]: tensors[hf] for hf in shapes}


def export_hf_checkpoint(
    state_dict: Mapping[str, Any], config: Mamba2Config | NemotronHConfig, path: str | os.PathLike[str]
) -> None:
    """Write a TP=1 Megatron state dict as an HF checkpoint directory (``save_checkpoint``, the tensors' own dtypes);
    every refusal, ``save_checkpoint``'s too, is a ``ModelLoadError``."""
    tensors = megatron_to_hf(state_dict, config)
    save = nemotron_h.save_checkpoint if isinstance(config, NemotronHConfig) else save_checkpoint
    try:
        save(path, config, tensors)
    except ValueError as exc:  # save_checkpoint's validation: dtype or finiteness, one line
        raise ModelLoadError(f"cannot export to {os.fspath(path)!r}: {exc}") from None


def import_hf_checkpoint(
    path: str | os.PathLike[str], *, te_fused_norm: bool = False
) -> tuple[Mamba2Config | NemotronHConfig, dict[str, torch.Tensor]]:
    """An HF Mamba2 or Nemotron-H checkpoint directory (``load_checkpoint``) -> (config, TP=1 Megatron state dict),
    the stored dtypes kept."""
    config, tensors = load_checkpoint(path)
    if not isinstance(config, (Mamba2Config, NemotronHConfig)):
        raise ModelLoadError(f"{os.fspath(path)!r} is a {type(config).__name__} checkpoint; the Megatron conversion "
                             "covers the Hugging Face Mamba2 and Nemotron-H layouts")
    return config, hf_to_megatron(tensors, config, te_fused_norm=te_fused_norm)


def megatron_names(config: Mamba2Config | NemotronHConfig) -> dict[str, str]:
    """HF name -> the TP=1 Megatron state-dict name holding it (plain norm names), in HF order; q/k/v of a
    Nemotron-H attention layer all map to its linear_qkv."""
    if isinstance(config, NemotronHConfig):
        return {hf: mg for mg, hf_names in _hybrid_plan(config, te_fused_norm=False) for hf in hf_names}
    return _name_map(config, te_fused_norm=False)


def _name_map(config: Mamba2Config, *, te_fused_norm: bool) -> dict[str, str]:
    """HF name -> Megatron name for every tensor of ``expected_shapes(config)``, in that order."""
    names: dict[str, str] = {}
    for hf in expected_shapes(config):
        layer = _HF_LAYER.fullmatch(hf)
        if layer is None:
            names[hf] = _FIXED_HF_TO_MEGATRON[hf]
        elif te_fused_norm and layer.group(2) == "norm.weight":
            names[hf] = f"decoder.layers.{layer.group(1)}.{TE_NORM}"
        else:
            names[hf] = f"decoder.layers.{layer.group(1)}.{layer.group(2)}"
    return names


def _tensor(key: str, value: Any) -> torch.Tensor:
    """``value`` if it is a tensor, else a one-line ModelLoadError naming ``key``."""
    if not isinstance(value, torch.Tensor):
        raise ModelLoadError(f"{key!r} is a {type(value).__name__}, not a torch.Tensor")
    return value


def _check_shape(
    key: str, other: str, tensor: torch.Tensor, expected: tuple[int, ...], *, megatron_side: bool
) -> None:
    """Refuse a shape other than ``expected``, naming both keys and both shapes, with a hint when one is clear."""
    found = tuple(tensor.shape)
    if found == expected:
        return
    hint = ""
    if megatron_side:
        tp = _tp_factor(found, expected)
        if tp is not None:
            hint = (f"; this looks like one tensor-parallel shard (TP={tp}): only TP=1 state dicts are supported, "
                    "merge the shards first (trainer_hooks.megatron.shards.merge_megatron)")
        elif key in (MEGATRON_EMBEDDING, MEGATRON_OUTPUT) and len(found) == 2 and found[1] == expected[1] \
                and found[0] > expected[0]:
            hint = (f"; Megatron pads the vocabulary (--make-vocab-size-divisible-by): build the config with "
                    f"vocab_size={found[0]}")
    where = f"HF {other!r}" if megatron_side else f"Megatron {other!r}"
    raise ModelLoadError(f"tensor {key!r} ({where}): expected shape {list(expected)}, found {list(found)}{hint}")


def _tp_factor(found: tuple[int, ...], expected: tuple[int, ...]) -> int | None:
    """k > 1 when ``found`` is ``expected`` with exactly one dimension divided by k (a TP shard), else None."""
    if len(found) != len(expected):
        return None
    differing = [(f, e) for f, e in zip(found, expected) if f != e]
    if len(differing) != 1:
        return None
    f, e = differing[0]
    return e // f if 0 < f < e and e % f == 0 else None


def _check_tied(key: str, tensor: torch.Tensor, embedding_key: str, embedding: torch.Tensor) -> None:
    """With tied embeddings a stored output matrix is redundant; refuse it unless it equals the embedding."""
    if tuple(tensor.shape) != tuple(embedding.shape) or not torch.equal(tensor, embedding):
        raise ModelLoadError(
            f"{key!r} (shape {list(tensor.shape)}) differs from {embedding_key!r} (shape {list(embedding.shape)}) "
            "but tie_word_embeddings is true"
        )


def _unknown_hint(key: str, config: Mamba2Config) -> str:
    """A short reason for a common unknown key, or ''."""
    if key.startswith("module."):
        return "; unwrap DDP / Float16Module (the 'module.' prefix) before converting"
    layer = re.match(r"(?:decoder|backbone)\.layers\.(\d+)\.", key)
    if layer is not None and int(layer.group(1)) >= config.num_hidden_layers:
        return f"; the config has {config.num_hidden_layers} layer(s)"
    if key.endswith("layer_norm_bias"):
        return "; Mamba2 layer norms are RMSNorms without a bias"
    if key.endswith(".bias"):
        return f" (use_bias={config.use_bias}, use_conv_bias={config.use_conv_bias})"
    if layer is not None:
        return ("; a Mamba2Config has only Mamba2 layers (mixer + norm): hybrid attention/MLP layers convert with a "
                "NemotronHConfig")
    return ""


# -- Nemotron-H (hybrid MambaModel) --------------------------------------------------------------------------

_HYBRID_NORM = {nemotron_h.MAMBA: ("norm.weight", "mixer.in_proj.layer_norm_weight"),
                nemotron_h.ATTENTION: ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                nemotron_h.MLP_LAYER: ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
                # a MoE layer's norm is not fused into a linear in either spec (its router reads the normed row)
                nemotron_h.MOE: ("pre_mlp_layernorm.weight", "pre_mlp_layernorm.weight")}
_HYBRID_MIXER = {"o_proj.weight": "self_attention.linear_proj.weight", "up_proj.weight": "mlp.linear_fc1.weight",
                 "up_proj.bias": "mlp.linear_fc1.bias", "down_proj.weight": "mlp.linear_fc2.weight",
                 "down_proj.bias": "mlp.linear_fc2.bias"}
_QKV = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
_KIND_NAMES = {nemotron_h.MAMBA: "a Mamba2", nemotron_h.ATTENTION: "an attention", nemotron_h.MLP_LAYER: "an MLP",
               nemotron_h.MOE: "a MoE"}
# a MoE layer's HF mixer names -> Megatron's under the layer (MoELayer: TopKRouter, SequentialMLP, SharedExpertMLP)
_MOE_NAMES = ((re.compile(r"gate\.weight$"), "mlp.router.weight"),
              (re.compile(r"gate\.e_score_correction_bias$"), "mlp.router.expert_bias"),
              (re.compile(r"experts\.(\d+)\.up_proj\.(weight|bias)$"), r"mlp.experts.local_experts.\1.linear_fc1.\2"),
              (re.compile(r"experts\.(\d+)\.down_proj\.(weight|bias)$"), r"mlp.experts.local_experts.\1.linear_fc2.\2"),
              (re.compile(r"shared_experts\.up_proj\.(weight|bias)$"), r"mlp.shared_experts.linear_fc1.\1"),
              (re.compile(r"shared_experts\.down_proj\.(weight|bias)$"), r"mlp.shared_experts.linear_fc2.\1"))


def _moe_name(name: str) -> str:
    """The Megatron name (under the layer) of a MoE layer's HF mixer tensor ``name``."""
    for pattern, repl in _MOE_NAMES:
        if pattern.fullmatch(name):
            return pattern.sub(repl, name)
    raise ModelLoadError(f"MoE tensor {name!r} has no Megatron name (a latent projection: megatron-core 0.16 needs "
                         "Transformer Engine for it)")


def _hybrid_plan(config: NemotronHConfig, *, te_fused_norm: bool) -> list[tuple[str, tuple[str, ...]]]:
    """(Megatron name, the HF names it holds) for every tensor, in HF order: one HF name is a rename, three
    (q, k, v) are one linear_qkv."""
    plan: list[tuple[str, tuple[str, ...]]] = [(MEGATRON_EMBEDDING, (EMBEDDING,))]
    for i, kind in enumerate(config.hybrid_override_pattern):
        hf, mg = f"backbone.layers.{i}.", f"decoder.layers.{i}."
        plan.append((mg + _HYBRID_NORM[kind][te_fused_norm], (hf + "norm.weight",)))
        names = list(config.layer_shapes(kind))
        if kind == nemotron_h.ATTENTION:
            plan.append((mg + "self_attention.linear_qkv.weight", tuple(hf + "mixer." + n for n in _QKV)))
            names = [n for n in names if n not in _QKV]
        for n in names:
            mg_name = f"mixer.{n}" if kind == nemotron_h.MAMBA else _moe_name(n) if kind == nemotron_h.MOE \
                else _HYBRID_MIXER[n]
            plan.append((mg + mg_name, (hf + "mixer." + n,)))
    plan += [(MEGATRON_FINAL_NORM, ("backbone.norm_f.weight",)), (MEGATRON_OUTPUT, (nemotron_h.LM_HEAD,))]
    return plan


def _qkv_groups(config: NemotronHConfig) -> tuple[int, int, int]:
    """(G key/value heads, H/G query heads per group, head_dim D)."""
    c = config
    return c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads, c.head_dim


def _megatron_shape(config: NemotronHConfig, hf_names: tuple[str, ...]) -> tuple[int, ...]:
    shapes = nemotron_h.expected_shapes(config)
    if len(hf_names) == 1:
        return shapes[hf_names[0]]
    return (sum(shapes[n][0] for n in hf_names), config.hidden_size)


def split_qkv(qkv: torch.Tensor, config: NemotronHConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's linear_qkv [G * (H/G + 2) * D, hidden] -> q [H*D, hidden], k, v [G*D, hidden], new tensors."""
    G, rep, D = _qkv_groups(config)
    per_group = qkv.reshape(G, rep + 2, D, qkv.shape[-1])
    return tuple(part.reshape(-1, qkv.shape[-1]).clone(memory_format=torch.contiguous_format)  # type: ignore[return-value]
                 for part in (per_group[:, :rep], per_group[:, rep], per_group[:, rep + 1]))


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: NemotronHConfig) -> torch.Tensor:
    """HF q [H*D, hidden], k, v [G*D, hidden] -> linear_qkv [G * (H/G + 2) * D, hidden] (``split_qkv``'s inverse)."""
    G, rep, D = _qkv_groups(config)
    h = q.shape[-1]
    return torch.cat([q.reshape(G, rep * D, h), k.reshape(G, D, h), v.reshape(G, D, h)], dim=1).reshape(-1, h)


def hybrid_megatron_to_hf(state_dict: Mapping[str, Any], config: NemotronHConfig) -> dict[str, torch.Tensor]:
    """A TP=1 hybrid Megatron state dict -> Nemotron-H HF tensors in ``expected_shapes`` order (q, k, v split)."""
    plan = _hybrid_plan(config, te_fused_norm=False)
    by_mg = dict(plan)
    te_alias = {mg_te: mg for (mg_te, _), (mg, _) in zip(_hybrid_plan(config, te_fused_norm=True), plan)
                if mg_te != mg}
    got: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    for key, value in state_dict.items():
        if key.rsplit(".", 1)[-1] == EXTRA_STATE_SUFFIX:
            continue
        name = te_alias.get(key, key)
        hf_names = by_mg.get(name)
        if hf_names is None:
            raise ModelLoadError(f"unknown Megatron state-dict key {key!r}{_hybrid_hint(key, config)}")
        if name in got:
            raise ModelLoadError(f"Megatron state dict gives {hf_names[0]!r} twice: as {source[name]!r} and as "
                                 f"{key!r}; keep only one")
        tensor = _tensor(key, value)
        _check_shape(key, "/".join(hf_names), tensor, _megatron_shape(config, hf_names), megatron_side=True)
        got[name], source[name] = tensor, key
    missing = [(mg, hf) for mg, hf in plan if mg not in got]
    if missing:
        mg, hf = missing[0]
        raise ModelLoadError(f"Megatron state dict lacks {mg!r} (HF {'/'.join(hf)!r}, shape "
                             f"{list(_megatron_shape(config, hf))})"
                             + (f" and {len(missing) - 1} more key(s)" if len(missing) > 1 else ""))
    out: dict[str, torch.Tensor] = {}
    for mg, hf_names in plan:
        if len(hf_names) == 1:
            out[hf_names[0]] = got[mg]
        else:
            out.update(zip(hf_names, split_qkv(got[mg], config)))
    return out


def hybrid_hf_to_megatron(tensors: Mapping[str, Any], config: NemotronHConfig, *,
                          te_fused_norm: bool = False) -> dict[str, torch.Tensor]:
    """Nemotron-H HF tensors -> a TP=1 hybrid Megatron state dict in layer order (linear_qkv joined;
    ``te_fused_norm``: layer norms under the TE names)."""
    shapes = nemotron_h.expected_shapes(config)
    plan = _hybrid_plan(config, te_fused_norm=te_fused_norm)
    mg_of = {hf: mg for mg, hf_names in plan for hf in hf_names}
    for key, value in tensors.items():
        if key not in shapes:
            raise ModelLoadError(f"unknown HF Nemotron-H tensor {key!r} for this config{_hybrid_hint(key, config)}")
        _check_shape(key, mg_of[key], _tensor(key, value), shapes[key], megatron_side=False)
    missing = [hf for hf in shapes if hf not in tensors]
    if missing:
        first = missing[0]
        raise ModelLoadError(f"HF tensors lack {first!r} (Megatron {mg_of[first]!r}, shape {list(shapes[first])})"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    return {mg: tensors[hf_names[0]] if len(hf_names) == 1 else join_qkv(*(tensors[n] for n in hf_names), config)
            for mg, hf_names in plan}


def _hybrid_hint(key: str, config: NemotronHConfig) -> str:
    """A short reason for an unknown key of a hybrid state dict, or ''."""
    if key.startswith("module."):
        return "; unwrap DDP / Float16Module (the 'module.' prefix) before converting"
    layer = re.match(r"(?:decoder|backbone)\.layers\.(\d+)\.", key)
    pattern = config.hybrid_override_pattern
    if layer is None:
        return ""
    i = int(layer.group(1))
    if i >= len(pattern):
        return f"; the config has {len(pattern)} layer(s)"
    kind = pattern[i]
    return (f"; layer {i} is {_KIND_NAMES[kind]} layer ({kind!r} in hybrid_override_pattern {pattern!r}; "
            f"use_bias={config.use_bias}, mlp_bias={config.mlp_bias}, use_conv_bias={config.use_conv_bias})")
