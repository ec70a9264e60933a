"""The causal conv's CPU form: ``native_cpu.c``'s loops with ``taps.py``'s bits, else ``taps.py``."""

from __future__ import annotations

import torch

from ..native import DTYPES, library, ok, ptr, row_stride, slot_stride
from ..step import Step
from . import taps


def tap_sum(taps: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            activation: bool) -> torch.Tensor | None:
    """``taps.conv_out``: taps [T, K, Cd], weight [Cd, K], bias [Cd] or None -> [T, Cd], or None."""
    if not ok(taps, weight, bias) or (lib := library()) is None:
        return None
    T, K, Cd = taps.shape
    taps = taps.contiguous()
    w = weight.to(torch.float32).contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    out = torch.empty(T, Cd, dtype=taps.dtype)
    work = torch.empty(Cd)
    lib.am_tap_sum(taps.data_ptr(), DTYPES[taps.dtype], w.data_ptr(), ptr(b), out.data_ptr(), T, K, Cd,
                   int(activation), work.data_ptr())
    return out


def conv_step(windows: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None, activation: bool = True) -> torch.Tensor | None:
    """``taps.causal_conv1d_step``, windows [slots, K-1, Cd] updated in place: x [S, Cd] (windows' dtype),
    slots [S] -> [S, Cd] in x's dtype; None (nothing written) where it does not apply."""
    if (not ok(windows, x, weight, bias) or x.dtype != windows.dtype or (lib := library()) is None
            or (ldx := row_stride(x)) is None or (sw := slot_stride(windows)) is None):
        return None
    S, Cd = x.shape
    K = windows.shape[1] + 1
    slots = slots.to(torch.int64).contiguous()
    w = weight.to(torch.float32).contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    out = torch.empty(S, Cd, dtype=x.dtype)
    work = torch.empty(K * Cd + Cd)
    lib.am_conv_step(windows.data_ptr(), sw, slots.data_ptr(), x.data_ptr(), ldx, DTYPES[x.dtype], w.data_ptr(),
                     ptr(b), out.data_ptr(), S, K, Cd, int(activation), work.data_ptr())
    return out


def conv_out(taps_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: bool) -> torch.Tensor:
    """``taps.conv_out`` in one loop where it applies."""
    out = tap_sum(taps_, weight, bias, activation)
    return taps.conv_out(taps_, weight, bias, activation) if out is None else out


def conv_advance(windows: torch.Tensor, step: Step, x: torch.Tensor, w: torch.Tensor,
                 b: torch.Tensor | None) -> torch.Tensor:
    """``taps.conv_advance``: a decode step in one loop (windows in place), others with ``conv_out``."""
    if step.decode_only:
        slots = step.plans[windows.device].slots
        if (out := conv_step(windows, slots, x, w, b)) is not None:  # the same bits, windows in place
            return out
    return taps.conv_advance(windows, step, x, w, b, out_form=conv_out)
