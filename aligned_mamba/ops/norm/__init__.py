"""RMSNorm and Mamba2's grouped, gated RMSNorm, with the residual add and the embedding gather that
precede a norm in the model, in their forms side by side.

Signatures (x, residual [M, d]; weight [d]; token_ids [T]):
``rms_norm(x, weight, eps, out_dtype) -> [M, d]``,
``add_norm(x, residual, weight, eps, dtype) -> (normed, residual + x)``,
``embed_norm(token_ids, embedding, weight, eps, dtype, residual_dtype) -> (normed, residual)``,
``gated_rms_norm(y, z, weight, eps, n_groups) -> [M, d]`` (norm_g(y * silu(z)) * weight).

- ``naive.py``: float64, the accuracy reference;
- ``tree.py``: the torch form (a fixed-tree sum of squares, row-invariant);
- ``cpu.py``: ``native_cpu.c``'s loops, the torch form's bits in one pass;
- ``triton.py``: the Triton kernels, their launchers and autograd Functions (the GPU's own bits).
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
