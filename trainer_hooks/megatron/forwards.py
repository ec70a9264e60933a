"""The aligned forwards: a Megatron module's ``forward`` over its own parameters by the core's layer and the
contract's ops, so the rows are the sampler's bits (``patch`` says where each goes)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from aligned_mamba.errors import ModelLoadError
from aligned_mamba.layers.attention import Attention, AttentionConfig
from aligned_mamba.layers.mamba2 import Mamba2Mixer, Mamba2MixerConfig
from aligned_mamba.layers.mlp import MLP as CoreMLP
from aligned_mamba.layers.mlp import MLPConfig
from aligned_mamba.layers.moe import MoE as CoreMoE
from aligned_mamba.layers.moe import MoEConfig
from aligned_mamba.ops.linear.sliced import row_parallel_linear, row_parallel_weight
from aligned_mamba.parallel import TPGroup, gather_rows

from .current import hook_for
from .norms import aligned_rms_norm
from .refusals import AlignmentRefused

if TYPE_CHECKING:
    from .hook import AlignedMambaHook


def embedding_forward(self: Any, input_: torch.Tensor) -> torch.Tensor:
    """VocabParallelEmbedding: ids [...] -> rows [..., hidden] in the model dtype. At TP k the ranks' offers are
    all-gathered and the owner's kept, a choice (Megatron's all-reduce of a row and zeros turns -0.0 into +0.0)."""
    hook = hook_for(self)
    tp = hook.tp(self)
    if tp is None:
        return torch.nn.functional.embedding(input_, self.weight).to(hook.dtype)
    v = self.weight.shape[0]
    local = (input_ - self.vocab_start_index).clamp(0, v - 1)
    offers = tp.all_gather(torch.nn.functional.embedding(local, self.weight).to(hook.dtype))  # [k, ..., hidden]
    owner = torch.div(input_, v, rounding_mode="floor").clamp(0, tp.size - 1)
    index = owner.unsqueeze(0).unsqueeze(-1).expand(1, *input_.shape, offers.shape[-1])
    rows = offers.gather(0, index).squeeze(0)
    if getattr(self, "reduce_scatter_embeddings", False):
        # sequence parallel: [b, s, h] -> this rank's rows of [s, b, h], as Megatron's reduce-scatter gives them
        return hook.layer_output(rows.transpose(0, 1).contiguous(), self)
    return rows


def linear_forward(self: Any, input_: torch.Tensor, weight: torch.Tensor | None = None,
                   runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Column/RowParallelLinear on the backend's row-invariant linear: [..., in] -> ([..., out], bias or None).
    At TP k a column-parallel layer computes its columns (all-gathered where asked); a row-parallel one is the
    contract's sliced tree (``ops.linear.sliced``), the same bits at every TP degree dividing S."""
    hook = hook_for(self)
    backend = hook.backend(input_.device)
    tp = hook.tp(self)
    row_parallel = type(self).__name__ == "RowParallelLinear"
    sequence_parallel = hook.sequence_group(self) is not None
    if sequence_parallel and not row_parallel:
        input_ = hook.layer_input(input_, self)  # the ranks' sequence rows gathered (e.g. into the output layer)
    w = self.weight if weight is None else weight
    if getattr(self, "_aligned_mamba_round_weight", False):
        w = w.to(hook.dtype)
    bias = getattr(self, "bias", None)
    skip = getattr(self, "skip_bias_add", False)
    shape = input_.shape
    x = input_.reshape(-1, shape[-1])
    if row_parallel and (tp is not None or hook.slices > 1):
        # the backend's fused subtree (one launch per rank) where it has one, else its partial GEMM per slice
        fused = backend.linear_tree is not None
        ws = row_parallel_weight(backend, backend.linear_weight(w) if fused else w, lambda: w, hook.slices,
                                 1 if tp is None else tp.size)
        out = row_parallel_linear(x, ws, None if skip else bias, slices=hook.slices, group=tp or TPGroup.single(),
                                  partial=backend.linear_partial, tree=backend.linear_tree)
        out = out.reshape(*shape[:-1], w.shape[0])
        return (hook.layer_output(out, self) if sequence_parallel else out), (bias if skip else None)
    if not sequence_parallel:
        x = hook.replicated_input(x, self)
    out = backend.linear(x, backend.linear_weight(w), None if skip else bias)
    gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
    if not row_parallel and tp is not None and gather:
        out = tp.all_gather(out).permute(1, 0, 2).reshape(out.shape[0], -1)  # [M, k * N / k], rank order
        return out.reshape(*shape[:-1], out.shape[-1]), (bias if skip else None)
    return out.reshape(*shape[:-1], w.shape[0]), (bias if skip else None)


def torch_rms_norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """torch.nn.RMSNorm (WrappedTorchNorm) on the backend's op, in the model dtype."""
    hook = hook_for(self)
    return aligned_rms_norm(hook.backend(x.device), x, self.weight, self.eps, hook.dtype)


def mamba_layer_forward(self: Any, hidden_states: torch.Tensor, attention_mask: Any = None,
                        inference_context: Any = None, rotary_pos_emb: Any = None, *, inference_params: Any = None,
                        packed_seq_params: Any = None) -> torch.Tensor:
    """MambaLayer.forward as the core computes it: hidden_states [s, b, h] -> [s, b, h], the norm over the
    residual as kept (fp32 with residual_in_fp32, not rounded first). The norm and the add read one [s * b, h]
    view, so autograd adds the norm's gradient terms in the core's order (why: docs/design.md, "How the bits
    are kept")."""
    context = inference_context if inference_context is not None else inference_params
    s, b, h = hidden_states.shape
    stream = hidden_states.reshape(s * b, h)
    residual = stream.to(torch.float32) if self.residual_in_fp32 else stream
    out, bias = self.mixer(self.norm(stream).view(s, b, h), inference_context=context,
                           packed_seq_params=packed_seq_params)
    with self.bias_dropout_add_exec_handler():
        y = self.mamba_bda(training=self.training, fused=self.config.bias_dropout_fusion)(
            (out.reshape(s * b, h), bias), residual, self.hidden_dropout)
    return y.view(s, b, h)


def core_mixer(m: Any, hook: AlignedMambaHook, device: torch.device) -> Mamba2Mixer:
    """The core's Mamba2 layer over a MambaMixer's own parameters, rebuilt per forward (the optimizer moves them)."""
    config = Mamba2MixerConfig(hidden_size=m.d_model, num_heads=m.nheads, head_dim=m.headdim, state_size=m.d_state,
                               n_groups=m.ngroups, conv_kernel=m.d_conv, use_bias=False,
                               use_conv_bias=m.conv1d.bias is not None, norm_eps=m.norm.eps, dt_limit=(0.0, math.inf))
    names = {"in_proj.weight": m.in_proj.weight, "conv1d.weight": m.conv1d.weight, "dt_bias": m.dt_bias,
             "A_log": m.A_log, "D": m.D, "norm.weight": m.norm.weight, "out_proj.weight": m.out_proj.weight}
    if m.conv1d.bias is not None:
        names["conv1d.bias"] = m.conv1d.bias
    # the config is the whole mixer's; at TP k the parameters are this rank's heads and groups, as shard_weights cuts
    return Mamba2Mixer(config, names, "", backend=hook.backend(device), dtype=hook.dtype,
                       chunk_size=hook.contract.chunk_size, tp=hook.tp(m), slices=hook.slices)


def _sequences(hidden_states: torch.Tensor, packed_seq_params: Any) -> tuple[list[int], torch.Tensor]:
    """A layer input's sequences: [s, b, d] (a sequence per batch row) or THD [T, 1, d] cut at
    ``cu_seqlens_q(_padded)`` -> (their lengths, the rows [sum lens, d] in that order)."""
    s, b, d = hidden_states.shape
    if packed_seq_params is None:
        return [s] * b, hidden_states.transpose(0, 1).reshape(b * s, d)
    if b != 1:
        raise AlignmentRefused(f"packed sequences (THD) need micro-batch size 1, got {b}")
    fmt = getattr(packed_seq_params, "qkv_format", "thd")
    if fmt != "thd":
        raise AlignmentRefused(f"packed_seq_params.qkv_format {fmt!r}: only 'thd' is covered")
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    bounds = [int(v) for v in cu.tolist()]
    if bounds[0] != 0 or any(a > c for a, c in zip(bounds, bounds[1:])) or bounds[-1] > s:
        raise AlignmentRefused(f"cu_seqlens {bounds[:8]}... are not offsets into {s} packed tokens")
    if bounds[-1] < s:  # tokens past the last offset form one more sequence (as Megatron's seq_idx does)
        bounds.append(s)
    return [c - a for a, c in zip(bounds, bounds[1:]) if c > a], hidden_states[:, 0]  # empty ones own no rows


def _layer_output(y: torch.Tensor, hidden_states: torch.Tensor, packed: bool, config: Any) -> torch.Tensor:
    """Rows [sum lens, d] (model dtype) back in the input's layout ([s, b, d], or THD [T, 1, d])."""
    if config.fp32_residual_connection:
        # Megatron's bias-dropout-add casts the residual to the output's dtype: an fp32 output keeps the fp32 add
        y = y.to(torch.float32)
    if packed:
        return y[:, None]
    s, b, d = hidden_states.shape
    return y.reshape(b, s, d).transpose(0, 1)


def mixer_forward(self: Any, hidden_states: torch.Tensor, inference_context: Any = None, *,
                  inference_params: Any = None, packed_seq_params: Any = None
                           ) -> tuple[torch.Tensor, None]:
    """MambaMixer.forward under the hook: [s, b, d_model] (or THD [T, 1, d_model]) -> ([s, b, d_model] in the
    model dtype, fp32 with ``fp32_residual_connection``; None) by ``Mamba2Mixer.advance`` from empty states,
    each sequence's chunk grid at its own first token."""
    hook = hook_for(self)
    if inference_context is not None or inference_params is not None:
        raise AlignmentRefused("Megatron inference (an inference context) with --aligned-mamba: sampling runs in the "
                               "aligned engine (reference or the vLLM plugin), not in Megatron")
    if self.chunk_size != hook.contract.chunk_size:
        raise AlignmentRefused(f"MambaMixer chunk_size={self.chunk_size} but the contract says chunk_size="
                               f"{hook.contract.chunk_size}")
    whole = hook.layer_input(hidden_states, self)
    lens, hidden = _sequences(whole, packed_seq_params)
    mixer = core_mixer(self, hook, hidden.device)
    state = mixer.state(mixer.state_spec().allocate(len(lens), hidden.device))
    y = mixer.advance(state, hook.batch_for(lens), hidden.to(hook.dtype))
    return hook.layer_output(_layer_output(y, whole, packed_seq_params is not None, self.config), self), None


def core_attention(m: Any, hook: AlignedMambaHook, device: torch.device) -> Attention:
    """The core's attention layer over a SelfAttention's own parameters, rebuilt per forward; linear_qkv's
    per-group rows [q heads | k | v] are cut by differentiable views, so gradients reach linear_qkv."""
    H, G, D = m.num_attention_heads_per_partition, m.num_query_groups_per_partition, m.hidden_size_per_attention_head
    rep = H // G
    w = m.linear_qkv.weight
    per_group = w.view(G, rep + 2, D, w.shape[-1])
    names = {"q_proj.weight": per_group[:, :rep].reshape(H * D, -1),
             "k_proj.weight": per_group[:, rep].reshape(G * D, -1),
             "v_proj.weight": per_group[:, rep + 1].reshape(G * D, -1), "o_proj.weight": m.linear_proj.weight}
    tp = hook.tp(m)
    k = 1 if tp is None else tp.size  # the config is the whole layer's; the weights this rank's heads
    config = AttentionConfig(hidden_size=w.shape[-1], num_heads=H * k, num_kv_heads=G * k, head_dim=D)
    try:
        return Attention(config, names, "", backend=hook.backend(device), dtype=hook.dtype, tp=tp,
                         slices=hook.slices)
    except ModelLoadError as exc:  # e.g. attention on a CUDA device, not yet measured there
        raise AlignmentRefused(str(exc)) from None


def _refuse_uncausal_mask(mask: torch.Tensor | None, s: int) -> None:
    """Only a causal mask (or none) is covered: a padding or document mask changes which keys a row sees."""
    if mask is None:
        return
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype != torch.bool or mask.shape[-2:] != (s, s) or mask.dim() != 4 or \
            not bool((mask == causal).all()):
        raise AlignmentRefused(f"attention_mask {tuple(mask.shape)} {mask.dtype} is not the causal mask: padding or "
                               "document masks are not covered (pack sequences with packed_seq_params instead)")


def attention_forward(self: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      key_value_states: torch.Tensor | None = None, inference_context: Any = None,
                      rotary_pos_emb: Any = None, rotary_pos_cos: Any = None, rotary_pos_sin: Any = None,
                      rotary_pos_cos_sin: Any = None, attention_bias: Any = None,
                      packed_seq_params: Any = None, sequence_len_offset: Any = None, *,
                      inference_params: Any = None) -> tuple[torch.Tensor, None]:
    """SelfAttention.forward under the hook: [s, b, hidden] (or THD [T, 1, hidden]) -> ([s, b, hidden] in the
    model dtype, fp32 with ``fp32_residual_connection``; None) by ``Attention.advance`` from empty states,
    each row over its own sequence's positions 0..t, as the sampler computes it."""
    hook = hook_for(self)
    if inference_context is not None or inference_params is not None:
        raise AlignmentRefused("Megatron inference (an inference context) with --aligned-mamba: sampling runs in the "
                               "aligned engine (reference or the vLLM plugin), not in Megatron")
    extra = {"rotary embeddings (rotary_pos_emb)": rotary_pos_emb is not None or rotary_pos_cos is not None
             or rotary_pos_sin is not None or rotary_pos_cos_sin is not None,
             "an attention bias": attention_bias is not None, "cross-attention": key_value_states is not None,
             "a sequence_len_offset (inference)": sequence_len_offset is not None}
    given = [name for name, on in extra.items() if on]
    if given:
        raise AlignmentRefused(f"attention with {', '.join(given)} is not covered by --aligned-mamba")
    whole = hook.layer_input(hidden_states, self)
    _refuse_uncausal_mask(attention_mask, whole.shape[0])
    lens, hidden = _sequences(whole, packed_seq_params)
    layer = core_attention(self, hook, hidden.device)
    state = layer.state(layer.state_spec().allocate(len(lens), hidden.device, max([1, *lens])))
    y = layer.advance(state, hook.batch_for(lens), hidden.to(hook.dtype))
    return hook.layer_output(_layer_output(y, whole, packed_seq_params is not None, self.config), self), None


def mlp_forward(self: Any, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None,
                **unused: Any) -> tuple[torch.Tensor, None]:
    """MLP.forward under the hook: [..., hidden] -> ([..., hidden] in the model dtype, fp32 with
    ``fp32_residual_connection``; None) by the core's squared-ReLU MLP."""
    hook = hook_for(self)
    if per_token_scale is not None:
        raise AlignmentRefused("MLP with per_token_scale (MoE expert scaling) is not covered by --aligned-mamba")
    whole = hook.layer_input(hidden_states, self)
    shape = whole.shape
    w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
    tp = hook.tp(self)
    k = 1 if tp is None else tp.size  # the config is the whole MLP's; the weights this rank's channels
    mlp = CoreMLP(MLPConfig(hidden_size=w1.shape[1], intermediate_size=w1.shape[0] * k),
                  {"up_proj.weight": w1, "down_proj.weight": w2}, "", backend=hook.backend(hidden_states.device),
                  dtype=hook.dtype, tp=tp, slices=hook.slices)
    y = mlp.advance(None, None, whole.reshape(-1, shape[-1]).to(hook.dtype)).reshape(shape)
    return hook.layer_output(y.to(torch.float32) if self.config.fp32_residual_connection else y, self), None


def core_moe(m: Any, hook: AlignedMambaHook, device: torch.device) -> CoreMoE:
    """The core's MoE layer over a MoELayer's own parameters (router, expert bias, experts, shared expert)."""
    cfg, r = m.config, m.router
    E, k = cfg.num_moe_experts, cfg.moe_router_topk
    bias = r.expert_bias if r.expert_bias is not None else torch.zeros(E, device=r.weight.device)
    tensors = {"gate.weight": r.weight, "gate.e_score_correction_bias": bias}
    for name, mlp in [*((f"experts.{e}.", x) for e, x in enumerate(m.experts.local_experts)),
                      ("shared_experts.", m.shared_experts)]:
        tensors[name + "up_proj.weight"] = mlp.linear_fc1.weight
        tensors[name + "down_proj.weight"] = mlp.linear_fc2.weight
    config = MoEConfig(hidden_size=cfg.hidden_size, n_routed_experts=E, num_experts_per_tok=k,
                       moe_intermediate_size=cfg.moe_ffn_hidden_size,
                       moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
                       n_group=cfg.moe_router_num_groups or 1, topk_group=cfg.moe_router_group_topk or 1,
                       norm_topk_prob=k > 1, routed_scaling_factor=cfg.moe_router_topk_scaling_factor or 1.0)
    # at TP k each expert's weights are the rank's channels (expert TP = TP: fc1's rows, fc2's columns), the
    # router whole; the experts' down projections take the contract's slices at every k
    tp = hook.tp(m.shared_experts)
    return CoreMoE(config, tensors, "", backend=hook.backend(device), dtype=hook.dtype, tp=tp, slices=hook.slices)


def moe_forward(self: Any, hidden_states: torch.Tensor, intermediate_tensors: Any = None,
                padding_mask: torch.Tensor | None = None, **unused: Any) -> tuple[torch.Tensor, None]:
    """MoELayer.forward under the hook: [..., hidden] -> ([..., hidden] in the model dtype, fp32 with
    ``fp32_residual_connection``; None). Training with the expert bias, the expert counts go into the router's
    ``local_tokens_per_expert``, as Megatron's router counts them for its bias update."""
    hook = hook_for(self)
    if intermediate_tensors is not None or padding_mask is not None:
        raise AlignmentRefused("MoE layer with intermediate tensors or a padding mask is not covered by "
                               "--aligned-mamba")
    moe = core_moe(self, hook, hidden_states.device)
    d = hidden_states.shape[-1]
    # the router, whole on every rank, routes the rows this rank holds (all of them, or its sequence-parallel
    # ones, whose routes are then gathered: the router's gradient is then this rank's part, as Megatron's is)
    local, weights = moe.route_rows(hidden_states.reshape(-1, d).to(hook.dtype))
    experts, group = local, hook.sequence_group(self)
    if group is not None:
        experts, weights = gather_rows(group, local, summed=False), gather_rows(group, weights, summed=False)
    # the experts see the whole x as a column-parallel layer does (their input gradients summed over the ranks)
    whole = hook.layer_input(hidden_states, self.shared_experts)
    x = whole.reshape(-1, d).to(hook.dtype)
    y = hook.layer_output(moe.experts_out(None, x, experts, weights).reshape(whole.shape), self)
    r = self.router
    if self.training and torch.is_grad_enabled() and getattr(r, "enable_expert_bias", False):
        with torch.no_grad():
            r.local_tokens_per_expert += torch.bincount(local.flatten(), minlength=moe.config.n_routed_experts).to(
                r.local_tokens_per_expert.dtype)
    return (y.to(torch.float32) if self.config.fp32_residual_connection else y), None
