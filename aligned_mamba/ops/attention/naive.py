"""The float64 reference of ``ops.attention`` (shapes: the package docstring), and the shared shape checks."""

from __future__ import annotations

import math

import torch


def _lengths(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cu_q, cu_k = cu_seqlens_q.to("cpu", torch.int64), cu_seqlens_k.to("cpu", torch.int64)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_q.numel() - 1} sequences, cu_seqlens_k {cu_k.numel() - 1}")
    nq, nk = cu_q.diff(), cu_k.diff()
    if bool((nq > nk).any()) or bool((nq < 0).any()):
        raise ValueError("every sequence needs 0 <= queries <= keys (queries are its last positions)")
    return nq, nk


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """H // G, after checking the shapes."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [Tq, H, D], k and v [Tk, G, D] expected; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    return q.shape[1] // k.shape[1]


def attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, *, scale: float) -> torch.Tensor:
    """softmax(scale q . k) @ v per row over exactly its keys, in float64: [Tq, H, D] float64."""
    rep = _check(q, k, v)
    nq, nk = _lengths(cu_seqlens_q, cu_seqlens_k)
    f64 = torch.float64
    out = torch.zeros(q.shape, dtype=f64, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(nq.numel()):
        qs = q[cq[i]:cq[i + 1]].to(f64)                                   # [n_q, H, D]
        ks = k[ck[i]:ck[i + 1]].to(f64).repeat_interleave(rep, dim=1)     # [n_k, H, D]
        vs = v[ck[i]:ck[i + 1]].to(f64).repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        pos = torch.arange(int(nq[i]), device=q.device) + int(nk[i] - nq[i])
        future = torch.arange(int(nk[i]), device=q.device)[None, :] > pos[:, None]
        weights = torch.softmax(scores.masked_fill(future, -math.inf), dim=-1)
        out[cq[i]:cq[i + 1]] = torch.einsum("hqk,khd->qhd", weights, vs)
    return out


__all__ = ["attention_naive"]
