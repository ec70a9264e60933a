"""Stand-ins for running Megatron-Core's MambaModel where mamba_ssm, Transformer Engine or CUDA is missing (the
check, the tests, the benchmarks; never the hook itself). ``setup()`` patches only what the machine lacks;
``init_model_parallel(tp)`` builds Megatron's groups (at TP 1 in a one-rank world, started if none is).

What ``setup()`` changes, and why (megatron-core 0.16.1, ``megatron.core.ssm``):

- ``mamba_mixer.HAVE_MAMBA_SSM = True``: MambaMixer refuses to build without mamba_ssm.
- ``torch.cuda.current_device`` returns "cpu": MambaMixer.__init__ places five tensors on it.
- without CUDA, the CUDA RNG tracker: the inference tracker, whose ``fork()`` is a no-op.
- ``TENorm`` (the final norm MambaStack hard-codes) and ``ExtendedRMSNorm`` (a MagicMock subclass without
  mamba_ssm): torch stand-ins, only where the hook has not installed its own.
- mamba_ssm's two scan ops: torch forms of their semantics, so Megatron's stock forward (hook off) runs (the chunk
  grid over the whole packed stream, reset by ``seq_idx``; the gate inside the scan). Right (tested against fp64), not
  mamba_ssm's bits: the hook-off baseline shows Megatron's stock arrangement of the math, not its kernels.
"""

from __future__ import annotations

import math
import os
import tempfile

import torch
import torch.nn.functional as F

__all__ = ["StockGatedRMSNorm", "StockRMSNorm", "init_model_parallel", "init_single_process", "setup",
           "stock_chunk_scan_combined", "stock_split_conv1d_scan_combined"]

_DONE = False


def setup() -> None:
    """Apply the stand-ins for what is missing (idempotent). Call before building a Megatron Mamba model."""
    global _DONE
    if _DONE:
        return
    from megatron.core.ssm import mamba_block
    from megatron.core.ssm import mamba_mixer as mm
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    if not mm.HAVE_MAMBA_SSM:
        mm.HAVE_MAMBA_SSM = True
        mm.ExtendedRMSNorm = StockGatedRMSNorm
        mm.mamba_split_conv1d_scan_combined = stock_split_conv1d_scan_combined
        mm.mamba_chunk_scan_combined = stock_chunk_scan_combined
        # it asks causal_conv1d / mamba_ssm for their versions; the stand-ins take seq_idx
        mm._check_mamba_sequence_packing_support = lambda for_inference_not_training=True: (True, None)
    if getattr(mamba_block.TENorm, "__module__", "") == "megatron.core.extensions.transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            mamba_block.TENorm = StockRMSNorm
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _DONE = True


def init_single_process() -> None:
    """torch.distributed (gloo, one rank, a file rendezvous) and Megatron's model-parallel groups at size 1."""
    init_model_parallel(1)


def init_model_parallel(tp: int) -> None:
    """Megatron's groups at TP ``tp`` (pipeline 1, one replica): at 1 without a world one is started (gloo, NCCL on
    a GPU); more needs the ``tp`` ranks' world up. Groups built at another size are refused."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if tp != 1:
            raise RuntimeError(f"tensor-parallel size {tp} needs torch.distributed initialised over its ranks first")
        fd, path = tempfile.mkstemp(prefix="aligned_mamba_dist_")
        os.close(fd)
        os.unlink(path)  # the file store creates it
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"file://{path}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        if dist.get_world_size() != tp:
            raise RuntimeError(f"tensor-parallel size {tp} over a world of {dist.get_world_size()} ranks: one model "
                               "replica per world is covered")
        parallel_state.initialize_model_parallel(tp, 1)
    elif parallel_state.get_tensor_model_parallel_world_size() != tp:
        raise RuntimeError(f"Megatron's model-parallel groups are built at tensor-parallel size "
                           f"{parallel_state.get_tensor_model_parallel_world_size()}, not {tp}")
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

        if not get_cuda_rng_tracker().get_states():  # a job that seeded its tracker keeps it
            model_parallel_cuda_manual_seed(0)


# -- stock stand-ins (Megatron's semantics with mamba_ssm, in torch) -------------------------------------


class StockRMSNorm(torch.nn.Module):
    """The final norm MambaStack builds as TENorm: fp32 RMSNorm, output in the weight's dtype."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(self.weight.dtype)


class StockGatedRMSNorm(torch.nn.Module):
    """mamba_ssm's ``layernorm_gated.RMSNorm``: grouped RMSNorm, z applied before (norm_before_gate=False)
    or after the norm; called without z it is a plain grouped RMSNorm (Megatron's training path)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size or hidden_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        xf = x.float()
        if z is not None and not self.norm_before_gate:
            xf = xf * F.silu(z.float())
        g = xf.reshape(*xf.shape[:-1], -1, self.group_size)
        y = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).reshape(xf.shape) * self.weight.float()
        if z is not None and self.norm_before_gate:
            y = y * F.silu(z.float())
        return y.to(x.dtype)


def _stock_conv(xBC: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                seq_idx: torch.Tensor | None) -> torch.Tensor:
    """Causal depthwise conv + SiLU over [b, l, c], not reaching across ``seq_idx`` boundaries (fp32 inside)."""
    b, seqlen, c = xBC.shape
    K = weight.shape[-1]
    out = torch.zeros(b, seqlen, c, dtype=torch.float32, device=xBC.device)
    if bias is not None:
        out = out + bias.float()
    for k in range(K):
        shift = K - 1 - k
        xs = F.pad(xBC.float(), (0, 0, shift, 0))[:, :seqlen]
        if seq_idx is not None and shift:
            same = seq_idx == F.pad(seq_idx, (shift, 0), value=-1)[:, :seqlen]
            xs = xs * same[..., None]
        out = out + weight[:, k].float() * xs
    return F.silu(out).to(xBC.dtype)


def _stock_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                chunk_size: int, D: torch.Tensor | None, seq_idx: torch.Tensor | None) -> torch.Tensor:
    """Chunked SSD as mamba_ssm chunks it (fp32): the grid at multiples of ``chunk_size`` over each row's stream,
    cut where ``seq_idx`` changes. x [b, l, h, p], dt [b, l, h] (softplus'd), A [h], B/C [b, l, g, n], D [h] or
    None -> y [b, l, h, p]."""
    b, seqlen, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    L = chunk_size
    pad = -seqlen % L
    nc = (seqlen + pad) // L
    seq = seq_idx.long() if seq_idx is not None else torch.zeros(b, seqlen, dtype=torch.long, device=x.device)
    seq = F.pad(seq, (0, pad), value=-1).reshape(b, nc, L)  # padding belongs to no sequence

    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = t.float()
        return F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)).reshape(b, nc, L, *t.shape[2:])

    xs, dts = chunks(x), chunks(dt)
    Bs = chunks(B.repeat_interleave(h // g, dim=2))
    Cs = chunks(C.repeat_interleave(h // g, dim=2))
    a = torch.cumsum(dts * A.float(), dim=2)  # [b, nc, L, h]
    same = seq[..., :, None] == seq[..., None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    seg = a[..., :, None, :] - a[..., None, :, :]  # [b, nc, t, s, h]
    decay = torch.where((same & causal)[..., None], torch.exp(torch.clamp(seg, max=0.0)), 0.0)
    scores = torch.einsum("bctHn,bcsHn->bctsH", Cs, Bs) * decay * dts[:, :, None]
    y = torch.einsum("bctsH,bcsHp->bctHp", scores, xs)
    # each chunk's end state from its own tokens (those of the sequence its last token belongs to)
    w_end = torch.exp(a[:, :, -1:] - a) * dts * (seq == seq[..., -1:])[..., None]
    st = torch.einsum("bcsH,bcsHp,bcsHn->bcHpn", w_end, xs, Bs)
    # each chunk's incoming state, kept in a list (no in-place writes, so autograd can run through it)
    inputs = []
    state = torch.zeros(b, h, p, n, device=x.device)
    for c in range(nc):
        carry = (seq[:, c, 0] == seq[:, c - 1, -1]).float()[:, None, None, None] if c else torch.zeros(())
        inputs.append(state * carry)
        whole = (seq[:, c, 0] == seq[:, c, -1]).float()[:, None, None, None]
        state = torch.exp(a[:, c, -1])[:, :, None, None] * inputs[c] * whole + st[:, c]
    h_in = torch.stack(inputs, dim=1)
    first = (seq == seq[..., :1])[..., None, None]
    y = y + torch.einsum("bctHn,bcHpn->bctHp", Cs, h_in) * torch.exp(a)[..., None] * first
    if D is not None:
        Df = D.float()
        y = y + (Df[:, None] if Df.dim() == 1 else Df) * xs
    return y.reshape(b, nc * L, h, p)[:, :seqlen]


def _refuse_uncovered(op: str, **used: bool) -> None:
    """Refuse, naming them, arguments beyond those Megatron's forward passes, rather than ignore them."""
    given = [name for name, on in used.items() if on]
    if given:
        raise ValueError(f"the CPU stand-in of mamba_ssm's {op} does not cover {', '.join(given)}: refused")


def stock_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, math.inf),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):
    """mamba_ssm's fused training-path op (torch stand-in): conv1d + SiLU, the scan, D skip, and with no
    ``rmsnorm_weight`` the gate y * silu(z) inside, before any norm. zxbcdt [b, l, d] -> y [b, l, d_inner]."""
    _refuse_uncovered("mamba_split_conv1d_scan_combined", initial_states=initial_states is not None,
                      return_final_states=return_final_states, outproj_weight=outproj_weight is not None,
                      rmsnorm_weight=rmsnorm_weight is not None, dt_limit=tuple(dt_limit) != (0.0, math.inf))
    b, seqlen, _ = zxbcdt.shape
    H = A.shape[0]
    P = headdim if headdim is not None else D.shape[-1]
    d_inner = H * P
    N = (conv1d_weight.shape[0] - d_inner) // (2 * ngroups)
    z, xBC, dt = torch.split(zxbcdt, [d_inner, d_inner + 2 * ngroups * N, H], dim=-1)
    xBC = _stock_conv(xBC, conv1d_weight, conv1d_bias, seq_idx)
    x, B, C = torch.split(xBC, [d_inner, ngroups * N, ngroups * N], dim=-1)
    dtf = F.softplus(dt.float() + dt_bias.float())
    y = _stock_scan(x.reshape(b, seqlen, H, P), dtf, A, B.reshape(b, seqlen, ngroups, N),
                    C.reshape(b, seqlen, ngroups, N), chunk_size, D, seq_idx).reshape(b, seqlen, d_inner)
    y = y * F.silu(z.float())  # norm_before_gate=False without a norm weight: the gate inside the op
    return y.to(zxbcdt.dtype)


def stock_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                              return_final_states=False, return_varlen_states=False):
    """mamba_ssm's ``mamba_chunk_scan_combined`` (prefill path; torch stand-in without states in or out)."""
    _refuse_uncovered("mamba_chunk_scan_combined", initial_states=initial_states is not None,
                      return_final_states=return_final_states, return_varlen_states=return_varlen_states,
                      dt_limit=tuple(dt_limit) != (0.0, math.inf))
    dtf = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        dtf = F.softplus(dtf)
    y = _stock_scan(x, dtf, A, B, C, chunk_size, D, seq_idx)
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)
