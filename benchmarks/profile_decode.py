"""Per-kernel CUDA time of one replay decode step (torch.profiler) on the GPU.

    python3 benchmarks/profile_decode.py [--out PATH]

For each shape and batch: the kernels a decode step (``triton_decode.decode_step_triton``, bf16,
pinned kernel configs) launches and their median device time, so a change to the decode kernels
can be aimed at the launch that costs most.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

SHAPES = {"32h_1g": (32, 1), "64h_8g": (64, 8), "128h_8g": (128, 8)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="64,256")
    args = ap.parse_args()
    from aligned_mamba.ops.configs import TritonKernelConfigs
    from aligned_mamba.ops.ssd.state import SSDState, SSMParams
    from aligned_mamba.ops.ssd.triton_decode import decode_step_triton

    P, N, L = 64, 128, 256
    dev = "cuda"
    cfg = TritonKernelConfigs()
    res = []
    for name, (H, G) in SHAPES.items():
        for S in (int(b) for b in args.batches.split(",")):
            g = torch.Generator(device=dev).manual_seed(0)
            st = SSDState.allocate(S, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=L,
                                   dtype=torch.bfloat16, device=dev)
            st.ssm_state.normal_(generator=g)
            pos = torch.randint(0, L - 1, (S,), generator=g, device=dev)
            for i in range(S):  # fill the partial chunks up to each offset
                r = int(pos[i])
                st.buf_x[i, :, :r].normal_(generator=g)
                st.buf_B[i, :, :r].normal_(generator=g)
                st.buf_dt[i, :, :r].normal_(generator=g)  # raw dt
            x = torch.randn(S, H, P, device=dev, generator=g).bfloat16()
            dt = torch.randn(S, H, device=dev, generator=g).bfloat16()
            B = torch.randn(S, G, N, device=dev, generator=g).bfloat16()
            C = torch.randn(S, G, N, device=dev, generator=g).bfloat16()
            prm = SSMParams(A=-torch.rand(H, device=dev, generator=g), D=torch.ones(H, device=dev),
                            dt_bias=torch.zeros(H, device=dev))
            slots = torch.arange(S, device=dev)

            def step() -> None:
                # pos never reaches L - 1, so no completion kernels (the common step)
                decode_step_triton(st, slots, pos, x, dt, B, C, prm, cfg=cfg, completes=False)

            for _ in range(5):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    step()
                torch.cuda.synchronize()
            times: dict[str, list[float]] = {}
            for ev in prof.events():
                if ev.device_type.name == "CUDA":
                    times.setdefault(ev.name, []).append(ev.device_time_total / 1000.0)
            row = {"shape": name, "batch": S,
                   "kernels_ms": {k: round(statistics.median(v), 4) for k, v in times.items()}}
            print(json.dumps(row), flush=True)
            res.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "profile": res}, f, indent=1)


if __name__ == "__main__":
    main()
