#!/usr/bin/env python3
"""The project's trainer and sampler against mamba_ssm's own ``MambaLMHeadModel``, same weights, same
process, on one GPU.

    PYTHONPATH=.:.anchors python3 benchmarks/bench_mamba_ssm_h200.py --out-dir OUT [--shapes mamba2-1.3b,...]
        [--parts train,forward,decode,accuracy] [--profile] [--quick]

Stock: mamba_ssm 2.3.2.post1's ``MambaLMHeadModel`` (the whole package from its sdist in .anchors/,
an empty module standing in for Mamba1's ``selective_scan_cuda``), built in bf16 with its own init
(Mamba2 layers: state 128, head dim 64, 1 group, chunk 256, ``use_mem_eff_path=False``: its conv is
torch's conv1d and its fused in_proj-to-out_proj path is off; then its Triton SSD forward and
backward, Triton RMSNormGated, fused add + RMSNorm; tied embeddings, vocab padded to a multiple of
16). ``--stock-mem-eff``: ``use_mem_eff_path=True``, the fused path with causal_conv1d's CUDA
kernels (conv forward/backward and the decode step's conv update), which must import; the JSON's
``stock`` says which ran. Its ``save_pretrained`` directory is what ours loads
(``load_checkpoint`` + ``build_model`` under ``Contract(chunk_size=256, backend="triton",
model_dtype="bfloat16")``, which ``aligned_mamba.load_model(dir, contract, cast=True)`` is), so both
compute with the same bf16 values.

Parts (each cell's CUDA-event median after a first call; the JSON is written after every cell):
- train: one step = the loss -sum of fp32 log-softmax at random targets over 4 x 2048 and 1 x 16384
  tokens, then the gradient of every weight (``torch.autograd.grad``); peak ``max_memory_allocated``
  over one step; ours' logits with gradients on equal its no-grad forward and two of its backwards
  are compared bit for bit. ``--profile``: torch.profiler's kernel table of one step of each side
  (and of one forward and one graph decode step of each side in those cells).
- forward: all logits, no gradients, the same two token counts.
- train and forward, after each side's own block: ``--turns`` rounds (5) of one ours' call then one stock call,
  each timed call after an untimed one of its side; ``ratio_turns``, the ratio of those medians, shares the
  machine's drift and is the cell's figure (``summarize.py``); the blocks' ``ratio`` stays beside it.
- decode: one token per sequence at batch 1 / 64 / 256, every sequence prefilled to L k + U[0, L)
  tokens; ours ``DecodeGraphs.step``; stock mamba_ssm's ``capture_graph`` over ``InferenceParams``
  with its default bf16 state and with an fp32 state. The three are timed in turns (``--rounds``
  rounds of ``--steps`` steps each, every step from an idle GPU, host work included); a cell's figure
  is the median of the rounds' medians. Ours' graph rows are checked against ``model.forward``.
- accuracy: logits of ``--accuracy-seqs`` x 1024 tokens (2) against the same weights in an fp32 mamba_ssm
  model (and an fp32 contract of ours): relative error ||a - ref|| / ||ref|| and top-1 agreement, and
  each sequence's error for both bf16 sides (a paired comparison: in how many sequences ours is closer).

Writes OUT/h200_train_mamba_ssm.json (train) and OUT/h200_model_mamba_ssm.json (the rest).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "benchmarks/bench_mamba_ssm_h200.py"
# name -> (layers, d_model)
SHAPES = {"mamba2-130m": (24, 768), "mamba2-1.3b": (48, 2048), "mamba2-2.7b": (64, 2560)}
VOCAB = 50280
CELLS = [("4x2048", 4, 2048), ("1x16384", 1, 16384)]
BATCHES = (1, 64, 256)
L = 256


def log(msg: str) -> None:
    print(f"[vs_mamba_ssm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def import_mamba_ssm():
    """mamba_ssm's model classes; Mamba1's CUDA extension is imported at package load but not used by Mamba2."""
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
    from mamba_ssm.utils.generation import InferenceParams, capture_graph

    return MambaConfig, MambaLMHeadModel, InferenceParams, capture_graph


def build_stock(layers: int, d_model: int, seed: int, mem_eff: bool = False):
    """mamba_ssm's MambaLMHeadModel; ``mem_eff``: its fused conv + scan path (needs causal_conv1d built)."""
    import torch

    MambaConfig, MambaLMHeadModel, _, _ = import_mamba_ssm()
    torch.manual_seed(seed)
    cfg = MambaConfig(d_model=d_model, n_layer=layers, vocab_size=VOCAB,
                      ssm_cfg=dict(layer="Mamba2", d_state=128, headdim=64, ngroups=1, chunk_size=L,
                                   use_mem_eff_path=mem_eff),
                      rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=16)
    return MambaLMHeadModel(cfg, device="cuda", dtype=torch.bfloat16)


def stock_label(mem_eff: bool) -> str:
    """What the stock column ran: mamba_ssm's version, and whether causal_conv1d's kernels were in it."""
    import importlib.metadata as md

    import_mamba_ssm()  # the stand-in for Mamba1's extension first
    import mamba_ssm
    try:
        cc = "causal_conv1d " + md.version("causal_conv1d")
    except md.PackageNotFoundError:
        cc = "causal_conv1d not installed"
    return (f"mamba_ssm {getattr(mamba_ssm, '__version__', '?')} MambaLMHeadModel, bf16, "
            f"use_mem_eff_path={mem_eff} ({cc})")


def load_ours(stock, dev):
    """The stock model's ``save_pretrained`` directory as the project loads it: (config, tensors on dev)."""
    from aligned_mamba.models.registry import load_checkpoint

    with tempfile.TemporaryDirectory() as d:
        stock.save_pretrained(d)
        config, tensors = load_checkpoint(d)
    return config, {k: v.to(dev) for k, v in tensors.items()}


def cuda_ms(torch, step, n: int, warmup: int = 0, before=None) -> list[float]:
    from benchmarks.bench_h200 import cuda_times

    return cuda_times(torch, step, n, warmup, before)


def gpu_timeline(torch, prof, top: int = 12) -> dict:
    """Where the GPU sat idle in a profiled step: span from the step's start (its ``record_function`` range)
    to the last kernel's end, time with a kernel (or copy) running, the idle rest, the lead (the step's start
    to its first kernel), and the longest gaps between kernels with the kernels on each side (ms)."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    evs = prof.events()
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in evs if e.device_type == cuda)
    starts = [e.time_range.start for e in evs if e.device_type == cpu and e.name == "step"]
    if not ks or not starts:
        return {}
    t0 = min(starts)
    busy, gaps, end = 0.0, [], ks[0][0]
    prev = "(the step's start)"
    gaps.append((ks[0][0] - t0, prev, ks[0][2]))
    for a, b, name in ks:
        if a > end:
            gaps.append((a - end, prev, name))
        busy += max(0.0, b - max(a, end))
        if b > end:
            end, prev = b, name
    span = end - t0
    gaps.sort(key=lambda g: -g[0])
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
            "lead_ms": (ks[0][0] - t0) / 1e3,
            "gaps": [{"ms": g / 1e3, "after": a[:80], "before": b[:80]} for g, a, b in gaps[:top]]}


def kernel_table(torch, step, top: int = 30) -> dict:
    """One call of step under torch.profiler (CPU and CUDA activity): kernels by GPU time, summed by name,
    and ``gpu_timeline``'s idle time (the profiler's own CPU cost included, so an upper bound)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("step"):
            step()
        torch.cuda.synchronize()
    acc: dict[str, list] = {}
    for ev in prof.key_averages():
        us = float(getattr(ev, "self_device_time_total", 0.0) or 0.0)
        if us > 0:
            a = acc.setdefault(ev.key[:120], [0.0, 0])
            a[0] += us
            a[1] += ev.count
    rows = sorted(acc.items(), key=lambda kv: -kv[1][0])
    return {"device_total_ms": sum(v[0] for _, v in rows) / 1e3,
            "kernels": [{"name": k, "ms": v[0] / 1e3, "calls": v[1]} for k, v in rows[:top]],
            "timeline": gpu_timeline(torch, prof)}


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def free(torch) -> None:
    gc.collect()
    torch.cuda.empty_cache()


def peak_and_times(torch, step, n: int, e: dict, prefix: str) -> None:
    t0 = time.perf_counter()
    out = step()
    torch.cuda.synchronize()
    e[f"{prefix}_first_call_s"] = time.perf_counter() - t0
    del out
    free(torch)
    peak(torch, step, e, prefix)
    ts = cuda_ms(torch, lambda i: step(), n)
    e[f"{prefix}_ms"] = statistics.median(ts)
    e[f"{prefix}_times_ms"] = ts


def peak(torch, step, e: dict, prefix: str) -> None:
    """One call of ``step``: its peak memory, in all and above what was allocated before it."""
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = step()
    torch.cuda.synchronize()
    e[f"{prefix}_peak_bytes"] = torch.cuda.max_memory_allocated()
    e[f"{prefix}_peak_above_weights_bytes"] = e[f"{prefix}_peak_bytes"] - base
    del out


def in_turns(torch, steps: dict, rounds: int, e: dict, prefix: str) -> None:
    """Each of ``steps`` (label -> step) timed once a round, in turn, ``rounds`` rounds, so their medians share
    the machine's drift: ``{prefix}_{label}_ms`` (the median) and ``{prefix}_{label}_times_ms``. Each timed call
    follows an untimed one of the same step: the allocator's cache then holds that step's blocks, as in a run
    of its own (without it, a call after the other side's paid for the cache's reshuffle)."""
    ts: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for k, f in steps.items():
            ts[k] += cuda_ms(torch, lambda i, f=f: f(), 1, warmup=1)
    for k, v in ts.items():
        e[f"{prefix}_{k}_ms"], e[f"{prefix}_{k}_times_ms"] = statistics.median(v), v


def ab_times(torch, steps: dict, rounds: int, e: dict) -> None:
    """``--configs-b``: ours and b in turns (``in_turns``); ``b_ratio`` = b / ours."""
    in_turns(torch, steps, rounds, e, "ab")
    e["b_ratio"] = e["ab_b_ms"] / e["ab_ours_ms"]


def stock_turns(torch, ours, stock, rounds: int, e: dict, more: dict | None = None) -> None:
    """Ours (and ``more``: label -> another of ours' steps) and the stock timed in turns after each side's own
    block (``--turns``): ``ratio_turns`` (and ``ratio_{label}_turns``), the ratio the cell is read by, shares the
    machine's drift between the sides (the blocks' ``ratio`` does not)."""
    if rounds < 1 or not (e.get("ours_ms") and e.get("stock_ms")):
        return
    try:
        in_turns(torch, {"ours": ours, **(more or {}), "stock": stock}, rounds, e, "turns")
        e["ratio_turns"] = e["turns_ours_ms"] / e["turns_stock_ms"]
        for k in more or {}:
            e[f"ratio_{k}_turns"] = e[f"turns_{k}_ms"] / e["turns_stock_ms"]
    except Exception as exc:  # noqa: BLE001 - a failed round is a result
        e["turns_error"] = f"{type(exc).__name__}: {exc}"
        log(traceback.format_exc())
    free(torch)


def _knob_module(key: str):
    """The module and attribute of a ``--knobs-b`` key: "module.NAME" (a module of ``aligned_mamba.ops.ssd``) or
    "package.module.NAME" (of ``aligned_mamba.ops``, e.g. "conv1d.triton.NAME")."""
    import importlib

    *path, name = key.split(".")
    if len(path) not in (1, 2):
        raise ValueError(f"{key!r}: expected module.NAME or package.module.NAME")
    mod = importlib.import_module("aligned_mamba.ops." + (f"ssd.{path[0]}" if len(path) == 1 else ".".join(path)))
    getattr(mod, name)  # an unknown name: AttributeError
    return mod, name


@contextlib.contextmanager
def module_knobs(knobs: dict | None):
    """``--knobs-b``: module attributes of ``aligned_mamba.ops`` (``_knob_module``'s keys) set for the block,
    then set back (launch choices outside the contract: the b side's step or forward runs under them)."""
    old = {}
    try:
        for key, value in (knobs or {}).items():
            mod, name = _knob_module(key)
            old[key] = (mod, name, getattr(mod, name))
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, value in old.values():
            setattr(mod, name, value)


HOLD_MARGIN = 128 << 20  # "stock": the budget this far below the stock's peak (the allocator's rounding)


def hold_budget(args, e: dict) -> int:
    """``--hold-conv-gib``'s budget in bytes: a number of GiB, or "stock": what the stock's measured peak
    leaves above ours' plain step's, less ``HOLD_MARGIN``."""
    if args.hold_conv_gib != "stock":
        return int(float(args.hold_conv_gib) * 2**30)
    if not (e.get("stock_peak_bytes") and e.get("ours_peak_bytes")):
        raise RuntimeError("--hold-conv-gib stock needs both plain peaks measured first")
    return max(0, e["stock_peak_bytes"] - e["ours_peak_bytes"] - HOLD_MARGIN)


def train_cell(args, torch, name, config, tensors, stock, contract, label, S, T, seed) -> dict:
    from aligned_mamba.layers.mamba2 import hold_conv_outputs
    from aligned_mamba.models import build_model
    from benchmarks.bench_train_h200 import ours_loss

    dev = torch.device("cuda")
    e = {"shape": name, "label": label, "tokens": S * T, "ours_ms": None, "stock_ms": None, "ratio": None}
    g = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.randint(0, VOCAB, (S, T), device=dev, generator=g)
    targets = torch.randint(0, VOCAB, (S, T), device=dev, generator=g)
    seqs, tgts = list(ids), list(targets)
    leaves = {k: v.detach().requires_grad_() for k, v in tensors.items()}
    names = sorted(leaves)
    n = 2 if args.quick else 4
    first = None

    def ours_step(budget: int | None = None, c=contract):
        with contextlib.nullcontext([0]) if budget is None else hold_conv_outputs(budget) as left:
            loss, _ = ours_loss(build_model(config, leaves, c, device=dev), seqs, tgts)
        if budget is not None:  # conv outputs held this step, bytes
            e["ours_hold_held_bytes"] = budget - left[0]
        return torch.autograd.grad(loss, [leaves[k] for k in names])

    params = [p for p in stock.parameters() if p.requires_grad]

    def stock_step():
        logits = stock(ids).logits
        loss = -torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).sum()
        return torch.autograd.grad(loss, params)

    try:
        with torch.no_grad():
            plain = build_model(config, tensors, contract, device=dev).forward(seqs, packed=True)
        loss, logits = ours_loss(build_model(config, leaves, contract, device=dev), seqs, tgts)
        e["ours_grad_mode_logits_equal"] = torch.equal(logits.detach(), plain)
        del plain, logits
        first = torch.autograd.grad(loss, [leaves[k] for k in names])
        del loss
        again = ours_step()
        e["ours_grads_repeat_differ"] = [k for k, u, v in zip(names, first, again) if not torch.equal(u, v)]
        e["ours_grads_repeat_equal"] = not e["ours_grads_repeat_differ"]
        first = [u.cpu() for u in first] if args.hold_conv_gib is not None else None
        del again
        free(torch)
        peak_and_times(torch, ours_step, n, e, "ours")
        if args.profile:
            e["ours_profile"] = kernel_table(torch, ours_step)
        if args.contract_b is not None:  # the other contract's step: its own repeat, then both in turn
            def b_step():
                with module_knobs(args.knobs_b):
                    return ours_step(c=args.contract_b)

            b1 = b_step()  # two gradient sets live at most (80 GB cards)
            e["b_grads_repeat_equal"] = all(torch.equal(u, v) for u, v in zip(b1, b_step()))
            e["b_grads_differ_from_ours"] = len([1 for u, v in zip(b1, ours_step()) if not torch.equal(u, v)])
            del b1
            free(torch)
            peak(torch, b_step, e, "b")  # timed below, in turn with ours
            ab_times(torch, {"ours": ours_step, "b": b_step}, max(n, 3), e)
            free(torch)
    except Exception as exc:  # noqa: BLE001 - a failed cell is a result
        e["ours_error"] = f"{type(exc).__name__}: {exc}"
        log(traceback.format_exc())
        first = None
    free(torch)
    if not args.ours_only:
        try:
            peak_and_times(torch, stock_step, n, e, "stock")
            if args.profile:
                e["stock_profile"] = kernel_table(torch, stock_step)
        except Exception as exc:  # noqa: BLE001
            e["stock_error"] = f"{type(exc).__name__}: {exc}"
            log(traceback.format_exc())
        free(torch)
    if first is not None:  # the budgeted hold, after both plain steps: the same bits, timed last
        try:
            budget = e["ours_hold_budget_bytes"] = hold_budget(args, e)
            held = ours_step(budget)
            e["ours_hold_grads_equal"] = all(torch.equal(u, v.cpu()) for u, v in zip(first, held))
            del first, held
            free(torch)
            peak_and_times(torch, lambda: ours_step(budget), n, e, "ours_hold")
        except Exception as exc:  # noqa: BLE001
            e["ours_hold_error"] = f"{type(exc).__name__}: {exc}"
            log(traceback.format_exc())
        free(torch)
    if not args.ours_only:  # the held step, where it ran, in the same turns
        held = {"ours_hold": lambda: ours_step(e["ours_hold_budget_bytes"])} if e.get("ours_hold_ms") else None
        stock_turns(torch, ours_step, stock_step, args.turns, e, held)
    if e["ours_ms"] and e["stock_ms"]:
        e["ratio"] = e["ours_ms"] / e["stock_ms"]
        e["peak_ratio"] = e["ours_peak_bytes"] / e["stock_peak_bytes"]
    if e.get("ours_hold_ms") and e["stock_ms"]:
        e["ratio_hold"] = e["ours_hold_ms"] / e["stock_ms"]
        e["peak_ratio_hold"] = e["ours_hold_peak_bytes"] / e["stock_peak_bytes"]
    return e


def forward_cell(args, torch, name, model, stock, label, S, T, seed) -> dict:
    dev = torch.device("cuda")
    e = {"shape": name, "label": label, "tokens": S * T, "ours_ms": None, "stock_ms": None, "ratio": None}
    g = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.randint(0, VOCAB, (S, T), device=dev, generator=g)
    seqs = list(ids)
    n = 3 if args.quick else 5
    with torch.no_grad():
        sides = (("ours", lambda: model.forward(seqs)), ("stock", lambda: stock(ids).logits))
        for side, fn in sides[:1] if args.ours_only else sides:
            try:
                fn()
                torch.cuda.synchronize()
                free(torch)
                ts = cuda_ms(torch, lambda i, f=fn: f(), n)
                e[f"{side}_ms"], e[f"{side}_times_ms"] = statistics.median(ts), ts
                if args.profile:
                    e[f"{side}_profile"] = kernel_table(torch, fn)
            except Exception as exc:  # noqa: BLE001
                e[f"{side}_error"] = f"{type(exc).__name__}: {exc}"
                log(traceback.format_exc())
            free(torch)
        if not args.ours_only:
            stock_turns(torch, sides[0][1], sides[1][1], args.turns, e)
    if args.contract_b is not None and e["ours_ms"]:
        def b_forward():
            with module_knobs(args.knobs_b):
                return args.model_b.forward(seqs)

        with torch.no_grad():
            try:
                e["b_rows_equal_ours"] = all(map(torch.equal, b_forward(), model.forward(seqs)))
                free(torch)
                ab_times(torch, {"ours": lambda: model.forward(seqs), "b": b_forward}, n, e)
                if args.profile:
                    e["b_profile"] = kernel_table(torch, b_forward)
            except Exception as exc:  # noqa: BLE001
                e["b_error"] = f"{type(exc).__name__}: {exc}"
                log(traceback.format_exc())
            free(torch)
    if e["ours_ms"] and e["stock_ms"]:
        e["ratio"] = e["ours_ms"] / e["stock_ms"]
    return e


def decode_cell(args, torch, name, model, stock, batch: int, seed: int) -> dict:
    """Ours (DecodeGraphs), mamba_ssm's capture_graph with a bf16 and an fp32 state, timed in turns."""
    from aligned_mamba.decode_graph import DecodeGraphs
    from aligned_mamba.ops.ssd import triton_decode as td
    from benchmarks.bench_model_h200 import PREFILL_TOKENS, prefill_last_rows

    _, _, InferenceParams, capture_graph = import_mamba_ssm()
    dev = torch.device("cuda")
    e = {"shape": name, "batch": batch, "ours_ms": None, "stock_bf16_ms": None, "stock_fp32_ms": None}
    g = torch.Generator().manual_seed(seed)
    pos = L * torch.randint(0, 2, (batch,), generator=g) + torch.randint(1, L, (batch,), generator=g)
    slots = torch.randperm(batch, generator=g)
    hist = [torch.randint(0, VOCAB, (int(p),), generator=g) for p in pos]
    steps = args.steps
    toks = torch.randint(0, VOCAB, (steps * args.rounds + 1, batch), generator=g)
    max_seqlen = int(pos.max()) + toks.shape[0] + 1
    runners: dict = {}
    firsts: dict = {}
    # ours; with --prep-heads also ours with the decode prep split (its own cache and graphs, captured with
    # PREP_HEADS set: a graph keeps the launches it captured), with --in-order-completions ours with the completion
    # launches in order on the step's stream (DecodeGraphs' default: a side stream), with --configs-b/--knobs-b ours
    # under the b contract and knobs (its cache, graphs and steps under them); timed in the same rounds
    sides = [("ours", model, td.PREP_HEADS, True, None)] \
        + ([("ours_prep", model, args.prep_heads, True, None)] if args.prep_heads else []) \
        + ([("ours_inorder", model, td.PREP_HEADS, False, None)] if args.in_order_completions else []) \
        + ([("ours_b", args.model_b or model, td.PREP_HEADS, True, args.knobs_b)] if args.contract_b is not None
           else [])
    for side, m, heads, on_side, knobs in sides:
        try:
            with module_knobs(knobs):
                cache = m.new_cache(batch + 1)
                prefill_last_rows(m, cache, slots.tolist(), [h.to(dev) for h in hist], PREFILL_TOKENS)
                graphs = DecodeGraphs(m, cache, spare_slot=batch, side_completions=on_side)
                base, td.PREP_HEADS = td.PREP_HEADS, heads
                try:
                    graphs.capture([graphs.bucket(batch)])  # both graphs (with and without completions), untimed
                finally:
                    td.PREP_HEADS = base
                firsts[side] = graphs.step(slots, pos, toks[0]).clone()

            def run(i, gr=graphs):
                return gr.step(slots, pos + 1 + i, toks[1 + i])

            def run_under_knobs(i, gr=graphs, k=knobs, f=run):  # a knob the step's host side reads holds while timed
                with module_knobs(k):  # (f bound here: the stock's loop below rebinds the name run)
                    return f(i, gr)

            runners[side] = run_under_knobs if knobs else run
        except Exception as exc:  # noqa: BLE001
            e[f"{side}_error"] = f"{type(exc).__name__}: {exc}"
            log(traceback.format_exc())
    if "ours" in firsts:
        k = min(4, batch)
        fwd = torch.stack([lg[-1] for lg in model.forward([torch.cat([hist[i], toks[0, i:i + 1]]).to(dev)
                                                            for i in range(k)])])
        e["graph_rows_equal_forward"] = int((firsts["ours"][:k] == fwd).all(1).sum())
        e["graph_rows_checked"] = k
        if "ours_prep" in firsts:
            e["prep_heads"] = args.prep_heads
            e["ours_prep_rows_equal_ours"] = bool(torch.equal(firsts["ours_prep"], firsts["ours"]))
        if "ours_inorder" in firsts:
            e["ours_inorder_rows_equal_ours"] = bool(torch.equal(firsts["ours_inorder"], firsts["ours"]))
        if "ours_b" in firsts:
            e["ours_b_rows_equal_ours"] = bool(torch.equal(firsts["ours_b"], firsts["ours"]))
        del fwd
    firsts.clear()
    for tag, dtype in (("stock_bf16", None), ("stock_fp32", torch.float32)):
        try:
            params = InferenceParams(max_seqlen=max_seqlen, max_batch_size=batch)
            cache = stock.allocate_inference_cache(batch, max_seqlen)
            if dtype is not None:
                # the SSM state in fp32, the conv state in the model's dtype: causal_conv1d's update takes
                # no other (its inputs are bf16 values, so an fp32 conv state would hold the same numbers)
                cache = {i: (conv, ssm.to(dtype)) for i, (conv, ssm) in cache.items()}
            params.key_value_memory_dict = cache
            params.lengths_per_sample = torch.zeros(batch, dtype=torch.int32, device=dev)
            run = capture_graph(stock, params, batch, max_seqlen)
            ids = toks.to(dev)
            pos_d = pos.to(dev)
            conv_state, ssm_state = next(iter(params.key_value_memory_dict.values()))
            e[f"{tag}_state_dtype"] = str(ssm_state.dtype)
            e[f"{tag}_conv_state_dtype"] = str(conv_state.dtype)
            runners[tag] = (lambda i, r=run, ids=ids, pos_d=pos_d:
                            r(ids[1 + i][:, None], (pos_d + 1 + i)[:, None], int(pos.max()) + 1 + i))
        except Exception as exc:  # noqa: BLE001
            e[f"{tag}_error"] = f"{type(exc).__name__}: {exc}"
            log(traceback.format_exc())
    if args.profile:  # one graph replay of each side (CUPTI lists the graph's kernels)
        for tag, fn in runners.items():
            try:
                e[f"{tag}_profile"] = kernel_table(torch, lambda f=fn: f(0))
            except Exception as exc:  # noqa: BLE001
                e[f"{tag}_profile"] = {"error": f"{type(exc).__name__}: {exc}"}
    rounds: dict = {k: [] for k in runners}
    for r in range(args.rounds):
        for tag, fn in runners.items():
            ts = cuda_ms(torch, lambda i, f=fn, r=r: f(r * steps + i), steps, 0,
                         before=lambda i: torch.cuda.synchronize())
            rounds[tag].append(statistics.median(ts))
    for tag, meds in rounds.items():
        e[f"{tag}_round_ms"] = meds
        e[f"{tag}_ms"] = statistics.median(meds)
    for tag in ("stock_bf16", "stock_fp32"):
        if e["ours_ms"] and e.get(f"{tag}_ms"):
            e[f"ratio_{tag}"] = e["ours_ms"] / e[f"{tag}_ms"]
    if e["ours_ms"] and e.get("ours_prep_ms"):
        e["ratio_prep_over_ours"] = e["ours_prep_ms"] / e["ours_ms"]
    if e["ours_ms"] and e.get("ours_b_ms"):
        e["b_ratio"] = e["ours_b_ms"] / e["ours_ms"]  # b / ours, as the train and forward cells'
    if e["ours_ms"] and e.get("ours_inorder_ms"):
        e["ratio_inorder_over_ours"] = e["ours_inorder_ms"] / e["ours_ms"]
        if e.get("stock_bf16_ms"):
            e["ratio_inorder_stock_bf16"] = e["ours_inorder_ms"] / e["stock_bf16_ms"]
    runners.clear()
    return e


def accuracy(torch, name, config, tensors, stock, contract, seed: int, seqs: int, contract_b=None,
             knobs_b: dict | None = None) -> dict:
    """Logits error against mamba_ssm's model in fp32 on ``seqs`` x 1024 random tokens: ours, the stock in bf16,
    ours in fp32, and ours under ``contract_b`` and ``knobs_b`` (``--configs-b``, ``--knobs-b``) where given, its
    ``b_`` keys."""
    from aligned_mamba import Contract
    from aligned_mamba.models import build_model

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.randint(0, VOCAB, (seqs, 1024), device=dev, generator=g)

    def ours(c):
        return torch.stack(build_model(config, tensors, c, device=dev).forward(list(ids))).float()

    with torch.no_grad():
        ref = copy.deepcopy(stock).float()
        r = ref(ids).logits.float()
        del ref
        free(torch)
        s = stock(ids).logits.float()
        o = ours(contract)
        o32 = ours(Contract(chunk_size=L, backend="triton", model_dtype="float32"))
        with module_knobs(knobs_b):
            ob = None if contract_b is None else ours(contract_b)
    top = r.argmax(-1)
    ours_seq, stock_seq = ([rel(a[i], r[i]) for i in range(seqs)] for a in (o, s))
    e = {"shape": name, "tokens": seqs * 1024, "ours_rel_err_by_seq": ours_seq,
         "stock_bf16_rel_err_by_seq": stock_seq,
         "ours_closer_in_seqs": sum(a < b for a, b in zip(ours_seq, stock_seq)),
         "ours_rel_err_vs_stock_fp32": rel(o, r), "stock_bf16_rel_err_vs_stock_fp32": rel(s, r),
         "ours_fp32_rel_err_vs_stock_fp32": rel(o32, r),
         "ours_rel_err_vs_ours_fp32": rel(o, o32), "stock_bf16_rel_err_vs_ours_fp32": rel(s, o32),
         "ours_top1_agree": float((o.argmax(-1) == top).float().mean()),
         "stock_bf16_top1_agree": float((s.argmax(-1) == top).float().mean())}
    if ob is not None:
        b_seq = [rel(ob[i], r[i]) for i in range(seqs)]
        e.update({"b_rel_err_by_seq": b_seq, "b_closer_in_seqs": sum(a < b for a, b in zip(b_seq, stock_seq)),
                  "b_rel_err_vs_stock_fp32": rel(ob, r), "b_rel_err_vs_ours_fp32": rel(ob, o32),
                  "b_top1_agree": float((ob.argmax(-1) == top).float().mean())})
    return e


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--shapes", default="mamba2-1.3b,mamba2-2.7b")
    ap.add_argument("--parts", default="train,forward,decode,accuracy")
    ap.add_argument("--cells", default="4x2048,1x16384")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--profile", action="store_true",
                    help="kernel tables of one training step, forward and graph decode step of each side")
    ap.add_argument("--stock-mem-eff", action="store_true",
                    help="the stock's fused use_mem_eff_path=True path (causal_conv1d must import)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--configs", help="JSON of the triton contract's kernel configs for ours, "
                    'e.g. \'{"bwd_bf16_dots":"round"}\'')
    ap.add_argument("--configs-b", help="JSON of kernel configs over --configs: a second contract of ours, "
                    "timed in turn with the first in the same process (train, forward and decode; b_ratio = b / ours)")
    ap.add_argument("--knobs-b", help="JSON of module knobs for the b side (alone or over --configs-b): "
                    '{"triton_backward.BWD_HEADS_PER_PROGRAM": 16}')
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--turns", type=int, default=5, help="train, forward: after each side's own block, ours and the "
                    "stock timed in turns this many rounds (ratio_turns); 0: not")
    ap.add_argument("--accuracy-seqs", type=int, default=2, help="accuracy: sequences of 1024 tokens")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--scan-bwd", help="JSON of the scan backward's module knobs (bench_scan_backward_h200.py --best)"
                    " to run ours with instead of the committed ones")
    ap.add_argument("--ours-only", action="store_true", help="train, forward: time and profile ours alone (the stock's "
                    "first call tunes for a minute or two)")
    ap.add_argument("--no-recompute", action="store_true",
                    help="ours holds the conv's and the gated norm's outputs to the backward (Mamba2Mixer.recompute "
                         "off): fewer launches, more memory")
    ap.add_argument("--hold-conv", action="store_true",
                    help="ours holds the conv's output to the backward, the gated norm still recomputed "
                         "(Mamba2Mixer.recompute_conv off): one conv launch less a layer, conv_dim x 2 B a token "
                         "and layer more")
    ap.add_argument("--hold-conv-gib", default=None,
                    help="train: also time ours holding the conv's output in as many layers as fit in this many GiB "
                         "a step, in forward order (hold_conv_outputs; columns ours_hold_*), or 'stock': in what the "
                         "stock's peak leaves above ours'; its gradients' bits checked against the plain step's")
    ap.add_argument("--in-order-completions", action="store_true",
                    help="decode: also time ours with the chunk-completion launches in order on the step's "
                         "stream (DecodeGraphs side_completions=False), interleaved with the others")
    ap.add_argument("--prep-heads", type=int, default=None,
                    help="decode: also time ours with its prep kernel in programs of this many heads "
                         "(triton_decode.PREP_HEADS), interleaved with the others")
    args = ap.parse_args()
    if args.turns < 0:
        ap.error(f"--turns: a number of rounds, 0 for none, got {args.turns}")
    if args.hold_conv_gib not in (None, "stock"):
        try:
            float(args.hold_conv_gib)
        except ValueError:
            ap.error(f"--hold-conv-gib: a number of GiB or 'stock', got {args.hold_conv_gib!r}")
    sys.path.insert(0, str(ROOT))
    import torch
    import triton

    from aligned_mamba import Contract
    from aligned_mamba.models import build_model
    from benchmarks.bench_h200 import git_commit
    from benchmarks.bench_model_h200 import retune_stock

    if not torch.cuda.is_available():
        log("no CUDA device")
        return 2
    if args.stock_mem_eff:
        try:
            import causal_conv1d  # noqa: F401
        except ImportError:
            log("--stock-mem-eff refused: causal_conv1d does not import (build it: benchmarks/README.md, "
                "'The fused stock')")
            return 2
    parts = set(args.parts.split(","))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "commit": git_commit(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "script": SCRIPT,
            "argv": sys.argv[1:],
            "stock": stock_label(args.stock_mem_eff)}
    from aligned_mamba.ops.ssd import triton_backward as ta

    if args.scan_bwd:
        k = json.loads(Path(args.scan_bwd).read_text())
        ta.BWD_OPTS, ta.STATE_OPTS = k["BWD_OPTS"], k["STATE_OPTS"]
        ta.BWD_HEADS_PER_PROGRAM = k["BWD_HEADS_PER_PROGRAM"]
        ta.BWD_ROWS_HEADS_PER_PROGRAM = k.get("BWD_ROWS_HEADS_PER_PROGRAM", k["BWD_HEADS_PER_PROGRAM"])
    from aligned_mamba.layers.mamba2 import Mamba2Mixer

    Mamba2Mixer.recompute = not args.no_recompute
    Mamba2Mixer.recompute_conv = not args.hold_conv
    meta["recompute"] = Mamba2Mixer.recompute
    meta["recompute_conv"] = Mamba2Mixer.recompute_conv
    meta["hold_conv_gib"] = args.hold_conv_gib
    meta["prep_heads"] = args.prep_heads  # the decode's ours_prep side (None: no such side)
    meta["scan_bwd_knobs"] = {"BWD_OPTS": ta.BWD_OPTS, "BWD_HEADS_PER_PROGRAM": ta.BWD_HEADS_PER_PROGRAM,
                              "BWD_ROWS_HEADS_PER_PROGRAM": ta.BWD_ROWS_HEADS_PER_PROGRAM,
                              "BWD_FLAT_GRID": ta.BWD_FLAT_GRID,
                              "STATE_OPTS": ta.STATE_OPTS, "from": args.scan_bwd or "committed"}
    configs = json.loads(args.configs) if args.configs else None
    contract = Contract(chunk_size=L, backend="triton", model_dtype="bfloat16", kernel_configs=configs)
    args.contract_b, args.model_b = None, None
    args.knobs_b = json.loads(args.knobs_b) if args.knobs_b else None
    try:  # unknown knobs refused here, before the models load
        with module_knobs(args.knobs_b):
            pass
    except (ImportError, AttributeError, ValueError) as exc:
        ap.error(f"--knobs-b: {type(exc).__name__}: {exc} (keys: module.NAME of aligned_mamba.ops.ssd, or "
                 "package.module.NAME of aligned_mamba.ops)")
    if args.configs_b or args.knobs_b:
        args.contract_b = Contract(chunk_size=L, backend="triton", model_dtype="bfloat16",
                                   kernel_configs={**(configs or {}), **json.loads(args.configs_b or "{}")})
        meta["knobs_b"] = args.knobs_b
        meta["contract_b"] = args.contract_b.to_dict()
    train = dict(meta, contract=contract.to_dict(), train=[])
    model_res = dict(meta, forward=[], decode=[], accuracy=[])
    cells = [c for c in CELLS if c[0] in args.cells.split(",")]

    def save():
        if "train" in parts:
            (out / "h200_train_mamba_ssm.json").write_text(json.dumps(train, indent=1))
        if parts - {"train"}:
            (out / "h200_model_mamba_ssm.json").write_text(json.dumps(model_res, indent=1))

    gib = 2 ** 30
    for si, name in enumerate(args.shapes.split(",")):
        layers, d_model = SHAPES[name]
        stock = build_stock(layers, d_model, seed=1234 + si, mem_eff=args.stock_mem_eff)
        retune_stock()  # mamba_ssm's autotuners keyed alike at every shape: tune at this one
        config, tensors = load_ours(stock, torch.device("cuda"))
        log(f"{name}: {sum(p.numel() for p in stock.parameters()) / 1e9:.2f} B parameters")
        if "train" in parts:
            for ci, (label, S, T) in enumerate(cells):
                e = train_cell(args, torch, name, config, tensors, stock, contract, label, S, T, 17 + ci)
                train["train"].append(e)
                save()
                if args.contract_b is not None:
                    log(f"train {name} {label}: b {e.get('ab_b_ms')} ours {e.get('ab_ours_ms')} in turn, b_ratio "
                        f"{e.get('b_ratio')}, b repeat {e.get('b_grads_repeat_equal')}")
                log(f"train {name} {label}: ours {e['ours_ms']} stock {e['stock_ms']} ratio {e['ratio']} peak "
                    f"{(e.get('ours_peak_bytes') or 0) / gib:.1f} / {(e.get('stock_peak_bytes') or 0) / gib:.1f} GiB "
                    f"logits equal {e.get('ours_grad_mode_logits_equal')} repeat {e.get('ours_grads_repeat_equal')}")
        stock.eval()
        model = build_model(config, tensors, contract, device=torch.device("cuda"))
        if args.contract_b is not None:
            args.model_b = build_model(config, tensors, args.contract_b, device=torch.device("cuda"))
        if "forward" in parts:
            for ci, (label, S, T) in enumerate(cells):
                e = forward_cell(args, torch, name, model, stock, label, S, T, 27 + ci)
                model_res["forward"].append(e)
                save()
                log(f"forward {name} {label}: ours {e['ours_ms']} stock {e['stock_ms']} ratio {e['ratio']}"
                    + (f" b / ours in turn {e.get('b_ratio')}" if args.contract_b is not None else ""))
        if "accuracy" in parts:
            try:
                e = accuracy(torch, name, config, tensors, stock, contract, 5, args.accuracy_seqs, args.contract_b,
                             args.knobs_b)
            except Exception as exc:  # noqa: BLE001
                e = {"shape": name, "error": f"{type(exc).__name__}: {exc}"}
                log(traceback.format_exc())
            model_res["accuracy"].append(e)
            save()
            log(f"accuracy {name}: {e}")
            free(torch)
        if "decode" in parts:
            for b in map(int, args.batches.split(",")):
                try:
                    e = decode_cell(args, torch, name, model, stock, b, 37 + b)
                except Exception as exc:  # noqa: BLE001
                    e = {"shape": name, "batch": b, "error": f"{type(exc).__name__}: {exc}"}
                    log(traceback.format_exc())
                model_res["decode"].append(e)
                save()
                log(f"decode {name} b{b}: ours {e.get('ours_ms')} stock bf16 {e.get('stock_bf16_ms')} "
                    f"fp32 {e.get('stock_fp32_ms')} rows {e.get('graph_rows_equal_forward')}"
                    f"/{e.get('graph_rows_checked')}"
                    + (f" prep{args.prep_heads} {e.get('ours_prep_ms')} same rows {e.get('ours_prep_rows_equal_ours')}"
                       if args.prep_heads else "")
                    + (f" in order {e.get('ours_inorder_ms')} same rows {e.get('ours_inorder_rows_equal_ours')}"
                       if args.in_order_completions else "")
                    + (f" b {e.get('ours_b_ms')} b / ours {e.get('b_ratio')} rows {e.get('ours_b_rows_equal_ours')}"
                       if args.contract_b is not None else ""))
                free(torch)
        del stock, model, tensors
        args.model_b = None
        free(torch)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
