"""``dot_acc``, the dot every SSD Triton kernel accumulates with, in the contract's precision (``bf16_dots``):
a row of the result depends on that row of ``a`` and on ``b`` only, at the kernels' tile shapes. Kernels running
its tensor-core modes compile with ``enable_fp_fusion=False`` (why: docs/design.md, "How the bits are kept")."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DOT_MODES = {"split2": 1, "round": 2}


def tensor_core_dots(dtype: torch.dtype, bf16_dots: str) -> int:
    """The kernels' ``TC``: 0 (fp32 FMA dots) unless ``dtype`` is bf16, then ``DOT_MODES[bf16_dots]``."""
    if bf16_dots not in DOT_MODES:
        raise ValueError(f"bf16_dots must be one of {sorted(DOT_MODES)}, not {bf16_dots!r}")
    return DOT_MODES[bf16_dots] if dtype == torch.bfloat16 else 0


@triton.jit
def _split(v):
    hi = v.to(tl.bfloat16)
    lo = (v - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def dot_acc(acc, a, b, TC: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b; acc fp32 [M, N], a [M, K] and b [K, N] fp32 (or bf16). TC 0: ``tl.dot`` at PRECISION;
    1 ("split2"): bf16 tensor-core dots, the fp32 operand (SPLIT 1: a, 2: b, 0: neither) split into
    hi + lo, hi first; 2 ("round"): the fp32 operand rounded to bf16, one dot (mamba_ssm's precision)."""
    if TC == 2:
        acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif TC:
        if SPLIT == 1:
            hi, lo = _split(a.to(tl.float32))
            b16 = b.to(tl.bfloat16)
            acc = tl.dot(hi, b16, acc)
            acc = tl.dot(lo, b16, acc)
        elif SPLIT == 2:
            a16 = a.to(tl.bfloat16)
            hi, lo = _split(b.to(tl.float32))
            acc = tl.dot(a16, hi, acc)
            acc = tl.dot(a16, lo, acc)
        else:
            acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        acc += tl.dot(a, b, input_precision=PRECISION)
    return acc


__all__ = ["DOT_MODES", "dot_acc", "tensor_core_dots"]
