"""Where a Triton-backend prefill (``ssd_advance`` from an empty slot) spends its time, on the GPU.

    python3 benchmarks/profile_prefill.py [--out PATH] [--tokens 2048,32768] [--shapes 32h_1g]

torch.profiler over a few calls: the CPU-side ops (launch overhead, host syncs) and the CUDA
kernels, each with its count and total time per call, so the glue around the scan kernels can be
told apart from the scan itself.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

SHAPES = {"32h_1g": (32, 1), "64h_8g": (64, 8), "128h_8g": (128, 8)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", default="2048,32768")
    ap.add_argument("--shapes", default="32h_1g")
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    from aligned_mamba.replay import Batch, LayerReplayState, ssd_advance

    P, N, L = 64, 128, 256
    dev = "cuda"
    res = []
    for name in args.shapes.split(","):
        H, G = SHAPES[name]
        for T in (int(t) for t in args.tokens.split(",")):
            g = torch.Generator(device=dev).manual_seed(0)
            st = LayerReplayState.allocate(1, heads=H, head_dim=P, groups=G, state_size=N, conv_kernel=4,
                                           conv_dim=8, chunk_size=L, dtype=torch.bfloat16, device=dev)
            x = torch.randn(T, H, P, device=dev, generator=g).bfloat16()
            dt = (torch.randn(T, H, device=dev, generator=g) - 1).bfloat16()
            B = torch.randn(T, G, N, device=dev, generator=g).bfloat16()
            C = torch.randn(T, G, N, device=dev, generator=g).bfloat16()
            prm = dict(A=-torch.rand(H, device=dev, generator=g) - 0.5, D=torch.ones(H, device=dev),
                       dt_bias=torch.zeros(H, device=dev))
            batch = Batch.make([0], [0], [T])

            def call() -> None:
                st.reset(torch.zeros(1, dtype=torch.int64, device=dev))
                ssd_advance(st, batch, x, dt, B, C, backend="triton", **prm)

            for _ in range(3):
                call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.calls):
                    call()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
            ktable = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
            print(f"== {name} {T} tokens, {args.calls} calls\n{table}\n{ktable}", flush=True)
            kern = [{"name": e.key, "count": e.count / args.calls,
                     "cuda_ms_per_call": e.device_time_total / 1e3 / args.calls,
                     "cpu_ms_per_call": e.cpu_time_total / 1e3 / args.calls}
                    for e in prof.key_averages()]
            kern.sort(key=lambda d: -d["cuda_ms_per_call"])
            res.append({"shape": name, "tokens": T, "ops": kern[:40]})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
