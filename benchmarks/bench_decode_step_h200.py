"""One Mamba2 layer's exact-replay decode step, "tile" (four launches) against "step" (one), in CUDA graphs.

    PYTHONPATH=.:.anchors python3 benchmarks/bench_decode_step_h200.py --out OUT.json [--shapes 64h_1g,80h_1g]

Per shape (heads x groups of mamba2-1.3b and -2.7b: head dim 64, state 128, chunk 256, bf16) and
batch (1, 64, 256; offsets uniform in the chunk, one entry at L - 1 so a completion runs): the
median CUDA-event time of a graph replay of one step per mode, the kernels one eager step launches
(torch.profiler), and whether the two modes give the same rows, boundary states and buffers (one
step from the same state). mamba_ssm's ``selective_state_update`` (bf16 state, one launch) is timed
beside them where it imports. --views: x, dt, B and C are column slices of the conv's and in_proj's
output rows, as a layer passes them (the kernel lists then show whether they are copied first).
--prep-heads: "tile" again with the prep kernel split into programs of that many heads (``PREP_HEADS``),
each checked for the unsplit step's rows, states and buffers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.conv1d import triton as conv_triton  # noqa: E402
from aligned_mamba.ops.ssd import SSDState, SSMParams  # noqa: E402
from aligned_mamba.ops.ssd import triton_decode as td  # noqa: E402
from aligned_mamba.ops.ssd.triton_decode import decode_step_triton  # noqa: E402
from benchmarks.gpu_validate import captured, cuda_ms  # noqa: E402

SHAPES = {"64h_1g": (64, 1), "80h_1g": (80, 1)}
P, N, L = 64, 128, 256
CFG = TritonKernelConfigs()


def setup(H: int, G: int, S: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda")
    st = SSDState.allocate(S + 1, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=L, dtype=torch.bfloat16,
                           device=dev)
    st.ssm_state.copy_(0.3 * torch.randn(st.ssm_state.shape, generator=g))
    pos = torch.randint(0, L, (S,), generator=g)
    pos[0] = L - 1
    for i, p in enumerate(pos.tolist()):  # partial chunks: random buffered rows 0 .. p - 1
        st.buf_x[i, :, :p] = torch.randn(H, p, P, generator=g).to(torch.bfloat16).to(dev)
        st.buf_dt[i, :, :p] = (torch.randn(H, p, generator=g) - 1).to(torch.bfloat16).to(dev)
        st.buf_B[i, :, :p] = torch.randn(G, p, N, generator=g).to(torch.bfloat16).to(dev)
    A = -torch.empty(H).uniform_(1.0, 16.0, generator=g)
    dt0 = torch.exp(torch.empty(H).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
    bias = dt0 + torch.log(-torch.expm1(-dt0))  # inverse softplus
    prm = SSMParams(A=A.to(dev), D=torch.randn(H, generator=g).to(dev), dt_bias=bias.to(dev))
    x = torch.randn(S, H, P, generator=g).to(torch.bfloat16).to(dev)
    dt = (torch.randn(S, H, generator=g) - 1).to(torch.bfloat16).to(dev)
    B = torch.randn(S, G, N, generator=g).to(torch.bfloat16).to(dev)
    C = torch.randn(S, G, N, generator=g).to(torch.bfloat16).to(dev)
    slots = torch.arange(S, device=dev)
    return st, slots, pos.to(dev), x, dt, B, C, prm


def layer_views(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> tuple:
    """x, dt, B, C as column slices of xBC [S, H P + 2 G N] and zxbcdt [S, 2 H P + 2 G N + H], the layer's rows."""
    S, H, P_ = x.shape
    G, N_ = B.shape[1:]
    d, gn = H * P_, G * N_
    xbc = torch.cat([x.reshape(S, d), B.reshape(S, gn), C.reshape(S, gn)], 1)
    zxbcdt = torch.cat([torch.zeros_like(xbc[:, :d]), xbc, dt], 1)
    return (xbc[:, :d].view(S, H, P_), zxbcdt[:, -H:], xbc[:, d:d + gn].view(S, G, N_),
            xbc[:, d + gn:].view(S, G, N_))


def clone(st: SSDState) -> SSDState:
    return SSDState(*(t.clone() for t in st.tensors()))


def graph_ms(fn, reps: int = 200) -> float:
    """Median ms of one ``fn`` call: ten calls captured in one graph, replayed ``reps`` / 10 times."""
    graph = captured(lambda: [fn() for _ in range(10)])
    return cuda_ms(graph.replay, reps // 10, warmup=0) / 10


def kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA" and "memset" not in e.name.lower()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--variants", default="rt,rt:ns3,ns1",
                    help="step-mode variants timed too, at the first shape: rt (a run-time tl.range K loop), "
                         "ns<stages>, bp<P block> (not the contract's); each bit-checked against tile")
    ap.add_argument("--prep-heads", default="16,32",
                    help="tile mode with the prep kernel's heads per program (PREP_HEADS) at these, every shape "
                         "(0: a group's heads in one program)")
    ap.add_argument("--views", action="store_true", help="the inputs as the layer's column slices")
    args = ap.parse_args()
    import triton

    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    except Exception as exc:  # noqa: BLE001
        selective_state_update, ssu_err = None, f"{type(exc).__name__}: {exc}"
    base_rt, base_opts, base_ph = td.STEP_RT_RANGE, dict(td.STEP_OPTS), td.PREP_HEADS
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "cells": []}
    from benchmarks.bench_h200 import git_commit

    res["commit"] = git_commit()
    for name in args.shapes.split(","):
        H, G = SHAPES[name]
        for S in map(int, args.batches.split(",")):
            st, slots, pos, x, dt, B, C, prm = setup(H, G, S, seed=S)
            if args.views:
                x, dt, B, C = layer_views(x, dt, B, C)
            e = {"shape": name, "batch": S, "inputs": "views" if args.views else "packed"}
            outs = {}
            variants = ["tile", "step"]
            if name == args.shapes.split(",")[0] and args.variants:
                variants += [f"step:{v}" for v in args.variants.split(",")]
            if args.prep_heads:
                variants += [f"tile:ph{v}" for v in args.prep_heads.split(",")]
            for var in variants:
                mode, *opts = var.split(":")
                td.STEP_RT_RANGE = "rt" in opts
                td.STEP_BLOCK_P = next((int(o[2:]) for o in opts if o.startswith("bp")), None)
                td.PREP_HEADS = next((int(o[2:]) or None for o in opts if o.startswith("ph")), base_ph)  # ph0: None
                td.STEP_OPTS = dict(base_opts)
                for o in opts:
                    if o.startswith("ns"):
                        td.STEP_OPTS["num_stages"] = int(o[2:])
                s2 = clone(st)
                y = decode_step_triton(s2, slots, pos, x, dt, B, C, prm, cfg=CFG, mode=mode)
                outs[var] = (y, s2)
                s3 = clone(st)
                step = (lambda s=s3, m=mode: decode_step_triton(s, slots, pos, x, dt, B, C, prm, cfg=CFG, mode=m))
                if not opts:
                    e[f"{mode}_kernels"] = kernels(step)
                e[f"{var}_us"] = round(1e3 * graph_ms(step), 2)
                del s3, step
            td.STEP_RT_RANGE, td.STEP_OPTS, td.STEP_BLOCK_P, td.PREP_HEADS = base_rt, base_opts, None, base_ph
            for var in variants[2:]:
                e[f"{var}_same_bits"] = bool(torch.equal(outs[var][0], outs["tile"][0])) and all(
                    torch.equal(a, b) for a, b in zip(outs[var][1].tensors(), outs["tile"][1].tensors()))
            (yt, st_t), (ys, st_s) = outs["tile"], outs["step"]
            e["rows_equal"] = bool(torch.equal(yt, ys))
            e["states_equal"] = all(torch.equal(a, b) for a, b in zip(st_t.tensors(), st_s.tensors()))
            e["completion_moved_state"] = not torch.equal(st_s.ssm_state[0], st.ssm_state[0])
            if selective_state_update is not None:
                state = torch.randn(S, H, P, N, device="cuda").to(torch.bfloat16)
                xs, dts = x, dt[:, :, None].expand(S, H, P)
                A_ = prm.A[:, None, None].expand(H, P, N)
                D_ = prm.D[:, None].expand(H, P)
                bias = prm.dt_bias[:, None].expand(H, P)
                try:
                    e["ssu_bf16_us"] = round(1e3 * graph_ms(lambda: selective_state_update(
                        state, xs, dts, A_, B, C, D_, dt_bias=bias, dt_softplus=True)), 2)
                except Exception as exc:  # noqa: BLE001
                    e["ssu_error"] = f"{type(exc).__name__}: {exc}"
            else:
                e["ssu_error"] = ssu_err
            e["step_over_tile"] = round(e["step_us"] / e["tile_us"], 3)
            # the conv of the same layer (conv_dim = H P + 2 G N, K = 4): two launches against one
            Cd = H * P + 2 * G * N
            gg = torch.Generator().manual_seed(S + 1)
            xw = torch.randn(S, 2 * Cd, generator=gg).to(torch.bfloat16).cuda()[:, 8:8 + Cd]
            cw = torch.randn(Cd, 4, generator=gg).to(torch.bfloat16).cuda()
            cb = torch.randn(Cd, generator=gg).to(torch.bfloat16).cuda()
            win = torch.randn(S + 1, 3, Cd, generator=gg).to(torch.bfloat16).cuda()
            cu = torch.arange(S + 1, device="cuda")
            w1, w2 = win.clone(), win.clone()
            o2 = conv_triton.causal_conv1d_triton(xw, cu, slots, w2, cw, cb, CFG)
            o1 = conv_triton.conv_step_triton(xw, slots, w1, cw, cb, CFG)
            e["conv_same_bits"] = bool(torch.equal(o1, o2) and torch.equal(w1, w2))
            e["conv_two_us"] = round(1e3 * graph_ms(
                lambda: conv_triton.causal_conv1d_triton(xw, cu, slots, w2, cw, cb, CFG)), 2)
            e["conv_one_us"] = round(1e3 * graph_ms(
                lambda: conv_triton.conv_step_triton(xw, slots, w1, cw, cb, CFG)), 2)
            res["step_defaults"] = {"STEP_RT_RANGE": base_rt, "STEP_OPTS": base_opts}
            res["cells"].append(e)
            print(name, S, {k: v for k, v in e.items() if not k.endswith("_kernels")},
                  len(e["tile_kernels"]), len(e["step_kernels"]), flush=True)
            Path(args.out).write_text(json.dumps(res, indent=1))
            del st, outs
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
