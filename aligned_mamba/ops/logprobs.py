"""Log-softmax and per-token logprobs, row-invariant by construction.

log_softmax(x) = x - (m + log(sum(exp(x - m)))), m = max(x): max is exact in any order, the
sum is a fixed pairwise tree and exp/log are position-invariant (see ``elementwise``).
"""

from __future__ import annotations

import torch

from . import elementwise as ew
from .reduce import tree_sum


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits (any float dtype) -> [..., V] float32 logprobs."""
    x = logits.to(torch.float32)
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    lse = m + ew.log(tree_sum(ew.exp(x - m))).unsqueeze(-1)
    return x - lse


def log_softmax_backward(out: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gradient of ``log_softmax`` from its output ``out`` [..., V] float32 against g: the logits'
    gradient g - softmax * sum(g) in ``dtype`` (native torch ops: accuracy, not row invariance)."""
    gf = g.to(torch.float32)
    return (gf - torch.exp(out) * gf.sum(-1, keepdim=True)).to(dtype)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Logprob of ``token_ids`` under ``logits``. [..., V], [...] int64 -> [...] float32."""
    lp = log_softmax(logits)
    return lp.gather(-1, token_ids.to(torch.int64).unsqueeze(-1)).squeeze(-1)
