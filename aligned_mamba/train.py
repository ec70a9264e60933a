"""The reference trainer (REINFORCE, Adam, fp32 masters) and the pieces every policy trainer shares.

Scoring and the step run one ``CausalLM`` forward on the served (checkpoint-dtype) weights, so the scored
logprobs are the sampler's bits and the gradient is taken at the logits sampled from.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .contract import Contract
from .errors import TrainingDiverged
from .models import CausalLM, build_model
from .ops.backend import token_logprobs
from .ops.logprobs import check_temperature
from .parallel import TPGroup, differentiable, merge_gradients


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order: the identity of a weights version."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def weights_to_bytes(tensors: dict[str, torch.Tensor], version: int) -> bytes:
    """Safetensors bytes of ``tensors`` with the version in the metadata."""
    return save_safetensors({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                            metadata={"format": "pt", "weights_version": str(version)})


def weights_from_bytes(blob: bytes) -> dict[str, torch.Tensor]:
    return load_safetensors(blob)


class PackedScoring:
    """``token_logprobs`` of a trainer whose ``forward(sequences, packed=True)`` gives its whole sequences' raw logits
    as the one [sum len_i, vocab] tensor, scored by its contract's log-softmax (``generated_logprobs``)."""

    contract: Contract
    forward: Callable[..., list[torch.Tensor] | torch.Tensor]  # each trainer's own, with ``packed=``

    def token_logprobs(self, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int],
                       temperature: float = 1.0) -> list[torch.Tensor]:
        """float32 logprob of each generated token under logits / ``temperature``: [len_i - prompt_len_i]."""
        seqs = [s.to(torch.int64) for s in sequences]
        return generated_logprobs(self.forward(seqs, packed=True), seqs, prompt_lens, temperature,
                                  contract=self.contract)


class PolicyTrainer(PackedScoring):
    """The "reference" ``integrations.Trainer`` over a checkpoint's ``tensors`` (any family): each update is
    rounded back to their dtypes, which ``weights()`` serves. Masters and Adam's state are made at the first
    ``step``, so a trainer that only scores holds the weights once. ``tp``: this process is one rank of that
    group (``tp_reference.TPTrainer`` runs one in each): the masters stay whole, the model is the rank's, the
    all-gathers pass gradients and the gradients are merged over the ranks (``parallel.merge_gradients``)."""

    def __init__(self, config: Any, tensors: dict[str, torch.Tensor], contract: Contract, *,
                 lr: float = 1e-4, tp: TPGroup | None = None) -> None:
        check_lr(lr)
        self.tp = tp  # one rank of a group: its model is the rank's, the masters whole (tp_reference.TPTrainer)
        self.config = config
        self.contract = contract
        self.lr = lr
        self.dtypes = {k: v.dtype for k, v in tensors.items()}
        self._served = {k: v.detach() for k, v in tensors.items()}
        self.master: dict[str, torch.Tensor] | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.version = 0
        self._model: CausalLM | None = None

    def weights(self) -> dict[str, torch.Tensor]:
        """The served weights: the masters rounded to the checkpoint dtypes (detached)."""
        if self.master is None:
            return dict(self._served)
        return {k: v.detach().to(self.dtypes[k]) for k, v in self.master.items()}

    def model(self) -> CausalLM:
        """The scoring model on the served weights (no autograd)."""
        if self._model is None:
            self._model = build_model(self.config, self.weights(), self.contract, tp=self.tp)
        return self._model

    def forward(self, sequences: Sequence[torch.Tensor], *, packed: bool = False) -> list[torch.Tensor] | torch.Tensor:
        """Raw logits of whole sequences in one pass: list of [len_i] int64 -> list of [len_i, vocab]
        (``packed``: the one [sum len_i, vocab])."""
        with torch.no_grad():
            return self.model().forward([s.to(torch.int64) for s in sequences], packed=packed)

    score = forward

    def step(self, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int],
             advantages: Sequence[float]) -> dict[str, Any]:
        """One REINFORCE step (``reinforce_loss``, Adam) on the masters cast to the served dtypes inside the
        graph, so its logits are the scored ones. Returns loss, tokens, grad_norm and weights_version."""
        check_step_inputs(sequences, prompt_lens, advantages)
        # the triton backend trains too, its forward the same launch: docs/design.md, "Backends"
        if self.master is None:
            self.master = {k: v.to(torch.float32).clone().requires_grad_(True) for k, v in self._served.items()}
            self.opt = torch.optim.Adam(self.master.values(), lr=self.lr)
            self._served = {}
        assert self.opt is not None
        seqs = [s.to(torch.int64) for s in sequences]
        served = {k: v.to(self.dtypes[k]) for k, v in self.master.items()}
        tp = None if self.tp is None else differentiable(self.tp)
        loss, tokens = reinforce_loss(build_model(self.config, served, self.contract, tp=tp).forward(seqs, packed=True),
                                      seqs, prompt_lens, advantages, contract=self.contract)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.tp is not None:
            merge_gradients(self.tp, list(self.master.values()))
        grad_norm = total_norm(p.grad for p in self.master.values())
        check_step_health(loss, grad_norm, self.version)
        self.opt.step()
        self.version += 1
        self._model = None
        return {"loss": float(loss.detach()), "tokens": tokens, "grad_norm": grad_norm, "weights_version": self.version}

    def export_bytes(self) -> tuple[bytes, str]:
        """The served weights as safetensors bytes (version in the metadata) and their digest."""
        return export_weights(self.weights(), self.version)


def make_trainer(*, config: Any, tensors: dict[str, torch.Tensor], contract: Contract, lr: float = 1e-4,
                 tp: int = 1) -> Any:
    """The "reference" trainer's factory (``integrations.trainer_factory``): a ``PolicyTrainer``, or at
    ``tp`` > 1 a ``tp_reference.TPTrainer`` over that many rank processes."""
    if tp != 1:
        from .tp_reference import TPTrainer

        return TPTrainer(config, tensors, contract, tp, lr=lr)
    return PolicyTrainer(config, tensors, contract, lr=lr)


# -- the pieces every policy trainer shares (PolicyTrainer; trainer_hooks.megatron.trainer) -----------------


def check_lr(lr: float) -> None:
    if not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a finite number > 0, got {lr}")


def check_step_health(loss: torch.Tensor, grad_norm: float, version: int) -> None:
    """Before the optimizer step: a non-finite loss or gradient stops training (nothing applied)."""
    if not (math.isfinite(float(loss.detach())) and math.isfinite(grad_norm)):
        raise TrainingDiverged(f"training step {version + 1} diverged: loss {float(loss.detach())}, grad norm "
                               f"{grad_norm}; not applied, weights v{version} kept")


def check_weights_finite(weights: dict[str, torch.Tensor], version: int) -> None:
    """Before export: weights holding NaN or inf are never pushed to a sampler."""
    bad = [k for k, v in weights.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise TrainingDiverged(f"weights v{version} hold non-finite values in {len(bad)} tensor(s) (first {bad[0]}) "
                               "after the step; not exported (lower the learning rate)")


def check_step_inputs(sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int],
                      advantages: Sequence[float]) -> None:
    if not (len(sequences) == len(prompt_lens) == len(advantages)):
        raise ValueError("sequences, prompt_lens and advantages must have the same length")


def reinforce_loss(logits: Sequence[torch.Tensor] | torch.Tensor, sequences: Sequence[torch.Tensor],
                   prompt_lens: Sequence[int], advantages: Sequence[float], *, contract: Contract | None = None
                   ) -> tuple[torch.Tensor, int]:
    """-sum_i adv_i * sum_t logprob_it / (generated tokens) over logits [len_i, vocab] each or packed
    (``generated_logprobs``); (loss, tokens)."""
    lps = generated_logprobs(logits, sequences, prompt_lens, contract=contract)
    tokens = sum(int(lp.numel()) for lp in lps)
    if tokens == 0:
        raise ValueError("no generated tokens to learn from")
    return -sum(float(a) * lp.sum() for a, lp in zip(advantages, lps)) / tokens, tokens


def total_norm(grads: Iterable[torch.Tensor | None]) -> float:
    """The 2-norm of the per-tensor 2-norms, in the given order (None entries skipped)."""
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads if g is not None])))


def export_weights(weights: dict[str, torch.Tensor], version: int) -> tuple[bytes, str]:
    """Safetensors bytes (version in the metadata) and ``weights_digest``; TrainingDiverged if non-finite."""
    check_weights_finite(weights, version)
    return weights_to_bytes(weights, version), weights_digest(weights)


def generated_logprobs(logits: Sequence[torch.Tensor] | torch.Tensor, sequences: Sequence[torch.Tensor],
                       prompt_lens: Sequence[int], temperature: float = 1.0, *,
                       contract: Contract | None = None) -> list[torch.Tensor]:
    """float32 logprob of each generated token under ``logits`` / ``temperature``: [len_i - prompt_len_i]
    each, by the contract's ``token_logprobs`` (the sampler's); differentiable. ``logits``: [len_i, vocab]
    per sequence, or the packed [sum len_i, vocab] (``forward(..., packed=True)``), scored in one call
    over every row so its gradient is one tensor, not the sequences' slices zero-filled and concatenated
    (two logits-sized copies); a row's logprob is the same bits either way."""
    check_temperature(temperature)
    if len(prompt_lens) != len(sequences):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
    if not isinstance(logits, torch.Tensor) and len(logits) != len(sequences):
        raise ValueError(f"{len(sequences)} sequences but {len(logits)} logits tensors")
    for seq, p in zip(sequences, prompt_lens):
        if not 1 <= p <= seq.numel():
            raise ValueError(f"prompt length {p} outside [1, {seq.numel()}]")
    # row t predicts token t + 1: generated token t (t >= p) is scored by row t - 1
    if isinstance(logits, torch.Tensor):
        lens = [int(s.numel()) for s in sequences]
        if logits.dim() != 2 or logits.shape[0] != sum(lens):
            raise ValueError(f"packed logits must be [{sum(lens)}, vocab], got {tuple(logits.shape)}")
        # each sequence's last row predicts past its end: scored at id 0, dropped
        nxt = torch.cat([torch.cat([s[1:].to(torch.int64), s.new_zeros(1, dtype=torch.int64)]) for s in sequences])
        lp = token_logprobs(logits, nxt.to(logits.device), temperature, contract)
        starts = itertools.accumulate(lens, initial=0)
        return [lp[a + p - 1:a + n - 1] for a, n, p in zip(starts, lens, prompt_lens)]
    return [token_logprobs(lg[p - 1:-1], seq[p:].to(lg.device), temperature, contract)
            for lg, seq, p in zip(logits, sequences, prompt_lens)]
