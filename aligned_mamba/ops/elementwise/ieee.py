"""Position-invariant transcendental functions (and relu^2), the torch form.

Only IEEE basic operations (+, -, *, /, floor, integer bit manipulation), each a separate kernel (no fused
multiply-add), float32 in and out, any shape: within 4 ulp of float64 for normal inputs, nan propagates. Each public
function's backward is the analytic derivative in plain torch (autograd through the bit tricks would be wrong);
without a gradient the bit-exact form runs alone. Why: docs/design.md, "How the bits are kept".
"""

from __future__ import annotations

import torch

_CONSTANTS: dict[tuple[float | int, torch.dtype], torch.Tensor] = {}


def operand(value: float | int, like: torch.Tensor) -> torch.Tensor | float | int:
    """``value`` as a cached 0-dim tensor of like's dtype (float32 or int32 on the CPU; else the number itself):
    the number's bits (both round to like's dtype) without a wrapped tensor per op (twice a small op's time)."""
    if not like.is_cpu or like.dtype not in (torch.float32, torch.int32):
        return value
    key = (value, like.dtype)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.tensor(value, dtype=like.dtype)
    return t


_k = operand

_LOG2E = 1.44269504088896341
# Cody-Waite split of ln 2 (cephes): C1 is exact in a few bits so n * C1 is exact.
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
_EXP_HI = 88.3762626647949
_EXP_LO = -87.3365447505531  # below this exp underflows to a denormal; we return 0
_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in float32: 0 below -87.3 (where exp would be subnormal), 2.4e38 above 88.38. n = round(x / ln2),
    r = x - n ln2 (Cody-Waite), exp(r) by cephes' polynomial, times 2^n from exponent bits (n = -127 gives 0.0)."""
    xc = x.clamp(_EXP_LO - 0.7, _EXP_HI)
    # round to nearest (even) by adding and subtracting 1.5 * 2^23: two exact IEEE adds
    magic = _k(_ROUND_MAGIC, x)
    n = (xc * _k(_LOG2E, x)).add_(magic).sub_(magic).clamp_(min=-127.0)
    r = xc.sub_(n * _k(_LN2_HI, x)).sub_(n * _k(_LN2_LO, x))
    p = r * _k(_EXP_POLY[0], x) + _k(_EXP_POLY[1], x)
    for c in _EXP_POLY[2:]:
        p.mul_(r).add_(_k(c, x))
    p.mul_(r * r).add_(r).add_(_k(1.0, x))
    ni = n.to(torch.int32)
    scale = ni.add_(_k(127, ni)).bitwise_left_shift_(_k(23, ni)).view(torch.float32)
    return p.mul_(scale)


_SQRT_HALF = 0.70710678118654752


def _log(x: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """Natural log of positive normal float32 x (x <= 0 gives nan/-inf like libm). ``finite``: x is never 0,
    negative or +inf, so those are not checked (a nan then gives a finite number: the caller must propagate it)."""
    bits = x.view(torch.int32)
    e = ((bits >> _k(23, bits)) & _k(0xFF, bits)) - _k(127, bits)
    m = ((bits & _k(0x007FFFFF, bits)) | _k(0x3F800000, bits)).view(torch.float32)  # mantissa in [1, 2)
    big = m > _k(2.0 * _SQRT_HALF, x)
    m = torch.where(big, m * _k(0.5, x), m)  # now in [sqrt(1/2), sqrt(2))
    e = torch.where(big, e + _k(1, e), e).to(torch.float32)
    one = _k(1.0, x)
    s = (m - one) / (m + one)
    s2 = s * s
    # log(m) = 2 atanh(s) = 2 (s + s^3/3 + ... ), |s| < 0.1716
    p = s2 * _k(1.0 / 11.0, x) + _k(1.0 / 9.0, x)
    for k in (7.0, 5.0, 3.0):
        p = p * s2 + _k(1.0 / k, x)
    p = p * s2
    logm = (s + s * p) * _k(2.0, x)
    y = e * _k(_LN2_HI, x) + logm
    y = y + e * _k(_LN2_LO, x)
    if finite:
        return y
    y = torch.where(x == 0, float("-inf"), y)
    y = torch.where(x < 0, float("nan"), y)
    return torch.where(torch.isnan(x) | (torch.isinf(x) & (x > 0)), x, y)  # nan stays nan, inf stays inf


def _log1p(x: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """log(1 + x) for float32 x > -1, accurate for small x (log(w) * x / (w - 1), w = 1 + x). ``finite``: x is
    finite and >= 0 (or nan), so ``_log``'s special cases and +inf are not checked (nan still gives nan)."""
    one = _k(1.0, x)
    w = x + one
    d = w - one
    safe_d = torch.where(d == 0, one, d)
    y = _log(w, finite) * (x / safe_d)
    if not finite:
        y = torch.where(torch.isinf(x) & (x > 0), x, y)
    return torch.where(d == 0, x, y)


def _softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """log(1 + exp(x)), returning x itself above ``threshold`` (as torch's softplus does)."""
    # exp of at most the threshold is finite and >= 0 (or nan): log1p's finite case
    y = _log1p(_exp(x.clamp(max=threshold)), finite=True)
    return torch.where(x > _k(threshold, x), x, y)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    one = _k(1.0, x)
    return one / (_exp(-x) + one)


def _silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), written x / (1 + exp(-x))."""
    return x / (_exp(-x) + _k(1.0, x))


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


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 in x's dtype, squared in fp32 and rounded once (position-invariant); any shape, differentiable."""
    r = torch.relu(x.to(torch.float32))
    return (r * r).to(x.dtype)
