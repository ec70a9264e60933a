"""Which CPU ISA settings change the bits: digests of the trainer's logits and of the ops under them.

    python3 benchmarks/cpu_isa_bits.py                               # this process's settings
    ATEN_CPU_CAPABILITY=default python3 benchmarks/cpu_isa_bits.py   # one line of JSON per run
    python3 benchmarks/cpu_isa_bits.py --threads 2                   # intra-op threads (default 1)

Run it once per setting (ATen reads ATEN_CPU_CAPABILITY, MKL its variables, when the process
starts) and compare the lines: equal digests mean equal bits. What it digests
(``aligned_mamba.verify.rows_digest``):

- ``logits``: the embedded default model's one-pass forward over the main job's four prompts
  (600, 563, 526, 489 tokens; bf16, the torch backend): every row the trainer scores;
- ``bmm_f32``: the fp32 batched GEMM ``ops/linear.py`` runs (MKL's sgemm);
- ``linear_f32``: a plain fp32 ``F.linear`` (MKL's sgemm, one call);
- ``matmul_f64``: an fp64 GEMM (the accuracy line's fp64 reference uses such);
- ``matmul_bf16``: a bf16 GEMM (oneDNN on CPUs with bf16 paths, MKL's bf16 GEMM otherwise);
- ``sum_f32``: ATen's vectorised fp32 sum along a 4096-long row;
- ``exp_f32``: ATen's vectorised exp (SLEEF in the vector body, libm in the tail);
- ``ops_exp``: the project's IEEE-only exp (``ops.elementwise``), which is meant not to care.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from aligned_mamba.check import make_prompts
from aligned_mamba.contract import Contract
from aligned_mamba.hardware import hardware_class
from aligned_mamba.models import build_model
from aligned_mamba.models.mamba2 import make_tiny
from aligned_mamba.ops import elementwise
from aligned_mamba.verify import rows_digest


def _inputs(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values in [-4/3, 4/3) from integers, divided by 3 (so that products and sums round, even in
    fp64): the same bits under every ISA setting, as IEEE division is correctly rounded
    (torch.randn's vectorised transform is not: its inputs would differ before any op ran)."""
    return (torch.randint(-(1 << 22), 1 << 22, shape, generator=gen).to(dtype) * 2.0**-20 / 3).to(dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (the main job's processes run 1)")
    torch.set_num_threads(ap.parse_args().threads)
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    a = _inputs(64, 16, 256, gen=g)
    w = _inputs(512, 256, gen=g)
    x64 = _inputs(300, 128, gen=g, dtype=torch.float64)
    y64 = _inputs(128, 200, gen=g, dtype=torch.float64)
    v = _inputs(64, 4096, gen=g)
    out = {
        "inputs": rows_digest(torch.cat([a.reshape(-1), w.reshape(-1), v.reshape(-1)])),
        "bmm_f32": rows_digest(torch.bmm(a, w.t().expand(64, 256, 512))),
        "linear_f32": rows_digest(F.linear(a.reshape(-1, 256), w)),
        "matmul_f64": rows_digest(x64 @ y64),
        "matmul_bf16": rows_digest(a.reshape(-1, 256).bfloat16() @ w.t().bfloat16()),
        "sum_f32": rows_digest(v.sum(-1)),
        "exp_f32": rows_digest(torch.exp(v[:, :1000])),
        "ops_exp": rows_digest(elementwise.exp(v[:, :1000])),
    }
    config, tensors = make_tiny(0)
    model = build_model(config, tensors, Contract(chunk_size=256))
    prompts = make_prompts(model.shape.vocab_size, 600, 4, 0)
    with torch.no_grad():
        logits = model.forward([torch.tensor(p) for p in prompts])
    out["logits"] = rows_digest(torch.cat(logits))
    hw = hardware_class()
    print(json.dumps({"key": hw.key, "digests": out, "hardware": hw.to_dict(),
                      "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
