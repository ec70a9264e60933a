"""The RL loop's trainer on a real Megatron-Core MambaModel with the ``--aligned-mamba`` hook.

``MegatronPolicyTrainer`` implements ``rollout.actors.PolicyScorer`` (``version``, ``token_logprobs``,
``step``, ``export_bytes``) like the reference ``aligned_mamba.train.PolicyTrainer``, but every forward
and backward is Megatron's (``megatron_check.build_hooked_model``: Megatron's own non-TE modules, the
hook installed for the contract, one packed THD pass):

- ``token_logprobs``: the one-pass logits, then ``aligned_mamba.ops.logprobs.log_softmax`` of rows
  prompt_len-1 .. len-2 gathered at the generated tokens, exactly as ``PolicyTrainer`` does, so they are
  the sampler's logprobs bit for bit when the sampler serves ``export_bytes()``'s weights.
- ``step``: REINFORCE with ``PolicyTrainer``'s loss, mixed precision as Megatron's fp16/bf16 optimizer
  does it: the model's parameters stay in the checkpoint dtypes (bf16 weights, fp32 A_log / D / dt_bias
  for ``make_tiny``), their gradients are copied to fp32 master copies, Adam steps the masters, and the
  parameters are re-set from the masters rounded to their dtypes. The next forward and the exported
  weights are therefore the same bits.
- ``export_bytes``: ``megatron_to_hf`` of the model's state dict, i.e. HF names in the checkpoint dtypes
  (the input's names: with tied embeddings an ``lm_head.weight`` only if the checkpoint had one), as
  safetensors bytes with the version in the metadata, and their ``weights_digest``.

Registered as the ``megatron`` entry of ``aligned_mamba.rl_trainers`` (``build_policy_trainer``), so
``aligned-mamba rl --trainer megatron`` trains through Megatron. One hook per process: a second trainer
under another contract in the same process is refused (``AlignmentRefused``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from aligned_mamba.contract import Contract
from aligned_mamba.errors import ModelLoadError
from aligned_mamba.model.checkpoint import EMBEDDING, LM_HEAD
from aligned_mamba.model.config import Mamba2Config
from aligned_mamba.train import (
    check_lr,
    check_step_inputs,
    export_weights,
    generated_logprobs,
    reinforce_loss,
    total_norm,
)

from . import megatron as hook_module
from .megatron_check import build_hooked_model, megatron_packed_logits
from .megatron_weights import megatron_to_hf

__all__ = ["MegatronPolicyTrainer", "build_policy_trainer"]


class MegatronPolicyTrainer:
    """REINFORCE through a hooked Megatron MambaModel, Adam on fp32 masters of its checkpoint-dtype parameters.

    ``tensors``: the checkpoint (HF names, checkpoint dtypes); the model's parameters take those dtypes.
    """

    def __init__(self, config: Mamba2Config, tensors: dict[str, torch.Tensor], contract: Contract, *,
                 lr: float = 1e-4) -> None:
        check_lr(lr)
        self.config = config
        self.contract = contract
        self.dtypes = {k: v.dtype for k, v in tensors.items()}  # the served names and dtypes, in input order
        self.model = build_hooked_model(config, tensors, contract)
        self.params = dict(self.model.named_parameters())
        self.master = {n: p.detach().to(torch.float32).clone().requires_grad_(True) for n, p in self.params.items()}
        self.opt = torch.optim.Adam(self.master.values(), lr=lr)
        # the masters in the checkpoint's (HF) order, the order PolicyTrainer sums the gradient norm in
        megatron_name = {id(p): n for n, p in self.params.items()}
        by_hf = megatron_to_hf(self.params, config)
        self._hf_order = [megatron_name[id(by_hf[k])] for k in self.dtypes if k in by_hf]
        self.version = 0
        changed = [k for k, v in self.weights().items() if v.dtype != self.dtypes[k]]
        if changed:
            raise ModelLoadError(f"the Megatron model holds {changed[:3]} in other dtypes than the checkpoint")

    # -- the model ----------------------------------------------------------------------------------------------
    def _logits(self, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
        """One packed forward -> per sequence [len_i, vocab] logits (autograd per torch's grad mode)."""
        hook_module.install(self.contract)  # idempotent; back in place if someone uninstalled it
        logits = megatron_packed_logits(self.model, sequences)
        return list(torch.split(logits, [int(s.numel()) for s in sequences]))

    def weights(self) -> dict[str, torch.Tensor]:
        """The served weights: the model's parameters under HF names, in the checkpoint dtypes (detached;
        the same names as the checkpoint, so a tied ``lm_head.weight`` only if it had one)."""
        hf = megatron_to_hf(self.model.state_dict(), self.config)
        if LM_HEAD in self.dtypes and LM_HEAD not in hf:  # tied, but the checkpoint stored the copy
            hf[LM_HEAD] = hf[EMBEDDING]
        if set(hf) != set(self.dtypes):
            raise ModelLoadError(f"the Megatron model's tensors {sorted(set(hf) ^ set(self.dtypes))[:3]} do not match "
                                 "the checkpoint's")
        return {k: hf[k].detach() for k in self.dtypes}

    # -- PolicyScorer -------------------------------------------------------------------------------------------
    def token_logprobs(self, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int]) -> list[torch.Tensor]:
        """Logprob of every generated token (positions prompt_len .. len-1) under Megatron's one-pass logits,
        [len_i - prompt_len_i] float32 each, by the sampler's log_softmax (as ``PolicyTrainer``)."""
        seqs = [s.to(torch.int64) for s in sequences]
        self.model.eval()
        with torch.no_grad():
            return generated_logprobs(self._logits(seqs), seqs, prompt_lens)

    def step(self, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int],
             advantages: Sequence[float]) -> dict[str, Any]:
        """One REINFORCE step: loss = -sum_i adv_i * sum_t logprob_it / (generated tokens), through Megatron's
        forward and backward on the checkpoint-dtype parameters; their gradients (upcast to fp32) step the fp32
        masters with Adam, and the parameters are re-set from the rounded masters. Returns loss, token count,
        grad norm (of the master gradients) and the new weights version."""
        check_step_inputs(sequences, prompt_lens, advantages)
        seqs = [s.to(torch.int64) for s in sequences]
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        loss, tokens = reinforce_loss(self._logits(seqs), seqs, prompt_lens, advantages)
        loss.backward()
        self.opt.zero_grad(set_to_none=True)
        for name, p in self.params.items():
            if p.grad is not None:
                self.master[name].grad = p.grad.detach().to(torch.float32)
        grad_norm = total_norm(self.master[n].grad for n in self._hf_order)
        self.opt.step()
        self.model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(self.master[name].detach().to(p.dtype))
        self.version += 1
        return {"loss": float(loss.detach()), "tokens": tokens, "grad_norm": grad_norm, "weights_version": self.version}

    def export_bytes(self) -> tuple[bytes, str]:
        """The served weights as safetensors bytes (metadata "weights_version") and their ``weights_digest``."""
        return export_weights(self.weights(), self.version)


def build_policy_trainer(*, config: Mamba2Config, tensors: dict[str, torch.Tensor], contract: Contract,
                         lr: float) -> MegatronPolicyTrainer:
    """The ``aligned_mamba.rl_trainers`` entry point ``megatron`` (called by ``rollout.actors.build_trainer``)."""
    return MegatronPolicyTrainer(config, tensors, contract, lr=lr)
