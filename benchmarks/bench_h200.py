#!/usr/bin/env python3
"""Exact-replay decode and prefill on one GPU, next to the upstream mamba_ssm kernels.

    python3 benchmarks/bench_h200.py --out OUT/h200.json [--quick]
    python3 benchmarks/bench_h200.py --dry-run --out /tmp/h200.json     (CPU: tiny shapes, no timing)

Decode: ``triton_decode.decode_step_triton`` (bf16: mode "tile"; fp32: "row" and "tile") vs
mamba_ssm's ``selective_state_update`` (SSU) with an fp32 state, per layer, at batch 1 / 64 / 256
with partial-chunk fills uniform in [0, chunk); each step decodes the next token of every sequence
(positions advance, so chunks complete as they would in serving). ``bitwise``: every decode row
(and every state and buffer) torch.equal to a single-pass prefill (``triton_chunk.replay_chunk_triton``,
same kernel configs) over the sequence's chunk prefix + token from the same boundary state.

Prefill: ``replay.ssd_advance`` from an empty slot on the Triton backend (host plan, pack, scan,
buffers) vs ``mamba_chunk_scan_combined`` (bf16 inputs, chunk 256, dt_softplus) at 2k / 8k / 32k
tokens and a varlen batch of 64 x 512; "scan only" times the scan kernels with dt packed beforehand.
``--variants`` also times the scan under other kernel configs (row tile, tile warps, K block, dot
mode: ``TritonKernelConfigs`` replacements) and checks that each gives the pinned config's bits
(rows and states torch.equal).

Times: CUDA events around each call, median over >= 20 calls after warm-up (eager mode: at small
batches this is launch overhead, which is what a layer costs in an eager engine); CUDA-graph
replay times are reported next to them where capture works. Bytes moved per step are compared
with the measured device-to-device copy bandwidth. Upstream kernels come from .anchors/ (see
benchmarks/README.md); without them the upstream columns are null.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "benchmarks/bench_h200.py"

FULL_SHAPES = {"32h_1g": (32, 1), "64h_8g": (64, 8), "128h_8g": (128, 8)}
FULL_DIMS = dict(P=64, N=128, L=256)
TINY_SHAPES = {"tiny_2h_1g": (2, 1)}
TINY_DIMS = dict(P=16, N=16, L=32)
MODES = ("row", "tile")
BF16_MODES = ("tile",)
# (row tile, tile kernel warps, state pass P block, K block, opts): candidates for the pinned
# prefill configs, each run as ``TritonKernelConfigs`` with row_tile, tile_num_warps, pass_block_p
# and block_k replaced. A K block other than the pinned one is another contract (other bits, its
# own decode): its "bitwise" against the pinned config is expected False. opts: {"tile": the
# row-tile kernel's compile options (``triton_chunk.TILE_OPTS``, occupancy only), "dots": the
# config's bf16_dots}.
VARIANTS = [(64, 4, 64, 32, {"dots": "round"})]
# bf16 decode variants (--variants): "tile:nopdl", the tile kernel launched after the prep kernel
# ends (no programmatic dependent launch: ``triton_decode.PDL``); "tile:bk64", a K block of 64
# (config block_k, so prefill and decode: the bit check runs both with it); "tile:ns<k>:reg<n>",
# the tile kernel compiled with k pipelining stages and at most n registers
# (``triton_decode.TILE_OPTS``); "tile:round", config bf16_dots "round" (one bf16 dot per fp32
# operand; the bit check runs the prefill so too)
DECODE_VARIANTS = ("tile:nopdl",)
# prefill lengths up to this get an accuracy figure (fp64 reference, token by token)
ACCURACY_MAX_TOKENS = 2048


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def git_commit() -> str | None:
    """GIT_COMMIT if set (a copy of a working tree may carry stale git metadata), else git's HEAD."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def source_digest() -> str:
    """sha256 over the library sources, this script and its byte counters: identifies the code even
    without git."""
    h = hashlib.sha256()
    files = sorted((ROOT / "aligned_mamba").rglob("*.py")) + [ROOT / SCRIPT, ROOT / "benchmarks/bytes_moved.py"]
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def cuda_times(torch, step, n: int, warmup: int, before=None) -> list[float]:
    """Milliseconds of step(i) for i in warmup .. warmup + n - 1, one CUDA event pair per call;
    before(i), if given, runs outside the timed region."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(warmup):
        if before is not None:
            before(i)
        step(i)
    torch.cuda.synchronize()
    for k in range(n):
        i = warmup + k
        if before is not None:
            before(i)
        starts[k].record()
        step(i)
        ends[k].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def summary(ts: list[float] | None) -> dict:
    if not ts:
        return {"median_ms": None, "mean_ms": None, "min_ms": None, "n": 0}
    return {"median_ms": statistics.median(ts), "mean_ms": statistics.fmean(ts), "min_ms": min(ts), "n": len(ts)}


def graph_time(torch, fn, n: int) -> float | None:
    """Median ms of one replay of a CUDA graph capturing fn() (fn must be capturable and safe to
    repeat); None if capture fails."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        return statistics.median(cuda_times(torch, lambda i: g.replay(), n, 2))
    except Exception as e:  # noqa: BLE001 - a capture failure is a result, not a crash
        log(f"  graph capture failed: {type(e).__name__}: {e}")
        return None


def copy_bandwidth(torch, dev, reps: int) -> dict:
    nbytes = 1 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ts = cuda_times(torch, lambda i: dst.copy_(src), reps, 3)
    med = statistics.median(ts)
    return {"copy_GBps": 2 * nbytes / (med * 1e-3) / 1e9, "copy_bytes": nbytes,
            "method": "device-to-device copy of 1 GiB (read + write counted), median of CUDA-event times"}


# --------------------------------------------------------------------------------------------
# upstream
# --------------------------------------------------------------------------------------------


def load_upstream() -> tuple[object, object, str | None]:
    anchors = ROOT / ".anchors"
    if anchors.is_dir() and str(anchors) not in sys.path:
        sys.path.insert(0, str(anchors))
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        return selective_state_update, mamba_chunk_scan_combined, None
    except Exception as e:  # noqa: BLE001
        return None, None, f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------


def params(torch, H, P, seed, dev):
    """Mamba2 init as in the RFC: A in [-16, -1], softplus(dt_bias) in [1e-3, 1e-1]; D per head."""
    from aligned_mamba.ops.ssd.state import SSMParams

    g = torch.Generator().manual_seed(seed)
    A = -torch.empty(H).uniform_(1.0, 16.0, generator=g)
    dt0 = torch.exp(torch.empty(H).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
    bias = dt0 + torch.log(-torch.expm1(-dt0))
    D = torch.randn(H, generator=g)
    return SSMParams(A=A.to(dev), D=D.to(dev), dt_bias=bias.to(dev))


def tokens(torch, T, H, P, G, N, seed, dtype, dev):
    g = torch.Generator(device=dev).manual_seed(seed)
    kw = dict(generator=g, device=dev)
    return (torch.randn(T, H, P, **kw).to(dtype), (torch.randn(T, H, **kw) - 1.0).to(dtype),
            torch.randn(T, G, N, **kw).to(dtype), torch.randn(T, G, N, **kw).to(dtype))


def pinned_cfg():
    """The pinned Triton kernel configs (the defaults of every contract that states none)."""
    from aligned_mamba.ops.configs import TritonKernelConfigs

    return TritonKernelConfigs()


def triton_backend(cfg, L, dtype, dev):
    """The Triton backend an engine resolves for a contract with these kernel configs."""
    from aligned_mamba.contract import Contract
    from aligned_mamba.ops.backend import resolve

    contract = Contract(chunk_size=L, backend="triton", model_dtype=str(dtype).replace("torch.", ""),
                        kernel_configs=cfg)
    return resolve(contract, dev)


def decode_case(torch, H, G, dims, batch, dtype, dev, seed):
    """batch sequences in scattered slots, each at boundary k L (k in 0..3) + fill (uniform in
    [0, L)), nonzero boundary states, partial chunks filled by one prefill (pinned configs)."""
    from aligned_mamba.ops.ssd.state import SSDState
    from aligned_mamba.ops.ssd.triton_chunk import replay_chunk_triton
    from aligned_mamba.ops.step import Step

    P, N, L = dims["P"], dims["N"], dims["L"]
    g = torch.Generator().manual_seed(seed)
    fill = torch.randint(0, L, (batch,), generator=g)
    bound = torch.randint(0, 4, (batch,), generator=g) * L
    nslots = batch + 3
    slots = torch.randperm(nslots, generator=g)[:batch]
    prm = params(torch, H, P, seed, dev)
    st = SSDState.allocate(nslots, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=L, dtype=dtype,
                           device=dev)
    gs = torch.Generator(device=dev).manual_seed(seed + 1)
    st.ssm_state.copy_(0.3 * torch.randn(st.ssm_state.shape, generator=gs, device=dev))
    T = int(fill.sum())
    pre = tokens(torch, T, H, P, G, N, seed + 2, dtype, dev)
    boundary = clone_state(st)
    keep = fill > 0
    if T:
        replay_chunk_triton(st, Step.make(slots[keep].tolist(), bound[keep].tolist(), fill[keep].tolist()), *pre,
                            prm, cfg=pinned_cfg())
    tok = tokens(torch, batch, H, P, G, N, seed + 3, dtype, dev)
    return dict(state=st, boundary=boundary, slots=slots, fill=fill, bound=bound, pre=pre, tok=tok, prm=prm,
                H=H, G=G, P=P, N=N, L=L)


def clone_state(st):
    from aligned_mamba.ops.ssd.state import SSDState

    return SSDState(*(t.clone() for t in st.tensors()))


def decode_mode(mode: str, cfg):
    """A context manager for a decode mode "tile" or "tile:<opt>[:<opt>]" (DECODE_VARIANTS; opt:
    "nopdl", "round", "bk<K block>", "ns<stages>", "reg<registers>"): yields (the base mode, the
    kernel configs to launch with). "round" and "bk" replace fields of ``cfg`` (bf16_dots,
    block_k: the contract, so the bit check's prefill runs with them too); "nopdl", "ns" and "reg"
    set ``triton_decode.PDL`` and ``triton_decode.TILE_OPTS`` (occupancy knobs outside the contract)
    for the duration. An unknown option, or a value the configs refuse, raises ValueError."""
    import contextlib
    import dataclasses

    import aligned_mamba.ops.ssd.triton_decode as td

    base, *opts = mode.split(":")
    changes: dict = {}
    pdl, tile_opts = td.PDL, dict(td.TILE_OPTS)
    for opt in opts:
        if opt == "round":
            changes["bf16_dots"] = "round"
        elif opt.startswith("ns"):
            tile_opts["num_stages"] = int(opt[2:])
        elif opt.startswith("reg"):
            tile_opts["maxnreg"] = int(opt[3:])
        elif opt == "nopdl":
            pdl = False
        elif opt.startswith("bk"):
            changes["block_k"] = int(opt[2:])
        else:
            raise ValueError(f"unknown decode option {opt!r} in {mode!r}")
    mode_cfg = dataclasses.replace(cfg, **changes)

    @contextlib.contextmanager
    def ctx():
        old = (td.PDL, td.TILE_OPTS)
        td.PDL, td.TILE_OPTS = pdl, tile_opts
        try:
            yield base, mode_cfg
        finally:
            td.PDL, td.TILE_OPTS = old

    return ctx()


def decode_bitwise(torch, case, mode, cfg) -> dict:
    """One decode step vs one prefill over (chunk prefix + token) from the boundary state."""
    from aligned_mamba.ops.ssd.triton_chunk import replay_chunk_triton
    from aligned_mamba.ops.ssd.triton_decode import decode_step_triton
    from aligned_mamba.ops.step import Step

    dev = case["tok"][0].device
    st = clone_state(case["state"])
    slots, fill, bound = case["slots"], case["fill"], case["bound"]
    y = decode_step_triton(st, slots.to(dev), (bound + fill).to(dev), *case["tok"], case["prm"], cfg=cfg, mode=mode)
    ref = clone_state(case["boundary"])
    lens = (fill + 1).tolist()
    cu = torch.tensor([0] + lens).cumsum(0)
    is_tok = torch.zeros(int(cu[-1]), dtype=torch.bool)
    is_tok[cu[1:] - 1] = True
    is_tok = is_tok.to(dev)
    packed = []
    for p, t in zip(case["pre"], case["tok"]):
        z = torch.empty((int(cu[-1]),) + tuple(p.shape[1:]), dtype=p.dtype, device=dev)
        z[~is_tok] = p
        z[is_tok] = t
        packed.append(z)
    # the prefill form itself: through a backend, a batch of one-token sequences would take the decode kernels
    yp = replay_chunk_triton(ref, Step.make(slots.tolist(), bound.tolist(), lens), *packed, case["prm"], cfg=cfg)
    yl = yp[cu[1:].to(dev) - 1]
    rows_equal = int((y == yl).flatten(1).all(1).sum())
    sl = slots.to(dev)
    states_equal = all(bool(torch.equal(getattr(st, n)[sl], getattr(ref, n)[sl]))
                       for n in ("ssm_state", "buf_x", "buf_dt", "buf_B"))
    return {"rows_equal": rows_equal, "rows": int(slots.numel()), "states_equal": states_equal,
            "bitwise": rows_equal == int(slots.numel()) and states_equal,
            "max_abs_diff": float((y.float() - yl.float()).abs().max())}


def bench_decode(torch, case, mode, cfg, n, warmup, upstream_ssu, dev) -> dict:
    from aligned_mamba.ops.ssd.triton_decode import decode_step_triton
    from benchmarks.bytes_moved import replay_decode_bytes, ssu_step_bytes

    out: dict = {}
    steps = warmup + n
    L = case["L"]
    st = clone_state(case["state"])
    slots_d = case["slots"].to(dev)
    pos_h = case["bound"] + case["fill"]
    pos_d = [(pos_h + k).to(dev) for k in range(steps)]
    # what an engine knows on the host: which sequences complete their chunk at each step
    done = [torch.nonzero(((pos_h + k) % L) == L - 1).flatten() for k in range(steps)]
    hint = [d.to(dev) if d.numel() else False for d in done]
    x, dt, B, C = case["tok"]
    prm = case["prm"]

    def step(i, use_hint):
        decode_step_triton(st, slots_d, pos_d[i], x, dt, B, C, prm, cfg=cfg, mode=mode,
                           completes=(hint[i] if use_hint else None))

    if dev.type == "cuda":
        out["replay"] = summary(cuda_times(torch, lambda i: step(i, True), n, warmup))
        st = clone_state(case["state"])
        out["replay_nohint"] = summary(cuda_times(torch, lambda i: step(i, False), n, warmup))
        st = clone_state(case["state"])
        out["replay_graph_ms"] = graph_time(torch, lambda: step(0, False), n)
        # what the completion kernels cost in a graph: the same step told that no chunk completes
        st = clone_state(case["state"])
        out["replay_graph_nocompletion_ms"] = graph_time(torch, lambda: decode_step_triton(
            st, slots_d, pos_d[0], x, dt, B, C, prm, cfg=cfg, mode=mode, completes=False), n)
    H, G, P, N = case["H"], case["G"], case["P"], case["N"]
    esize = x.element_size()
    out["bytes_replay"] = int(sum(replay_decode_bytes(H, G, P, N, int(f), esize, case["L"]) for f in case["fill"]))
    out["bytes_ssu"] = int(case["slots"].numel()) * ssu_step_bytes(H, G, P, N, esize)
    if upstream_ssu is not None and dev.type == "cuda":
        S = int(case["slots"].numel())
        pool = torch.randn(case["state"].ssm_state.shape, device=dev) * 0.3
        A_e = prm.A[:, None, None].expand(H, P, N)
        bias_e = prm.dt_bias[:, None].expand(H, P)
        D_e = prm.D[:, None].expand(H, P)
        dt_e = dt[:, :, None].expand(S, H, P)
        idx = slots_d.to(torch.int32)

        def ssu(i=0):
            upstream_ssu(pool, x, dt_e, A_e, B, C, D=D_e, z=None, dt_bias=bias_e, dt_softplus=True,
                         state_batch_indices=idx)

        out["ssu"] = summary(cuda_times(torch, ssu, n, warmup))
        out["ssu_graph_ms"] = graph_time(torch, ssu, n)
    return out


def bench_prefill(torch, H, G, dims, lens, dtype, dev, n, warmup, upstream_scan, seed, variants=False) -> dict:
    import dataclasses

    import aligned_mamba.ops.ssd.triton_chunk as tch
    from aligned_mamba.ops.ssd.plan import plan_advance, to_device
    from aligned_mamba.ops.ssd.state import SSDState
    from aligned_mamba.ops.step import Step

    P, N, L = dims["P"], dims["N"], dims["L"]
    S, T = len(lens), sum(lens)
    prm = params(torch, H, P, seed, dev)
    x, dt, B, C = tokens(torch, T, H, P, G, N, seed + 1, dtype, dev)
    st = SSDState.allocate(S, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=L, dtype=dtype, device=dev)
    batch = Step.make(list(range(S)), [0] * S, lens)
    slots = torch.arange(S, device=dev)
    out: dict = {}
    cfg = pinned_cfg()
    R0 = cfg.scan_row_tile(L)
    pinned_backend = triton_backend(cfg, L, dtype, dev)

    def ours(i=0, backend=pinned_backend):
        return backend.ssd_advance(st, batch, x, dt, B, C, prm)

    def reset(i=0):
        st.reset(slots)

    reset()
    y0 = ours()  # plans the batch (kept on it, as every layer of an engine step shares it)
    s0 = [t.clone() for t in st.tensors()]
    ref = None
    if T <= ACCURACY_MAX_TOKENS:  # the fp64 token-by-token reference, next to the bf16 floor
        from aligned_mamba.ops.ssd.naive import ssd_naive

        cu = torch.tensor([0, *lens], device=dev).cumsum(0)
        ref, _ = ssd_naive(x, dt, B, C, prm, cu)
        out["error_vs_fp64"] = rel_error(y0, ref)
        out["bf16_floor"] = rel_error(ref.to(dtype), ref)
    if dev.type == "cuda":
        # what the plan costs the host, once per step (not per layer): numpy tables + one pinned copy
        hs = []
        for _ in range(n):
            t0 = time.perf_counter()
            to_device(plan_advance(batch.lengths, batch.start_pos % L, L, R0, slots=batch.slots), dev)
            hs.append((time.perf_counter() - t0) * 1e3)
        out["plan_host_ms"] = statistics.median(hs)
        torch.cuda.synchronize()
        out["ours"] = summary(cuda_times(torch, ours, n, warmup, before=reset))
        # what an engine also pays when these sequences start: SSDState.reset of their slots
        out["reset_ms"] = summary(cuda_times(torch, reset, n, warmup))["median_ms"]
        # the scan kernels alone, dt packed once (what the scan costs without the pack and the buffers)
        plan = to_device(plan_advance(batch.lengths, torch.zeros(S, dtype=torch.int64), L, R0), dev)
        NC = plan.num_chunks
        dtc = torch.rand(NC, H, L, device=dev) * 0.05
        states = torch.zeros(S, H, P, N, device=dev)
        none = dict(x_parts=x.new_empty(0, H, L, P), B_parts=B.new_empty(0, G, L, N))  # no buffered rows
        out["ours_scan_only"] = summary(cuda_times(
            torch, lambda i: tch.scan_planned(plan, x, dtc, B, C, prm.A, prm.D, states, T=T, out_dtype=dtype,
                                              zero_unwanted=False, cfg=cfg, **none), n, warmup))
        del dtc
    if variants:
        out["variants"] = []
        pinned_tile_opts = tch.TILE_OPTS
        try:
            for R, warps, pass_bp, bk, opts in VARIANTS:
                if L % R:
                    continue
                vcfg = dataclasses.replace(cfg, row_tile=R, tile_num_warps=warps, pass_block_p=pass_bp, block_k=bk,
                                           bf16_dots=opts.get("dots", cfg.bf16_dots))
                tch.TILE_OPTS = opts.get("tile", pinned_tile_opts)
                vbackend = triton_backend(vcfg, L, dtype, dev)
                reset()
                y1 = ours(backend=vbackend)
                same = bool(torch.equal(y0, y1)) and all(torch.equal(a, b) for a, b in zip(s0, st.tensors()))
                v = {"row_tile": R, "tile_warps": warps, "pass_block_p": pass_bp, "block_k": bk, "tile_opts": opts,
                     "bitwise": same}
                if ref is not None:
                    v["error_vs_fp64"] = rel_error(y1, ref)
                if dev.type == "cuda":
                    ts = cuda_times(torch, lambda i: ours(backend=vbackend), n, warmup, before=reset)
                    v["ms"] = summary(ts)["median_ms"]
                out["variants"].append(v)
        finally:
            tch.TILE_OPTS = pinned_tile_opts
    if upstream_scan is not None and dev.type == "cuda":
        if S == 1:
            xu, dtu, Bu, Cu = (t.unsqueeze(0) for t in (x, dt, B, C))
        else:  # equal lengths, multiples of the chunk: a plain batch is the aligned varlen batch
            xu, dtu, Bu, Cu = (t.view(S, lens[0], *t.shape[1:]) for t in (x, dt, B, C))

        def up(i=0):
            return upstream_scan(xu, dtu, prm.A, Bu, Cu, L, D=prm.D, dt_bias=prm.dt_bias, dt_softplus=True)

        t0 = time.time()
        up()  # first call autotunes
        torch.cuda.synchronize()
        out["mamba_ssm_first_call_s"] = time.time() - t0
        out["mamba_ssm"] = summary(cuda_times(torch, up, n, warmup))
    return out


def rel_error(y, ref) -> float:
    """mean |y - ref| / mean |ref| (ref fp64)."""
    return float((y.double() - ref).abs().mean() / ref.abs().mean())


def memory_report(torch, H, G, dims, dtype) -> dict:
    """One Mamba2 layer's resident state per sequence (``Mamba2Mixer.state_spec``: the scan's
    replay state and the conv window, kernel 4) against the budget."""
    from aligned_mamba.layers.mamba2 import Mamba2MixerConfig, state_spec

    P, N, L = dims["P"], dims["N"], dims["L"]
    # hidden_size does not enter the per-slot state
    mixer = Mamba2MixerConfig(hidden_size=H * P // 2, num_heads=H, head_dim=P, state_size=N, n_groups=G,
                              conv_kernel=4)
    spec = state_spec(mixer, L, dtype)
    esize = torch.tensor([], dtype=dtype).element_size()
    parts = {name: math.prod(shape) * dt.itemsize for name, shape, dt in spec.fields}
    total = spec.bytes_per_slot()
    state32 = H * P * N * 4
    budget = state32 + L * (H * P * esize + H * esize + G * N * esize)  # fp32 state + L tokens of x, raw dt, B
    replay_ssm = total - parts["conv_window"]
    return {
        "bytes_per_slot": total, "parts": parts, "conv_window_bytes": parts["conv_window"],
        "replay_ssm_bytes": replay_ssm, "budget_bytes": budget, "within_budget": replay_ssm <= budget,
        "over_budget_bytes": max(0, replay_ssm - budget),
        "fp32_state_bytes": state32, "bf16_state_bytes": H * P * N * 2,
        "ratio_to_fp32_state": replay_ssm / state32,
        "note": "budget = fp32 state + chunk_size tokens of x, raw dt and B in the model dtype (no C); "
                "replay_ssm_bytes excludes the conv window, which the baseline keeps too; buf_dt holds raw dt "
                "in the model dtype",
    }


# --------------------------------------------------------------------------------------------
# schema
# --------------------------------------------------------------------------------------------

_TOP = {"gpu": str, "torch": str, "triton": str, "date": str, "commit": (str, type(None)), "script": str,
        "decode": list, "prefill": list, "memory": dict, "bandwidth": dict}
_DECODE = {"shape": str, "batch": int, "mode": str, "replay_ms": (float, type(None)), "ssu_ms": (float, type(None)),
           "ratio": (float, type(None)), "bitwise": (bool, type(None))}
_PREFILL = {"shape": str, "tokens": (int, str), "ours_ms": (float, type(None)),
            "mamba_ssm_ms": (float, type(None)), "ratio": (float, type(None))}


def validate(result: dict) -> list[str]:
    errs = []

    def check(obj, spec, where):
        for k, ty in spec.items():
            if k not in obj:
                errs.append(f"{where}: missing {k}")
            elif not isinstance(obj[k], ty):
                errs.append(f"{where}.{k}: {type(obj[k]).__name__} is not {ty}")

    check(result, _TOP, "top")
    for i, d in enumerate(result.get("decode", [])):
        check(d, _DECODE, f"decode[{i}]")
    for i, d in enumerate(result.get("prefill", [])):
        check(d, _PREFILL, f"prefill[{i}]")
    if "copy_GBps" not in result.get("bandwidth", {}):
        errs.append("bandwidth: missing copy_GBps")
    json.dumps(result)  # serialisable
    return errs


def _ratio(a, b):
    return a / b if (a is not None and b) else None


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="path of the JSON result")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, build inputs, check bits and schema")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of shapes")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--variants", action="store_true", help="prefill: also time and bit-check other tile configs")
    args = ap.parse_args()

    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    sys.path.insert(0, str(ROOT))
    import torch
    import triton

    dev = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if dev.type != "cuda" and not args.dry_run:
        log("no CUDA device: run with --dry-run on a CPU")
        return 2
    shapes, dims = (TINY_SHAPES, TINY_DIMS) if args.dry_run else (FULL_SHAPES, FULL_DIMS)
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if k in args.shapes.split(",")}
    batches = (1, 3) if args.dry_run else (1, 64, 256)
    prefills = ([("64", [64]), ("varlen_2x32", [32, 32])] if args.dry_run else
                [("2k", [2048]), ("8k", [8192]), ("32k", [32768]), ("varlen_64x512", [512] * 64)])
    n, warmup = (5, 2) if args.quick else (30, 5)
    dtype = torch.float32 if args.dry_run else torch.bfloat16  # the interpreter computes bf16 wrongly

    ssu, chunk_scan, up_err = load_upstream()
    if up_err:
        log(f"mamba_ssm not importable ({up_err}): upstream columns are null")
    result = {
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.processor() or 'dry-run'})",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(), "source_sha256": source_digest(), "script": SCRIPT,
        "argv": sys.argv[1:], "dry_run": args.dry_run, "quick": args.quick, "dims": dims,
        "dtype": str(dtype).replace("torch.", ""), "mamba_ssm": None if up_err else "2.3.2.post1 (.anchors)",
        "mamba_ssm_error": up_err, "reps": n, "warmup": warmup,
        "decode": [], "prefill": [], "memory": {}, "bandwidth": {}, "errors": [],
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out_path.write_text(json.dumps(result, indent=1))

    if dev.type == "cuda":
        result["bandwidth"] = copy_bandwidth(torch, dev, n)
        log(f"copy bandwidth {result['bandwidth']['copy_GBps']:.0f} GB/s")
    else:
        result["bandwidth"] = {"copy_GBps": None, "method": "dry run: not measured"}
    copy_bw = result["bandwidth"]["copy_GBps"]
    for name, (H, G) in shapes.items():
        result["memory"][name] = memory_report(torch, H, G, dims, torch.bfloat16)
    save()

    for name, (H, G) in ({} if args.skip_decode else shapes).items():
        for batch in batches:
            seed = 1000 * H + batch
            log(f"decode {name} batch {batch}: setup")
            try:
                case = decode_case(torch, H, G, dims, batch, dtype, dev, seed)
            except Exception as e:  # noqa: BLE001
                result["errors"].append(f"decode setup {name} b{batch}: {e!r}")
                log(traceback.format_exc())
                continue
            ssu_cache = None
            # bf16 models decode in "tile" mode (tensor-core dots); fp32 ones in "row" and "tile"
            modes = (BF16_MODES + (DECODE_VARIANTS if args.variants else ())) if dtype == torch.bfloat16 else MODES
            for mode in modes:
                entry = {"shape": name, "batch": batch, "mode": mode, "heads": H, "groups": G,
                         "fill_mean": float(case["fill"].float().mean()),
                         "replay_ms": None, "ssu_ms": None, "ratio": None, "bitwise": None}
                try:
                    with decode_mode(mode, pinned_cfg()) as (m, mcfg):
                        bw = decode_bitwise(torch, case, m, mcfg)
                        t = bench_decode(torch, case, m, mcfg, n, warmup, ssu if ssu_cache is None else None, dev)
                    entry.update(bitwise=bw["bitwise"], rows_equal=bw["rows_equal"], states_equal=bw["states_equal"],
                                 max_abs_diff=bw["max_abs_diff"])
                    if "ssu" in t:
                        ssu_cache = (t["ssu"], t.get("ssu_graph_ms"))
                    if dev.type == "cuda":
                        entry["replay_ms"] = t["replay"]["median_ms"]
                        entry["replay_mean_ms"] = t["replay"]["mean_ms"]
                        entry["replay_nohint_ms"] = t["replay_nohint"]["median_ms"]
                        entry["replay_graph_ms"] = t["replay_graph_ms"]
                        entry["replay_graph_nocompletion_ms"] = t["replay_graph_nocompletion_ms"]
                    if ssu_cache is not None:
                        entry["ssu_ms"] = ssu_cache[0]["median_ms"]
                        entry["ssu_mean_ms"] = ssu_cache[0]["mean_ms"]
                        entry["ssu_graph_ms"] = ssu_cache[1]
                    entry["ratio"] = _ratio(entry["replay_ms"], entry["ssu_ms"])
                    entry["ratio_graph"] = _ratio(entry.get("replay_graph_ms"), entry.get("ssu_graph_ms"))
                    entry["bytes_replay"], entry["bytes_ssu"] = t["bytes_replay"], t["bytes_ssu"]
                    for k, b, ms in (("replay", t["bytes_replay"], entry.get("replay_graph_ms") or entry["replay_ms"]),
                                     ("ssu", t["bytes_ssu"], entry.get("ssu_graph_ms") or entry["ssu_ms"])):
                        gbps = b / (ms * 1e-3) / 1e9 if ms else None
                        entry[f"{k}_GBps"] = gbps
                        entry[f"{k}_frac_copy_bw"] = _ratio(gbps, copy_bw)
                except Exception as e:  # noqa: BLE001
                    result["errors"].append(f"decode {name} b{batch} {mode}: {e!r}")
                    log(traceback.format_exc())
                result["decode"].append(entry)
                log(f"decode {name} b{batch} {mode}: bitwise={entry['bitwise']} "
                    f"({entry.get('rows_equal')}/{batch} rows, states {entry.get('states_equal')}) "
                    f"replay={entry['replay_ms']} ssu={entry['ssu_ms']} ratio={entry['ratio']} "
                    f"graph replay={entry.get('replay_graph_ms')} ssu={entry.get('ssu_graph_ms')}")
                save()
            del case
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    if not args.skip_prefill:
        for name, (H, G) in shapes.items():
            for label, lens in prefills:
                entry = {"shape": name, "tokens": label, "total_tokens": sum(lens), "sequences": len(lens),
                         "ours_ms": None, "mamba_ssm_ms": None, "ratio": None}
                log(f"prefill {name} {label}")
                try:
                    t = bench_prefill(torch, H, G, dims, lens, dtype, dev, n, warmup, chunk_scan, seed=7 * H,
                                      variants=args.variants)
                    entry["variants"] = t.get("variants")
                    if dev.type == "cuda":
                        entry["ours_ms"] = t["ours"]["median_ms"]
                        entry["ours_scan_only_ms"] = t["ours_scan_only"]["median_ms"]
                        entry["plan_host_ms"] = t["plan_host_ms"]
                        entry["reset_ms"] = t["reset_ms"]
                    for k in ("error_vs_fp64", "bf16_floor"):
                        if k in t:
                            entry[k] = t[k]
                    if "mamba_ssm" in t:
                        entry["mamba_ssm_ms"] = t["mamba_ssm"]["median_ms"]
                        entry["mamba_ssm_first_call_s"] = t["mamba_ssm_first_call_s"]
                    entry["ratio"] = _ratio(entry["ours_ms"], entry["mamba_ssm_ms"])
                    entry["ratio_scan_only"] = _ratio(entry.get("ours_scan_only_ms"), entry["mamba_ssm_ms"])
                except Exception as e:  # noqa: BLE001
                    result["errors"].append(f"prefill {name} {label}: {e!r}")
                    log(traceback.format_exc())
                result["prefill"].append(entry)
                log(f"prefill {name} {label}: ours={entry['ours_ms']} (scan only {entry.get('ours_scan_only_ms')}) "
                    f"mamba_ssm={entry['mamba_ssm_ms']} ratio={entry['ratio']} variants={entry.get('variants')}")
                save()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()

    errs = validate(result)
    result["schema_errors"] = errs
    save()
    log(f"wrote {out_path} ({len(result['decode'])} decode, {len(result['prefill'])} prefill entries, "
        f"{len(result['errors'])} errors, schema {'ok' if not errs else errs})")
    return 0 if not errs else 1


if __name__ == "__main__":
    sys.exit(main())
