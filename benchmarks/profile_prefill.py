"""Where a Triton-backend prefill (``replay.ssd_advance`` from empty slots, pinned kernel configs)
spends its time on the GPU, kernel by kernel, next to mamba_ssm's ``mamba_chunk_scan_combined`` on
the same inputs.

    python3 benchmarks/profile_prefill.py [--out PATH] [--cases 32768,64x512] [--shapes 128h_8g]

A case is a token count (one sequence) or ``SxT`` (S sequences of T tokens). torch.profiler over
a few calls; per kernel its launches and CUDA time per call, and the sum, for both. mamba_ssm comes
from ``.anchors/`` (benchmarks/README.md); without it only ours is profiled.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"32h_1g": (32, 1), "64h_8g": (64, 8), "128h_8g": (128, 8)}


def kernels(fn, calls: int) -> list[dict]:
    """Per CUDA kernel of ``fn``: launches and device ms per call, most expensive first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [{"name": e.key[:60], "count": e.count / calls, "ms": e.device_time_total / 1e3 / calls}
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda d: -d["ms"])
    return rows


def lengths(case: str) -> list[int]:
    if "x" in case:
        s, t = case.split("x")
        return [int(t)] * int(s)
    return [int(case)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="32768,64x512")
    ap.add_argument("--shapes", default="32h_1g,64h_8g,128h_8g")
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    from aligned_mamba.contract import Contract
    from aligned_mamba.ops.backend import resolve
    from aligned_mamba.ops.ssd.state import SSDState, SSMParams
    from aligned_mamba.ops.step import Step

    sys.path.insert(0, str(ROOT / ".anchors"))
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError as e:
        print(f"mamba_ssm not importable ({e}): profiling ours only", flush=True)
        mamba_chunk_scan_combined = None

    P, N, L = 64, 128, 256
    dev = "cuda"
    backend = resolve(Contract(chunk_size=L, backend="triton", model_dtype="bfloat16"), dev)
    res = []
    for name in args.shapes.split(","):
        H, G = SHAPES[name]
        for case in args.cases.split(","):
            lens = lengths(case)
            S, T = len(lens), sum(lens)
            g = torch.Generator(device=dev).manual_seed(0)
            st = SSDState.allocate(S, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=L,
                                   dtype=torch.bfloat16, device=dev)
            x = torch.randn(T, H, P, device=dev, generator=g).bfloat16()
            dt = (torch.randn(T, H, device=dev, generator=g) - 1).bfloat16()
            B = torch.randn(T, G, N, device=dev, generator=g).bfloat16()
            C = torch.randn(T, G, N, device=dev, generator=g).bfloat16()
            prm = SSMParams(A=-torch.rand(H, device=dev, generator=g) - 0.5, D=torch.ones(H, device=dev),
                            dt_bias=torch.zeros(H, device=dev))
            batch = Step.make(list(range(S)), [0] * S, lens)
            slots = torch.arange(S, device=dev)

            def ours() -> None:
                st.reset(slots)
                backend.ssd_advance(st, batch, x, dt, B, C, prm)

            entry = {"shape": name, "case": case, "ours": kernels(ours, args.calls)}
            if mamba_chunk_scan_combined is not None:
                xu, dtu, Bu, Cu = (t.view(S, lens[0], *t.shape[1:]) for t in (x, dt, B, C))

                def up() -> None:
                    mamba_chunk_scan_combined(xu, dtu, prm.A, Bu, Cu, L, D=prm.D, dt_bias=prm.dt_bias,
                                              dt_softplus=True)

                entry["mamba_ssm"] = kernels(up, args.calls)
            res.append(entry)
            print(f"== {name} {case}", flush=True)
            for who in ("ours", "mamba_ssm"):
                if who in entry:
                    tot = sum(r["ms"] for r in entry[who])
                    print(f"  {who}: {tot:.3f} ms of kernels per call", flush=True)
                    for r in entry[who][:12]:
                        print(f"    {r['ms']:8.3f} ms  x{r['count']:<5g} {r['name']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
