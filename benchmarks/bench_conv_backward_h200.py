#!/usr/bin/env python3
"""The conv1d + SiLU backward alone (``ops.conv1d.triton.causal_conv1d_backward_triton``) at a model's
layer shape, per walk launch, against the tile kernel and causal_conv1d's channel-last backward.

    PYTHONPATH=.:/path/to/causal_conv1d python3 benchmarks/bench_conv_backward_h200.py --out OUT/conv_bwd.json
    python3 benchmarks/bench_conv_backward_h200.py --dry-run --out /tmp/c.json   (CPU: interpreter, tiny shapes)

The input rows are a column slice of a wider in_proj output (as the layer reads them), bf16, packed
sequences of 4 x 2048 and 1 x 16384 tokens, width 4, mamba2-1.3b's and mamba2-2.7b's conv channels.
The backward (the walk, the default form) at each ``--walk`` launch (conv_bwd_block_t rows,
conv_bwd_block_c channels, conv_bwd_warps; the pinned configs' launch first) is timed (CUDA-event
median) and compared with the tile kernel (``walk=False``, at ``TILE_LAUNCH``, timed once as the
reference): dx bit for bit (a row's dx does not depend on the form or the launch), dweight and dbias
by relative norm (their row-block partial sums follow the launch's rows), and two calls bit for bit.
The stock: causal_conv1d's ``causal_conv1d_fn`` forward + backward minus its forward.

    --shapes mamba2-1.3b --cells 2x2048 --walk 64x128x1,32x128x1   (a short run)
    --forward 64x128x1,32x128x1 --walk=   (the forward's walk launches instead: rows x channels x warps)

``--forward`` times the forward (``causal_conv1d_triton``, the trainer's call: fresh windows): the tile
kernel at the configs' conv_block_t x conv_block_c (``conv_walk=False``) and at each ``--tiles`` launch
(rows x channels), then the walk at each launch (rows x channels x warps), each output against the tile
kernel's bit for bit (an output element is one fixed chain over its taps whatever the form or launch),
and causal_conv1d's forward.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--dry-run" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.conv1d import triton as ct  # noqa: E402
from aligned_mamba.ops.conv1d.triton import causal_conv1d_backward_triton, causal_conv1d_triton  # noqa: E402
from benchmarks.bench_mamba_ssm_h200 import module_knobs  # noqa: E402
from benchmarks.gpu_validate import cuda_ms, launches  # noqa: E402

SHAPES = {"mamba2-1.3b": (4096, 128, 64), "mamba2-2.7b": (5120, 128, 80)}  # (d_inner, d_state, heads), 1 group
CELLS = [("4x2048", 4, 2048), ("1x16384", 1, 16384), ("2x2048", 2, 2048)]
# the walk's launches (rows, channels, warps): the pinned configs' first
WALKS = [(64, 128, 1), (32, 128, 1), (128, 128, 1), (64, 256, 2), (64, 64, 1)]


def timed(fn, reps: int) -> float:
    """Median ms of ``fn``: CUDA events, or wall clock in the dry run."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return cuda_ms(fn, reps, warmup=1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def stock_ms(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, g: torch.Tensor, S: int, reps: int):
    """causal_conv1d's channel-last forward + backward minus its forward, or None where it does not import."""
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError:
        return None
    L = x.shape[0] // S
    xs = x.view(S, L, -1).transpose(1, 2).detach().requires_grad_()  # [S, Cd, L], channel-last in memory
    gs = g.view(S, L, -1).transpose(1, 2)
    ws, bs = w.detach().requires_grad_(), bias.detach().requires_grad_()

    def fwd():
        return causal_conv1d_fn(xs, ws, bs, activation="silu")

    def both():
        torch.autograd.grad(fwd(), [xs, ws, bs], gs)

    return timed(both, reps) - timed(fwd, reps)


def stock_fwd_ms(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, S: int, reps: int):
    """causal_conv1d's channel-last forward + SiLU, or None where it does not import."""
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError:
        return None
    xs = x.reshape(S, x.shape[0] // S, -1).transpose(1, 2)
    return timed(lambda: causal_conv1d_fn(xs, w, bias, activation="silu"), reps)


def forward_tiles(a, res: dict, base: TritonKernelConfigs, launches: list[tuple[int, ...]], name: str, label: str,
                  x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, cu: torch.Tensor, S: int,
                  tile_launches: tuple[tuple[int, int], ...] = ()) -> None:
    """The forward's tile kernel (the configs' launch, then each of ``tile_launches``: rows, channels), then its
    walk at each launch (rows, channels, warps), against the first tile's output."""
    slots = torch.arange(S, device=x.device)
    pinned = (base.conv_walk_block_t, base.conv_walk_block_c, base.conv_walk_warps)
    ref = None
    tile = dataclasses.replace(base, conv_walk=False)
    forms = [("tile", tile)]
    forms += [(f"tile {t[0]}x{t[1]}", dataclasses.replace(tile, conv_block_t=t[0], conv_block_c=t[1]))
              for t in tile_launches]
    forms += [(list(t), dataclasses.replace(base, conv_walk=True, conv_walk_block_t=t[0], conv_walk_block_c=t[1],
                                            conv_walk_warps=t[2]))
              for t in [pinned] + [t for t in launches if t != pinned]]
    for form, cfg in forms:
        def run(c=cfg):
            return causal_conv1d_triton(x, cu, slots, torch.zeros(S, 3, x.shape[1], device=x.device, dtype=x.dtype),
                                        w, bias, c)

        e = dict(shape=name, cell=label, tokens=x.shape[0], channels=x.shape[1], forward=form, silu=cfg.silu,
                 pinned=isinstance(form, list) and tuple(form) == pinned)
        try:
            out = run()
            ref = out if ref is None else ref
            e["equal_tile"] = bool(torch.equal(out, ref))
            e["repeat_equal"] = bool(torch.equal(out, run()))
            e["ms"] = timed(run, a.reps)
        except Exception as exc:  # noqa: BLE001
            e["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        res["cells"].append(e)
        print(json.dumps(e), flush=True)
    # the pinned walk without its SiLU: what the activation's IEEE-built exp and division cost
    pin = dataclasses.replace(base, conv_walk=True)
    e = dict(shape=name, cell=label, tokens=x.shape[0], channels=x.shape[1], forward=list(pinned), silu=False,
             ms=timed(lambda: causal_conv1d_triton(x, cu, slots, torch.zeros(S, 3, x.shape[1], device=x.device,
                                                                            dtype=x.dtype), w, bias, pin,
                                                  activation=False), a.reps))
    res["cells"].append(e)
    print(json.dumps(e), flush=True)
    if x.is_cuda:
        res["cells"].append(dict(shape=name, cell=label, tokens=x.shape[0], channels=x.shape[1], forward="stock",
                                 stock="causal_conv1d 1.7.0", ms=stock_fwd_ms(x, w, bias, S, a.reps)))
        print(json.dumps(res["cells"][-1]), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--cells", default="4x2048,1x16384", help="of " + ",".join(c[0] for c in CELLS))
    ap.add_argument("--walk", default=WALKS, type=launches(3),
                    help="the walk's launches, rows x channels x warps (empty: the tile kernel alone)")
    ap.add_argument("--forward", default=[], type=launches(3),
                    help="the forward walk's launches, rows x channels x warps (instead of the backward)")
    ap.add_argument("--configs", help='JSON of kernel configs over the pinned ones, e.g. \'{"silu":"device"}\'')
    ap.add_argument("--tiles", default=[], type=launches(2),
                    help="with --forward: the tile kernel's launches too, rows x channels")
    ap.add_argument("--ahead", default=str(ct.WALK_AHEAD),
                    help="the backward walk's WALK_AHEAD values, each launch timed at each (e.g. 2,4)")
    a = ap.parse_args()
    import triton

    dry = a.dry_run
    dev = "cpu" if dry else "cuda"
    dtype = torch.float32 if dry else torch.bfloat16
    shapes = {"tiny": (64, 16, 4)} if dry else {k: SHAPES[k] for k in a.shapes.split(",")}
    cells = [("2x40", 2, 40)] if dry else [c for c in CELLS if c[0] in a.cells.split(",")]
    walks, tiles = list(a.walk), list(a.forward)
    aheads = [int(k) for k in a.ahead.split(",")]
    for k in aheads:
        if k not in ct.WALK_AHEADS:
            ap.error(f"--ahead: one of {ct.WALK_AHEADS} (conv1d.triton.WALK_AHEAD), got {k}")
    if dry:
        tiles = [(8, 16, 1), (16, 32, 2)] if tiles else []
        walks = [(8, 32, 1), (16, 16, 2)] if walks else []
    res = dict(script="benchmarks/bench_conv_backward_h200.py", gpu="cpu (dry run)" if dry else
               torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               commit=os.environ.get("GIT_COMMIT", "unknown"),
               date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), cells=[])
    base = TritonKernelConfigs(**json.loads(a.configs or "{}"))
    res["configs"] = json.loads(a.configs or "{}")
    g0 = torch.Generator(device=dev).manual_seed(0)
    for name, (d, N, H) in shapes.items():
        Cd = d + 2 * N
        for label, S, L in cells:
            T = S * L
            wide = torch.randn(T, 2 * d + 2 * N + H, generator=g0, device=dev).to(dtype)
            x = wide[:, d:d + Cd]  # the layer's xBC: a column slice of in_proj's output
            g = torch.randn(T, Cd, generator=g0, device=dev).to(dtype)
            w = (torch.randn(Cd, 4, generator=g0, device=dev) * 0.3).to(dtype)
            bias = (torch.randn(Cd, generator=g0, device=dev) * 0.1).to(dtype)
            cu = torch.arange(0, T + 1, L, device=dev, dtype=torch.int64)
            win = torch.zeros(S, 3, Cd, device=dev, dtype=dtype)
            if tiles:
                tile_launches = tuple(a.tiles)
                if dry and tile_launches:
                    tile_launches = ((4, 16), (16, 32))
                forward_tiles(a, res, base, tiles, name, label, x, w, bias, cu, S, tile_launches)
                with open(a.out, "w") as f:
                    json.dump(res, f, indent=1)
                continue
            e = dict(shape=name, cell=label, tokens=T, channels=Cd, tile=list(ct.TILE_LAUNCH))
            ref = None
            try:
                ref = causal_conv1d_backward_triton(x, cu, win, w, bias, g, base, walk=False)
                again = causal_conv1d_backward_triton(x, cu, win, w, bias, g, base, walk=False)
                e["repeat_equal"] = all(torch.equal(p, q) for p, q in zip(ref, again))
                e["ms"] = timed(lambda: causal_conv1d_backward_triton(x, cu, win, w, bias, g, base, walk=False),
                                a.reps)
            except Exception as exc:  # noqa: BLE001
                e["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            res["cells"].append(e)
            print(json.dumps(e), flush=True)
            for ahead, launch in ((k, w) for k in aheads for w in walks):
                bt, bc, nw = launch
                cfg = dataclasses.replace(base, conv_bwd_block_t=bt, conv_bwd_block_c=bc, conv_bwd_warps=nw)
                e = dict(shape=name, cell=label, tokens=T, channels=Cd, walk=list(launch), ahead=ahead,
                         pinned_walk=launch == (base.conv_bwd_block_t, base.conv_bwd_block_c, base.conv_bwd_warps))
                with module_knobs({"conv1d.triton.WALK_AHEAD": ahead}):
                    try:
                        out = causal_conv1d_backward_triton(x, cu, win, w, bias, g, cfg)
                        again = causal_conv1d_backward_triton(x, cu, win, w, bias, g, cfg)
                        e["repeat_equal"] = all(torch.equal(p, q) for p, q in zip(out, again))
                        if ref is not None:
                            e["dx_equal_tile"] = bool(torch.equal(out[0], ref[0]))
                            e["dx_rows_differing_tile"] = int((out[0] != ref[0]).any(1).sum())
                            e["dx_rel_tile"] = rel(out[0], ref[0])
                            e["dw_rel_tile"], e["db_rel_tile"] = rel(out[1], ref[1]), rel(out[2], ref[2])
                        e["ms"] = timed(lambda c=cfg: causal_conv1d_backward_triton(x, cu, win, w, bias, g, c), a.reps)
                    except Exception as exc:  # noqa: BLE001
                        e["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                res["cells"].append(e)
                print(json.dumps(e), flush=True)
            if not dry:
                st = stock_ms(x, w, bias, g, S, a.reps)
                res["cells"].append(dict(shape=name, cell=label, tokens=T, channels=Cd, stock="causal_conv1d 1.7.0",
                                         ms=st))
                print(f"stock {name} {label}: {st}", flush=True)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
