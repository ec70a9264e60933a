"""Weight conversion between Megatron-Core's ``MambaModel`` state dict and the Hugging Face Mamba2 layout.

Trainers export weights to rollout workers (vLLM, the reference engine) in the HF safetensors layout and
import HF checkpoints to start training; both directions are pure renaming, so a round trip is exact
(the very same tensor objects, same dtype, nothing copied or cast).

Supported layout: megatron-core 0.16.x names of a pure Mamba2 ``MambaModel`` (every layer a Mamba layer)
at tensor/pipeline parallel size 1, i.e. what ``model.state_dict()`` returns on one rank of a TP=1, PP=1
run, unwrapped from DDP / Float16Module::

    embedding.word_embeddings.weight                 <-> backbone.embeddings.weight
    decoder.layers.{i}.norm.weight                   <-> backbone.layers.{i}.norm.weight
    decoder.layers.{i}.mixer.in_proj.layer_norm_weight -> backbone.layers.{i}.norm.weight  (Transformer Engine)
    decoder.layers.{i}.mixer.{in_proj.weight, in_proj.bias, conv1d.weight, conv1d.bias, A_log, D, dt_bias,
                              norm.weight, out_proj.weight, out_proj.bias}
                                                     <-> backbone.layers.{i}.mixer.<same>
    decoder.final_norm.weight                        <-> backbone.norm_f.weight
    output_layer.weight                              <-> lm_head.weight  (absent when embeddings are tied)

in_proj rows are [z | x | B | C | dt] in Megatron (TP=1) and [z, xBC, dt] in HF: the same order, so no
tensor is split or permuted. ``*._extra_state`` keys (Transformer Engine / fp8 metadata) are dropped on import
and never produced. The biases appear exactly when the config's ``use_bias`` / ``use_conv_bias`` say so.

Nemotron-H (``NemotronHConfig``, a hybrid ``MambaModel`` with ``hybrid_override_pattern`` of M, *, - and E
layers built from ``trainer_hooks.megatron.local_mamba_stack_spec``), per layer kind::

    M  decoder.layers.{i}.norm.weight (TE: mixer.in_proj.layer_norm_weight) <-> backbone.layers.{i}.norm.weight
       decoder.layers.{i}.mixer.<name>                                      <-> backbone.layers.{i}.mixer.<name>
    *  decoder.layers.{i}.input_layernorm.weight (TE: self_attention.linear_qkv.layer_norm_weight)
                                                                            <-> backbone.layers.{i}.norm.weight
       decoder.layers.{i}.self_attention.linear_qkv.weight                  <-> mixer.{q,k,v}_proj.weight
       decoder.layers.{i}.self_attention.linear_proj.weight                 <-> mixer.o_proj.weight
    -  decoder.layers.{i}.pre_mlp_layernorm.weight (TE: mlp.linear_fc1.layer_norm_weight)
                                                                            <-> backbone.layers.{i}.norm.weight
       decoder.layers.{i}.mlp.linear_fc1.{weight,bias}                      <-> mixer.up_proj.{weight,bias}
       decoder.layers.{i}.mlp.linear_fc2.{weight,bias}                      <-> mixer.down_proj.{weight,bias}
    E  decoder.layers.{i}.pre_mlp_layernorm.weight (both specs)             <-> backbone.layers.{i}.norm.weight
       decoder.layers.{i}.mlp.router.weight                                 <-> mixer.gate.weight
       decoder.layers.{i}.mlp.router.expert_bias                            <-> mixer.gate.e_score_correction_bias
       decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight   <-> mixer.experts.{e}.up_proj.weight
       decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight   <-> mixer.experts.{e}.down_proj.weight
       decoder.layers.{i}.mlp.shared_experts.linear_fc{1,2}.weight <-> mixer.shared_experts.{up,down}_proj.weight

and the embedding, final norm and output layer as above. linear_qkv's rows are grouped per key/value head
g (Megatron's layout, ``SelfAttention.get_query_key_value_tensors``): [q rows of the H/G query heads of g |
k_g | v_g] for g = 0 .. G-1, not q | k | v; the conversion splits and joins exactly those rows (new tensors,
the same bits), every other tensor is renamed (the same objects).

Refused with a one-line ``ModelLoadError`` naming the key (and both shapes where a shape is wrong): unknown
keys (hybrid attention/MLP layers, ``module.`` wrapper prefixes, layers beyond ``num_hidden_layers``),
missing keys, a layer norm given twice (both the plain and the TE-fused name), wrong shapes (including a
Megatron-padded vocabulary that the config does not state, and ``D`` per channel), tensor-parallel shards
(TP>1 shapes: merge the shards first), and a stored output layer / lm_head that differs from the embedding
while the config ties them (an identical copy is accepted and dropped, as ``load_checkpoint`` does).
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

# HF "backbone.layers.{i}.<rest>" <-> Megatron "decoder.layers.{i}.<rest>" for every per-layer tensor,
# except the layer norm when TE fuses it; the fixed names are mapped explicitly.
_HF_LAYER = re.compile(r"backbone\.layers\.(\d+)\.(.+)")
_FIXED_HF_TO_MEGATRON = {
    EMBEDDING: MEGATRON_EMBEDDING,
    "backbone.norm_f.weight": MEGATRON_FINAL_NORM,
    LM_HEAD: MEGATRON_OUTPUT,
}


def megatron_to_hf(state_dict: Mapping[str, Any], config: Mamba2Config | NemotronHConfig) -> dict[str, torch.Tensor]:
    """Rename a TP=1 Megatron-Core ``MambaModel`` state dict to the HF Mamba2 layout of ``config``
    (a ``NemotronHConfig``: to the Nemotron-H layout, ``hybrid_megatron_to_hf``).

    Accepts the layer norm under either ``decoder.layers.{i}.norm.weight`` or the Transformer Engine name
    ``decoder.layers.{i}.mixer.in_proj.layer_norm_weight``; drops ``*._extra_state`` keys. Returns the input
    tensor objects themselves (no copy, no cast) under HF names, in ``expected_shapes(config)`` order, so
    with tied embeddings there is no ``lm_head.weight``. Raises ``ModelLoadError`` (one line) for an
    unknown, missing, duplicated or mis-shaped key, or a tensor-parallel shard.
    """
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
    missing = [hf for hf in shapes if hf not in out]
    if missing:
        first = missing[0]
        raise ModelLoadError(
            f"Megatron state dict lacks {hf_to_mg[first]!r} (HF {first!r}, shape {list(shapes[first])})"
            + (f" and {len(missing) - 1} more key(s)" if len(missing) > 1 else "")
        )
    if tied_output is not None:
        _check_tied(MEGATRON_OUTPUT, tied_output, MEGATRON_EMBEDDING, out[EMBEDDING])
    return {hf: out[hf] for hf in shapes}


def hf_to_megatron(
    tensors: Mapping[str, Any], config: Mamba2Config | NemotronHConfig, *, te_fused_norm: bool = False
) -> dict[str, torch.Tensor]:
    """Rename HF Mamba2 tensors (the layout of ``expected_shapes(config)``) to a TP=1 Megatron-Core state dict
    (a ``NemotronHConfig``: Nemotron-H tensors, ``hybrid_hf_to_megatron``).

    ``te_fused_norm=True`` writes each layer norm as ``decoder.layers.{i}.mixer.in_proj.layer_norm_weight``
    (Transformer Engine specs) instead of ``decoder.layers.{i}.norm.weight``. No ``_extra_state`` keys are
    produced (load into the model with ``strict=False`` or let TE fill them). With tied embeddings there
    is no ``output_layer.weight``; an ``lm_head.weight`` equal to the embedding is accepted and dropped.
    Returns the input tensor objects themselves. Raises ``ModelLoadError`` (one line) for an unknown,
    missing or mis-shaped tensor.
    """
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
    missing = [hf for hf in shapes if hf not in tensors]
    if missing:
        first = missing[0]
        raise ModelLoadError(
            f"HF tensors lack {first!r} (Megatron {names[first]!r}, shape {list(shapes[first])})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    if lm_head is not None:
        _check_tied(LM_HEAD, lm_head, EMBEDDING, tensors[EMBEDDING])
    return {names[hf]: tensors[hf] for hf in shapes}


def export_hf_checkpoint(
    state_dict: Mapping[str, Any], config: Mamba2Config | NemotronHConfig, path: str | os.PathLike[str]
) -> None:
    """Write a Megatron-Core TP=1 ``MambaModel`` state dict as an HF Mamba2 checkpoint directory at ``path``.

    ``config.json`` comes from ``config`` and ``model.safetensors`` holds the renamed tensors in their own
    dtypes (via ``save_checkpoint``, so the result loads back with ``load_checkpoint``). Raises
    ``ModelLoadError`` for a key or shape problem, and also for what ``save_checkpoint`` refuses (fp16,
    other dtypes, non-finite values), so that callers handle one error type.
    """
    tensors = megatron_to_hf(state_dict, config)
    save = nemotron_h.save_checkpoint if isinstance(config, NemotronHConfig) else save_checkpoint
    try:
        save(path, config, tensors)
    except ValueError as exc:  # save_checkpoint's validation: dtype or finiteness, one line
        raise ModelLoadError(f"cannot export to {os.fspath(path)!r}: {exc}") from None


def import_hf_checkpoint(
    path: str | os.PathLike[str], *, te_fused_norm: bool = False
) -> tuple[Mamba2Config | NemotronHConfig, dict[str, torch.Tensor]]:
    """Load an HF Mamba2 or Nemotron-H checkpoint directory (strictly, via ``load_checkpoint``) as a TP=1
    Megatron state dict.

    Returns the config and the state dict (see ``hf_to_megatron`` for ``te_fused_norm``); the tensors keep
    the stored dtypes. Raises ``ModelLoadError``.
    """
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
                    "merge the shards first (megatron_shards.merge_megatron)")
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
    """Megatron's linear_qkv weight [G * (H/G + 2) * D, hidden] -> q [H*D, hidden], k, v [G*D, hidden]
    (new contiguous tensors, the same bits)."""
    G, rep, D = _qkv_groups(config)
    per_group = qkv.reshape(G, rep + 2, D, qkv.shape[-1])
    return tuple(part.reshape(-1, qkv.shape[-1]).clone(memory_format=torch.contiguous_format)  # type: ignore[return-value]
                 for part in (per_group[:, :rep], per_group[:, rep], per_group[:, rep + 1]))


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: NemotronHConfig) -> torch.Tensor:
    """HF q [H*D, hidden], k, v [G*D, hidden] -> Megatron's linear_qkv [G * (H/G + 2) * D, hidden], rows
    grouped per key/value head: [q of the group's query heads | k_g | v_g] (``split_qkv``'s inverse)."""
    G, rep, D = _qkv_groups(config)
    h = q.shape[-1]
    return torch.cat([q.reshape(G, rep * D, h), k.reshape(G, D, h), v.reshape(G, D, h)], dim=1).reshape(-1, h)


def hybrid_megatron_to_hf(state_dict: Mapping[str, Any], config: NemotronHConfig) -> dict[str, torch.Tensor]:
    """A TP=1 Megatron-Core hybrid ``MambaModel`` state dict -> Nemotron-H HF tensors (``nemotron_h.expected_shapes``
    order). Layer norms under the plain or the Transformer Engine name; ``*._extra_state`` dropped. Renamed
    tensors are the input objects; q/k/v are split from linear_qkv (``split_qkv``). Raises ``ModelLoadError``
    (one line) for an unknown, missing, duplicated or mis-shaped key, or a tensor-parallel shard."""
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
    """Nemotron-H HF tensors (``nemotron_h.expected_shapes(config)``) -> a TP=1 Megatron-Core hybrid ``MambaModel``
    state dict, in the model's layer order. ``te_fused_norm``: layer norms under the Transformer Engine names.
    Renamed tensors are the input objects; linear_qkv is joined from q/k/v (``join_qkv``). No ``_extra_state``
    keys. Raises ``ModelLoadError`` (one line) for an unknown, missing or mis-shaped tensor."""
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
