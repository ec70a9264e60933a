"""The float64 reference of a tiny Mamba2ForCausalLM and the tolerance its gradients are held to
(shared by the autograd tests of the torch and Triton backends and of the Megatron hook)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aligned_mamba.ops.ssd import SSMParams, ssd_naive

# fp32 against fp64: measured relative errors (norm of the difference / norm of the reference) are
# 4e-8 .. 2.3e-6 for the scan and up to ~1e-5 for the model; 1e-4 leaves room without hiding a wrong
# formula (a missing or wrong term gives O(1)).
GRAD_RTOL = 1e-4


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64."""
    return float((got.double() - ref).norm() / ref.norm())


MODEL = dict(hidden_size=64, num_heads=4, head_dim=32, state_size=16, num_hidden_layers=2, vocab_size=96,
             conv_kernel=4, chunk_size=16, n_groups=2)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_logits_fp64(config, w: dict[str, torch.Tensor], seq: torch.Tensor) -> torch.Tensor:
    """Mamba2ForCausalLM in float64 from textbook torch ops and ``ssd_naive`` (one sequence)."""
    c = config
    T, d, Cd, eps = seq.numel(), c.intermediate_size, c.conv_dim, c.layer_norm_epsilon
    G, N = c.n_groups, c.state_size
    residual = w["backbone.embeddings.weight"][seq]
    for i in range(c.num_hidden_layers):
        p = f"backbone.layers.{i}."
        m = p + "mixer."
        zxbcdt = _rms(residual, w[p + "norm.weight"], eps) @ w[m + "in_proj.weight"].t()
        z, xBC, dt = zxbcdt[:, :d], zxbcdt[:, d:d + Cd], zxbcdt[:, d + Cd:]
        conv = F.conv1d(xBC.t()[None], w[m + "conv1d.weight"], w[m + "conv1d.bias"], padding=c.conv_kernel - 1,
                        groups=Cd)[0, :, :T].t()
        xBC = F.silu(conv)
        x = xBC[:, :d].reshape(T, c.num_heads, c.head_dim)
        B, C = xBC[:, d:d + G * N].reshape(T, G, N), xBC[:, d + G * N:].reshape(T, G, N)
        y, _ = ssd_naive(x, dt, B, C, SSMParams(-torch.exp(w[m + "A_log"]), w[m + "D"], w[m + "dt_bias"]),
                         torch.tensor([0, T]))
        gated = (y.reshape(T, d) * F.silu(z)).view(T, G, d // G)
        gated = _rms(gated, 1.0, eps).reshape(T, d) * w[m + "norm.weight"]
        residual = residual + gated @ w[m + "out_proj.weight"].t()
    return _rms(residual, w["backbone.norm_f.weight"], eps) @ w["lm_head.weight"].t()
