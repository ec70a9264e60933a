"""A stock Nemotron-H (Mamba2 + attention + MLP or MoE) as an engine or trainer composes it from stock
parts today, over the same weights as the project's model, for ``bench_hybrid_h200.py``'s whole-model
and slice cells.

- forward (``stock_forward``): cuBLAS ``F.linear`` for every projection, torch SDPA (flash) for causal
  attention (k, v repeated to the query heads first, as transformers' repeat_kv), torch's conv1d +
  SiLU, mamba_ssm's ``mamba_chunk_scan_combined``, gated RMSNorm and fused add + RMSNorm, torch's relu
  and square; MoE: the router as fp32 cuBLAS + sigmoid + ``torch.topk`` (transformers'), the routed
  experts through ``torch._grouped_mm`` over the tokens sorted by expert, a cuBLAS shared expert and
  a torch weighted sum;
- decode (``StockHybrid.step``): the same layers for one token per sequence over a state pool: the
  conv window in torch ops, mamba_ssm's ``selective_state_update`` on an fp32 state, K and V written
  into a [B, G, len, D] cache and SDPA with the group's query heads as its query rows, the MoE as
  above with the expert counts from ``scatter_add_`` (no host read): capturable in a CUDA graph.

Weights: ``p`` maps checkpoint names to tensors; a MoE layer's routed experts come stacked as
``{layer}mixer.experts_up`` [E, f, d] and ``experts_down`` [E, d, f] (the project's MoE layer on a
GPU holds exactly these, so the two models share one copy of the experts).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping
from types import SimpleNamespace

import torch
import torch.nn.functional as F

NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"  # 23 Mamba2, 23 MoE, 6 attention
H8B_PATTERN = "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-M-M-M-M-"  # 24 Mamba2, 4 attention, 24 MLP
# Nemotron-3-Nano-30B-A3B's shape (issue 30) and Nemotron-H-8B's (issue 29); chunk 256 for the scan
NANO = dict(hybrid_override_pattern=NANO_PATTERN, vocab_size=131072, hidden_size=2688, num_attention_heads=32,
            num_key_value_heads=2, head_dim=128, ssm_state_size=128, mamba_num_heads=64, mamba_head_dim=64,
            n_groups=8, chunk_size=256, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
            moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5, n_group=1, topk_group=1)
H8B = dict(hybrid_override_pattern=H8B_PATTERN, vocab_size=131072, hidden_size=4096, num_attention_heads=32,
           num_key_value_heads=8, head_dim=128, intermediate_size=21504, ssm_state_size=128, mamba_num_heads=128,
           mamba_head_dim=64, n_groups=8, chunk_size=256)


def draw(name: str, shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """One weight on ``g``'s device with Mamba2's init where it has one (A in [-16, -1], softplus(dt_bias)
    log-uniform in [1e-3, 1e-1], D = 1), norms near 1, projections N(0, 1 / fan_in)."""
    f32, dev = torch.float32, g.device
    u = torch.empty(shape, dtype=f32, device=dev)
    if name.endswith(".A_log"):
        return torch.log(u.uniform_(1.0, 16.0, generator=g))
    if name.endswith(".dt_bias"):
        dt = torch.exp(u.uniform_(math.log(1e-3), math.log(1e-1), generator=g))
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith(".D"):
        return torch.ones(shape, dtype=f32, device=dev)
    if name.endswith("e_score_correction_bias"):
        return u.uniform_(0.0, 0.01, generator=g)
    if name.endswith("conv1d.weight"):
        return u.uniform_(-0.5, 0.5, generator=g).to(dtype)
    if name.endswith(".bias"):
        return (0.02 * u.normal_(generator=g)).to(dtype)
    if "norm" in name:
        return (1.0 + 0.05 * u.normal_(generator=g)).to(dtype)
    if name.endswith("embeddings.weight"):
        return u.normal_(generator=g).to(dtype)
    return (u.normal_(generator=g) / math.sqrt(shape[-1])).to(dtype)


class LazyWeights(Mapping):
    """A model's weights drawn on the GPU when first read, each from its own seed (name and ``seed``):
    routed-expert tensors are drawn on every read and not kept, so building the project's model (which
    stacks each MoE layer's experts into one tensor) holds one copy of the experts, not two."""

    def __init__(self, config, seed: int, device: str = "cuda") -> None:
        from aligned_mamba.models.nemotron_h import expected_shapes

        self.shapes = expected_shapes(config)
        self.device = device
        self.dtype = config.torch_dtype
        self.seed = seed
        self.kept: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.kept:
            return self.kept[name]
        if name not in self.shapes:
            raise KeyError(name)
        g = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        t = draw(name, self.shapes[name], self.dtype, g)
        if ".experts." not in name:
            self.kept[name] = t
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def stock_weights(config, model, weights: Mapping) -> dict:
    """The stock model's tensors: every non-expert weight from ``weights``, each MoE layer's stacked
    experts from the project's built ``model`` (its MoE mixers' ``up_w`` / ``down_w``)."""
    p = {}
    for i, kind in enumerate(config.hybrid_override_pattern):
        pre = f"backbone.layers.{i}."
        if kind == "E":
            mixer = model.blocks[i].mixer  # lists of per-expert weights on the torch backend
            up, down = mixer.up_w, mixer.down_w
            p[pre + "mixer.experts_up"] = up if isinstance(up, torch.Tensor) else torch.stack(up)
            p[pre + "mixer.experts_down"] = down if isinstance(down, torch.Tensor) else torch.stack(down)
    for name in weights.shapes if isinstance(weights, LazyWeights) else weights:
        if ".experts." not in name:
            p[name] = weights[name]
    return p


def stock_moe(c, p: dict, m: str, x: torch.Tensor) -> torch.Tensor:
    """Nemotron-H's MoE on x [T, d] (model dtype) the stock way (module docstring); no host reads."""
    E, k = c.n_routed_experts, c.num_experts_per_tok
    if c.n_group != 1:
        raise ValueError("the stock MoE routes without expert groups (n_group 1)")
    scores = torch.sigmoid(F.linear(x.float(), p[m + "gate.weight"].float()))
    idx = torch.topk(scores + p[m + "gate.e_score_correction_bias"].float(), k, dim=-1).indices
    w = scores.gather(1, idx)
    if c.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * c.routed_scaling_factor
    T = x.shape[0]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // k]
    a = torch.square(torch.relu(torch._grouped_mm(xs, p[m + "experts_up"].transpose(1, 2), offs=offs)))
    y = torch._grouped_mm(a, p[m + "experts_down"].transpose(1, 2), offs=offs)
    out = torch.empty_like(y)
    out[order] = y
    routed = (out.view(T, k, -1).float() * w[..., None]).sum(1).to(x.dtype)
    shared = F.linear(torch.square(torch.relu(F.linear(x, p[m + "shared_experts.up_proj.weight"]))),
                      p[m + "shared_experts.down_proj.weight"])
    return routed + shared


def stock_forward(c, p: dict, ids: torch.Tensor, ms) -> torch.Tensor:
    """Nemotron-H as a stock trainer runs it on a batch ids [B, L] of equal lengths: logits [B, L, V]."""
    scan, gated_norm, add_norm = ms[:3]
    eps = c.layer_norm_epsilon
    Bsz, L = ids.shape
    x, residual = p["backbone.embeddings.weight"][ids], None
    for i, kind in enumerate(c.hybrid_override_pattern):
        pre = f"backbone.layers.{i}."
        normed, residual = add_norm(x, p[pre + "norm.weight"], None, residual=residual, prenorm=True, eps=eps)
        m = pre + "mixer."
        if kind == "M":
            Hm, P, Gm, N = c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size
            di = Hm * P
            z, xbc, dt = F.linear(normed, p[m + "in_proj.weight"]).split([di, di + 2 * Gm * N, Hm], dim=-1)
            xbc = F.silu(F.conv1d(xbc.transpose(1, 2), p[m + "conv1d.weight"], p[m + "conv1d.bias"],
                                  padding=c.conv_kernel - 1, groups=xbc.shape[-1])[..., :L]).transpose(1, 2)
            xs, Bm, Cm = xbc.split([di, Gm * N, Gm * N], dim=-1)
            y = scan(xs.reshape(Bsz, L, Hm, P), dt, -torch.exp(p[m + "A_log"].float()), Bm.reshape(Bsz, L, Gm, N),
                     Cm.reshape(Bsz, L, Gm, N), chunk_size=c.chunk_size, D=p[m + "D"], z=None,
                     dt_bias=p[m + "dt_bias"], dt_softplus=True)
            y = gated_norm(y.reshape(Bsz, L, di), p[m + "norm.weight"], None, z=z, eps=eps, group_size=di // Gm,
                           norm_before_gate=False)
            x = F.linear(y, p[m + "out_proj.weight"])
        elif kind == "*":
            Hq, Gk, Dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            q = F.linear(normed, p[m + "q_proj.weight"]).view(Bsz, L, Hq, Dh).transpose(1, 2)
            k = F.linear(normed, p[m + "k_proj.weight"]).view(Bsz, L, Gk, Dh).transpose(1, 2)
            v = F.linear(normed, p[m + "v_proj.weight"]).view(Bsz, L, Gk, Dh).transpose(1, 2)
            k, v = k.repeat_interleave(Hq // Gk, dim=1), v.repeat_interleave(Hq // Gk, dim=1)
            from torch.nn.attention import SDPBackend, sdpa_kernel
            backends = [SDPBackend.FLASH_ATTENTION] if q.is_cuda else [SDPBackend.MATH]
            with sdpa_kernel(backends):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=Dh ** -0.5)
            x = F.linear(o.transpose(1, 2).reshape(Bsz, L, Hq * Dh), p[m + "o_proj.weight"])
        elif kind == "E":
            x = stock_moe(c, p, m, normed.reshape(Bsz * L, -1)).view(Bsz, L, -1)
        else:
            x = F.linear(torch.square(torch.relu(F.linear(normed, p[m + "up_proj.weight"]))), p[m + "down_proj.weight"])
    normed, _ = add_norm(x, p["backbone.norm_f.weight"], None, residual=residual, prenorm=True, eps=eps)
    return F.linear(normed, p["lm_head.weight"])


class StockHybrid:
    """The stock decode step over a state pool of B sequences (slot b holds batch row b)."""

    def __init__(self, config, p: dict, ms) -> None:
        self.c, self.p = config, p
        self.scan, self.gated_norm, self.add_norm, self.ssu = ms
        c = config
        H, P, N = c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size
        self.mamba = {}
        for i, kind in enumerate(c.hybrid_override_pattern):
            if kind != "M":
                continue
            m = f"backbone.layers.{i}.mixer."
            A, D, bias = -torch.exp(p[m + "A_log"].float()), p[m + "D"].float(), p[m + "dt_bias"].float()
            w = p[m + "conv1d.weight"]
            # selective_state_update's Mamba2 call: per-head scalars broadcast over the head dim (stride 0);
            # the conv taps along dim 0 in fp32 ([K, Cd]): an engine prepares these once
            self.mamba[i] = SimpleNamespace(taps=w[:, 0, :].float().t().contiguous(),
                                            bias=p[m + "conv1d.bias"].float(), A=A[:, None, None].expand(H, P, N),
                                            D=D[:, None].expand(H, P), dt_bias=bias[:, None].expand(H, P))

    def new_state(self, B: int, max_len: int, seed: int = 0, zero: bool = False) -> dict:
        """Per Mamba2 layer an fp32 SSM state [B, H, P, N] and a conv window [B, K-1, Cd]; per attention
        layer K and V [B, G, max_len, D]; random unless ``zero`` (stock's bits are never compared)."""
        c = self.c
        dev, dt = self.p["lm_head.weight"].device, c.torch_dtype
        g = torch.Generator(device=dev).manual_seed(seed)
        conv_dim = c.mamba_num_heads * c.mamba_head_dim + 2 * c.n_groups * c.ssm_state_size
        st: dict = {}
        for i, kind in enumerate(c.hybrid_override_pattern):
            if kind == "M":
                shapes = dict(ssm=((B, c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size), torch.float32),
                              conv=((B, c.conv_kernel - 1, conv_dim), dt))
            elif kind == "*":
                kv = (B, c.num_key_value_heads, max_len, c.head_dim)
                shapes = dict(k=(kv, dt), v=(kv, dt))
            else:
                continue
            st[i] = {n: (torch.zeros(s, dtype=d, device=dev) if zero else
                         torch.randn(s, device=dev, generator=g).mul_(0.3).to(d)) for n, (s, d) in shapes.items()}
        return st

    def step(self, st: dict, ids: torch.Tensor, pos: int) -> torch.Tensor:
        """One token for each of the B sequences, all at position ``pos`` (attention reads keys 0..pos):
        ids [B] int64 on the device -> logits [B, vocab]. Device work only: capturable in a CUDA graph."""
        c, p = self.c, self.p
        eps = c.layer_norm_epsilon
        Bn = ids.shape[0]
        x, residual = p["backbone.embeddings.weight"][ids], None
        for i, kind in enumerate(c.hybrid_override_pattern):
            pre = f"backbone.layers.{i}."
            normed, residual = self.add_norm(x, p[pre + "norm.weight"], None, residual=residual, prenorm=True,
                                             eps=eps)
            m = pre + "mixer."
            if kind == "M":
                Hm, P, Gm, N = c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size
                di, ly, s = Hm * P, self.mamba[i], st[i]
                z, xbc, dt = F.linear(normed, p[m + "in_proj.weight"]).split([di, di + 2 * Gm * N, Hm], dim=-1)
                stream = torch.cat([s["conv"], xbc[:, None]], dim=1)  # [B, K, Cd]: the window, then the token
                s["conv"].copy_(stream[:, 1:])
                xc = F.silu((stream.float() * ly.taps).sum(1) + ly.bias).to(x.dtype)
                xs, Bm, Cm = xc.split([di, Gm * N, Gm * N], dim=-1)
                y = self.ssu(s["ssm"], xs.reshape(Bn, Hm, P), dt[:, :, None].expand(Bn, Hm, P), ly.A,
                             Bm.reshape(Bn, Gm, N), Cm.reshape(Bn, Gm, N), D=ly.D, z=None, dt_bias=ly.dt_bias,
                             dt_softplus=True)
                y = self.gated_norm(y.reshape(Bn, di), p[m + "norm.weight"], None, z=z, eps=eps, group_size=di // Gm,
                                    norm_before_gate=False)
                x = F.linear(y, p[m + "out_proj.weight"])
            elif kind == "*":
                Hq, Gk, Dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
                kc, vc = st[i]["k"], st[i]["v"]
                q = F.linear(normed, p[m + "q_proj.weight"]).view(Bn, Gk, Hq // Gk, Dh)
                kc[:, :, pos] = F.linear(normed, p[m + "k_proj.weight"]).view(Bn, Gk, Dh)
                vc[:, :, pos] = F.linear(normed, p[m + "v_proj.weight"]).view(Bn, Gk, Dh)
                o = F.scaled_dot_product_attention(q, kc[:, :, :pos + 1], vc[:, :, :pos + 1], scale=Dh ** -0.5)
                x = F.linear(o.reshape(Bn, Hq * Dh), p[m + "o_proj.weight"])
            elif kind == "E":
                x = stock_moe(c, p, m, normed)
            else:
                x = F.linear(torch.square(torch.relu(F.linear(normed, p[m + "up_proj.weight"]))),
                             p[m + "down_proj.weight"])
        normed, _ = self.add_norm(x, p["backbone.norm_f.weight"], None, residual=residual, prenorm=True, eps=eps)
        return F.linear(normed, p["lm_head.weight"])
