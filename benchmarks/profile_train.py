#!/usr/bin/env python3
"""Where a training step of the triton backend spends its time on the GPU and on the host, next to
the stock step of ``bench_train_h200.py`` (same weights, same process).

    PYTHONPATH=.:.anchors python3 benchmarks/profile_train.py --out OUT [--shape mamba2-1.3b] [--cell 4x2048]
        [--parts phases,cprofile,torch,conv]

Parts, each written to OUT/profile_train.json (text tables next to it):
- phases: per side, CUDA-event and host (enqueue, to the call's return) medians of the forward
  without gradients, the forward with them, and the backward alone. A host time close to the
  device time means the step is bound by the host (launches, synchronisations).
- cprofile: one of ours' steps under cProfile (then a synchronisation): the Python functions by
  their own time (cprofile.txt).
- torch: one of ours' steps under torch.profiler with CPU activity: host ops by self time
  (torch_cpu.txt) and the counts of the CUDA runtime's synchronising calls.
- glue: one of ours' steps under torch.profiler with Python stacks: the device time of the torch ops
  that are not our kernels (copies, concatenations, casts, reductions, elementwise ops) by op and by
  the project's code that called them (glue.txt, and the top rows in the JSON).
- host: ours' forward with gradients and its backward, each enqueued behind a 2 s GPU sleep: a host
  time near 2 s means a wait on the GPU, a synchronising call or a full launch queue (about a
  thousand launches deep); every synchronising call of one step (``torch.cuda.set_sync_debug_mode``)
  with the project's frames that made it (host.txt); the host ops by self CPU time grouped by the
  project's frames, each half behind a GPU sleep, so the op that waited shows the sleep
  (host_ops_forward.txt, host_ops_backward.txt).
- fwdgrad: ours' forward without and with gradients under torch.profiler, kernels summed by name,
  and by how much each name's time and calls differ (what recording the gradient adds to the forward;
  fwdgrad.txt).
- conv: the conv1d + SiLU backward kernel at the shape's conv width and the cell's tokens over
  (conv_bwd_block_t, conv_bwd_block_c, conv_bwd_warps), against the pinned configs' gradients
  (dx equal, dw/db within rounding, two calls equal), with torch's cuDNN conv1d + SiLU backward
  on the same tensors as a yardstick.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[profile_train {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def timed(torch, fn, n: int) -> tuple[float, float]:
    """Medians over n calls of (device ms between events around fn, host ms until fn returns)."""
    dev, host = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        dev.append(a.elapsed_time(b))
    return statistics.median(dev), statistics.median(host)


def phases(torch, fwd, params: list, n: int) -> dict:
    """fwd() -> loss. Forward without and with gradients, and the backward of the latter (the
    gradients of ``params``)."""
    out = {}
    with torch.no_grad():
        out["forward_nograd_ms"], out["forward_nograd_host_ms"] = timed(torch, lambda: fwd(), n)
    out["forward_grad_ms"], out["forward_grad_host_ms"] = timed(torch, lambda: fwd(), n)
    dev, host = [], []
    for _ in range(n):
        loss = fwd()
        torch.cuda.synchronize()
        ms = timed(torch, lambda lo=loss: torch.autograd.grad(lo, params), 1)
        dev.append(ms[0])
        host.append(ms[1])
        del loss
    out["backward_ms"], out["backward_host_ms"] = statistics.median(dev), statistics.median(host)
    return out


def conv_sweep(torch, T: int, Cd: int, K: int, reps: int) -> list[dict]:
    from aligned_mamba.ops.configs import TritonKernelConfigs
    from aligned_mamba.ops.conv1d.triton import causal_conv1d_backward_triton

    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(T, Cd, device="cuda", generator=g).bfloat16()
    w = (torch.randn(Cd, K, device="cuda", generator=g) * 0.5).bfloat16()
    b = (torch.randn(Cd, device="cuda", generator=g) * 0.1).bfloat16()
    gy = torch.randn(T, Cd, device="cuda", generator=g).bfloat16()
    cu = torch.tensor([0, T], device="cuda")
    window = torch.zeros(1, K - 1, Cd, device="cuda", dtype=torch.bfloat16)
    base = TritonKernelConfigs()
    ref = causal_conv1d_backward_triton(x, cu, window, w, b, gy, base)
    rows = []
    for bt in (16, 32, 64, 128, 256):  # the walk's rows, channels and warps a program
        for bc in (64, 128, 256, 512):
            for warps in (1, 2, 4):
                cfg = dataclasses.replace(base, conv_bwd_block_t=bt, conv_bwd_block_c=bc, conv_bwd_warps=warps)
                try:
                    got = causal_conv1d_backward_triton(x, cu, window, w, b, gy, cfg)
                    again = causal_conv1d_backward_triton(x, cu, window, w, b, gy, cfg)
                    ms, _ = timed(torch, lambda: causal_conv1d_backward_triton(x, cu, window, w, b, gy, cfg), reps)
                    rows.append({"block_t": bt, "block_c": bc, "warps": warps, "ms": ms,
                                 "dx_equal": bool(torch.equal(got[0], ref[0])),
                                 "dw_rel": float((got[1].float() - ref[1].float()).norm() / ref[1].float().norm()),
                                 "db_rel": float((got[2].float() - ref[2].float()).norm() / ref[2].float().norm()),
                                 "repeat_equal": all(torch.equal(u, v) for u, v in zip(got, again))})
                except Exception as exc:  # noqa: BLE001 - a config the compiler refuses is a row
                    rows.append({"block_t": bt, "block_c": bc, "warps": warps,
                                 "error": f"{type(exc).__name__}: {exc}"[:200]})
                log(f"conv bwd {rows[-1]}")
    # cuDNN's depthwise conv1d + SiLU under autograd, the same tensors (a yardstick, not our bits)
    xt = x.t().contiguous()[None].requires_grad_()
    wt = w[:, None, :].detach().requires_grad_()
    bt_ = b.detach().requires_grad_()

    def stock():
        y = torch.nn.functional.conv1d(xt, wt, bt_, padding=K - 1, groups=Cd)[..., :T]
        torch.autograd.grad(torch.nn.functional.silu(y), (xt, wt, bt_), gy.t()[None])

    stock()
    ms, _ = timed(torch, stock, reps)
    rows.append({"stock_cudnn_fwd_bwd_ms": ms})
    log(f"conv cudnn fwd+bwd {ms:.3f} ms")
    return rows


GLUE_OPS = ("aten::copy_", "aten::cat", "aten::sum", "aten::add", "aten::add_", "aten::mul", "aten::sub",
            "aten::clone", "aten::contiguous", "aten::fill_", "aten::zero_", "aten::index", "aten::cumsum",
            "aten::flip", "aten::exp", "aten::mm", "aten::bmm", "aten::where", "aten::zeros")


def glue(torch, profile, activity, step, path: Path) -> list[dict]:
    """One ``step()`` under torch.profiler with stacks: the torch ops of ``GLUE_OPS`` by (op, the
    innermost frames of the project's code), their device time summed, largest first."""
    # verbose: recent torch records Python frames only with it
    cfg = torch._C._profiler._ExperimentalConfig(verbose=True)
    with profile(activities=[activity.CPU, activity.CUDA], with_stack=True, experimental_config=cfg) as prof:
        step()
        torch.cuda.synchronize()
    rows: dict[tuple, dict] = {}
    for e in prof.key_averages(group_by_stack_n=12):  # the stacks live on the averages, not the events
        if e.key not in GLUE_OPS or not e.self_device_time_total:
            continue
        frames = [f for f in (e.stack or []) if "aligned_mamba/" in f or "benchmarks/" in f][:3]
        where = " <- ".join(f.split("aligned_mamba/")[-1] for f in frames) or "(no project frame: autograd's own)"
        r = rows.setdefault((e.key, where), {"op": e.key, "where": where, "calls": 0, "device_ms": 0.0})
        r["calls"] += e.count
        r["device_ms"] += e.self_device_time_total / 1e3
    table = sorted(rows.values(), key=lambda r: -r["device_ms"])
    path.write_text("\n".join(f"{r['device_ms']:9.3f} ms {r['calls']:5d}  {r['op']:18s} {r['where']}" for r in table))
    return table[:40]


def host_cost(torch, fwd, params: list, path: Path) -> dict:
    """The host's work of fwd() (with gradients) and of its backward, each enqueued behind a GPU
    sleep, in ms; and the synchronising calls of one step with their project frames."""
    import traceback
    import warnings

    def behind_sleep(fn) -> tuple[float, object]:
        torch.cuda.synchronize()
        torch.cuda._sleep(4_000_000_000)  # about 2 s of one SM's clock: the queue stays busy
        t0 = time.perf_counter()
        r = fn()
        ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        return ms, r

    out: dict = {}
    fw, bw = [], []
    for _ in range(3):
        ms, loss = behind_sleep(fwd)
        fw.append(ms)
        ms, _ = behind_sleep(lambda lo=loss: torch.autograd.grad(lo, params))
        bw.append(ms)
        del loss
    out["forward_grad_host_ms"], out["backward_host_ms"] = statistics.median(fw), statistics.median(bw)
    syncs: list[str] = []
    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "aligned_mamba/" in f.filename
                  or "benchmarks/" in f.filename][-4:]
        syncs.append(f"{str(message)[:80]} @ " + " <- ".join(
            f"{f.filename.split('/')[-1]}:{f.lineno}" for f in reversed(frames)))

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning and the filters on the way out
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.autograd.grad(fwd(), params)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out["syncs"] = syncs
    path.write_text(json.dumps(out, indent=1))
    return out


def host_ops(torch, profile, activity, step, path: Path) -> None:
    """One ``step()`` under torch.profiler with stacks, enqueued behind a GPU sleep: host ops by self
    CPU time and call site (an op that waits on the GPU shows the sleep)."""
    cfg = torch._C._profiler._ExperimentalConfig(verbose=True)
    torch.cuda.synchronize()
    with profile(activities=[activity.CPU], with_stack=True, experimental_config=cfg) as prof:
        torch.cuda._sleep(4_000_000_000)  # behind a busy queue, an op that waits on the GPU takes ~2 s
        step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages(group_by_stack_n=8):
        frames = [f for f in (e.stack or []) if "aligned_mamba/" in f or "benchmarks/" in f][:3]
        rows.append((e.self_cpu_time_total / 1e3, e.count, e.key,
                     " <- ".join(f.split("aligned_mamba/")[-1] for f in frames)))
    rows.sort(key=lambda r: -r[0])
    path.write_text("\n".join(f"{ms:9.3f} ms {n:5d}  {k[:40]:40s} {w}" for ms, n, k, w in rows[:80]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="mamba2-1.3b")
    ap.add_argument("--cell", default="4x2048", help="SxT")
    ap.add_argument("--parts", default="phases,cprofile,torch,conv")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch
    from torch.profiler import ProfilerActivity, profile

    from aligned_mamba import Contract
    from aligned_mamba.models import build_model
    from benchmarks.bench_model_h200 import SHAPES, Stock, device_weights, load_stock, make_config, retune_stock
    from benchmarks.bench_train_h200 import ours_loss, stock_loss

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    S, T = (int(v) for v in args.cell.split("x"))
    config = make_config(SHAPES[args.shape], 256, "bfloat16")
    contract = Contract(chunk_size=256, backend="triton", model_dtype="bfloat16")
    dev = torch.device("cuda")
    tensors = device_weights(config, dev, seed=4321)
    leaves = {k: v.detach().requires_grad_() for k, v in tensors.items()}
    g = torch.Generator(device=dev).manual_seed(17)
    ids = torch.randint(0, config.vocab_size, (S, T), device=dev, generator=g)
    targets = torch.randint(0, config.vocab_size, (S, T), device=dev, generator=g)
    seqs, tgts = list(ids), list(targets)
    result: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "shape": args.shape,
                    "cell": args.cell, "contract": contract.fingerprint}

    def ours_fwd():
        return ours_loss(build_model(config, leaves, contract, device=dev), seqs, tgts)[0]

    def ours_step():
        return torch.autograd.grad(ours_fwd(), list(leaves.values()))

    def save():
        (out / "profile_train.json").write_text(json.dumps(result, indent=1))

    ours_step()
    torch.cuda.synchronize()
    if "phases" in parts:
        params = list(leaves.values())
        result["ours"] = phases(torch, ours_fwd, params, args.reps)
        log(f"ours {result['ours']}")
        scan, ssu, impl, err = load_stock(False)
        if scan is not None:
            retune_stock()
            stock = Stock(config, leaves, scan, ssu)
            torch.autograd.grad(stock_loss(stock, leaves, ids, targets)[0], params)
            result["stock"] = phases(torch, lambda: stock_loss(stock, leaves, ids, targets)[0], params, args.reps)
            log(f"stock {result['stock']}")
            del stock
        save()
    if "cprofile" in parts:
        pr = cProfile.Profile()
        pr.enable()
        ours_step()
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45)
        s.write("\n\n==== by cumulative time\n")
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60)
        (out / "cprofile.txt").write_text(s.getvalue())
        log("cprofile written")
    if "torch" in parts:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ours_step()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        (out / "torch_cpu.txt").write_text(ka.table(sort_by="self_cpu_time_total", row_limit=60))
        result["runtime_calls"] = {e.key: {"count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3}
                                   for e in ka if e.key.startswith(("cuda", "cu")) and "Kernel" not in e.key[:4]}
        log(f"runtime calls {result['runtime_calls']}")
        save()
    if "glue" in parts:
        result["glue"] = glue(torch, profile, ProfilerActivity, ours_step, out / "glue.txt")
        log(f"glue {result['glue'][:8]}")
        save()
    if "host" in parts:
        result["host"] = host_cost(torch, ours_fwd, list(leaves.values()), out / "host.txt")
        log(f"host {result['host']['forward_grad_host_ms']:.1f} / {result['host']['backward_host_ms']:.1f} ms, "
            f"{len(result['host']['syncs'])} syncs")
        host_ops(torch, profile, ProfilerActivity, ours_fwd, out / "host_ops_forward.txt")
        loss = ours_fwd()
        host_ops(torch, profile, ProfilerActivity, lambda: torch.autograd.grad(loss, list(leaves.values())),
                 out / "host_ops_backward.txt")
        del loss
        save()
    if "fwdgrad" in parts:
        from benchmarks.bench_mamba_ssm_h200 import kernel_table

        with torch.no_grad():
            plain = kernel_table(torch, ours_fwd, top=400)
        graded = kernel_table(torch, ours_fwd, top=400)
        a = {k["name"]: (k["ms"], k["calls"]) for k in plain["kernels"]}
        b = {k["name"]: (k["ms"], k["calls"]) for k in graded["kernels"]}
        diff = sorted(({"name": n, "nograd_ms": a.get(n, (0.0, 0))[0], "grad_ms": b.get(n, (0.0, 0))[0],
                        "nograd_calls": a.get(n, (0.0, 0))[1], "grad_calls": b.get(n, (0.0, 0))[1]}
                       for n in set(a) | set(b)), key=lambda r: r["nograd_ms"] - r["grad_ms"])
        result["fwdgrad"] = {"nograd_total_ms": plain["device_total_ms"], "grad_total_ms": graded["device_total_ms"],
                             "by_kernel": diff}
        lines = [f"forward kernels: {plain['device_total_ms']:.1f} ms without gradients, "
                 f"{graded['device_total_ms']:.1f} ms with", f"{'grad - nograd ms':>16} {'calls':>11}  kernel"]
        lines += [f"{r['grad_ms'] - r['nograd_ms']:16.2f} {r['nograd_calls']:5d}/{r['grad_calls']:<5d}  {r['name']}"
                  for r in diff]
        (out / "fwdgrad.txt").write_text("\n".join(lines) + "\n")
        log("\n".join(lines[:25]))
        save()
    if "conv" in parts:
        cd = config.intermediate_size + 2 * config.n_groups * config.state_size
        result["conv_bwd"] = conv_sweep(torch, S * T, cd, config.conv_kernel, 10)
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
