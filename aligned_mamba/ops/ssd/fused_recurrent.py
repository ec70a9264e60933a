"""The recurrent one-step update (selective state update, SSU): the baseline.

This is how engines decode Mamba2 today: one token per step, the state updated in place. It is
the same math as the chunked scan but another rounding, so its outputs differ from the trainer's
chunked pass from the first decoded token on. Kept to show the mismatch exact replay removes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def recurrent_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> torch.Tensor:
    """One token for each of S sequences; ``state`` [S, H, P, N] float32 is updated in place.

    x [S, H, P], dt [S, H] raw, A [H] fp32, B/C [S, G, N], D [H] or [H, P], dt_bias [H].
    Returns y [S, H, P] in x's dtype.
    """
    H = x.shape[1]
    G = B.shape[1]
    dtf = F.softplus(dt.float() + dt_bias)
    if dt_limit != (0.0, math.inf):
        dtf = dtf.clamp(dt_limit[0], dt_limit[1])
    head_group = torch.arange(H, device=x.device) // (H // G)
    Bh, Ch = B.float()[:, head_group], C.float()[:, head_group]  # [S, H, N]
    xf = x.float()
    decay = torch.exp(dtf * A)[:, :, None, None]
    state.mul_(decay).add_((dtf[:, :, None] * xf)[:, :, :, None] * Bh[:, :, None, :])
    y = (state * Ch[:, :, None, :]).sum(-1)
    Df = D.float()
    y = y + (Df[:, None] if Df.dim() == 1 else Df) * xf
    return y.to(x.dtype)
