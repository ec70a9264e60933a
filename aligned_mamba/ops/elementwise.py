"""Position-invariant transcendental functions.

ATen computes the tail of a vectorised elementwise loop (and the tail of each thread's range)
with the scalar libm function, the rest with SLEEF, and the two disagree in the last bit for a
fraction of inputs (measured on torch 2.13 CPU: ``sigmoid`` 777 and ``softplus`` 1,463 of 20,000
elements). Which elements fall in a tail depends on the tensor's size and the thread count, so
an element's bits would depend on the rest of the call. These functions use only IEEE basic
operations (+, -, *, /, floor and integer bit manipulation), each a separate kernel (no fused
multiply-add), so every element is a fixed function of its own input, whatever the shape.

All functions take and return float32 tensors (any shape); accuracy is within 4 ulp of a float64
reference for normal inputs (tests/test_ops_elementwise.py measures it); nan propagates.
"""

from __future__ import annotations

import torch

_LOG2E = 1.44269504088896341
# Cody-Waite split of ln 2 (cephes): C1 is exact in a few bits so n * C1 is exact.
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
_EXP_HI = 88.3762626647949
_EXP_LO = -87.3365447505531  # below this exp underflows to a denormal; we return 0
_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in float32: 0 below -87.3 (where exp would be subnormal), 2.4e38 above 88.38.

    n = round(x / ln2), r = x - n ln2 (Cody-Waite, two steps), exp(r) by cephes' polynomial,
    times 2^n built from the exponent bits (n = -127 gives the bit pattern of 0.0).
    """
    xc = x.clamp(_EXP_LO - 0.7, _EXP_HI)
    # round to nearest (even) by adding and subtracting 1.5 * 2^23: two exact IEEE adds
    n = (xc * _LOG2E).add_(_ROUND_MAGIC).sub_(_ROUND_MAGIC).clamp_(min=-127.0)
    r = xc.sub_(n * _LN2_HI).sub_(n * _LN2_LO)
    p = r * _EXP_POLY[0] + _EXP_POLY[1]
    for c in _EXP_POLY[2:]:
        p.mul_(r).add_(c)
    p.mul_(r * r).add_(r).add_(1.0)
    scale = n.to(torch.int32).add_(127).bitwise_left_shift_(23).view(torch.float32)
    return p.mul_(scale)


_SQRT_HALF = 0.70710678118654752


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float32 x (x <= 0 gives nan/-inf like libm)."""
    bits = x.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127
    m = ((bits & 0x007FFFFF) | 0x3F800000).view(torch.float32)  # mantissa in [1, 2)
    big = m > (2.0 * _SQRT_HALF)
    m = torch.where(big, m * 0.5, m)  # now in [sqrt(1/2), sqrt(2))
    e = torch.where(big, e + 1, e).to(torch.float32)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    # log(m) = 2 atanh(s) = 2 (s + s^3/3 + ... ), |s| < 0.1716
    p = torch.full_like(s, 1.0 / 11.0)
    for k in (9.0, 7.0, 5.0, 3.0):
        p = p * s2 + 1.0 / k
    p = p * s2
    logm = (s + s * p) * 2.0
    y = e * _LN2_HI + logm
    y = y + e * _LN2_LO
    y = torch.where(x == 0, torch.full_like(y, float("-inf")), y)
    y = torch.where(x < 0, torch.full_like(y, float("nan")), y)
    return torch.where(torch.isnan(x) | (torch.isinf(x) & (x > 0)), x, y)  # nan stays nan, inf stays inf


def log1p(x: torch.Tensor) -> torch.Tensor:
    """log(1 + x) for float32 x > -1, accurate for small x (log(w) * x / (w - 1), w = 1 + x)."""
    w = x + 1.0
    d = w - 1.0
    safe_d = torch.where(d == 0, torch.ones_like(d), d)
    y = log(w) * (x / safe_d)
    y = torch.where(torch.isinf(x) & (x > 0), x, y)
    return torch.where(d == 0, x, y)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """log(1 + exp(x)), returning x itself above ``threshold`` (as torch's softplus does)."""
    y = log1p(exp(torch.minimum(x, torch.full_like(x, threshold))))
    return torch.where(x > threshold, x, y)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (exp(-x) + 1.0)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), written x / (1 + exp(-x))."""
    return x / (exp(-x) + 1.0)
