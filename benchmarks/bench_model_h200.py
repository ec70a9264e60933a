#!/usr/bin/env python3
"""The whole model on one GPU: the project's Mamba2 LM (triton backend, exact replay) against a
stock composition of the parts engines use today, with the same weights in the same process.

    python3 benchmarks/bench_model_h200.py --out OUT/h200_model.json [--quick] [--shapes mamba2-1.3b,...]
    python3 benchmarks/bench_model_h200.py --dry-run --out /tmp/m.json      (CPU: Triton interpreter, tiny shapes)

Shapes: mamba2-130m, -1.3b, -2.7b and one Mamba2 layer of Nemotron-H-8B's mixer (128 heads x 64,
8 groups, a 131072-row lm_head); state 128, chunk 256, bf16 weights (A_log, D, dt_bias fp32) drawn
on the GPU with the realistic Mamba2 init of ``models.tiny`` (A in [-16, -1], softplus(dt_bias)
log-uniform in [1e-3, 1e-1], D = 1).

Ours: ``build_model`` under ``Contract(chunk_size=256, backend="triton", model_dtype="bfloat16")``;
the trainer's forward is ``model.forward`` (all logits), a decode step is ``model.advance`` (eager)
or ``DecodeGraphs.step`` (one CUDA graph per batch-size bucket).
Stock: bf16 ``F.linear`` (cuBLAS) for in_proj / out_proj / lm_head, torch RMSNorms with the residual
in fp32, the gated grouped RMSNorm in torch ops, torch conv1d (``F.conv1d`` for prefill, a window
update in torch ops for decode), mamba_ssm's ``mamba_chunk_scan_combined`` for prefill and
``selective_state_update`` over an fp32 state pool indexed by slot for decode; its decode step is
captured in one ``torch.cuda.CUDAGraph``. mamba_ssm's Triton files come from .anchors/ (see
benchmarks/README.md); without them the stock columns are null. Its autotuners are reset at each
shape (their keys are the same at every shape here), so each model's stock prefill is tuned at its
own first forward, 4 x 2048 tokens.

Forward: 4 x 2048 and 1 x 32768 tokens, all logits; CUDA-event medians after a first (JIT) call.
Decode: batch 1 / 64 / 256, each sequence already holding L k + U[0, L) tokens (k < --max-chunks),
prefilled through ``model.advance``; the stock state is random (its bits are not compared). Each
timed step decodes the next token of every sequence (positions advance, so chunks complete as in
serving) and starts on an idle GPU, as in an engine that samples on the host after every step: the
time includes the step's host work (tables, launches) as well as the GPU's. Bytes moved per step
(weights once; ours: the fp32 state read once per sequence and layer plus the buffered rows; stock:
the state read and written; both: the conv windows and the logits) are set against the measured
device-to-device copy bandwidth.
Bits, per decode cell: the graph step's logits rows ``torch.equal`` to a single-pass prefill
(``model.advance`` of a fresh cache over each sequence's history and the new token; at most
``CHECK_BYTES`` of fresh state, so the big shapes check a subset), to the eager step's rows (every
row), and to ``model.forward``'s last rows for up to 4 sequences.

The JSON (written after every entry: a timeout keeps what was measured) names the GPU, torch,
triton, the commit (GIT_COMMIT if set, else git's HEAD), the date and the copy bandwidth; a short
table is printed last. ``--dry-run`` runs every path that needs no CUDA (no graphs, no timing) with
torch stand-ins for mamba_ssm's kernels, and checks the schema.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "benchmarks/bench_model_h200.py"

# name -> (layers, hidden, heads, head_dim, groups, state, vocab)
SHAPES = {
    "mamba2-130m": (24, 768, 24, 64, 1, 128, 50280),
    "mamba2-1.3b": (48, 2048, 64, 64, 1, 128, 50280),
    "mamba2-2.7b": (64, 2560, 80, 64, 1, 128, 50280),
    "nemotronh8b_mixer": (1, 4096, 128, 64, 8, 128, 131072),
}
TINY_SHAPES = {
    "tiny-2l": (2, 64, 2, 32, 1, 16, 128),
    "tiny-mixer-2g": (1, 64, 2, 32, 2, 16, 128),
}
FORWARD = [("4x2048", [2048] * 4), ("1x32768", [32768])]
TINY_FORWARD = [("2x40", [40, 40]), ("1x70", [70])]
BATCHES = (1, 64, 256)
TINY_BATCHES = (1, 3)
# fresh state the prefill reference may allocate per decode cell (2.7b holds 344 MB per sequence)
CHECK_BYTES = 10 * 2 ** 30
# tokens per prefill call (the histories and the reference): bounds the activations
PREFILL_TOKENS = 32768
# GPU memory kept free beyond a decode cell's state pool (weights are already resident)
HEADROOM_BYTES = 8 * 2 ** 30


def log(msg: str) -> None:
    print(f"[model {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def source_digest() -> str:
    """sha256 over the library sources and this script: the code even where git metadata is stale."""
    h = hashlib.sha256()
    for f in sorted((ROOT / "aligned_mamba").rglob("*.py")) + [ROOT / SCRIPT]:
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _ratio(a, b):
    return a / b if (a is not None and b) else None


def _per_s(count, ms):
    return count / (ms * 1e-3) if ms else None


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------


def make_config(spec, chunk: int, dtype: str):
    from aligned_mamba.models.mamba2 import Mamba2Config

    layers, hidden, heads, head_dim, groups, state, vocab = spec
    return Mamba2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_heads=heads,
                        head_dim=head_dim, state_size=state, n_groups=groups, expand=heads * head_dim // hidden,
                        chunk_size=chunk, tie_word_embeddings=False, dtype=dtype)


def device_weights(config, dev, seed: int) -> dict:
    """Every tensor of ``expected_shapes(config)`` drawn on ``dev`` by its name, with the rules of
    ``models.tiny.init_tensor`` (whose CPU generation takes minutes at 2.7b): A_log, dt_bias and D
    in fp32, the rest in the config's dtype."""
    import torch

    from aligned_mamba.models.mamba2 import expected_shapes

    g = torch.Generator(device=dev).manual_seed(seed)
    f32, dtype = torch.float32, config.torch_dtype

    def uniform(shape, lo, hi):
        return torch.empty(shape, dtype=f32, device=dev).uniform_(lo, hi, generator=g)

    def normal(shape):
        return torch.randn(shape, dtype=f32, device=dev, generator=g)

    out = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith(".A_log"):  # A = -exp(A_log) uniform in [-16, -1]
            t = torch.log(uniform(shape, 1.0, 16.0))
        elif name.endswith(".dt_bias"):  # softplus(dt_bias) log-uniform in [1e-3, 1e-1]
            dt = torch.exp(uniform(shape, math.log(1e-3), math.log(1e-1)))
            t = dt + torch.log(-torch.expm1(-dt))
        elif name.endswith(".D"):
            t = torch.ones(shape, dtype=f32, device=dev)
        elif name.endswith("conv1d.weight"):
            bound = 1.0 / math.sqrt(config.conv_kernel)
            t = uniform(shape, -bound, bound).to(dtype)
        elif name.endswith("conv1d.bias"):
            t = uniform(shape, -0.1, 0.1).to(dtype)
        elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            t = (1.0 + 0.05 * normal(shape)).to(dtype)
        elif name.endswith("embeddings.weight"):
            t = normal(shape).to(dtype)
        elif name.endswith(".weight"):  # projections and lm_head [out, in]
            t = (normal(shape) / math.sqrt(shape[1])).to(dtype)
        elif name.endswith(".bias"):
            t = (0.02 * normal(shape)).to(dtype)
        else:
            raise AssertionError(f"no initialiser for {name}")
        out[name] = t
    return out


# --------------------------------------------------------------------------------------------
# the stock composition
# --------------------------------------------------------------------------------------------


def load_stock(dry: bool):
    """(scan, ssu, description, error): mamba_ssm's kernels, or in a dry run torch stand-ins (its
    kernels do not run on a CPU) so that the stock code path is exercised and checked against ours."""
    if dry:
        return ref_chunk_scan, ref_state_update, "torch stand-ins (dry run)", None
    from benchmarks.bench_h200 import load_upstream

    ssu, scan, err = load_upstream()
    if err:
        return None, None, None, err
    return scan, ssu, "mamba_ssm 2.3.2.post1 (.anchors)", None


def retune_stock() -> int:
    """Forget mamba_ssm's autotuned configs; returns how many tuners were reset. Their keys (chunk
    size, head dim, state size) are the same at every shape here, so without this the first shape's
    tuning would serve them all; an engine serving one model tunes at that model's shape."""
    from triton.runtime.autotuner import Autotuner

    n = 0
    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("mamba_ssm."):
            continue
        for obj in vars(mod).values():
            for _ in range(4):  # heuristics and autotune decorators wrap each other through .fn
                if isinstance(obj, Autotuner):
                    obj.cache.clear()
                    n += 1
                obj = getattr(obj, "fn", None)
                if obj is None:
                    break
    return n


def ref_chunk_scan(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False, **_):
    """Dry-run stand-in for ``mamba_chunk_scan_combined`` (same arguments): the recurrence token by
    token in fp32 (chunking changes only the rounding)."""
    import torch
    import torch.nn.functional as F

    S, T, H, P = x.shape
    G = B.shape[2]
    dt = dt.float() + (dt_bias if dt_bias is not None else 0.0)
    dt = F.softplus(dt) if dt_softplus else dt
    Bh = B.float().repeat_interleave(H // G, dim=2)
    Ch = C.float().repeat_interleave(H // G, dim=2)
    h = torch.zeros(S, H, P, B.shape[-1], dtype=torch.float32, device=x.device)
    ys = []
    for t in range(T):
        xt = x[:, t].float()
        h = h * torch.exp(dt[:, t] * A)[..., None, None] + (dt[:, t, :, None] * xt)[..., None] * Bh[:, t, :, None, :]
        y = (h * Ch[:, t, :, None, :]).sum(-1)
        ys.append(y + D[:, None] * xt if D is not None else y)
    return torch.stack(ys, dim=1).to(x.dtype)


def ref_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                     state_batch_indices=None):
    """Dry-run stand-in for ``selective_state_update`` (same arguments, heads form): one recurrent
    step of ``state[state_batch_indices]`` in fp32, written back."""
    import torch.nn.functional as F

    H, G = x.shape[1], B.shape[1]
    idx = state_batch_indices.long()
    dt = dt.float() + (dt_bias if dt_bias is not None else 0.0)
    dt = F.softplus(dt) if dt_softplus else dt
    Bh = B.float().repeat_interleave(H // G, dim=1)[:, :, None, :]
    Ch = C.float().repeat_interleave(H // G, dim=1)[:, :, None, :]
    s = state[idx] * (dt[..., None] * A).exp() + (dt * x.float())[..., None] * Bh
    state[idx] = s
    y = (s * Ch).sum(-1)
    if D is not None:
        y = y + D * x.float()
    return y.to(x.dtype)


class Stock:
    """The baseline model over the same tensors: what an engine composes from stock parts today."""

    def __init__(self, config, tensors: dict, scan, ssu) -> None:
        import torch

        c = self.c = config
        self.scan, self.ssu = scan, ssu
        self.dtype = c.torch_dtype
        self.eps = c.layer_norm_epsilon
        H, P, N = c.num_heads, c.head_dim, c.state_size
        self.emb = tensors["backbone.embeddings.weight"]
        self.norm_f = tensors["backbone.norm_f.weight"]
        self.head = tensors["lm_head.weight"]
        self.layers = []
        for i in range(c.num_hidden_layers):
            p, m = f"backbone.layers.{i}.", f"backbone.layers.{i}.mixer."
            A = -torch.exp(tensors[m + "A_log"].float())
            D, bias = tensors[m + "D"].float(), tensors[m + "dt_bias"].float()
            conv_w = tensors[m + "conv1d.weight"]
            self.layers.append(SimpleNamespace(
                norm=tensors[p + "norm.weight"], w_in=tensors[m + "in_proj.weight"],
                w_out=tensors[m + "out_proj.weight"], gate_norm=tensors[m + "norm.weight"], conv_w=conv_w,
                conv_b=tensors[m + "conv1d.bias"],
                # the decode window dot in fp32, taps along dim 0 ([K, Cd]): an engine prepares its weights once
                conv_taps=conv_w[:, 0, :].float().t().contiguous(), conv_bf=tensors[m + "conv1d.bias"].float(),
                A=A, D=D, dt_bias=bias,
                # selective_state_update's Mamba2 call: per-head scalars broadcast over the head dim (stride 0)
                A_e=A[:, None, None].expand(H, P, N), D_e=D[:, None].expand(H, P), bias_e=bias[:, None].expand(H, P)))

    def _rms(self, x, w):
        """x [M, d] fp32 (the residual) -> RMSNorm in fp32, rounded, times the weight."""
        import torch

        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(self.dtype) * w

    def _gated(self, y, z, w):
        """Mamba2's gated RMSNorm: y * silu(z), normalised per group in fp32."""
        import torch
        import torch.nn.functional as F

        M, d = y.shape
        G = self.c.n_groups
        g = (y.float() * F.silu(z.float())).view(M, G, d // G)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return g.view(M, d).to(self.dtype) * w

    def _split(self):
        c = self.c
        return c.intermediate_size, c.conv_dim, c.num_heads, c.n_groups * c.state_size

    def forward(self, ids):
        """ids [S, T] int64 (equal lengths) -> logits [S * T, vocab]: the trainer's forward."""
        import torch.nn.functional as F

        c = self.c
        S, T = ids.shape
        d, Cd, H, GN = self._split()
        K = c.conv_kernel
        residual = F.embedding(ids.reshape(-1), self.emb).float()
        for ly in self.layers:
            zxbcdt = F.linear(self._rms(residual, ly.norm), ly.w_in)
            z, xBC, dt = zxbcdt.split([d, Cd, H], dim=-1)
            conv = F.conv1d(xBC.reshape(S, T, Cd).transpose(1, 2), ly.conv_w, ly.conv_b, padding=K - 1, groups=Cd)
            # back to [S, T, Cd] rows: the scan kernels read x, B, C coalesced along the head dim
            xBC = F.silu(conv[..., :T]).transpose(1, 2).contiguous()
            x, B, C = xBC.split([d, GN, GN], dim=-1)
            y = self.scan(x.reshape(S, T, H, c.head_dim), dt.reshape(S, T, H), ly.A,
                          B.reshape(S, T, c.n_groups, c.state_size), C.reshape(S, T, c.n_groups, c.state_size),
                          c.chunk_size, D=ly.D, dt_bias=ly.dt_bias, dt_softplus=True)
            out = F.linear(self._gated(y.reshape(S * T, d), z, ly.gate_norm), ly.w_out)
            residual = residual + out.float()
        return F.linear(self._rms(residual, self.norm_f), self.head)

    def new_state(self, num_slots: int, dev, seed: int, zero: bool = False) -> SimpleNamespace:
        """Per layer an fp32 SSM state pool [slots, H, P, N] and a conv window pool [slots, K-1, Cd];
        random unless ``zero`` (stock's bits are never compared, so no prefill is needed)."""
        import torch

        c = self.c
        g = torch.Generator(device=dev).manual_seed(seed)
        shape = (num_slots, c.num_heads, c.head_dim, c.state_size)
        wshape = (num_slots, c.conv_kernel - 1, c.conv_dim)
        if zero:
            ssm = [torch.zeros(shape, dtype=torch.float32, device=dev) for _ in self.layers]
            win = [torch.zeros(wshape, dtype=self.dtype, device=dev) for _ in self.layers]
        else:
            ssm = [torch.randn(shape, dtype=torch.float32, device=dev, generator=g).mul_(0.3) for _ in self.layers]
            win = [torch.randn(wshape, dtype=torch.float32, device=dev, generator=g).to(self.dtype)
                   for _ in self.layers]
        return SimpleNamespace(ssm=ssm, conv=win)

    def step(self, st, idx, idx32, ids):
        """One decode token for each of B sequences in slots ``idx`` ([B] int64; ``idx32`` the same
        as int32 for the SSU kernel), token ids [B] int64 on the device -> logits [B, vocab]. Only
        device tensors and no host reads: capturable in a CUDA graph."""
        import torch
        import torch.nn.functional as F

        c = self.c
        d, Cd, H, GN = self._split()
        Bn = ids.shape[0]
        G, N, P = c.n_groups, c.state_size, c.head_dim
        residual = F.embedding(ids, self.emb).float()
        for ly, ssm, win in zip(self.layers, st.ssm, st.conv, strict=True):
            zxbcdt = F.linear(self._rms(residual, ly.norm), ly.w_in)
            z, xBC, dt = zxbcdt.split([d, Cd, H], dim=-1)
            stream = torch.cat([win[idx], xBC[:, None]], dim=1)  # [B, K, Cd]: the window, then the token
            win[idx] = stream[:, 1:]
            xc = F.silu((stream.float() * ly.conv_taps).sum(1) + ly.conv_bf).to(self.dtype)
            x, B, C = xc.split([d, GN, GN], dim=-1)
            y = self.ssu(ssm, x.reshape(Bn, H, P), dt[:, :, None].expand(Bn, H, P), ly.A_e, B.reshape(Bn, G, N),
                         C.reshape(Bn, G, N), D=ly.D_e, z=None, dt_bias=ly.bias_e, dt_softplus=True,
                         state_batch_indices=idx32)
            out = F.linear(self._gated(y.reshape(Bn, d), z, ly.gate_norm), ly.w_out)
            residual = residual + out.float()
        return F.linear(self._rms(residual, self.norm_f), self.head)


# --------------------------------------------------------------------------------------------
# timing and checks
# --------------------------------------------------------------------------------------------


class Runner:
    """What every case shares: device, repetitions, the stock kernels, the result and its file."""

    def __init__(self, args, result: dict, out_path: Path) -> None:
        import torch

        self.args, self.result, self.out_path = args, result, out_path
        self.dry = args.dry_run
        self.dev = torch.device("cpu" if self.dry else "cuda")
        self.cuda = self.dev.type == "cuda"
        if self.dry:
            self.fwd_n, self.dec_n, self.dec_warm, self.eager_n, self.eager_warm = 0, 2, 0, 2, 0
        elif args.quick:
            self.fwd_n, self.dec_n, self.dec_warm, self.eager_n, self.eager_warm = 2, 6, 1, 3, 1
        else:
            self.fwd_n, self.dec_n, self.dec_warm, self.eager_n, self.eager_warm = 5, 20, 3, 8, 2

    def save(self) -> None:
        self.out_path.write_text(json.dumps(self.result, indent=1))

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def times(self, step, n: int, warmup: int, before=None) -> list[float] | None:
        """CUDA-event ms of step(i) for i in warmup .. warmup + n - 1 (``bench_h200.cuda_times``);
        on the CPU the steps just run (no timing) and None comes back."""
        import torch

        if not self.cuda:
            for i in range(warmup + n):
                if before is not None:
                    before(i)
                step(i)
            return None
        from benchmarks.bench_h200 import cuda_times

        return cuda_times(torch, step, n, warmup, before)

    def free(self) -> None:
        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def free_bytes(self) -> int | None:
        import torch

        return torch.cuda.mem_get_info(self.dev)[0] if self.cuda else None


def stats(ts: list[float] | None) -> dict:
    if not ts:
        return {"ms": None, "mean_ms": None, "min_ms": None, "n": 0}
    return {"ms": statistics.median(ts), "mean_ms": statistics.fmean(ts), "min_ms": min(ts), "n": len(ts)}


def rel_err(a, b) -> float:
    """mean |a - b| / mean |b| in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).abs().mean() / b.abs().mean().clamp_min(1e-30))


def rows_equal(a, b) -> int:
    """How many rows of a [R, V] are torch.equal to the same rows of b."""
    return int((a == b).all(dim=1).sum())


def capture_graph(fn):
    """fn() captured in a CUDA graph after two warm-up calls on a side stream (JIT, allocator); returns
    (graph, fn's output as the graph's static tensor)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def kernel_table(fn, n: int) -> list[dict]:
    """GPU kernels of one call of fn(i) from torch.profiler over n calls (each from an idle GPU):
    per kernel name, launches and microseconds per call, the largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            fn(i)
            torch.cuda.synchronize()
    acc: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            a = acc.setdefault(ev.name[:90], [0, 0.0])
            a[0] += 1
            a[1] += ev.device_time_total
    rows = [{"kernel": k, "launches": c / n, "us": round(t / n, 2)} for k, (c, t) in acc.items()]
    return sorted(rows, key=lambda r: -r["us"])


def prefill_last_rows(model, cache, slots: list[int], seqs: list, max_tokens: int):
    """Advance each slot from empty over its sequence (all non-empty), in calls of at most
    ``max_tokens`` tokens; returns the logits of each sequence's last token [len(seqs), vocab]."""
    import torch

    from aligned_mamba.ops.step import Step

    out, group = [], []

    def flush():
        lens = [int(s.numel()) for _, s in group]
        mask = torch.zeros(sum(lens), dtype=torch.bool)
        mask[torch.tensor(lens).cumsum(0) - 1] = True
        batch = Step.make([sl for sl, _ in group], [0] * len(group), lens)
        out.append(model.advance(cache, batch, torch.cat([s for _, s in group]), logit_rows=mask))
        group.clear()

    total = 0
    for slot, seq in zip(slots, seqs, strict=True):
        if group and total + seq.numel() > max_tokens:
            flush()
            total = 0
        group.append((slot, seq))
        total += int(seq.numel())
    if group:
        flush()
    return torch.cat(out)


def weight_bytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def decode_bytes(config, batch: int, fills: list[list[int]], wbytes: int, esize: int) -> tuple[int, int]:
    """(ours, stock) bytes of one decode step averaged over the timed steps (fills: per step, each
    sequence's partial-chunk fill before its token): the weights once (the embedding only for the
    batch's rows), per sequence and layer the scan state (``bytes_moved``: ours reads the fp32 state
    once and the buffered rows, stock reads and writes its fp32 state) and the conv window read and
    written, and the logits."""
    from benchmarks.bytes_moved import replay_decode_bytes, ssu_step_bytes

    c = config
    H, G, P, N, L = c.num_heads, c.n_groups, c.head_dim, c.state_size, c.chunk_size
    emb = c.vocab_size * c.hidden_size * esize
    common = wbytes - emb + batch * c.hidden_size * esize + batch * c.vocab_size * esize
    window = 2 * (c.conv_kernel - 1) * c.conv_dim * esize * batch * c.num_hidden_layers
    ours = statistics.fmean(sum(replay_decode_bytes(H, G, P, N, f, esize, L) for f in fs) for fs in fills)
    stock = batch * ssu_step_bytes(H, G, P, N, esize)
    return (int(common + window + ours * c.num_hidden_layers), int(common + window + stock * c.num_hidden_layers))


# --------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------


def forward_case(run: Runner, name: str, config, model, stock, label: str, lens: list[int], seed: int) -> dict:
    import torch

    S, T = len(lens), lens[0]
    entry = {"shape": name, "label": label, "tokens": S * T, "sequences": S, "ours_ms": None, "stock_ms": None,
             "ratio": None}
    g = torch.Generator(device=run.dev).manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (S, T), device=run.dev, generator=g)
    seqs = list(ids)  # the trainer's token ids are on the device
    ours_rows = stock_rows = None
    try:
        t0 = time.perf_counter()
        logits = model.forward(seqs)
        run.sync()
        entry["ours_first_call_s"] = time.perf_counter() - t0
        ours_rows = logits[0][: min(T, 2048)].clone()
        del logits
        ts = run.times(lambda i: model.forward(seqs), run.fwd_n, 1)
        entry.update({f"ours_{k}": v for k, v in stats(ts).items()})
    except Exception as e:  # noqa: BLE001 - a failed cell is a result; the others still run
        entry["ours_error"] = f"{type(e).__name__}: {e}"
        run.result["errors"].append(f"forward {name} {label} ours: {e!r}")
        log(traceback.format_exc())
    run.free()
    if stock is not None:
        try:
            t0 = time.perf_counter()
            logits = stock.forward(ids)
            run.sync()
            entry["stock_first_call_s"] = time.perf_counter() - t0  # mamba_ssm autotunes on its first calls
            stock_rows = logits[: min(T, 2048)].clone()
            del logits
            ts = run.times(lambda i: stock.forward(ids), run.fwd_n, 1)
            entry.update({f"stock_{k}": v for k, v in stats(ts).items()})
        except Exception as e:  # noqa: BLE001
            entry["stock_error"] = f"{type(e).__name__}: {e}"
            run.result["errors"].append(f"forward {name} {label} stock: {e!r}")
            log(traceback.format_exc())
    if ours_rows is not None and stock_rows is not None:
        # the same model computed two ways (not bitwise: other roundings): the baseline is no cheaper model
        entry["ours_vs_stock_rel_err"] = rel_err(ours_rows, stock_rows)
        entry["ours_vs_stock_max_abs"] = float((ours_rows.float() - stock_rows.float()).abs().max())
    entry["ratio"] = _ratio(entry["ours_ms"], entry["stock_ms"])
    entry["ours_tokens_per_s"] = _per_s(S * T, entry["ours_ms"])
    entry["stock_tokens_per_s"] = _per_s(S * T, entry["stock_ms"])
    run.free()
    return entry


def stock_sanity(run: Runner, name: str, config, model, stock, seed: int, T: int = 12) -> dict:
    """The stock decode step from empty state over T tokens against its own forward and against ours
    (rows close, not bitwise): the decode composition (conv window, SSU call) computes the model."""
    import torch

    g = torch.Generator(device=run.dev).manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (1, T), device=run.dev, generator=g)
    st = stock.new_state(1, run.dev, seed, zero=True)
    idx = torch.zeros(1, dtype=torch.int64, device=run.dev)
    rows = torch.stack([stock.step(st, idx, idx.to(torch.int32), ids[:, t])[0] for t in range(T)])
    fwd = stock.forward(ids)
    ours = model.forward([ids[0]])[0]
    return {"shape": name, "tokens": T, "stock_decode_vs_stock_forward_rel_err": rel_err(rows, fwd),
            "stock_decode_vs_ours_forward_rel_err": rel_err(rows, ours),
            "stock_forward_vs_ours_forward_rel_err": rel_err(fwd, ours)}


def decode_cell(run: Runner, name: str, config, tensors: dict, model, stock, batch: int, seed: int) -> list[dict]:
    """One (shape, batch) cell: the graph entry and the eager entry (see the module docstring)."""
    import torch

    from aligned_mamba.ops.step import Step

    L, V = config.chunk_size, config.vocab_size
    g = torch.Generator().manual_seed(seed)
    pos = L * torch.randint(0, run.args.max_chunks, (batch,), generator=g) + torch.randint(0, L, (batch,), generator=g)
    slots = torch.randperm(batch, generator=g)  # scattered slots; slot `batch` is the graphs' spare
    hist = [torch.randint(0, V, (int(p),), generator=g) for p in pos]
    n_rows = 2 + max(run.dec_warm + run.dec_n, run.eager_warm + run.eager_n)
    toks = torch.randint(0, V, (n_rows, batch), generator=g)  # row 0: the checked step; then the timed ones
    esize = config.torch_dtype.itemsize
    base = {"shape": name, "batch": batch, "pos_mean": float(pos.float().mean()), "max_chunks": run.args.max_chunks,
            "ours_ms": None, "stock_ms": None, "ratio": None, "bitwise": None}
    ge, ee = dict(base, graph=True), dict(base, graph=False)
    per_seq = model.state_bytes_per_sequence()
    stock_per_seq = config.num_hidden_layers * (config.num_heads * config.head_dim * config.state_size * 4
                                                + (config.conv_kernel - 1) * config.conv_dim * esize)
    for e in (ge, ee):
        e.update(ours_state_bytes_per_seq=per_seq, stock_state_bytes_per_seq=stock_per_seq)
    wbytes = weight_bytes(tensors)
    sl, ps = slots.tolist(), pos.tolist()
    live = [i for i in range(batch) if ps[i] > 0]

    def prefill(cache):
        if live:
            prefill_last_rows(model, cache, [sl[i] for i in live], [hist[i] for i in live], PREFILL_TOKENS)

    def fills(first: int, n: int) -> list[list[int]]:
        return [[(p + first + k) % L for p in ps] for k in range(n)]

    # ---- ours -----------------------------------------------------------------------------
    cache = graphs = None
    G0 = E0 = None

    def fail(part: str, e: Exception, entries) -> None:
        for x in entries:
            x[f"{part}_error"] = f"{type(e).__name__}: {e}"
        run.result["errors"].append(f"decode {name} b{batch} {part}: {e!r}")
        log(traceback.format_exc())

    try:
        free = run.free_bytes()
        need = (batch + 1) * per_seq
        if free is not None and need + HEADROOM_BYTES > free:
            raise MemoryError(f"the cache needs {need / 2 ** 30:.1f} GiB, {free / 2 ** 30:.1f} GiB free")
        cache = model.new_cache(batch + 1)
        t0 = time.perf_counter()
        prefill(cache)
        run.sync()
        ge["prefill_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a failed cell is a result; the others still run
        fail("ours", e, (ge, ee))
        cache = None
    if cache is not None and not run.cuda:
        ge["skipped"] = "DecodeGraphs needs CUDA (dry run: eager decode only)"
    elif cache is not None:
        try:
            from aligned_mamba.decode_graph import DecodeGraphs

            graphs = DecodeGraphs(model, cache, spare_slot=batch)
            t0 = time.perf_counter()
            graphs.capture([graphs.bucket(batch)])  # the bucket's two graphs (with and without completions)
            G0 = graphs.step(slots, pos, toks[0]).clone()
            run.sync()  # the step's pinned tables are rewritten by the next step
            ge["first_step_s"] = time.perf_counter() - t0

            def gstep(i):
                graphs.step(slots, pos + 1 + i, toks[1 + i])

            ts = run.times(gstep, run.dec_n, run.dec_warm, before=lambda i: run.sync())
            ge.update({f"ours_{k}": v for k, v in stats(ts).items()})
            if run.args.profile:
                ge["ours_kernels"] = kernel_table(lambda i: gstep(run.dec_warm + run.dec_n + i), 1)
                # the graph alone, without the step's host work (its tables as the last step left them)
                g = graphs.graph(batch)
                ts = run.times(lambda i: g.replay(), run.dec_n, run.dec_warm, before=lambda i: run.sync())
                ge["ours_replay_ms"] = stats(ts)["ms"]
            ge["ours_bytes"] = decode_bytes(config, batch, fills(1 + run.dec_warm, run.dec_n), wbytes, esize)[0]
            ge["completions"] = sum(f == L - 1 for fs in fills(1 + run.dec_warm, run.dec_n) for f in fs)
        except Exception as e:  # noqa: BLE001
            fail("ours_graph", e, (ge,))
        graphs = None  # the closure above holds this name: clearing it frees the graphs' pool
        try:
            # back to the prefilled state for the eager step (the prefill is deterministic)
            cache.reset(slots)
            prefill(cache)
        except Exception as e:  # noqa: BLE001
            fail("ours", e, (ee,))
            cache = None
    if cache is not None:
        try:
            E0 = model.advance(cache, Step.make(sl, ps, [1] * batch), toks[0]).clone()

            def estep(i):
                model.advance(cache, Step.make(sl, (pos + 1 + i).tolist(), [1] * batch), toks[1 + i])

            ts = run.times(estep, run.eager_n, run.eager_warm, before=lambda i: run.sync())
            ee.update({f"ours_{k}": v for k, v in stats(ts).items()})
            ee["ours_bytes"] = decode_bytes(config, batch, fills(1 + run.eager_warm, run.eager_n), wbytes, esize)[0]
        except Exception as e:  # noqa: BLE001
            fail("ours_eager", e, (ee,))
    cache = None  # as graphs above
    run.free()

    # ---- bits: against a single-pass prefill of each (checked) sequence's history + token -----
    if E0 is not None or G0 is not None:
        try:
            k = max(1, min(batch, CHECK_BYTES // max(per_seq, 1)))
            full = [torch.cat([hist[i], toks[0, i:i + 1]]) for i in range(k)]
            fresh = model.new_cache(k)
            R = prefill_last_rows(model, fresh, list(range(k)), full, PREFILL_TOKENS)
            del fresh
            nf = min(4, k)  # the trainer's forward itself, over a few of the sequences
            fwd = torch.stack([lg[-1] for lg in model.forward(full[:nf])])
            for e, got in ((ee, E0), (ge, G0)):
                if got is None:
                    continue
                same = (got[:k] == R).all(1)
                if e is ge and E0 is not None:  # the graph's rows must also be the eager step's, every row
                    e.update(eager_rows_equal=rows_equal(G0, E0), eager_rows=batch)
                    same = same & (G0[:k] == E0[:k]).all(1)
                e.update(rows=k, rows_equal=int(same.sum()), prefill_rows_equal=rows_equal(got[:k], R),
                         forward_rows=nf, forward_rows_equal=rows_equal(got[:nf], fwd),
                         max_abs_diff=float((got[:k] - R).abs().max()))
                e["bitwise"] = (e["rows_equal"] == k and e["forward_rows_equal"] == nf
                                and e.get("eager_rows_equal", batch) == batch)
        except Exception as e:  # noqa: BLE001
            fail("bits", e, (ge, ee))
    del G0, E0
    run.free()

    # ---- stock ------------------------------------------------------------------------------
    if stock is not None:
        st = None
        try:
            free = run.free_bytes()
            if free is not None and batch * stock_per_seq + HEADROOM_BYTES > free:
                raise MemoryError(f"the stock state needs {batch * stock_per_seq / 2 ** 30:.1f} GiB")
            st = stock.new_state(batch, run.dev, seed)
            idx = slots.to(run.dev)
            idx32 = idx.to(torch.int32)
            ids = torch.empty(batch, dtype=torch.int64, device=run.dev)
            host = toks.pin_memory() if run.cuda else toks

            def load(i):  # the step's token ids into the static buffer, as an engine copies them
                ids.copy_(host[i], non_blocking=True)

            def sstep(i):
                load(1 + i)
                stock.step(st, idx, idx32, ids)

            ts = run.times(sstep, run.eager_n, run.eager_warm, before=lambda i: run.sync())
            ee.update({f"stock_{k}": v for k, v in stats(ts).items()})
            if run.cuda:
                graph, _ = capture_graph(lambda: stock.step(st, idx, idx32, ids))

                def sgraph(i):
                    load(1 + i)
                    graph.replay()

                ts = run.times(sgraph, run.dec_n, run.dec_warm, before=lambda i: run.sync())
                ge.update({f"stock_{k}": v for k, v in stats(ts).items()})
                if run.args.profile:
                    ge["stock_kernels"] = kernel_table(sgraph, 3)
                    ts = run.times(lambda i: graph.replay(), run.dec_n, run.dec_warm, before=lambda i: run.sync())
                    ge["stock_replay_ms"] = stats(ts)["ms"]
                del graph
            for e in (ge, ee):
                e["stock_bytes"] = decode_bytes(config, batch, [[0] * batch], wbytes, esize)[1]
        except Exception as e:  # noqa: BLE001
            fail("stock", e, (ge, ee))
        del st
        run.free()

    bw = run.result["bandwidth"].get("copy_GBps")
    for e in (ge, ee):
        e["ratio"] = _ratio(e["ours_ms"], e["stock_ms"])
        for side in ("ours", "stock"):
            ms, b = e.get(f"{side}_ms"), e.get(f"{side}_bytes")
            e[f"{side}_tokens_per_s"] = _per_s(batch, ms)
            gbps = b / (ms * 1e-3) / 1e9 if (ms and b) else None
            e[f"{side}_GBps"] = gbps
            e[f"{side}_frac_copy_bw"] = _ratio(gbps, bw)
    return [ge, ee]


# --------------------------------------------------------------------------------------------
# schema and table
# --------------------------------------------------------------------------------------------

_NUM = (float, int, type(None))
_TOP = {"gpu": str, "torch": str, "triton": str, "date": str, "commit": (str, type(None)), "script": str,
        "forward": list, "decode": list, "bandwidth": dict, "errors": list}
_FORWARD = {"shape": str, "tokens": int, "ours_ms": _NUM, "stock_ms": _NUM, "ratio": _NUM}
_DECODE = {"shape": str, "batch": int, "graph": bool, "ours_ms": _NUM, "stock_ms": _NUM, "ratio": _NUM,
           "bitwise": (bool, type(None)), "ours_tokens_per_s": _NUM, "stock_tokens_per_s": _NUM}


def validate(result: dict) -> list[str]:
    errs = []

    def check(obj, spec, where):
        for k, ty in spec.items():
            if k not in obj:
                errs.append(f"{where}: missing {k}")
            elif not isinstance(obj[k], ty) or (ty is int and isinstance(obj[k], bool)):
                errs.append(f"{where}.{k}: {type(obj[k]).__name__} is not {ty}")

    check(result, _TOP, "top")
    for i, e in enumerate(result.get("forward", [])):
        check(e, _FORWARD, f"forward[{i}]")
    for i, e in enumerate(result.get("decode", [])):
        check(e, _DECODE, f"decode[{i}]")
        if "rows_equal" in e and not (isinstance(e.get("rows"), int) and 0 <= e["rows_equal"] <= e["rows"]):
            errs.append(f"decode[{i}]: rows_equal without a matching rows")
    if "copy_GBps" not in result.get("bandwidth", {}):
        errs.append("bandwidth: missing copy_GBps")
    json.dumps(result)  # serialisable
    return errs


def _f(v, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def table(result: dict) -> str:
    lines = [f"{'forward':<20}{'tokens':>8}{'ours ms':>10}{'stock ms':>10}{'ratio':>7}{'ours tok/s':>12}"]
    for e in result["forward"]:
        lines.append(f"{e['shape']:<20}{e['label']:>8}{_f(e['ours_ms'], '.1f'):>10}{_f(e['stock_ms'], '.1f'):>10}"
                     f"{_f(e['ratio']):>7}{_f(e.get('ours_tokens_per_s'), '.3g'):>12}")
    lines.append(f"{'decode step':<20}{'batch':>6}{'mode':>7}{'ours ms':>9}{'stock ms':>9}{'ratio':>7}"
                 f"{'ours tok/s':>12}{'BW ours/stock':>15}  bits")
    for e in result["decode"]:
        mode = "graph" if e["graph"] else "eager"
        bits = (f"{e['rows_equal']}/{e['rows']}" if "rows_equal" in e else "-")
        if "eager_rows_equal" in e:
            bits += f" (eager {e['eager_rows_equal']}/{e['eager_rows']})"
        if e.get("skipped"):
            bits = "skipped"
        bw = f"{_f(e.get('ours_frac_copy_bw'))}/{_f(e.get('stock_frac_copy_bw'))}"
        lines.append(f"{e['shape']:<20}{e['batch']:>6}{mode:>7}{_f(e['ours_ms'], '.3f'):>9}"
                     f"{_f(e['stock_ms'], '.3f'):>9}{_f(e['ratio']):>7}{_f(e.get('ours_tokens_per_s'), '.3g'):>12}"
                     f"{bw:>15}  {bits}")
    lines.append(f"copy bandwidth {_f(result['bandwidth'].get('copy_GBps'), '.0f')} GB/s; "
                 f"{len(result['errors'])} errors; schema {'ok' if not result.get('schema_errors') else 'BAD'}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="path of the JSON result")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: Triton interpreter, tiny shapes, no timing")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of shapes")
    ap.add_argument("--batches", default=None, help="comma-separated decode batch sizes")
    ap.add_argument("--max-chunks", type=int, default=2, help="histories hold L k + U[0, L) tokens, k < this")
    ap.add_argument("--skip-forward", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also record each decode graph's kernels (torch.profiler)")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch the decode kernels without programmatic dependent launch (scheduling only)")
    args = ap.parse_args()

    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    sys.path.insert(0, str(ROOT))
    import torch
    import triton

    from aligned_mamba import Contract
    from aligned_mamba.models import build_model
    from aligned_mamba.ops.configs import TritonKernelConfigs

    if args.no_pdl:
        from aligned_mamba.ops.ssd import triton_decode

        triton_decode.PDL = False

    if not args.dry_run and not torch.cuda.is_available():
        log("no CUDA device: run with --dry-run on a CPU")
        return 2
    shapes = TINY_SHAPES if args.dry_run else SHAPES
    if args.shapes:
        wanted = args.shapes.split(",")
        unknown = sorted(set(wanted) - set(shapes))
        if unknown:
            log(f"unknown shapes {unknown}; known: {', '.join(shapes)}")
            return 2
        shapes = {k: v for k, v in shapes.items() if k in wanted}
    batches = [int(b) for b in args.batches.split(",")] if args.batches else (
        TINY_BATCHES if args.dry_run else BATCHES)
    forwards = TINY_FORWARD if args.dry_run else FORWARD
    chunk, dtype = (32, "float32") if args.dry_run else (256, "bfloat16")  # the interpreter computes bf16 wrongly
    contract = Contract(chunk_size=chunk, backend="triton", model_dtype=dtype)
    scan, ssu, stock_impl, stock_err = load_stock(args.dry_run)
    if stock_err:
        log(f"mamba_ssm not importable ({stock_err}): stock columns are null")

    from benchmarks.bench_h200 import git_commit

    cuda = not args.dry_run
    result = {
        "gpu": torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or 'dry-run'})",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(), "source_sha256": source_digest(), "script": SCRIPT, "argv": sys.argv[1:],
        "dry_run": args.dry_run, "quick": args.quick, "contract": contract.to_dict(),
        "kernel_configs": dataclasses.asdict(TritonKernelConfigs()),
        "stock": stock_impl, "stock_error": stock_err,
        "shapes": {n: dict(zip(("layers", "hidden", "heads", "head_dim", "groups", "state", "vocab"), s, strict=True))
                   for n, s in shapes.items()},
        "bandwidth": {}, "forward": [], "decode": [], "sanity": [], "errors": [],
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    run = Runner(args, result, out_path)
    result["reps"] = {"forward": run.fwd_n, "decode_graph": run.dec_n, "decode_eager": run.eager_n}
    if cuda:
        from benchmarks.bench_h200 import copy_bandwidth

        result["bandwidth"] = copy_bandwidth(torch, run.dev, 10)
        log(f"copy bandwidth {result['bandwidth']['copy_GBps']:.0f} GB/s")
        run.free()
    else:
        result["bandwidth"] = {"copy_GBps": None, "method": "dry run: not measured"}
    run.save()

    for si, (name, spec) in enumerate(shapes.items()):
        t_shape = time.time()
        model = stock = tensors = None
        try:
            config = make_config(spec, chunk, dtype)
            tensors = device_weights(config, run.dev, seed=1234 + si)
            model = build_model(config, tensors, contract, device=run.dev)
            stock = Stock(config, tensors, scan, ssu) if scan is not None else None
            if stock is not None and not args.dry_run:
                result.setdefault("stock_tuners_reset", {})[name] = retune_stock()
            log(f"{name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
                f"{weight_bytes(tensors) / 2 ** 30:.2f} GiB of weights, "
                f"{model.state_bytes_per_sequence() / 2 ** 20:.1f} MiB of state per sequence")
        except Exception as e:  # noqa: BLE001
            result["errors"].append(f"setup {name}: {e!r}")
            log(traceback.format_exc())
            run.save()
            continue
        for li, (label, lens) in ([] if args.skip_forward else enumerate(forwards)):
            log(f"forward {name} {label}")
            e = forward_case(run, name, config, model, stock, label, lens, seed=7 + 100 * si + li)
            result["forward"].append(e)
            log(f"forward {name} {label}: ours {_f(e['ours_ms'], '.2f')} ms, stock {_f(e['stock_ms'], '.2f')} ms, "
                f"ratio {_f(e['ratio'])}, rel err vs stock {_f(e.get('ours_vs_stock_rel_err'), '.2e')}")
            run.save()
        # after the forwards: mamba_ssm's autotune keys leave out the length, so its first call picks
        # the configs of every later one (12 tokens would tune the 32k prefill)
        if stock is not None:
            try:
                s = stock_sanity(run, name, config, model, stock, seed=99 + si)
                result["sanity"].append(s)
                log(f"{name} stock sanity: {s}")
                # fp32 in a dry run: the stock composition must compute our model to rounding
                if args.dry_run and max(v for k, v in s.items() if k.endswith("rel_err")) > 1e-4:
                    result["errors"].append(f"stock sanity {name}: the stock composition differs from ours: {s}")
            except Exception as e:  # noqa: BLE001
                result["errors"].append(f"stock sanity {name}: {e!r}")
                log(traceback.format_exc())
            run.free()
            run.save()
        for batch in ([] if args.skip_decode else batches):
            log(f"decode {name} batch {batch}")
            try:
                entries = decode_cell(run, name, config, tensors, model, stock, batch, seed=31 + 1000 * si + batch)
            except Exception as e:  # noqa: BLE001
                result["errors"].append(f"decode {name} b{batch}: {e!r}")
                log(traceback.format_exc())
                run.free()
                run.save()
                continue
            result["decode"].extend(entries)
            for x in entries:
                log(f"decode {name} b{batch} {'graph' if x['graph'] else 'eager'}: ours {_f(x['ours_ms'], '.3f')} ms, "
                    f"stock {_f(x['stock_ms'], '.3f')} ms, bitwise {x['bitwise']} "
                    f"({x.get('rows_equal')}/{x.get('rows')}, eager {x.get('eager_rows_equal')}, "
                    f"forward {x.get('forward_rows_equal')}/{x.get('forward_rows')})")
            run.save()
        del model, stock, tensors
        run.free()
        log(f"{name} done in {time.time() - t_shape:.0f} s")

    errs = validate(result)
    result["schema_errors"] = errs
    run.save()
    log(f"wrote {out_path} ({len(result['forward'])} forward, {len(result['decode'])} decode entries, "
        f"{len(result['errors'])} errors, schema {'ok' if not errs else errs})")
    print(table(result), flush=True)
    return 0 if not errs and not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
