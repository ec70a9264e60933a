"""Log-softmax and per-token logprobs, row-invariant by construction.

log_softmax(x) = x - (m + log(sum(exp(x - m)))), m = max(x): max is exact in any order, the
sum is a fixed pairwise tree and exp/log are position-invariant (see ``elementwise``).

Temperature is one stated operation before it: x = fp32(logits) / fp32(T), IEEE division (correctly
rounded, so position-invariant); T = 1 skips it (x / 1 == x exactly anyway).
"""

from __future__ import annotations

import torch

from . import elementwise as ew
from .reduce import tree_sum


def scale(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The contract's temperature: [..., V] any float dtype -> [..., V] float32 logits / T."""
    t = float(temperature)
    if not (t > 0.0 and t != float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    x = logits.to(torch.float32)
    return x if t == 1.0 else x / torch.tensor(t, dtype=torch.float32, device=x.device)


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[..., V] logits (any float dtype) -> [..., V] float32 logprobs of logits / temperature."""
    x = scale(logits, temperature)
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    lse = m + ew.log(tree_sum(ew.exp(x - m))).unsqueeze(-1)
    return x - lse


def log_softmax_backward(out: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gradient of ``log_softmax`` from its output ``out`` [..., V] float32 against g: the logits'
    gradient g - softmax * sum(g) in ``dtype`` (native torch ops: accuracy, not row invariance)."""
    gf = g.to(torch.float32)
    return (gf - torch.exp(out) * gf.sum(-1, keepdim=True)).to(dtype)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Logprob of ``token_ids`` under ``logits`` / temperature. [..., V], [...] int64 -> [...] float32."""
    lp = log_softmax(logits, temperature)
    return lp.gather(-1, token_ids.to(torch.int64).unsqueeze(-1)).squeeze(-1)
