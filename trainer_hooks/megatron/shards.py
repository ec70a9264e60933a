"""Tensor-parallel shards of a Megatron-Core ``MambaModel`` state dict: a TP=1 state dict cut per rank exactly
as megatron-core 0.16.1 shards its modules at TP k, and the shards merged back.

What rank r of k holds (``_layout``)::

    embedding, output_layer     rows r*V/k .. (r+1)*V/k (the vocabulary shard)
    mixer.in_proj / conv1d      [z_r | x_r | B_r | C_r | dt_r] / [x_r | B_r | C_r]: each part cut in k and the
                                rank's pieces stacked (as MambaMixer.sharded_state_dict), not a contiguous block
    A_log, D, dt_bias, norm     the rank's heads / d_inner channels
    out_proj, linear_proj, fc2  columns: the rank's channels / query heads
    linear_qkv, fc1             rows (linear_qkv's grouped per key/value group: [q_g | k_g | v_g])
    MoE experts, shared expert  fc1 rows, fc2 columns (expert tensor parallelism at k, no expert parallelism)
    replicated                  the layer and final norms, out_proj / fc2 biases (added after the sum), the
                                MoE router and its expert bias

Refused in one line (``ModelLoadError``): a k not dividing the Mamba heads or groups (Megatron asserts it), the
vocabulary, the attention heads, the MLP or an expert's width. Merging checks the replicated tensors agree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from aligned_mamba.errors import ModelLoadError
from aligned_mamba.models import nemotron_h
from aligned_mamba.models.mamba2 import Mamba2Config
from aligned_mamba.models.nemotron_h import NemotronHConfig

from .weights import MEGATRON_EMBEDDING, MEGATRON_OUTPUT, hf_to_megatron

__all__ = ["hf_to_megatron_shard", "merge_megatron", "shard_megatron", "tp_problems"]

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# a MoE layer's experts (expert tensor parallel size = TP): each expert an MLP over the rank's channels
_EXPERT_FC1 = re.compile(r"mlp\.(experts\.local_experts\.\d+|shared_experts)\.linear_fc1\.(weight|bias)")
_EXPERT_FC2 = re.compile(r"mlp\.(experts\.local_experts\.\d+|shared_experts)\.linear_fc2\.weight")
_COLUMNS = "columns"  # dim 1 cut in k
_ROWS = "rows"  # dim 0 cut in k
_REPLICATED = "replicated"


def _mamba_shapes(config: Mamba2Config | NemotronHConfig) -> tuple[int, int, int, int]:
    """(heads H, head dim P, groups G, state N) of the Mamba2 layers."""
    if isinstance(config, NemotronHConfig):
        return config.mamba_num_heads, config.mamba_head_dim, config.n_groups, config.ssm_state_size
    return config.num_heads, config.head_dim, config.n_groups, config.state_size


def tp_problems(config: Mamba2Config | NemotronHConfig, size: int) -> list[str]:
    """What keeps ``config`` from being sharded as Megatron shards it at TP ``size`` (empty: nothing)."""
    if size < 1:
        return [f"tensor parallel size {size} (must be >= 1)"]
    if size == 1:
        return []
    H, _, G, _ = _mamba_shapes(config)
    out = []
    if config.vocab_size % size:
        out.append(f"vocab_size {config.vocab_size} is not a multiple of TP {size} (Megatron pads it: "
                   "--make-vocab-size-divisible-by)")
    pattern = config.hybrid_override_pattern if isinstance(config, NemotronHConfig) else nemotron_h.MAMBA
    if nemotron_h.MAMBA in pattern:
        if H % size:
            out.append(f"{H} Mamba heads are not a multiple of TP {size}")
        if G % size:
            out.append(f"n_groups {G} is not a multiple of TP {size} (Megatron's MambaMixer gives each rank whole "
                       "groups)")
    if isinstance(config, NemotronHConfig):
        if nemotron_h.ATTENTION in pattern and (config.num_attention_heads % size or
                                                config.num_key_value_heads % size):
            out.append(f"{config.num_attention_heads} query / {config.num_key_value_heads} key-value heads are not "
                       f"multiples of TP {size}")
        if nemotron_h.MLP_LAYER in pattern and config.intermediate_size % size:
            out.append(f"MLP width {config.intermediate_size} is not a multiple of TP {size}")
        if nemotron_h.MOE in pattern:
            for what, width in (("MoE expert width", config.moe_intermediate_size),
                                ("MoE shared expert width", config.moe_shared_expert_intermediate_size)):
                if width % size:
                    out.append(f"{what} {width} is not a multiple of TP {size}")
    return out


def _refuse(config: Mamba2Config | NemotronHConfig, size: int) -> None:
    problems = tp_problems(config, size)
    if problems:
        raise ModelLoadError(f"cannot shard for tensor parallel size {size}: " + "; ".join(problems))


def _layout(name: str, config: Mamba2Config | NemotronHConfig) -> tuple[str, tuple[int, ...] | None]:
    """How a TP=1 tensor is cut: (rows / columns / replicated, the sizes of its parts along that dim, each cut
    in k on its own; None: one part)."""
    if name in (MEGATRON_EMBEDDING, MEGATRON_OUTPUT):
        return _ROWS, None
    layer = _LAYER.fullmatch(name)
    if layer is None:
        return _REPLICATED, None  # the final norm
    rest = layer.group(2)
    H, P, G, N = _mamba_shapes(config)
    if rest in ("mixer.in_proj.weight", "mixer.in_proj.bias"):
        return _ROWS, (H * P, H * P, G * N, G * N, H)
    if rest in ("mixer.conv1d.weight", "mixer.conv1d.bias"):
        return _ROWS, (H * P, G * N, G * N)
    if rest in ("mixer.A_log", "mixer.D", "mixer.dt_bias", "mixer.norm.weight", "self_attention.linear_qkv.weight",
                "mlp.linear_fc1.weight", "mlp.linear_fc1.bias") or _EXPERT_FC1.fullmatch(rest):
        return _ROWS, None
    if rest in ("mixer.out_proj.weight", "self_attention.linear_proj.weight", "mlp.linear_fc2.weight") \
            or _EXPERT_FC2.fullmatch(rest):
        return _COLUMNS, None
    return _REPLICATED, None  # layer norms, out_proj / fc2 biases (added once, after the reduction)


def _pieces(tensor: torch.Tensor, dim: int, parts: tuple[int, ...] | None) -> list[torch.Tensor]:
    return list(torch.split(tensor, list(parts), dim=dim)) if parts else [tensor]


def shard_megatron(state_dict: Mapping[str, torch.Tensor], config: Mamba2Config | NemotronHConfig, rank: int,
                   size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of a TP=1 state dict at TP ``size``, the same keys in order: new contiguous tensors
    with the TP=1 bits (size 1: the input objects). ``ModelLoadError`` where Megatron cannot shard ``config``."""
    _refuse(config, size)
    if not 0 <= rank < size:
        raise ModelLoadError(f"rank {rank} is not in a tensor-parallel group of size {size}")
    if size == 1:
        return dict(state_dict)
    out = {}
    for name, tensor in state_dict.items():
        how, parts = _layout(name, config)
        if how == _REPLICATED:
            out[name] = tensor.clone()
            continue
        dim = 0 if how == _ROWS else 1
        mine = []
        for piece in _pieces(tensor, dim, parts):
            if piece.shape[dim] % size:
                raise ModelLoadError(f"{name!r}: dim {dim} part of {piece.shape[dim]} does not split in {size}")
            mine.append(piece.chunk(size, dim=dim)[rank])
        out[name] = torch.cat(mine, dim=dim).contiguous()
    return out


def merge_megatron(shards: Sequence[Mapping[str, torch.Tensor]], config: Mamba2Config | NemotronHConfig
                   ) -> dict[str, torch.Tensor]:
    """The TP=1 state dict of ``shards`` in rank order (``shard_megatron``'s inverse); ``ModelLoadError`` when the
    ranks' keys or a replicated tensor differ."""
    size = len(shards)
    _refuse(config, size)
    if size == 1:
        return dict(shards[0])
    keys = list(shards[0])
    for r, shard in enumerate(shards[1:], 1):
        if list(shard) != keys:
            raise ModelLoadError(f"rank {r}'s state dict has other keys than rank 0's "
                                 f"({sorted(set(shard) ^ set(keys))[:3]})")
    out = {}
    for name in keys:
        how, parts = _layout(name, config)
        tensors = [s[name] for s in shards]
        if how == _REPLICATED:
            if any(not torch.equal(t, tensors[0]) or t.dtype != tensors[0].dtype for t in tensors[1:]):
                raise ModelLoadError(f"{name!r} is replicated across tensor-parallel ranks but the ranks hold "
                                     "different values")
            out[name] = tensors[0]
            continue
        dim = 0 if how == _ROWS else 1
        local = tuple(p // size for p in parts) if parts else None
        want = sum(local) if local else tensors[0].shape[dim]
        if any(t.dim() <= dim or t.shape[dim] != want for t in tensors):
            raise ModelLoadError(f"{name!r}: the ranks' shards {[list(t.shape) for t in tensors]} are not {size} "
                                 f"shards of one tensor (dim {dim} of {want} each)")
        split = [_pieces(t, dim, local) for t in tensors]
        out[name] = torch.cat([torch.cat([s[i] for s in split], dim=dim) for i in range(len(split[0]))], dim=dim)
    return out


def hf_to_megatron_shard(tensors: Mapping[str, torch.Tensor], config: Mamba2Config | NemotronHConfig, rank: int,
                         size: int) -> dict[str, torch.Tensor]:
    """HF Mamba2 / Nemotron-H tensors -> rank ``rank``'s Megatron state dict at TP ``size``
    (``hf_to_megatron``, then ``shard_megatron``)."""
    _refuse(config, size)
    return shard_megatron(hf_to_megatron(tensors, config), config, rank, size)
