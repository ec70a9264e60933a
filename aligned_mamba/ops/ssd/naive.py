"""fp64 sequential reference of the Mamba2 SSM (the accuracy yardstick, not a fast path): per head,
dt_t = softplus(dt_raw_t + dt_bias) clamped, h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = C_t . h_t + D x_t.
"""

from __future__ import annotations

import torch

from .state import SSMParams


def ssd_naive(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    params: SSMParams,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed sequence token by token in float64: x [T, H, P], dt [T, H] raw, B/C [T, G, N],
    cu_seqlens [S+1], initial_states [S, H, P, N] or None (zeros) -> y [T, H, P], finals [S, H, P, N].
    """
    A, D, dt_bias, dt_limit = params.A, params.D, params.dt_bias, params.dt_limit
    f64 = torch.float64
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    S = cu_seqlens.numel() - 1
    xd, Bd, Cd = x.to(f64), B.to(f64), C.to(f64)
    dtd = torch.nn.functional.softplus(dt.to(f64) + dt_bias.to(f64))
    if params.has_limit:
        dtd = dtd.clamp(dt_limit[0], dt_limit[1])
    Ad = A.to(f64)
    Dd = D.to(f64)
    Dd = Dd[:, None] if Dd.dim() == 1 else Dd
    dev = x.device
    head_group = torch.arange(H, device=dev) // (H // G)
    y = torch.zeros(T, H, P, dtype=f64, device=dev)
    finals = torch.zeros(S, H, P, N, dtype=f64, device=dev)
    for s in range(S):
        h = torch.zeros(H, P, N, dtype=f64, device=dev) if initial_states is None else initial_states[s].to(f64).clone()
        for t in range(int(cu_seqlens[s]), int(cu_seqlens[s + 1])):
            Bt, Ct = Bd[t, head_group], Cd[t, head_group]  # [H, N]
            h = torch.exp(dtd[t] * Ad)[:, None, None] * h + (dtd[t][:, None] * xd[t])[:, :, None] * Bt[:, None, :]
            y[t] = (h * Ct[:, None, :]).sum(-1) + Dd * xd[t]
        finals[s] = h
    return y, finals
