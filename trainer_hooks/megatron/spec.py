"""Megatron ``ModuleSpec`` trees for MambaStacks the hook covers: Megatron's own local modules
(``local_mamba_stack_spec``), or those with the aligned modules placed (``aligned_mamba_stack_spec``)."""

from __future__ import annotations

from typing import Any

from aligned_mamba.contract import Contract

from .norms import AlignedRMSNorm


def local_mamba_stack_spec(eps: float = 1e-5, *, conv_bias: bool = True, norm: Any = None,
                           moe_experts: int | None = None) -> Any:
    """A MambaStack spec of Megatron's own modules, no Transformer Engine, pure or hybrid (M, *, - and, with
    ``moe_experts``, E layers): WrappedTorchNorm norms (``norm`` overrides the Mamba layers'), Column- and
    RowParallelLinear, a causal SelfAttention, Megatron's local MLP and MoELayer. The hook covers exactly these
    (the TE spec fuses each layer norm into the next linear)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    mixer = ModuleSpec(module=MambaMixer, params={"conv_bias": conv_bias},
                       submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear))
    layer = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=ModuleSpec(module=norm or WrappedTorchNorm, params={"eps": eps}), mixer=mixer,
        mamba_bda=get_bias_dropout_add))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                                     core_attention=DotProductAttention,
                                                                     linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=WrappedTorchNorm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add))
    moe: dict[str, Any] = {}
    if moe_experts is not None:
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

        moe["moe_layer"] = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=get_moe_module_spec(use_te=False, num_experts=moe_experts, moe_grouped_gemm=False),
            mlp_bda=get_bias_dropout_add))
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(mamba_layer=layer, attention_layer=attention,
                                                                         mlp_layer=mlp, **moe))


def aligned_mamba_stack_spec(contract: Contract, eps: float = 1e-5, *, conv_bias: bool = True,
                             moe_experts: int | None = None) -> Any:
    """``local_mamba_stack_spec`` with ``AlignedRMSNorm`` as every layer norm and ``contract``'s chunk size in every
    mixer (the same parameter names); install the hook for the same contract before building."""
    spec = local_mamba_stack_spec(eps, conv_bias=conv_bias, norm=AlignedRMSNorm, moe_experts=moe_experts)
    stack = spec.submodules
    stack.mamba_layer.submodules.mixer.params["chunk_size"] = contract.chunk_size
    stack.attention_layer.submodules.input_layernorm = AlignedRMSNorm
    for layer in (stack.mlp_layer, stack.moe_layer):
        if hasattr(layer, "submodules"):  # the MoE slot is IdentityOp without moe_experts
            layer.submodules.pre_mlp_layernorm = AlignedRMSNorm
    return spec
