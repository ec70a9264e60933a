#!/usr/bin/env python3
"""The Mamba2 mixer's gated RMSNorm in training, alone, at a model's layer shape: our forward (with the
saved rstd; also at one block and at two blocks over 4, 8 and 16 warps, ``fwd_forms``) and backward
(which writes the norm's output again for out_proj's weight gradient) at several launches, against
mamba_ssm's ``layernorm_gated`` forward and backward (``recompute_output``).

    PYTHONPATH=.:/path/to/mamba_ssm_parent python3 benchmarks/bench_norm_backward_h200.py --out OUT/n.json
    python3 benchmarks/bench_norm_backward_h200.py --dry-run --out /tmp/n.json   (CPU: interpreter, tiny)

y and z are column slices of a wider in_proj output, as the layer reads z (y is the scan's output:
contiguous), bf16, 8192 and 16384 tokens. For each ``--launches`` entry (norm_bwd_block_per_warp x
norm_bwd_rows) the backward is timed (CUDA-event median), its written output checked against the
forward's bit for bit, and two calls compared bit for bit; the gradients against the pinned launch's
by relative norm (the row reduction's order follows the warps). The stock: mamba_ssm's
``_layer_norm_fwd`` / ``_layer_norm_bwd`` with ``norm_before_gate=False``, ``is_rms_norm=True``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--dry-run" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.norm import triton as nt  # noqa: E402
from benchmarks.gpu_validate import cuda_ms, launches  # noqa: E402

#: name -> (intermediate size d, n_groups)
SHAPES = {"mamba2-1.3b": (4096, 1), "mamba2-2.7b": (5120, 1), "nemotron-h-8b": (8192, 8)}
LAUNCHES = ((256, 16), (512, 16), (256, 64), (128, 16), (512, 64), (256, 4))
EPS = 1e-5


def timed(fn, reps: int) -> float:
    return cuda_ms(fn, reps, warmup=1) if torch.cuda.is_available() else float("nan")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def forward_at(y, z, w, G: int, block_a: int, block_b: int, warps: int) -> torch.Tensor:
    """``_gated_norm_kernel`` at an explicit launch (blocks, warps), as ``gated_rms_norm_triton`` launches it."""
    M, d = y.shape
    out = torch.empty_like(y)
    rstd = torch.empty(M, G, dtype=torch.float32, device=y.device)
    nt._gated_norm_kernel[(M, G)](y, z, w, out, rstd, d // G, y.stride(0), z.stride(0), out.stride(0), EPS,
                                  WRITE_RSTD=True, DEVICE_SILU=False, BLOCK_A=block_a, BLOCK_B=block_b, num_warps=warps,
                                  enable_fp_fusion=False)
    return out


def forward_forms(y, z, w, G: int, out: torch.Tensor, cfg: TritonKernelConfigs, reps: int) -> list[dict]:
    """The forward at one next-power-of-two block (the configs' warps for it, 16 at most) and at two
    blocks over 4, 8 and 16 warps: ms, and whether the output is the pinned launch's bit for bit."""
    gs = y.shape[1] // G
    a, b = nt._two_blocks(gs)
    block, warps = nt._block_warps(gs, cfg)
    forms = [(block, 0, warps)]
    forms += [(a, b, wp) for wp in (4, 8, 16) if b]
    rows = []
    for ba, bb, wp in forms:
        got = forward_at(y, z, w, G, ba, bb, wp)
        rows.append(dict(block_a=ba, block_b=bb, warps=wp, out_equal_pinned=bool(torch.equal(got, out)),
                         ms=timed(lambda: forward_at(y, z, w, G, ba, bb, wp), reps)))
    return rows


def stock(y, z, w, g, gs: int, reps: int) -> dict:
    # mamba_ssm's package imports Mamba1's CUDA extension, unbuilt here and unused by the norm
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    from mamba_ssm.ops.triton.layernorm_gated import _layer_norm_bwd, _layer_norm_fwd

    def fwd():
        return _layer_norm_fwd(y, w, None, EPS, z=z, group_size=gs, norm_before_gate=False, is_rms_norm=True)

    out, _, rstd = fwd()

    def bwd():
        return _layer_norm_bwd(g, y, w, None, EPS, None, rstd, z=z, group_size=gs, norm_before_gate=False,
                               is_rms_norm=True, recompute_output=True)

    return dict(fwd_ms=timed(fwd, reps), bwd_ms=timed(bwd, reps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="8192,16384")
    ap.add_argument("--launches", default=list(LAUNCHES), type=launches(2),
                    help="norm_bwd_block_per_warp x norm_bwd_rows, the pinned one first")
    ap.add_argument("--no-stock", action="store_true")
    a = ap.parse_args()
    import triton

    dry = a.dry_run
    dev = "cpu" if dry else "cuda"
    dtype = torch.float32 if dry else torch.bfloat16
    shapes = {"tiny": (96, 3)} if dry else {k: SHAPES[k] for k in a.shapes.split(",")}
    token_counts = [40] if dry else [int(t) for t in a.tokens.split(",")]
    res = dict(script="benchmarks/bench_norm_backward_h200.py", gpu="cpu (dry run)" if dry else
               torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               commit=os.environ.get("GIT_COMMIT", "unknown"),
               date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), cells=[])
    base = TritonKernelConfigs()
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, (d, G) in shapes.items():
        for T in token_counts:
            wide = torch.randn(T, 2 * d + 64, generator=gen, device=dev).to(dtype)
            z = wide[:, :d]  # in_proj's z: a column slice
            y = torch.randn(T, d, generator=gen, device=dev).to(dtype)
            g = torch.randn(T, d, generator=gen, device=dev).to(dtype)
            w = (1 + 0.1 * torch.randn(d, generator=gen, device=dev)).to(dtype)
            out, rstd = nt.gated_rms_norm_triton(y, z, w, EPS, G, base, with_rstd=True)
            cell = dict(shape=name, tokens=T, d=d, n_groups=G,
                        fwd_ms=timed(lambda: nt.gated_rms_norm_triton(y, z, w, EPS, G, base, with_rstd=True), a.reps),
                        bytes_bwd=6 * T * d * y.element_size(), launches=[],
                        fwd_forms=forward_forms(y, z, w, G, out, base, a.reps))
            ref = None
            for bpw, rows in a.launches:
                cfg = dataclasses.replace(base, norm_bwd_block_per_warp=bpw, norm_bwd_rows=rows)
                e = dict(block_per_warp=bpw, rows=rows)
                try:
                    got = nt.gated_rms_norm_backward_triton(y, z, w, EPS, G, g, cfg, rstd, write_out=True)
                    again = nt.gated_rms_norm_backward_triton(y, z, w, EPS, G, g, cfg, rstd, write_out=True)
                    e["out_equal_forward"] = bool(torch.equal(got[3], out))
                    e["repeat_equal"] = all(torch.equal(p, q) for p, q in zip(got, again))
                    ref = got if ref is None else ref
                    e["rel_first"] = [rel(p, q) for p, q in zip(got[:3], ref[:3])]
                    e["ms"] = timed(lambda c=cfg: nt.gated_rms_norm_backward_triton(y, z, w, EPS, G, g, c, rstd,
                                                                                    write_out=True), a.reps)
                    e["TB_s"] = cell["bytes_bwd"] / e["ms"] / 1e9
                except Exception as exc:  # noqa: BLE001
                    e["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                cell["launches"].append(e)
            if not (dry or a.no_stock):
                try:
                    cell["stock"] = stock(y, z.contiguous(), w, g, d // G, a.reps)
                except Exception as exc:  # noqa: BLE001
                    cell["stock"] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
            res["cells"].append(cell)
            print(json.dumps(cell), flush=True)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
