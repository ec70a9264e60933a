"""What the hook refuses, each with one line saying what and why: settings (parallelism, dtypes,
dropout), the megatron-core version, and the modules of a built model it does not cover."""

from __future__ import annotations

from typing import Any

import torch

from aligned_mamba.contract import Contract
from aligned_mamba.errors import AlignedMambaError

SUPPORTED_MEGATRON_CORE = ">=0.16.1,<0.17"


class AlignmentRefused(AlignedMambaError):
    """Megatron would run something the hook cannot align (or under another contract); one line says what."""


def tp_problems(tp: int, slices: int) -> list[str]:
    """Why tensor-parallel size ``tp`` cannot keep the bits under a contract of ``slices`` row-parallel slices
    (empty: it can): a power of two dividing S, so every rank computes whole subtrees of the fixed trees."""
    tp = tp or 1
    if tp == 1:
        return []
    if tp & (tp - 1):
        return [f"tensor model parallel size {tp} (not a power of two: the fixed reduction trees split into whole "
                "subtrees only then)"]
    if slices % tp:
        return [f"tensor model parallel size {tp} with the contract's row_parallel_slices {slices} (TP {tp} needs a "
                f"contract with row_parallel_slices >= {tp}: each rank computes whole slices of the fixed tree)"]
    return []


def parallel_problems(*, tp: int, pp: int, cp: int, fp8: Any, hidden_dropout: float, slices: int = 1) -> list[str]:
    out = tp_problems(tp, slices)
    if (pp or 1) > 1:
        out.append(f"pipeline model parallel size {pp} (pipeline parallelism is not covered)")
    if (cp or 1) > 1:
        out.append(f"context parallel size {cp} (context parallelism splits a sequence's scan across ranks; not "
                   "covered)")
    if fp8:
        out.append(f"fp8 ({fp8})")
    if hidden_dropout:
        out.append(f"hidden dropout {hidden_dropout} (random masks give other bits than the sampler; set it to 0)")
    return out


def config_problems(config: Any, contract: Contract) -> list[str]:
    out = parallel_problems(tp=config.tensor_model_parallel_size, pp=config.pipeline_model_parallel_size,
                            cp=config.context_parallel_size, fp8=config.fp8, hidden_dropout=config.hidden_dropout,
                            slices=contract.row_parallel_slices)
    dtype = str(config.params_dtype).removeprefix("torch.")
    if dtype != contract.model_dtype:
        out.append(f"params_dtype {dtype} (contract model_dtype {contract.model_dtype})")
    if config.normalization != "RMSNorm":
        out.append(f"normalization {config.normalization!r} (Mamba2 norms are RMSNorm)")
    return out


def refuse_problems(problems: list[str]) -> None:
    if problems:
        raise AlignmentRefused("--aligned-mamba cannot align this run: " + "; ".join(problems))


def check_megatron_version() -> None:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    try:
        found = version("megatron-core")
    except PackageNotFoundError:
        return  # a source checkout (Megatron-LM): megatron.core imported, version unknown; the names are checked
    if found not in SpecifierSet(SUPPORTED_MEGATRON_CORE):
        raise AlignmentRefused(f"megatron-core {found} is not supported by the hook (supported: "
                               f"{SUPPORTED_MEGATRON_CORE}); its Mamba2 path may differ")


def check_mixer(m: Any, where: str, contract: Contract) -> None:
    """A MambaMixer the core's Mamba2 layer computes under ``contract``: its chunk size, the gate in a
    grouped RMSNorm after the scan, one D per head, CP 1, a TP size the contract's row_parallel_slices hold
    (out_proj's K and each group's width in S equal slices), Megatron's own linears without biases."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    c = contract
    if m.chunk_size != c.chunk_size:
        raise AlignmentRefused(f"{where}: built with chunk_size={m.chunk_size} but the contract says chunk_size="
                               f"{c.chunk_size} (install the hook before building the model)")
    problems = []
    if not m.rmsnorm:
        problems.append("rmsnorm=False (the gate would go inside the scan)")
    if m.norm_before_gate:
        problems.append("norm_before_gate=True")
    if m.D_has_hdim:
        problems.append("D_has_hdim=True (Mamba2 checkpoints have one D per head)")
    if m.cp.cp_size != 1:
        problems.append("context parallel > 1")
    problems += tp_problems(m.pg_collection.tp.size(), c.row_parallel_slices)
    s = c.row_parallel_slices
    if m.d_inner % s:
        problems.append(f"d_inner {m.d_inner} is not a multiple of row_parallel_slices {s} (out_proj's K in equal "
                        "slices)")
    elif s > 1 and (m.d_inner // m.ngroups) % s:
        problems.append(f"the gated norm's group width {m.d_inner // m.ngroups} is not a multiple of "
                        f"row_parallel_slices {s} (its sum of squares in equal slices)")
    if m.d_state % 4:
        problems.append(f"d_state {m.d_state} not a multiple of 4 (row bits could depend on alignment)")
    if m.d_inner % m.d_model:
        problems.append(f"d_inner {m.d_inner} is not a whole multiple of d_model {m.d_model}")
    if type(m.in_proj) is not ColumnParallelLinear or type(m.out_proj) is not RowParallelLinear:
        problems.append(f"in_proj/out_proj are {type(m.in_proj).__name__}/{type(m.out_proj).__name__}, not "
                        "ColumnParallelLinear/RowParallelLinear (e.g. Transformer Engine layers)")
    elif m.in_proj.bias is not None or m.out_proj.bias is not None:
        problems.append("in_proj/out_proj biases")
    norm = m.norm
    if not all(hasattr(norm, a) for a in ("weight", "eps", "group_size")) or getattr(norm, "norm_before_gate", 0):
        problems.append(f"gated norm {type(norm).__name__} is not one the hook covers")
    elif norm.group_size * m.ngroups != m.d_inner:
        problems.append(f"gated norm group size {norm.group_size} != d_inner / ngroups")
    if problems:
        raise AlignmentRefused(f"{where}: " + "; ".join(problems))


def check_layer_types(stack: Any, where: str, covered: dict[str, type]) -> None:
    """Each layer of a MambaStack is the class the hook covers for its pattern symbol; any other layer class
    is refused, naming the layer, its symbol and the pattern."""
    pattern = "".join(stack.layer_type_list)
    for i, (symbol, layer) in enumerate(zip(stack.layer_type_list, stack.layers)):
        want = covered.get(symbol)
        if want is None or type(layer) is not want:
            raise AlignmentRefused(f"{where}: layer {i} ({symbol!r} in {pattern!r}) is a {type(layer).__name__}, not "
                                   f"the {getattr(want, '__name__', 'layer')} the hook covers (build the stack from "
                                   "local_mamba_stack_spec)")


def check_transformer_layer(layer: Any, where: str, *, attention: bool, moe: bool = False) -> set[int]:
    """A hybrid layer of norm, one mixer (SelfAttention, MLP or MoELayer) and residual add, nothing else; returns
    the ids of its identity slots (visited no further). Refuses, e.g., a TE spec (its norm fused into the next
    linear) or a GPT block (attention and MLP in one layer)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from .norms import AlignedRMSNorm  # here: norms raises AlignmentRefused, so it imports this module

    used = ("input_layernorm", "self_attention") if attention else ("pre_mlp_layernorm", "mlp")
    work = SelfAttention if attention else MoELayer if moe else MLP
    identity = [n for n in ("input_layernorm", "self_attention", "pre_cross_attn_layernorm", "cross_attention",
                            "pre_mlp_layernorm", "mlp") if n not in used]
    problems = []
    norm, inner = (getattr(layer, n) for n in used)
    if type(norm) not in (AlignedRMSNorm, torch.nn.RMSNorm):
        problems.append(f"its {used[0]} is {type(norm).__name__}, not an RMSNorm (a Transformer Engine spec fuses it "
                        "into the next linear; use local_mamba_stack_spec)")
    if type(inner) is not work:
        problems.append(f"its {used[1]} is {type(inner).__name__}, not Megatron's {work.__name__}")
    others = [n for n in identity if type(getattr(layer, n)) is not IdentityOp]
    if others:
        problems.append(f"{', '.join(others)} are not identities (one mixer per hybrid layer, as Nemotron-H)")
    bda = layer.self_attn_bda if attention else layer.mlp_bda
    if bda is not get_bias_dropout_add:
        problems.append(f"its residual add is {getattr(bda, '__name__', type(bda).__name__)}, not get_bias_dropout_add")
    if layer.config.apply_residual_connection_post_layernorm:
        problems.append("apply_residual_connection_post_layernorm (the residual would be the normed input)")
    if layer.hidden_dropout:
        problems.append(f"hidden dropout {layer.hidden_dropout}")
    if problems:
        raise AlignmentRefused(f"{where}: " + "; ".join(problems))
    slots = [getattr(layer, n) for n in identity] + [layer.cross_attn_bda, layer.mlp_bda if attention
                                                     else layer.self_attn_bda]
    return {id(x) for x in slots if isinstance(x, (IdentityOp, IdentityFuncOp))}


def check_attention(m: Any, where: str, contract: Contract | None = None) -> None:
    """A SelfAttention the core's attention layer computes: causal, grouped-query, no biases, no rotary,
    the default scale, none of the attention features the core lacks (each refused by name)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    cfg = m.config
    head_dim = m.hidden_size_per_attention_head
    problems = []
    if m.attn_mask_type != AttnMaskType.causal:
        problems.append(f"attn_mask_type {m.attn_mask_type.name} (only causal self-attention)")
    if cfg.window_size is not None:
        problems.append(f"sliding-window attention (window_size={cfg.window_size})")
    if cfg.attention_output_gate:
        problems.append("an output gate (attention_output_gate)")
    if cfg.qk_layernorm or m.q_layernorm is not None or m.k_layernorm is not None:
        problems.append("query/key norms (qk_layernorm)")
    if cfg.qk_l2_norm:
        problems.append("query/key L2 norms (qk_l2_norm)")
    if cfg.softmax_type != "vanilla":
        problems.append(f"softmax_type {cfg.softmax_type!r} (a softmax offset)")
    if cfg.softmax_scale is not None and cfg.softmax_scale != head_dim ** -0.5:
        problems.append(f"softmax_scale {cfg.softmax_scale} (the core scales scores by head_dim ** -0.5)")
    if cfg.apply_query_key_layer_scaling:
        problems.append("apply_query_key_layer_scaling")
    if cfg.attention_dropout:
        problems.append(f"attention dropout {cfg.attention_dropout}")
    if cfg.multi_latent_attention or cfg.experimental_attention_variant is not None:
        problems.append(f"attention variant {cfg.experimental_attention_variant or 'multi_latent_attention'}")
    s = 1 if contract is None else contract.row_parallel_slices
    if (m.num_attention_heads_per_partition * m.world_size * head_dim) % s:
        problems.append(f"o_proj's K {m.num_attention_heads_per_partition * m.world_size * head_dim} not a multiple "
                        f"of row_parallel_slices {s}")
    if type(m.linear_qkv) is not ColumnParallelLinear or type(m.linear_proj) is not RowParallelLinear:
        problems.append(f"linear_qkv/linear_proj are {type(m.linear_qkv).__name__}/{type(m.linear_proj).__name__}, "
                        "not ColumnParallelLinear/RowParallelLinear (e.g. Transformer Engine layers)")
    elif m.linear_qkv.bias is not None or m.linear_proj.bias is not None:
        problems.append("attention biases (add_bias_linear / add_qkv_bias; Nemotron-H's attention has none)")
    if type(m.core_attention) is not DotProductAttention:
        problems.append(f"core attention {type(m.core_attention).__name__} (only Megatron's DotProductAttention "
                        "slot, which the aligned forward replaces)")
    if problems:
        raise AlignmentRefused(f"{where}: attention with " + "; ".join(problems) + " is not covered")


def check_mlp(m: Any, where: str, contract: Contract | None = None) -> None:
    """An MLP the core's MLP layer computes: fc2(relu(fc1 x)^2), no gate, no biases."""
    from megatron.core.activations import squared_relu
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    cfg = m.config
    problems = []
    if cfg.gated_linear_unit:
        problems.append("a gated linear unit (gated_linear_unit; Nemotron-H's MLP has no gate)")
    if m.activation_func is not squared_relu or cfg.use_te_activation_func:
        act = getattr(m.activation_func, "__name__", type(m.activation_func).__name__)
        problems.append(f"activation {act} (only megatron.core.activations.squared_relu, Nemotron-H's relu2)")
    if cfg.activation_func_clamp_value is not None:
        problems.append(f"activation_func_clamp_value {cfg.activation_func_clamp_value}")
    if type(m.linear_fc1) is not ColumnParallelLinear or type(m.linear_fc2) is not RowParallelLinear:
        problems.append(f"linear_fc1/linear_fc2 are {type(m.linear_fc1).__name__}/{type(m.linear_fc2).__name__}, "
                        "not ColumnParallelLinear/RowParallelLinear (e.g. Transformer Engine layers)")
    elif m.linear_fc1.bias is not None or m.linear_fc2.bias is not None:
        problems.append("MLP biases (add_bias_linear)")
    else:
        s = 1 if contract is None else contract.row_parallel_slices
        width = m.linear_fc1.weight.shape[0] * m.tp_group.size()
        if width % s:
            problems.append(f"MLP width {width} not a multiple of row_parallel_slices {s} (fc2's K in equal slices)")
    if problems:
        raise AlignmentRefused(f"{where}: MLP with " + "; ".join(problems) + " is not covered")


def check_moe(m: Any, where: str, contract: Contract | None = None) -> None:
    """A MoELayer the core's MoE layer computes (Nemotron-H's): Megatron's TopKRouter with sigmoid scores
    (its expert bias, when enabled, as the score correction bias), group-limited top-k as Nemotron-H scores
    groups, no aux or z loss, no jitter; local ``SequentialMLP`` experts and one ``SharedExpertMLP``, each
    an MLP ``check_mlp`` covers; no latent projection; expert parallel size 1."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    cfg, r = m.config, m.router
    problems = []
    if type(r) is not TopKRouter:
        problems.append(f"router {type(r).__name__} (only Megatron's TopKRouter)")
    else:
        if cfg.moe_router_score_function != "sigmoid":
            problems.append(f"moe_router_score_function {cfg.moe_router_score_function!r} (Nemotron-H's is sigmoid)")
        if r.bias is not None:
            problems.append("a router bias (add_bias_linear)")
        if r.is_aux_loss_enabled() or cfg.moe_z_loss_coeff or cfg.moe_input_jitter_eps:
            problems.append("an aux loss, z loss or input jitter (the aligned forward computes the layer's output "
                            "only)")
        groups = cfg.moe_router_num_groups or 1
        if groups > 1 and cfg.moe_router_topk // (cfg.moe_router_group_topk or 1) != 2:
            problems.append(f"moe_router_num_groups {groups} with topk {cfg.moe_router_topk} and group_topk "
                            f"{cfg.moe_router_group_topk} (Nemotron-H scores a group by its top 2 experts)")
        if cfg.moe_router_force_load_balancing or cfg.moe_router_fusion:
            problems.append("moe_router_force_load_balancing or moe_router_fusion")
    etp = cfg.expert_tensor_parallel_size or cfg.tensor_model_parallel_size
    if etp != cfg.tensor_model_parallel_size:
        # the core's MoE layer cuts every expert's channels as the layer's other row-parallel weights
        problems.append(f"expert tensor parallel size {etp} at tensor parallel size {cfg.tensor_model_parallel_size} "
                        "(the experts are covered sharded as the other layers, expert TP = TP)")
    if cfg.moe_latent_size:
        problems.append(f"a latent projection (moe_latent_size={cfg.moe_latent_size})")
    if type(m.experts) is not SequentialMLP or m.num_local_experts != cfg.num_moe_experts:
        problems.append(f"experts {type(m.experts).__name__} over {m.num_local_experts} of {cfg.num_moe_experts} "
                        "experts (only SequentialMLP, expert parallel size 1)")
    if type(m.shared_experts) is not SharedExpertMLP or m.shared_experts.use_shared_expert_gate:
        problems.append("no shared expert, or a gated one (Nemotron-H's MoE has one ungated shared expert)")
    if problems:
        raise AlignmentRefused(f"{where}: MoE layer with " + "; ".join(problems) + " is not covered")
    for e, expert in enumerate(m.experts.local_experts):
        check_mlp(expert, f"{where} expert {e}", contract)
    check_mlp(m.shared_experts, f"{where} shared expert", contract)
