"""The one dot product every SSD Triton kernel accumulates with, in the precision the contract pins.

``dot_acc(acc, a, b, TC, SPLIT)`` returns ``acc + a @ b`` (fp32 [M, K] x [K, N] -> fp32 [M, N]):

- ``TC=0`` (fp32 models): ``tl.dot`` with ``input_precision=PRECISION`` (the pinned "ieee"): fp32
  operands, fp32 fused multiply-adds on the CUDA cores, k ascending.
- ``TC=1`` ("split2", bf16 models): tensor-core dots with bf16 operands and fp32 accumulation. An
  operand that holds bf16 inputs (x, B, C of a bf16 model, widened to fp32 exactly) is rounded
  back to bf16 without loss. An fp32 operand (the state, the scores, the weighted x) is split into
  ``hi = bf16(v)`` and ``lo = bf16(v - hi)`` and multiplied as two dots, hi first: about 16
  significant bits instead of 8, so the split costs ~2^-17 relative, far below the bf16 output
  rounding (2^-9). ``SPLIT``: 0 both operands exact in bf16, 1 split ``a``, 2 split ``b``.
- ``TC=2`` ("round"): the fp32 operand is rounded to bf16 and multiplied in one dot, as
  mamba_ssm's kernels do (``SPLIT`` only says which operand): half the tensor-core work, with
  about 2^-9 relative error per product instead of 2^-17.

Kernels that run the tensor-core dots are compiled with ``enable_fp_fusion=False``, all of them:
the split's ``v - hi``, next to the product that made ``v``, may be contracted into one fused
multiply-add in one kernel and not in another, and then ``lo`` differs in its last bits. Measured
on the H200 with contraction left on: 7-103 of 64/256 decode sequences had some bf16 output
rounded the other way from the prefill's; with it off, every row is equal (tests/ops/ssd/test_triton_decode.py).

Both are row-invariant (a row of the result depends on that row of ``a`` and on ``b`` only) at the
tile shapes the kernels use, so a decode step that computes one live row in a small row tile gets
the bits a prefill gets for that row in a large one; measured on the H200 (design notes) and
re-checked by the GPU tests for every kernel pair. The two modes give different bits: the
precision is part of the contract (``TritonKernelConfigs.bf16_dots``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# bf16_dots value -> the kernels' TC code (fp32 models always run 0, the fp32 FMA dots)
DOT_MODES = {"split2": 1, "round": 2}


def tensor_core_dots(dtype: torch.dtype, bf16_dots: str) -> int:
    """The kernels' ``TC`` for inputs of ``dtype``: 0 (fp32 FMA dots) unless bf16, then the code of
    the contract's ``bf16_dots`` mode (1 "split2", 2 "round"; see the module docstring)."""
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
    """acc + a @ b; see the module docstring. acc fp32 [M, N]; a [M, K], b [K, N] fp32 (or bf16)."""
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
