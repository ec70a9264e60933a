"""Position-invariant transcendentals in Triton, operation by operation those of ``ops.elementwise``.

A kernel gets the torch forms' bits from them only when compiled with ``enable_fp_fusion=False`` (an FMA rounds
once); division is ``div_rn`` (IEEE), never Triton's approximate ``/``. Why: docs/design.md, "How the bits are kept".
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .elementwise import ieee as ew

# elementwise's constants as the same doubles: Triton rounds them to fp32 as torch does (nearest-even)
_LOG2E = tl.constexpr(ew._LOG2E)
_LN2_HI = tl.constexpr(ew._LN2_HI)
_LN2_LO = tl.constexpr(ew._LN2_LO)
_EXP_HI = tl.constexpr(ew._EXP_HI)
_EXP_LO_CLAMP = tl.constexpr(ew._EXP_LO - 0.7)
_ROUND_MAGIC = tl.constexpr(ew._ROUND_MAGIC)
_P0 = tl.constexpr(ew._EXP_POLY[0])
_P1 = tl.constexpr(ew._EXP_POLY[1])
_P2 = tl.constexpr(ew._EXP_POLY[2])
_P3 = tl.constexpr(ew._EXP_POLY[3])
_P4 = tl.constexpr(ew._EXP_POLY[4])
_P5 = tl.constexpr(ew._EXP_POLY[5])
_SQRT2 = tl.constexpr(2.0 * ew._SQRT_HALF)
_INV3 = tl.constexpr(1.0 / 3.0)
_INV5 = tl.constexpr(1.0 / 5.0)
_INV7 = tl.constexpr(1.0 / 7.0)
_INV9 = tl.constexpr(1.0 / 9.0)
_INV11 = tl.constexpr(1.0 / 11.0)
_SOFTPLUS_THRESHOLD = tl.constexpr(20.0)


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``), which some loops must allow for."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def exp_exact(x):
    """``elementwise.exp``, step by step. The clamps are NaN-propagating max / min, one instruction each: NaN
    passes, as through torch.clamp."""
    xc = tl.maximum(x, _EXP_LO_CLAMP, propagate_nan=tl.PropagateNan.ALL)
    xc = tl.minimum(xc, _EXP_HI, propagate_nan=tl.PropagateNan.ALL)
    n = xc * _LOG2E
    n = n + _ROUND_MAGIC
    n = n - _ROUND_MAGIC
    n = tl.maximum(n, -127.0, propagate_nan=tl.PropagateNan.ALL)
    r = xc - n * _LN2_HI
    r = r - n * _LN2_LO
    p = r * _P0 + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    p = p * (r * r)
    p = p + r
    p = p + 1.0
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return p * scale


@triton.jit
def log_exact(x):
    """``elementwise.log``, step by step (IEEE division: ``div_rn``, never Triton's approximate ``/``)."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    m = ((bits & 0x007FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    big = m > _SQRT2
    m = tl.where(big, m * 0.5, m)
    ef = tl.where(big, e + 1, e).to(tl.float32)
    s = tl.math.div_rn(m - 1.0, m + 1.0)
    s2 = s * s
    p = _INV11 * s2 + _INV9
    p = p * s2 + _INV7
    p = p * s2 + _INV5
    p = p * s2 + _INV3
    p = p * s2
    logm = (s + s * p) * 2.0
    y = ef * _LN2_HI + logm
    y = y + ef * _LN2_LO
    y = tl.where(x == 0.0, float("-inf"), y)
    y = tl.where(x < 0.0, float("nan"), y)
    return tl.where(x == float("inf"), x, y)


@triton.jit
def softplus_exact(x):
    """softplus of fp32 ``x`` with the bits of ``elementwise.softplus`` (threshold 20)."""
    xm = tl.where(x > _SOFTPLUS_THRESHOLD, _SOFTPLUS_THRESHOLD, x)
    w0 = exp_exact(xm)
    # log1p(w0) as elementwise.log1p: log(w) * (x / (w - 1)), w = 1 + x
    w = w0 + 1.0
    d = w - 1.0
    safe_d = tl.where(d == 0.0, 1.0, d)
    y = log_exact(w) * tl.math.div_rn(w0, safe_d)
    y = tl.where(d == 0.0, w0, y)
    return tl.where(x > _SOFTPLUS_THRESHOLD, x, y)


@triton.jit
def silu_exact(x):
    """``elementwise.silu`` of fp32 ``x``: x / (1 + exp(-x)), IEEE division (compile without fp fusion)."""
    return tl.math.div_rn(x, exp_exact(-x) + 1.0)


@triton.jit
def silu_device(x):
    """SiLU of fp32 ``x`` on the GPU's own exp and division (``ex2.approx``, ``div.full``): x * (1 / (1 +
    exp(-x))), a few instructions; its bits are the architecture's, not ``elementwise.silu``'s."""
    return x * (1.0 / (1.0 + tl.exp(-x)))


@triton.jit
def silu_of(x, DEVICE: tl.constexpr):
    """``silu_device`` if DEVICE (the configs' ``silu == "device"``), else ``silu_exact``."""
    if DEVICE:
        y = silu_device(x)
    else:
        y = silu_exact(x)
    return y


@triton.jit
def dt_softplus_exact(raw, bias, lo, hi, HAS_LIMIT: tl.constexpr):
    """``chunk.dt_softplus`` for one element: softplus(raw + bias) (fp32), clamped to [lo, hi]."""
    d = softplus_exact(raw.to(tl.float32) + bias.to(tl.float32))
    if HAS_LIMIT:
        d = tl.where(d < lo, lo, d)  # torch.clamp: min(max(d, lo), hi), NaN passes
        d = tl.where(d > hi, hi, d)
    return d


@triton.jit
def _dt_softplus_kernel(dt_ptr, bias_ptr, out_ptr, numel, lo, hi, H: tl.constexpr, HAS_LIMIT: tl.constexpr,
                        BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < numel
    raw = tl.load(dt_ptr + i, mask=m, other=0.0)
    bias = tl.load(bias_ptr + i % H, mask=m, other=0.0)
    tl.store(out_ptr + i, dt_softplus_exact(raw, bias, lo, hi, HAS_LIMIT), mask=m)


def has_limit(dt_limit: tuple[float, float]) -> bool:
    return tuple(dt_limit) != (0.0, math.inf)


def limits(dt_limit: tuple[float, float]) -> tuple[float, float]:
    lo, hi = (float(v) for v in dt_limit)
    return lo, hi


def dt_softplus_triton(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float] = (0.0, math.inf)
                       ) -> torch.Tensor:
    """``chunk.dt_softplus`` in one launch, the same bits: dt [..., H] raw (any float dtype), dt_bias [H] -> fp32."""
    H = dt.shape[-1]
    src = dt.contiguous()
    out = torch.empty(dt.shape, dtype=torch.float32, device=dt.device)
    numel = src.numel()
    if numel == 0:
        return out
    lo, hi = limits(dt_limit)
    BLOCK = 1024
    _dt_softplus_kernel[(triton.cdiv(numel, BLOCK),)](
        src, dt_bias.contiguous(), out, numel, lo, hi, H=H, HAS_LIMIT=has_limit(dt_limit), BLOCK=BLOCK,
        num_warps=4, enable_fp_fusion=False,
    )
    return out
