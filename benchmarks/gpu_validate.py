"""First look on a GPU: the Triton scan's bits under every schedule, and its cost next to mamba_ssm.

    python3 benchmarks/gpu_validate.py --out OUT_DIR [--quick]

Writes OUT_DIR/gpu_validate.json:
  bitwise: per shape, rows of decode steps (one token per sequence, a batch at random offsets) and
           of unaligned chunked prefills compared with torch.equal to the single-pass prefill rows;
  timing:  medians (CUDA events, after warm-up) of our scan through ``replay.ssd_advance`` on the
           Triton backend with the pinned configs (prefill from empty; one decode step of a batch)
           and, where importable (PYTHONPATH holding mamba_ssm's Triton files), mamba_ssm's
           ``mamba_chunk_scan_combined`` and ``selective_state_update`` (fp32 state) on the same shapes.
The decode step timed here is whatever ``ssd_advance`` runs for a batch of one-token sequences (on a
GPU the backend's fused decode kernels); its JSON key keeps the name ``naive_replay_ms``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aligned_mamba.contract import Contract  # noqa: E402
from aligned_mamba.ops.backend import Backend, resolve  # noqa: E402
from aligned_mamba.ops.ssd.state import SSDState, SSMParams  # noqa: E402
from aligned_mamba.ops.step import Step  # noqa: E402

SHAPES = {"h32_g1": (32, 1), "h64_g8": (64, 8), "h128_g8": (128, 8)}
P, N, L = 64, 128, 256


def backend(dev: str) -> Backend:
    """The Triton backend of a bf16 contract with the pinned kernel configs (what an engine resolves)."""
    return resolve(Contract(chunk_size=L, backend="triton", model_dtype="bfloat16"), dev)


def params(H: int, dev: str, seed: int = 0) -> SSMParams:
    g = torch.Generator().manual_seed(seed)
    A = -(1 + 15 * torch.rand(H, generator=g))
    dt0 = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(H, generator=g))
    return SSMParams(A=A.to(dev), D=torch.ones(H, device=dev), dt_bias=(dt0 + torch.log(-torch.expm1(-dt0))).to(dev))


def inputs(T: int, H: int, G: int, dev: str, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    return (torch.randn(T, H, P, generator=g).to(dev, bf), (0.5 * torch.randn(T, H, generator=g)).to(dev, bf),
            torch.randn(T, G, N, generator=g).to(dev, bf), torch.randn(T, G, N, generator=g).to(dev, bf))


def state(S: int, H: int, G: int, dev: str) -> SSDState:
    return SSDState.allocate(S, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=L, dtype=torch.bfloat16,
                             device=dev)


def captured(fn) -> torch.cuda.CUDAGraph:
    """fn captured in one CUDA graph after a warm-up call on a side stream (as torch's docs do it);
    raises where fn cannot be captured (a host synchronisation inside it)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def launches(n: int):
    """An argparse type: comma-separated launches of ``n`` positive ints joined by x ("16x128x1,32x128x2")."""
    def parse(text: str) -> list[tuple[int, ...]]:
        out = []
        for item in filter(None, text.split(",")):
            parts = item.split("x")
            if len(parts) != n or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise argparse.ArgumentTypeError(f"{item!r} is not {n} positive integers joined by x")
            out.append(tuple(int(p) for p in parts))
        return out
    return parse


def cuda_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median ms of ``fn`` over ``reps`` calls after ``warmup`` (CUDA events around each call; of an even
    count, the upper middle)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def bitwise(H: int, G: int, dev: str, batch: int, T: int = 2048) -> dict:
    """Single pass over ``batch`` sequences vs (a) one decode step of all of them at random offsets
    (prefix prefilled in one advance), (b) an unaligned chunked prefill of each."""
    prm, be = params(H, dev), backend(dev)
    x, dt, B, C = inputs(T * batch, H, G, dev)
    lens = [T] * batch
    st = state(batch, H, G, dev)
    ref = be.ssd_advance(st, Step.make(list(range(batch)), [0] * batch, lens), x, dt, B, C, prm)
    g = torch.Generator().manual_seed(2)
    offs = [int(v) for v in torch.randint(1, T, (batch,), generator=g)]
    st = state(batch, H, G, dev)
    rows = torch.cat([torch.arange(i * T, i * T + o) for i, o in enumerate(offs)]).to(dev)
    be.ssd_advance(st, Step.make(list(range(batch)), [0] * batch, offs), x[rows], dt[rows], B[rows], C[rows], prm)
    new = torch.tensor([i * T + o for i, o in enumerate(offs)], device=dev)
    y = be.ssd_advance(st, Step.make(list(range(batch)), offs, [1] * batch), x[new], dt[new], B[new], C[new], prm)
    decode_bad = int(sum(not torch.equal(y[i], ref[int(new[i])]) for i in range(batch)))
    # unaligned chunked prefill: 100-token pieces for the first sequence
    st = state(1, H, G, dev)
    pieces, pos, bad = [], 0, 0
    while pos < T:
        n = min(100, T - pos)
        piece = slice(pos, pos + n)
        pieces.append(be.ssd_advance(st, Step.make([0], [pos], [n]), x[piece], dt[piece], B[piece], C[piece], prm))
        pos += n
    yc = torch.cat(pieces)
    bad = int(sum(not torch.equal(yc[t], ref[t]) for t in range(T)))
    return {"batch": batch, "decode_rows": batch, "decode_rows_differing": decode_bad,
            "chunked_prefill_rows": T, "chunked_prefill_rows_differing": bad}


def timing(H: int, G: int, dev: str, reps: int, upstream) -> dict:
    prm, be = params(H, dev), backend(dev)
    out: dict = {"prefill": [], "decode": []}
    for T in (2048, 8192):
        x, dt, B, C = inputs(T, H, G, dev)
        ours = cuda_ms(lambda: be.ssd_advance(state(1, H, G, dev), Step.make([0], [0], [T]), x, dt, B, C, prm), reps)
        up = None
        if upstream:
            chunk_scan, _ = upstream
            up = cuda_ms(lambda: chunk_scan(x[None], dt[None], prm.A, B[None], C[None], L, D=prm.D,
                                            dt_bias=prm.dt_bias, dt_softplus=True), reps)
        out["prefill"].append({"tokens": T, "ours_ms": ours, "mamba_ssm_ms": up})
    for batch in (1, 64, 256):
        g = torch.Generator().manual_seed(3)
        offs = [int(v) for v in torch.randint(0, L, (batch,), generator=g)]
        st = state(batch, H, G, dev)
        st.buf_x.normal_()
        st.buf_dt.uniform_(1e-3, 1e-1)
        st.buf_B.normal_()
        for i, o in enumerate(offs):  # rows past the fill level stay zero
            st.buf_x[i, :, o:] = 0
            st.buf_dt[i, :, o:] = 0
            st.buf_B[i, :, o:] = 0
        x, dt, B, C = inputs(batch, H, G, dev)
        bt = Step.make(list(range(batch)), offs, [1] * batch)
        ours = cuda_ms(lambda: be.ssd_advance(st, bt, x, dt, B, C, prm), reps)
        ssu = None
        if upstream:
            _, ssu_fn = upstream
            s32 = torch.zeros(batch, H, P, N, device=dev)
            A3 = prm.A[:, None, None].expand(H, P, N)
            D2 = prm.D[:, None].expand(H, P)
            db2 = prm.dt_bias[:, None].expand(H, P)
            ssu = cuda_ms(lambda: ssu_fn(s32, x, dt[:, :, None].expand(batch, H, P), A3, B, C, D=D2, dt_bias=db2,
                                         dt_softplus=True), reps)
        out["decode"].append({"batch": batch, "naive_replay_ms": ours, "ssu_ms": ssu})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    dev = "cuda"
    reps = 5 if a.quick else 20
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        upstream = (mamba_chunk_scan_combined, selective_state_update)
    except Exception as e:  # noqa: BLE001 - record why the upstream columns are empty
        print(f"mamba_ssm not importable: {e!r}", flush=True)
        upstream = None
    commit = os.environ.get("GIT_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                            text=True).stdout.strip() or None
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d"), "commit": commit, "script": "benchmarks/gpu_validate.py",
              "headdim": P, "dstate": N, "chunk": L, "shapes": {}}
    for name, (H, G) in SHAPES.items():
        entry: dict = {"heads": H, "groups": G}
        try:
            entry["bitwise"] = [bitwise(H, G, dev, b, T=1024 if a.quick else 2048) for b in (1, 8)]
            print(name, "bitwise", entry["bitwise"], flush=True)
            entry["timing"] = timing(H, G, dev, reps, upstream)
            print(name, "timing", entry["timing"], flush=True)
        except Exception as e:  # noqa: BLE001 - keep going to the other shapes, record the failure
            import traceback

            entry["error"] = repr(e)
            traceback.print_exc()
        result["shapes"][name] = entry
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "gpu_validate.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
