"""The loss side's logprobs: Megatron's output logits through the contract's log-softmax, the sampler's bits."""

from __future__ import annotations

from typing import Any

import torch

from .current import installed


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *,
                   sequence_first: bool | None = None, contract: Any = None,
                   vocab_parallel: bool = False) -> torch.Tensor:
    """The contract's per-token logprobs of Megatron's output logits, as a loss function reads them.

    logits [s, b, V] (``sequence_first=True``) or [b, s, V], any float dtype; tokens: ``labels`` [b, s] integer
    (``sequence_first=None`` infers the layout, refusing s == b). Returns [b, s] float32, differentiable: the
    bits the sampler reports. ``contract`` (default: the installed hook's) picks the backend.
    ``vocab_parallel=True``: logits are this rank's shard [..., V / k] (``parallel_output``); the log-softmax
    runs over the shards by the contract's tree, the unsharded bits on every rank (torch backend only).
    """
    import aligned_mamba

    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or not isinstance(tokens, torch.Tensor) \
            or tokens.dim() != 2:
        raise ValueError("token_logprobs expects logits [s, b, V] or [b, s, V] and labels [b, s] tensors")
    b, s = tokens.shape
    if sequence_first is None:
        if b == s and logits.shape[0] == logits.shape[1] == b:
            raise ValueError(f"logits {list(logits.shape)} with labels [{b}, {s}]: layout ambiguous, pass "
                             "sequence_first=True ([s, b, V]) or False ([b, s, V])")
        sequence_first = tuple(logits.shape[:2]) == (s, b)
    rows = logits.transpose(0, 1) if sequence_first else logits
    if contract is None and (hook := installed()) is not None:
        contract = hook.contract
    if not vocab_parallel:
        return aligned_mamba.token_logprobs(rows, tokens, temperature, contract)
    from megatron.core import parallel_state

    from aligned_mamba.ops.logprobs import check_temperature
    from aligned_mamba.parallel import TPGroup

    check_temperature(temperature)
    if contract is not None and contract.backend != "torch":
        raise ValueError(f"vocab_parallel token_logprobs on the {contract.backend} backend: the sharded "
                         "log-softmax is the torch backend's form only for now")
    pg = parallel_state.get_tensor_model_parallel_group()
    tp = TPGroup.from_torch(pg) if pg.size() > 1 else TPGroup.single()
    return _ShardedTokenLogprobs.apply(rows, tokens, tp, float(temperature))


class _ShardedTokenLogprobs(torch.autograd.Function):
    """``token_logprobs_sharded`` with the vocab-parallel cross entropy's analytic backward, (onehot(label) -
    softmax(x)) / T on this rank's entries. Every rank has the whole loss, so nothing is communicated; through
    the gathered max each rank would get only its share of that (zero-sum) path."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, tokens: torch.Tensor, tp: Any, temperature: float) -> torch.Tensor:
        from aligned_mamba.ops.logprobs.sliced import log_softmax_sharded, token_logprobs_sharded

        lp = token_logprobs_sharded(local, tokens, tp.rank, tp.size, tp.all_gather, temperature)
        ctx.save_for_backward(log_softmax_sharded(local, tp.rank, tp.size, tp.all_gather, temperature),
                              tokens.to(device=local.device, dtype=torch.int64))
        ctx.offset, ctx.temperature, ctx.dtype = tp.rank * local.shape[-1], temperature, local.dtype
        return lp

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        lp_local, tokens = ctx.saved_tensors
        v = lp_local.shape[-1]
        g = grad.to(torch.float32)
        out = -torch.exp(lp_local) * g.unsqueeze(-1)
        ids = tokens - ctx.offset
        mine = ((ids >= 0) & (ids < v)).to(torch.float32)
        out.scatter_add_(-1, ids.clamp(0, v - 1).unsqueeze(-1), (g * mine).unsqueeze(-1))
        return (out / ctx.temperature).to(ctx.dtype), None, None, None
