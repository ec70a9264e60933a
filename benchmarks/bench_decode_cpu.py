"""The core model's exact-replay decode step on the CPU: ms per ``CausalLM.advance`` of one token
per sequence, after each sequence has prefilled its prompt.

    .venv/bin/python benchmarks/bench_decode_cpu.py [--models tiny,wide] [--batches 1,8] [--threads 1]

Models as in ``bench_vllm_cpu.py`` (tiny: the embedded default; wide: 8 layers, hidden 512, 16
heads x 64). Medians of ``--steps`` steps after ``--warmup``. To compare two commits, run it from
each checkout (``PYTHONPATH=<checkout>``) one after the other, alternating, on an otherwise idle
machine: only runs made side by side compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from aligned_mamba.contract import Contract
from aligned_mamba.models.mamba2 import make_tiny
from aligned_mamba.models.registry import build_model
from aligned_mamba.ops.step import Step

MODELS = {"tiny": {}, "wide": {"num_hidden_layers": 8, "hidden_size": 512, "num_heads": 16, "head_dim": 64}}


def step_ms(name: str, batch: int, prompt_len: int, steps: int, warmup: int) -> float:
    """Median ms of a decode step of ``batch`` sequences of model ``name``."""
    config, tensors = make_tiny(0, **MODELS[name])
    model = build_model(config, tensors, Contract(chunk_size=256))
    cache = model.new_cache(batch)
    g = torch.Generator().manual_seed(0)
    slots = list(range(batch))
    with torch.no_grad():
        prompts = torch.randint(0, config.vocab_size, (batch * prompt_len,), generator=g)
        model.advance(cache, Step.make(slots, [0] * batch, [prompt_len] * batch), prompts)
        token = torch.randint(0, config.vocab_size, (batch,), generator=g)
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            model.advance(cache, Step.make(slots, [prompt_len + i] * batch, [1] * batch), token)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,wide")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        for b in (int(v) for v in args.batches.split(",")):
            ms = step_ms(name, b, args.prompt_len, args.steps, args.warmup)
            rows.append({"model": name, "batch": b, "threads": args.threads, "step_ms": round(ms, 3)})
            print(f"{name} batch {b}: {ms:.2f} ms per decode step ({args.threads} thread(s))", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
