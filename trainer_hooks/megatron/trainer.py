"""The core's trainer protocol on a real Megatron-Core MambaModel with the hook: the ``megatron`` entry of
``aligned_mamba.trainers`` (``check`` / ``rl --trainer megatron``), for Mamba2 and Nemotron-H checkpoints.

Every forward and backward is Megatron's: the model built from ``local_mamba_stack_spec``, loaded through
``weights``, scoring sequences in one packed (THD) pass. ``step`` is ``PolicyTrainer``'s REINFORCE with
Megatron's mixed precision (Adam on fp32 masters, the parameters re-set from them rounded), so the next forward
and the exported weights are the same bits. ``ALIGNED_MAMBA_MEGATRON_HOOK=off``: the stock forward (the baseline).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from aligned_mamba.contract import Contract
from aligned_mamba.errors import ModelLoadError
from aligned_mamba.models.mamba2 import EMBEDDING, LM_HEAD, Mamba2Config
from aligned_mamba.models.nemotron_h import NemotronHConfig
from aligned_mamba.train import (
    PackedScoring,
    check_lr,
    check_step_health,
    check_step_inputs,
    export_weights,
    reinforce_loss,
    total_norm,
)

from .hook import install, installed
from .logprobs import token_logprobs
from .shards import hf_to_megatron_shard
from .spec import aligned_mamba_stack_spec, local_mamba_stack_spec
from .weights import hf_to_megatron, megatron_names, megatron_to_hf

__all__ = ["MegatronTrainer", "build_hooked_model", "build_mamba_model", "load_hf_weights", "make_trainer",
           "megatron_packed_logits", "megatron_sequence_logits", "megatron_transformer_config", "prepare_process",
           "sum_sequence_parallel_gradients", "tp_rank_forward", "tp_rank_logits", "tp_rank_model", "tp_size"]

# MambaMixer hard-codes its gated norm's eps; a checkpoint with another eps is not Megatron-representable
MEGATRON_GATED_NORM_EPS = 1e-5


def prepare_process(tp: int = 1) -> None:
    """Megatron's groups at TP ``tp`` (1: a one-rank world started here; more: over the world its ranks started)
    and ``cpu``'s stand-ins for what the machine lacks."""
    from . import cpu

    cpu.setup()
    cpu.init_model_parallel(tp)


def tp_size() -> int:
    """Megatron's tensor-parallel size in this process (1 before its groups are built)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_tensor_model_parallel_world_size()


def _refuse_mixer_settings(config: Any) -> None:
    """What Megatron's MambaMixer cannot represent, for Mamba2 and Nemotron-H configs alike."""
    if not config.use_conv_bias:  # MambaMixer.__init__ tags conv1d.bias unconditionally (0.16.1)
        raise ModelLoadError("use_conv_bias=False: megatron-core 0.16's MambaMixer cannot be built without a conv bias")
    if tuple(config.time_step_limit) != (0.0, math.inf):
        raise ModelLoadError(f"time_step_limit {config.time_step_limit}: Megatron's MambaMixer does not clamp dt")
    if config.layer_norm_epsilon != MEGATRON_GATED_NORM_EPS:
        raise ModelLoadError(f"layer_norm_epsilon {config.layer_norm_epsilon}: Megatron's MambaMixer hard-codes "
                             f"{MEGATRON_GATED_NORM_EPS} for its gated norm")


def megatron_transformer_config(config: Mamba2Config | NemotronHConfig, dtype: str, *,
                                sequence_parallel: bool = False) -> Any:
    """The TransformerConfig of ``config``'s model (pure Mamba2, or the hybrid of a ``NemotronHConfig``), params in
    ``dtype``, sequence parallel or not; refuses (ModelLoadError) what Megatron's MambaMixer cannot represent."""
    from megatron.core.transformer import TransformerConfig

    if isinstance(config, NemotronHConfig):
        return _hybrid_transformer_config(config, dtype, sequence_parallel)

    if config.use_bias:
        raise ModelLoadError("use_bias=True: Megatron's MambaMixer has no in_proj/out_proj bias")
    _refuse_mixer_settings(config)
    return TransformerConfig(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        mamba_state_dim=config.state_size, mamba_head_dim=config.head_dim, mamba_num_groups=config.n_groups,
        mamba_num_heads=config.num_heads, params_dtype=getattr(torch, dtype), bf16=dtype == "bfloat16",
        layernorm_epsilon=config.layer_norm_epsilon, normalization="RMSNorm", hidden_dropout=0.0,
        attention_dropout=0.0, fp32_residual_connection=config.residual_in_fp32,
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=False, add_bias_linear=False,
        **_tp_fields(config, sequence_parallel))


def _tp_fields(config: Mamba2Config | NemotronHConfig, sequence_parallel: bool) -> dict[str, Any]:
    """The TP fields at this process's TP size; TransformerConfig wants ``num_attention_heads`` a multiple of it
    even for a pure Mamba2 stack. Sequence parallelism needs TP > 1 (refused in one line, before Megatron's)."""
    tp = tp_size()
    if sequence_parallel and tp == 1:
        raise ModelLoadError("sequence parallel at tensor-parallel size 1: it shards the sequence over the TP ranks, "
                             "so it needs TP > 1")
    out: dict[str, Any] = {"tensor_model_parallel_size": tp, "sequence_parallel": sequence_parallel}
    if not isinstance(config, NemotronHConfig):
        out["num_attention_heads"] = tp
    return out


def _moe_transformer_fields(config: NemotronHConfig) -> dict[str, Any]:
    """The fields of Nemotron-H's MoE layers (none without 'E'): the sigmoid TopKRouter with the score correction
    bias as its expert bias, fp32 routing, no aux loss, the all-gather dispatcher (the one a single CPU process
    can build). Refuses (ModelLoadError) what megatron-core 0.16 cannot represent."""
    if "E" not in config.hybrid_override_pattern:
        return {}
    if config.moe_latent_size is not None:
        raise ModelLoadError(f"moe_latent_size={config.moe_latent_size}: megatron-core 0.16's MoE latent projections "
                             "need Transformer Engine")
    if not config.norm_topk_prob and config.num_experts_per_tok > 1:
        raise ModelLoadError("norm_topk_prob=False: Megatron's sigmoid router always normalises the top-k weights")
    if config.n_group > 1 and config.num_experts_per_tok // config.topk_group != 2:
        raise ModelLoadError(f"n_group={config.n_group} with num_experts_per_tok={config.num_experts_per_tok} and "
                             f"topk_group={config.topk_group}: Megatron scores a group by its top "
                             "num_experts_per_tok // topk_group experts, Nemotron-H by its top 2")
    return dict(num_moe_experts=config.n_routed_experts, moe_router_topk=config.num_experts_per_tok,
                moe_ffn_hidden_size=config.moe_intermediate_size,
                moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_num_groups=config.n_group, moe_router_group_topk=config.topk_group,
                moe_router_topk_scaling_factor=config.routed_scaling_factor, moe_router_dtype="fp32",
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather")


def _hybrid_transformer_config(config: NemotronHConfig, dtype: str, sequence_parallel: bool) -> Any:
    """The TransformerConfig of a hybrid MambaModel of Nemotron-H's shapes, the residual in the model dtype as
    Nemotron-H keeps it; refuses (ModelLoadError) what Megatron cannot represent for it."""
    from megatron.core.activations import squared_relu
    from megatron.core.transformer import TransformerConfig

    if config.use_bias or config.mlp_bias:
        raise ModelLoadError(f"use_bias={config.use_bias}, mlp_bias={config.mlp_bias}: Megatron has one "
                             "add_bias_linear for every linear, and Nemotron-H's attention has no biases")
    _refuse_mixer_settings(config)
    return TransformerConfig(
        **_moe_transformer_fields(config),
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, num_query_groups=config.num_key_value_heads,
        kv_channels=config.head_dim, ffn_hidden_size=config.intermediate_size, activation_func=squared_relu,
        gated_linear_unit=False, mamba_state_dim=config.ssm_state_size, mamba_head_dim=config.mamba_head_dim,
        mamba_num_groups=config.n_groups, mamba_num_heads=config.mamba_num_heads, params_dtype=getattr(torch, dtype),
        bf16=dtype == "bfloat16", layernorm_epsilon=config.layer_norm_epsilon, normalization="RMSNorm",
        hidden_dropout=0.0, attention_dropout=0.0, fp32_residual_connection=False,
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=False, add_bias_linear=False,
        **_tp_fields(config, sequence_parallel))


def build_mamba_model(config: Mamba2Config | NemotronHConfig, dtype: str, *, chunk_size: int | None = None,
                      sequence_parallel: bool = False) -> Any:
    """A MambaModel of ``config``'s shape, weights uninitialised (the hybrid for a ``NemotronHConfig``), aligned on
    construction when the hook is installed; ``chunk_size`` goes to every MambaMixer explicitly.
    ``sequence_parallel``: the layers between the mixers run on sequence shards, every norm the hook's
    ``AlignedRMSNorm`` (``aligned_mamba_stack_spec``: Megatron's torch norms refuse sequence parallelism, and
    its Transformer Engine ones are not covered), so the hook must be installed."""
    from megatron.core.models.mamba.mamba_model import MambaModel

    moe = isinstance(config, NemotronHConfig) and "E" in config.hybrid_override_pattern
    experts = config.n_routed_experts if moe else None
    if sequence_parallel:
        hook = installed()
        if hook is None:
            raise ModelLoadError("sequence parallel without the hook: Megatron's torch norms refuse it and its "
                                 "Transformer Engine norms are not available here, so there is no stock baseline")
        spec = aligned_mamba_stack_spec(hook.contract, config.layer_norm_epsilon, conv_bias=config.use_conv_bias,
                                        moe_experts=experts)
    else:
        spec = local_mamba_stack_spec(config.layer_norm_epsilon, conv_bias=config.use_conv_bias, moe_experts=experts)
    if chunk_size is not None:
        spec.submodules.mamba_layer.submodules.mixer.params["chunk_size"] = chunk_size
    pattern = config.hybrid_override_pattern if isinstance(config, NemotronHConfig) else None
    transformer = megatron_transformer_config(config, dtype, sequence_parallel=sequence_parallel)
    model = MambaModel(transformer, spec, vocab_size=config.vocab_size,
                       max_sequence_length=1 << 20, share_embeddings_and_output_weights=config.tie_word_embeddings,
                       position_embedding_type="none", hybrid_override_pattern=pattern)
    if torch.cuda.is_available():
        # as Megatron-LM's get_model does: modules built without a device (torch norms) start on the CPU
        model.cuda(torch.cuda.current_device())
    return model


def load_hf_weights(model: Any, config: Mamba2Config | NemotronHConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Load the whole checkpoint's HF tensors into ``model`` (this rank's shard at TP > 1). Each parameter first takes
    the stored dtype in place (the same Parameter objects, which MambaMixer's context-parallel helper also holds),
    so values are copied exactly, never cast to Megatron's params dtype."""
    from megatron.core import parallel_state

    tp = tp_size()
    sd = hf_to_megatron(tensors, config) if tp == 1 else \
        hf_to_megatron_shard(tensors, config, parallel_state.get_tensor_model_parallel_rank(), tp)
    params = dict(model.named_parameters())
    for name, value in sd.items():
        param = params.get(name)
        if param is not None and param.dtype != value.dtype:
            param.data = param.data.to(value.dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ModelLoadError(f"Megatron model and checkpoint differ: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")


def megatron_packed_logits(model: Any, sequences: list[torch.Tensor], *, gather: bool = True) -> torch.Tensor:
    """One THD forward over the packed sequences -> [sum len_i, vocab] whole rows at any TP size (``gather=False``:
    this rank's vocabulary shard, as Megatron's loss reads it); grad mode and model mode as they are. Sequence
    parallel: the packed tokens padded to a multiple of the TP size (Megatron splits them evenly), the padding one
    more sequence past the last offset, its rows dropped."""
    from megatron.core.packed_seq_params import PackedSeqParams

    dev = _model_device(model)
    lens = [int(s.numel()) for s in sequences]
    total = sum(lens)
    pad = -total % tp_size() if getattr(getattr(model, "config", None), "sequence_parallel", False) else 0
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    ids = torch.cat([*(s.to(torch.int64) for s in sequences), torch.zeros(pad, dtype=torch.int64)])[None].to(dev)
    pos = torch.cat([*(torch.arange(n) for n in lens), torch.arange(pad)])[None].to(dev)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                             max_seqlen_kv=max(lens))
    logits = model(ids, pos, attention_mask=None, packed_seq_params=params, runtime_gather_output=gather)[0]
    return logits[:total] if pad else logits


def megatron_sequence_logits(model: Any, sequences: list[torch.Tensor]) -> torch.Tensor:
    """Megatron's forward a sequence at a time, with an explicit causal mask -> [sum len_i, vocab]: the stock hybrid
    on the CPU, whose DotProductAttention takes no packed sequences and builds its default mask on CUDA."""
    dev = _model_device(model)
    out = []
    for seq in sequences:
        n = int(seq.numel())
        mask = torch.ones(n, n, dtype=torch.bool, device=dev).triu(1)[None, None]
        out.append(model(seq.to(torch.int64)[None].to(dev), None, attention_mask=mask, runtime_gather_output=True)[0])
    return torch.cat(out)


def _model_device(model: Any) -> torch.device:
    """Where the model's parameters are (a CUDA MambaModel takes CUDA token ids)."""
    return next(model.parameters()).device


def sum_sequence_parallel_gradients(model: Any) -> int:
    """After a backward of a sequence-parallel ``model``: the parameters Megatron marks ``sequence_parallel`` (the
    norms, the MoE router), applied to this rank's rows only, hold a part of their gradient; each is summed over
    the TP ranks in rank order (what Megatron's ``finalize_model_grads`` all-reduces), so every rank holds the same
    sum. Returns how many were summed (0 without sequence parallelism)."""
    if not model.config.sequence_parallel:
        return 0
    from megatron.core import parallel_state

    from aligned_mamba.parallel import TPGroup, merge_gradients

    marked = [p for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.requires_grad]
    merge_gradients(TPGroup.from_torch(parallel_state.get_tensor_model_parallel_group()), marked, mean=False)
    return len(marked)


def build_hooked_model(config: Mamba2Config | NemotronHConfig, tensors: dict[str, torch.Tensor],
                       contract: Contract, tp: int = 1, *, sequence_parallel: bool = False) -> Any:
    """A MambaModel with the hook installed for ``contract``, the process prepared at TP ``tp``, HF-named
    ``tensors`` loaded (this rank's shard at TP > 1); left in train mode."""
    prepare_process(tp)
    install(contract)
    model = build_mamba_model(config, contract.model_dtype, sequence_parallel=sequence_parallel)
    load_hf_weights(model, config, tensors)
    return model


class MegatronTrainer(PackedScoring):
    """The trainer protocol through a hooked Megatron MambaModel, its parameters in the checkpoint's dtypes, Adam
    on fp32 masters. ``hook=False``: Megatron's stock forward (the baseline)."""

    def __init__(self, config: Mamba2Config | NemotronHConfig, tensors: dict[str, torch.Tensor], contract: Contract,
                 *, lr: float = 1e-4, hook: bool = True, tp: int = 1, sequence_parallel: bool = False) -> None:
        check_lr(lr)
        if sequence_parallel and not hook:  # a hook installed earlier in the process must not build it either
            raise ModelLoadError("sequence parallel with the hook off: Megatron's torch norms refuse it and its "
                                 "Transformer Engine norms are not available here, so there is no stock baseline")
        self.tp = tp
        self.config = config
        self.contract = contract
        self.lr = lr
        self.hooked = hook
        self.dtypes = {k: v.dtype for k, v in tensors.items()}  # the served names and dtypes, in input order
        if hook:
            self.model = build_hooked_model(config, tensors, contract, tp, sequence_parallel=sequence_parallel)
        else:
            prepare_process(tp)
            self.model = build_mamba_model(config, contract.model_dtype, chunk_size=contract.chunk_size,
                                           sequence_parallel=sequence_parallel)
            load_hf_weights(self.model, config, tensors)
        self.params = dict(self.model.named_parameters())
        self.master: dict[str, torch.Tensor] | None = None
        self.opt: torch.optim.Optimizer | None = None
        self._hybrid = isinstance(config, NemotronHConfig)
        self.version = 0
        changed = [k for k, v in self.weights().items() if v.dtype != self.dtypes[k]]
        if changed:
            raise ModelLoadError(f"the Megatron model holds {changed[:3]} in other dtypes than the checkpoint")

    def _logits(self, sequences: list[torch.Tensor]) -> torch.Tensor:
        """One packed forward -> [sum len_i, vocab] logits (autograd per torch's grad mode); scored packed, so the
        backward holds no per-sequence copy of them."""
        if self.hooked:
            install(self.contract)  # idempotent; back in place if someone uninstalled it
        if self._hybrid and not self.hooked:
            return megatron_sequence_logits(self.model, sequences)
        return megatron_packed_logits(self.model, sequences)

    def weights(self) -> dict[str, torch.Tensor]:
        """The served weights: the parameters under the checkpoint's HF names, in its dtypes, detached."""
        hf = megatron_to_hf(self._merged(self.model.state_dict()), self.config)
        if LM_HEAD in self.dtypes and LM_HEAD not in hf:  # tied, but the checkpoint stored the copy
            hf[LM_HEAD] = hf[EMBEDDING]
        if set(hf) != set(self.dtypes):
            raise ModelLoadError(f"the Megatron model's tensors {sorted(set(hf) ^ set(self.dtypes))[:3]} do not match "
                                 "the checkpoint's")
        return {k: hf[k].detach() for k in self.dtypes}

    def forward(self, sequences: Sequence[torch.Tensor], *, packed: bool = False) -> list[torch.Tensor] | torch.Tensor:
        """Raw logits of whole sequences in one packed pass (eval mode, no grad): [len_i, vocab] each (``packed``:
        the one [sum len_i, vocab])."""
        seqs = [s.to(torch.int64) for s in sequences]
        self.model.eval()
        with torch.no_grad():
            logits = self._logits(seqs)
        return logits if packed else list(torch.split(logits, [int(s.numel()) for s in seqs]))

    def step(self, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int],
             advantages: Sequence[float]) -> dict[str, Any]:
        """One REINFORCE step (``PolicyTrainer``'s loss) through Megatron's forward and backward; the gradients step
        the fp32 masters, the parameters are re-set from them rounded. Returns loss, tokens, grad norm, version."""
        check_step_inputs(sequences, prompt_lens, advantages)
        if self.master is None:
            self.master = {n: p.detach().to(torch.float32).clone().requires_grad_(True)
                           for n, p in self.params.items()}
            self.opt = torch.optim.Adam(self.master.values(), lr=self.lr)
        assert self.opt is not None
        seqs = [s.to(torch.int64) for s in sequences]
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        loss, tokens = reinforce_loss(self._logits(seqs), seqs, prompt_lens, advantages, contract=self.contract)
        loss.backward()
        sum_sequence_parallel_gradients(self.model)
        self.opt.zero_grad(set_to_none=True)
        for name, p in self.params.items():
            if p.grad is not None:
                self.master[name].grad = p.grad.detach().to(torch.float32)
        grad_norm = self._grad_norm()
        check_step_health(loss, grad_norm, self.version)
        self.opt.step()
        self.model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(self.master[name].detach().to(p.dtype))
        self.version += 1
        return {"loss": float(loss.detach()), "tokens": tokens, "grad_norm": grad_norm, "weights_version": self.version}

    def _grad_norm(self) -> float:
        """The master gradients' norm over the checkpoint's HF tensors in its order, as ``PolicyTrainer`` sums it
        (a linear_qkv's gradient as its q, k and v parts)."""
        assert self.master is not None
        master = self.master
        # buffers among the checkpoint's tensors (a MoE router's expert bias) have no gradient: zeros, skipped
        grads = {n: g if n in master and (g := master[n].grad) is not None else torch.zeros_like(v)
                 for n, v in self.model.state_dict().items() if not n.endswith("_extra_state")}
        by_hf, source = megatron_to_hf(self._merged(grads), self.config), megatron_names(self.config)
        return total_norm(by_hf[k] if source[k] in master and master[source[k]].grad is not None else None
                          for k in self.dtypes if k in by_hf)

    def _merged(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state dict (or gradients) of this rank's shard -> the TP 1 layout (at TP > 1 every rank's
        gathered and merged, ``shards.merge_megatron``: a collective every rank must call)."""
        if self.tp == 1:
            return state
        import torch.distributed as dist

        from .shards import merge_megatron

        local = {k: v.detach() for k, v in state.items() if not k.endswith("_extra_state")}
        every: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp)]
        dist.all_gather_object(every, local)
        return merge_megatron(every, self.config)

    def export_bytes(self) -> tuple[bytes, str]:
        """The served weights as safetensors bytes (metadata "weights_version") and their ``weights_digest``."""
        return export_weights(self.weights(), self.version)


def make_trainer(*, config: Any, tensors: dict[str, torch.Tensor], contract: Contract, lr: float = 1e-4,
                 tp: int = 1, sequence_parallel: bool = False) -> Any:
    """The ``aligned_mamba.trainers`` entry point ``megatron`` (``tp`` > 1: ``MegatronTPTrainer``, with
    ``sequence_parallel`` Megatron's sequence parallelism). ``ALIGNED_MAMBA_MEGATRON_HOOK=off``: Megatron's stock
    forward, not under the contract it reports."""
    if not isinstance(config, (Mamba2Config, NemotronHConfig)):
        raise ModelLoadError(f"the Megatron trainer covers Mamba2 and Nemotron-H checkpoints (Hugging Face layouts), "
                             f"not {type(config).__name__}")
    hook = os.environ.get("ALIGNED_MAMBA_MEGATRON_HOOK", "on") != "off"
    if not hook:
        print("aligned-mamba: ALIGNED_MAMBA_MEGATRON_HOOK=off: Megatron's stock forward (expect differing rows)",
              file=sys.stderr)
    if tp != 1:
        from .tp import MegatronTPTrainer

        return MegatronTPTrainer(config, tensors, contract, tp, hook=hook, lr=lr, sequence_parallel=sequence_parallel)
    return MegatronTrainer(config, tensors, contract, lr=lr, hook=hook, sequence_parallel=sequence_parallel)


def tp_rank_model(group: Any, config: Mamba2Config | NemotronHConfig, tensors: dict[str, torch.Tensor],
                  contract: Contract, hook: bool = True, sequence_parallel: bool = False) -> Any:
    """This rank's MambaModel at TP ``group.size`` in eval mode, its shard of ``tensors`` loaded: hooked for
    ``contract`` (``hook=False``: Megatron's stock forward, a hook installed earlier in the process taken off)."""
    prepare_process(group.size)
    if hook:
        install(contract)
    elif (current := installed()) is not None:
        current.uninstall()
    model = build_mamba_model(config, contract.model_dtype, chunk_size=None if hook else contract.chunk_size,
                              sequence_parallel=sequence_parallel)
    load_hf_weights(model, config, tensors)
    return model.eval()


def tp_rank_forward(group: Any, model: Any, config: Mamba2Config | NemotronHConfig, sequences: list[torch.Tensor],
                    hook: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One packed eval forward of ``tp_rank_model``'s model -> (whole [sum len_i, vocab] logits rows; with the hook
    the [sum len_i] float32 next-token logprobs from this rank's vocabulary shard (the contract's, vocab-parallel),
    else None). The stock hybrid runs a sequence at a time (``megatron_sequence_logits``)."""
    with torch.no_grad():
        if not hook:
            if isinstance(config, NemotronHConfig):
                return megatron_sequence_logits(model, sequences), None
            return megatron_packed_logits(model, sequences), None
        local = megatron_packed_logits(model, sequences, gather=False)  # [T, V / k]
        rows = group.all_gather(local).permute(1, 0, 2).reshape(local.shape[0], -1) if group.size > 1 else local
        labels = torch.cat(sequences).to(torch.int64).roll(-1).to(local.device)
        logprobs = token_logprobs(local[None], labels[None], sequence_first=False, vocab_parallel=True)
        return rows, logprobs[0]


def tp_rank_logits(group: Any, config: Mamba2Config | NemotronHConfig, tensors: dict[str, torch.Tensor],
                   contract: Contract, sequences: list[torch.Tensor], hook: bool = True,
                   sequence_parallel: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One rank of a TP run (``parallel.launch(tp_rank_logits, k, ...)``): ``tp_rank_forward`` of a fresh
    ``tp_rank_model``."""
    model = tp_rank_model(group, config, tensors, contract, hook, sequence_parallel)
    return tp_rank_forward(group, model, config, sequences, hook)
