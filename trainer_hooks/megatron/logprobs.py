"""The loss side's logprobs: Megatron's output logits through the contract's log-softmax, so a loss
function reads the bits the sampler reports."""

from __future__ import annotations

from typing import Any

import torch

from .current import installed


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *,
                   sequence_first: bool | None = None, contract: Any = None) -> torch.Tensor:
    """The contract's per-token logprobs of Megatron's output logits, as a loss function reads them.

    logits: the output layer's [s, b, V] (``sequence_first=True``) or the model's returned [b, s, V]
    (any float dtype); tokens: Megatron's ``labels`` [b, s] (integer, the next token at each position).
    ``sequence_first=None`` infers the layout from the shapes and refuses a square (s == b) one.
    Returns [b, s] float32 ``aligned_mamba.token_logprobs(logits / temperature)`` at the labels: the
    bits the sampler reports for those tokens, differentiable through the logits. ``contract`` (default:
    the installed hook's) picks the backend that computes it, as the sampler's contract does.
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
    return aligned_mamba.token_logprobs(rows, tokens, temperature, contract)
