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
    runs over the shards by the contract's tree, the unsharded bits on every rank; each rank's gradient is its
    columns of the unsharded one (``Ops.token_logprobs_sharded``).
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

    from aligned_mamba.ops.backend import token_logprobs_sharded
    from aligned_mamba.parallel import TPGroup

    pg = parallel_state.get_tensor_model_parallel_group()
    tp = TPGroup.from_torch(pg) if pg.size() > 1 else TPGroup.single()
    return token_logprobs_sharded(rows, tokens, tp.rank, tp.size, tp.all_gather, temperature, contract)
