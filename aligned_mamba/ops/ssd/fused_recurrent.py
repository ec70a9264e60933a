"""The recurrent SSD update (SSU), as engines decode Mamba2 today: the baseline, whose rounding
differs from the chunked scan's from the first decoded token (kept to show the mismatch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .state import SSMParams


def recurrent_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   params: SSMParams) -> torch.Tensor:
    """One token for each of S sequences, ``state`` [S, H, P, N] fp32 updated in place.
    x [S, H, P], dt [S, H] raw, B/C [S, G, N] -> y [S, H, P] in x's dtype."""
    H = x.shape[1]
    G = B.shape[1]
    dtf = F.softplus(dt.float() + params.dt_bias)
    if params.has_limit:
        dtf = dtf.clamp(params.dt_limit[0], params.dt_limit[1])
    head_group = torch.arange(H, device=x.device) // (H // G)
    Bh, Ch = B.float()[:, head_group], C.float()[:, head_group]  # [S, H, N]
    xf = x.float()
    decay = torch.exp(dtf * params.A)[:, :, None, None]
    state.mul_(decay).add_((dtf[:, :, None] * xf)[:, :, :, None] * Bh[:, :, None, :])
    y = (state * Ch[:, :, None, :]).sum(-1)
    Df = params.D.float()
    y = y + (Df[:, None] if Df.dim() == 1 else Df) * xf
    return y.to(x.dtype)


def ssd_fused_recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    params: SSMParams,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every packed sequence token by token with ``recurrent_step`` (the scan forms' signature):
    initial_states [S, H, P, N] fp32 or None -> y [T, H, P] in x's dtype, final states fp32."""
    T, H, P = x.shape
    N = B.shape[2]
    S = cu_seqlens.numel() - 1
    states = (torch.zeros(S, H, P, N, device=x.device) if initial_states is None
              else initial_states.to(torch.float32).clone())
    y = torch.empty_like(x)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    starts = cu_seqlens[:-1].tolist()
    for j in range(max(lens, default=0)):  # position j of every sequence that has one, in one update
        seqs = [i for i in range(S) if lens[i] > j]
        rows = torch.tensor([starts[i] + j for i in seqs], dtype=torch.int64, device=x.device)
        idx = torch.tensor(seqs, dtype=torch.int64, device=x.device)
        st = states[idx]
        y[rows] = recurrent_step(st, x[rows], dt[rows], B[rows], C[rows], params)
        states[idx] = st
    return y, states
