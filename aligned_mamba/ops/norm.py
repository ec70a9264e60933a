"""RMSNorm and Mamba2's grouped, gated RMSNorm, row-invariant by construction.

The sum of squares is a fixed pairwise tree (``reduce.tree_sum``), 1/sqrt is two correctly
rounded IEEE operations, and the gate's SiLU is position-invariant, so a row's bits depend on that
row only.
"""

from __future__ import annotations

import torch

from . import elementwise as ew
from .reduce import tree_sum


def _normalize(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """xf [..., d] float32 -> xf / sqrt(mean(xf^2) + eps)."""
    k = ew.operand  # the constants as 0-dim tensors: the same rounding, half the cost of a Python number
    var = tree_sum(xf * xf) / k(float(xf.shape[-1]), xf)
    return xf * (k(1.0, xf) / torch.sqrt(var + k(eps, xf)))[..., None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm as in Mamba2 checkpoints: weight * (normalised x rounded to out_dtype).

    x [M, d] any float dtype; weight [d]; returns [M, d] in ``out_dtype`` (default weight's dtype).
    """
    out_dtype = out_dtype or weight.dtype
    y = _normalize(x.to(torch.float32), eps).to(out_dtype)
    return weight.to(out_dtype) * y


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, n_groups: int
) -> torch.Tensor:
    """Mamba2's gated norm after the scan: norm_g(y * silu(z)) * weight, normalised per group.

    The gate is applied here, after the scan and before the grouped normalisation (as Hugging
    Face, vLLM and mamba_ssm do for Mamba2), never inside the scan.
    y, z [M, d] (model dtype); weight [d]; d divisible by n_groups. Returns [M, d] in y's dtype.
    """
    M, d = y.shape
    g = y.to(torch.float32) * ew.silu(z.to(torch.float32))
    g = _normalize(g.view(M, n_groups, d // n_groups), eps).view(M, d)
    return weight.to(y.dtype) * g.to(y.dtype)
