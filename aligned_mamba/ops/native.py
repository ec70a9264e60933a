"""The torch backend's position-invariant ops as single loops on the CPU (``native_cpu.c``).

A torch form such as ``elementwise._exp`` is some twenty whole-tensor operations; on the small
tensors of a decode step each costs its dispatch, not its arithmetic. ``native_cpu.c`` runs the
same IEEE operations element by element, in the same order, in one pass, so it gives the torch
forms' bits (tests/test_ops_native.py compares them, special values included) at a fraction of
the time. The torch forms stay the statement of the arithmetic: every function here returns None
where it does not apply (not a contiguous-able CPU tensor of float32/bfloat16, inputs that need a
gradient, or no library), and the caller then runs the torch form.

The library is compiled on first use with the system's C compiler (``cc``, or ``$CC``) into
``$XDG_CACHE_HOME/aligned_mamba`` (default ``~/.cache``), keyed by the source's digest; flags:
``-O3 -ffp-contract=off`` (no fused multiply-adds, no reordered sums). ``ALIGNED_MAMBA_NATIVE=0``
turns it off; where it cannot be built, ``status()`` says why and the torch forms run.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("native_cpu.c")
_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=c11")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_UNARY = {"exp": 0, "log": 1, "log1p": 2, "softplus": 3, "sigmoid": 4, "silu": 5}

_lib: ctypes.CDLL | None = None
_status: str | None = None  # None: not tried yet


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aligned_mamba"


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC", "cc")
    src = _SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join((cc, *_FLAGS)).encode()).hexdigest()[:16]
    for d in (_cache_dir(), Path(tempfile.gettempdir()) / f"aligned_mamba-{os.getuid()}"):
        so = d / f"native_cpu-{key}.so"
        if so.exists():
            return ctypes.CDLL(str(so))
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
            os.close(fd)
        except OSError:
            continue
        try:
            subprocess.run([cc, *_FLAGS, "-o", tmp, str(_SOURCE)], check=True, capture_output=True, text=True)
            os.replace(tmp, so)  # atomic: a concurrent build leaves one complete file
        except subprocess.CalledProcessError as exc:
            os.unlink(tmp)
            lines = exc.stderr.strip().splitlines()
            raise OSError(f"{cc} failed: {lines[-1] if lines else exc}") from None
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return ctypes.CDLL(str(so))
    raise OSError("no writable cache directory")


def _declare(lib: ctypes.CDLL) -> None:
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.am_unary.argtypes = [i, p, p, i64, f]
    lib.am_tree_sum.argtypes = [p, p, i64, i64, p]
    lib.am_rms_norm.argtypes = [p, i, p, p, i, p, p, i, i64, i64, f, p]
    lib.am_gated_norm.argtypes = [p, p, p, p, i, i64, i64, i64, f, p]
    lib.am_tap_sum.argtypes = [p, i, p, p, p, i64, i64, i64, i]
    for fn in (lib.am_unary, lib.am_tree_sum, lib.am_rms_norm, lib.am_gated_norm, lib.am_tap_sum):
        fn.restype = None


def library() -> ctypes.CDLL | None:
    """The loaded library, built on first call; None where it is off or cannot be built."""
    global _lib, _status
    if _status is None:
        if os.environ.get("ALIGNED_MAMBA_NATIVE", "1") == "0":
            _status = "off (ALIGNED_MAMBA_NATIVE=0)"
        else:
            try:
                lib = _build()
                _declare(lib)
                _lib, _status = lib, "on"
            except OSError as exc:
                _status = f"unavailable ({exc}); the torch forms run"
                print(f"aligned_mamba: native CPU ops {_status}", file=sys.stderr)
    return _lib


def status() -> str:
    """"on", or why the native ops are not used."""
    library()
    return _status or "on"


def _ok(*ts: torch.Tensor | None) -> bool:
    grad = torch.is_grad_enabled()
    return all(t is None or (t.is_cpu and t.dtype in _DTYPES and not (grad and t.requires_grad)) for t in ts)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _scratch(n: int) -> torch.Tensor:
    return torch.empty(2 * max(2, 1 << max(0, (n - 1).bit_length())), dtype=torch.float32)


def unary(name: str, x: torch.Tensor, arg: float = 0.0) -> torch.Tensor | None:
    """``elementwise._<name>(x)`` for float32 x (softplus: ``arg`` the threshold), or None."""
    if x.dtype != torch.float32 or not _ok(x) or (lib := library()) is None:
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    lib.am_unary(_UNARY[name], x.data_ptr(), y.data_ptr(), x.numel(), arg)
    return y


def tree_sum(x: torch.Tensor) -> torch.Tensor | None:
    """``reduce.tree_sum`` for float32 x [..., n], or None."""
    if x.dtype != torch.float32 or not _ok(x) or (lib := library()) is None:
        return None
    x = x.contiguous()
    n = x.shape[-1]
    y = x.new_empty(x.shape[:-1])
    scratch = _scratch(n)  # held here: a temporary's memory would be freed before the call
    lib.am_tree_sum(x.data_ptr(), y.data_ptr(), y.numel(), n, scratch.data_ptr())
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``norm.rms_norm(x, weight, eps, out_dtype)`` for x [M, d]; with ``residual`` [M, d] the fused
    add of ``Backend.add_norm`` first (returns (normed, residual + x), the sum in residual's dtype,
    normed from it rounded to out_dtype). None where it does not apply."""
    if out_dtype not in _DTYPES or not _ok(x, weight, residual) or (lib := library()) is None:
        return None
    M, d = x.shape
    x = x.contiguous()
    w = weight.to(out_dtype).contiguous()
    out = torch.empty(M, d, dtype=out_dtype)
    res = res_out = None
    if residual is not None:
        if residual.dtype != torch.promote_types(residual.dtype, x.dtype):
            return None  # the sum would be in another dtype than residual's
        res = residual.contiguous()
        res_out = torch.empty_like(res)
    scratch = _scratch(d)
    lib.am_rms_norm(x.data_ptr(), _DTYPES[x.dtype], _ptr(res), _ptr(res_out),
                    _DTYPES[res.dtype] if res is not None else 0, w.data_ptr(), out.data_ptr(), _DTYPES[out_dtype],
                    M, d, eps, scratch.data_ptr())
    return out, res_out


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   n_groups: int) -> torch.Tensor | None:
    """``norm.gated_rms_norm`` for y, z [M, d] of one dtype, or None."""
    if z.dtype != y.dtype or not _ok(y, z, weight) or (lib := library()) is None:
        return None
    M, d = y.shape
    y, z = y.contiguous(), z.contiguous()
    w = weight.to(y.dtype).contiguous()
    out = torch.empty_like(y)
    scratch = _scratch(d // n_groups)
    lib.am_gated_norm(y.data_ptr(), z.data_ptr(), w.data_ptr(), out.data_ptr(), _DTYPES[y.dtype], M, d, n_groups,
                      eps, scratch.data_ptr())
    return out


def tap_sum(taps: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            activation: bool) -> torch.Tensor | None:
    """``conv1d._tap_sum`` (then SiLU if ``activation``) rounded to taps' dtype: taps [T, K, Cd],
    weight [Cd, K], bias [Cd] or None -> [T, Cd], or None."""
    if not _ok(taps, weight, bias) or (lib := library()) is None:
        return None
    T, K, Cd = taps.shape
    taps = taps.contiguous()
    w = weight.to(torch.float32).contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    out = torch.empty(T, Cd, dtype=taps.dtype)
    lib.am_tap_sum(taps.data_ptr(), _DTYPES[taps.dtype], w.data_ptr(), _ptr(b), out.data_ptr(), T, K, Cd,
                   int(activation))
    return out
