"""RMSNorm, the gated RMSNorm, and the residual add and embedding gather fused before a norm.

x, residual [M, d]; weight [d]; token_ids [T]: ``rms_norm(x, weight, eps, out_dtype) -> [M, d]``,
``add_norm(x, residual, weight, eps, dtype) -> (normed, residual + x)``, ``embed_norm(token_ids,
embedding, weight, eps, dtype, residual_dtype) -> (normed, residual)``, ``gated_rms_norm(y, z,
weight, eps, n_groups) -> [M, d]``. Forms: naive (fp64), tree (torch), cpu, triton.
"""

from .tree import (
    add_norm,
    embed_norm,
    gated_rms_norm,
    gated_rms_norm_backward,
    gated_rms_norm_sliced,
    rms_norm,
    rms_norm_backward,
)

__all__ = ["add_norm", "embed_norm", "gated_rms_norm", "gated_rms_norm_backward", "gated_rms_norm_sliced",
           "rms_norm", "rms_norm_backward"]
