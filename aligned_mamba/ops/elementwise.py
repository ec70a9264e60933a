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

Gradients: autograd through the bit tricks would be wrong (the rounding step passes a gradient,
the exponent bits pass none), so each public function is a ``torch.autograd.Function`` whose
forward is the bit-exact implementation (``_exp`` etc., unchanged) and whose backward is the
analytic derivative, computed from the forward's input and output with plain torch ops (the
backward is not part of the bitwise contract). Without a grad-requiring input the implementation
is called directly, so sampler calls pay nothing.
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


def _exp(x: torch.Tensor) -> torch.Tensor:
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


def _log(x: torch.Tensor) -> torch.Tensor:
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


def _log1p(x: torch.Tensor) -> torch.Tensor:
    """log(1 + x) for float32 x > -1, accurate for small x (log(w) * x / (w - 1), w = 1 + x)."""
    w = x + 1.0
    d = w - 1.0
    safe_d = torch.where(d == 0, torch.ones_like(d), d)
    y = _log(w) * (x / safe_d)
    y = torch.where(torch.isinf(x) & (x > 0), x, y)
    return torch.where(d == 0, x, y)


def _softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """log(1 + exp(x)), returning x itself above ``threshold`` (as torch's softplus does)."""
    y = _log1p(_exp(torch.minimum(x, torch.full_like(x, threshold))))
    return torch.where(x > threshold, x, y)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (_exp(-x) + 1.0)


def _silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), written x / (1 + exp(-x))."""
    return x / (_exp(-x) + 1.0)


# -- differentiable wrappers: forward = the bit-exact implementation, backward = the derivative ----------


class _Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = _exp(x)
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        x, y = ctx.saved_tensors
        # flat where the input was clamped from above (below, y is already 0)
        return torch.where(x > _EXP_HI, torch.zeros_like(g), g * y)


class _Log(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _log(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g / x


class _Log1p(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _log1p(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g / (x + 1.0)


class _Softplus(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, threshold: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.threshold = threshold
        return _softplus(x, threshold)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return torch.where(x > ctx.threshold, g, g * torch.sigmoid(x)), None


class _Sigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _sigmoid(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        # s (1 - s) as sigmoid(x) sigmoid(-x): no cancellation where s rounds to 1
        return g * (torch.sigmoid(x) * torch.sigmoid(-x))


class _Silu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _silu(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s * (1.0 + x * torch.sigmoid(-x)))


def _grad(x: torch.Tensor) -> bool:
    return x.requires_grad and torch.is_grad_enabled()


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in float32, position-invariant (see ``_exp``); d/dx = exp(x) (0 where clamped)."""
    return _Exp.apply(x) if _grad(x) else _exp(x)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float32 x (see ``_log``); d/dx = 1/x."""
    return _Log.apply(x) if _grad(x) else _log(x)


def log1p(x: torch.Tensor) -> torch.Tensor:
    """log(1 + x) for float32 x > -1 (see ``_log1p``); d/dx = 1/(1 + x)."""
    return _Log1p.apply(x) if _grad(x) else _log1p(x)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """log(1 + exp(x)), returning x itself above ``threshold`` (as torch's softplus does); d/dx = sigmoid(x)."""
    return _Softplus.apply(x, threshold) if _grad(x) else _softplus(x, threshold)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in float32; d/dx = s (1 - s)."""
    return _Sigmoid.apply(x) if _grad(x) else _sigmoid(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), written x / (1 + exp(-x)); d/dx = s (1 + x (1 - s))."""
    return _Silu.apply(x) if _grad(x) else _silu(x)
