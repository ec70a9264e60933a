"""Log-softmax in float64: the accuracy reference for the other forms."""

from __future__ import annotations

import torch


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[..., V] -> [..., V] float64 logprobs of logits / temperature."""
    return torch.log_softmax(logits.double() / temperature, dim=-1)
