"""Decode throughput on the CPU: vLLM with the exact-replay plugin vs stock vLLM, same model.

Each (model, mode) runs in its own engine process (rollout.vllm_runner), one after another so
they never share the cores. Per batch size, ``--repeats`` runs of ``batch`` requests (prompts of
``--prompt-len`` tokens, ``--gen-len`` new tokens each, no logprobs); decode throughput counts
the tokens sampled in the steps where every request was decoding, over those steps' wall time.
Medians are reported; writes benchmarks/results/vllm_cpu.json.

    nice -n 10 .venv/bin/python benchmarks/bench_vllm_cpu.py [--models tiny,wide] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from aligned_mamba.integrations import Scenario
from aligned_mamba.models.mamba2 import make_tiny, save_checkpoint
from rollout.vllm_runner import LLMSpec, run_engines

# tiny: the embedded default (3 layers, d=256). wide: 8 layers, d=512, 16 heads x 64, state 128.
MODELS = {"tiny": {}, "wide": {"num_hidden_layers": 8, "hidden_size": 512, "num_heads": 16, "head_dim": 64}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,wide")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "vllm_cpu.json"))
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_vllm_") as tmp:
        for name in args.models.split(","):
            config, tensors = make_tiny(0, **MODELS[name])
            path = Path(tmp) / name
            save_checkpoint(path, config, tensors)
            g = torch.Generator().manual_seed(0)
            scenarios = [Scenario("warmup", [list(range(1, 40))], 8, rows="none")]
            for b in batches:
                prompts = [torch.randint(0, config.vocab_size, (args.prompt_len,), generator=g).tolist()
                           for _ in range(b)]
                scenarios += [Scenario(f"b{b}-r{r}", prompts, args.gen_len, rows="none")
                              for r in range(args.repeats)]
            per_mode = {}
            for exact in (True, False):
                spec = LLMSpec(model_dir=str(path), exact_replay=exact, max_model_len=args.prompt_len
                                  + args.gen_len + 16, max_num_batched_tokens=max(2048, max(batches) * args.prompt_len),
                                  max_num_seqs=max(batches))
                t0 = time.perf_counter()
                got = next(run_engines([(spec, scenarios)]))
                if isinstance(got, str):
                    raise SystemExit(f"engine did not start: {got}")
                per_mode[exact] = {r.name: r for r in got}
                print(f"{name} {'exact' if exact else 'stock'}: {time.perf_counter() - t0:.0f}s "
                      f"({got[0].info['model_class']})", flush=True)
            for b in batches:
                row = {"model": name, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
                       "heads": config.num_heads, "batch": b}
                for exact, key in ((True, "exact"), (False, "stock")):
                    runs = [per_mode[exact][f"b{b}-r{r}"] for r in range(args.repeats)]
                    tps = [r.info["decode_tokens"] / r.info["decode_seconds"] for r in runs]
                    row[f"{key}_tok_s"] = round(statistics.median(tps), 2)
                    row[f"{key}_runs_tok_s"] = [round(t, 2) for t in tps]
                row["exact_over_stock"] = round(row["exact_tok_s"] / row["stock_tok_s"], 3)
                results.append(row)
                print(f"{name} batch {b}: exact {row['exact_tok_s']} tok/s, stock {row['stock_tok_s']} tok/s, "
                      f"ratio {row['exact_over_stock']}", flush=True)
    from importlib.metadata import version

    out = {"what": "vLLM-cpu decode throughput, exact replay plugin vs stock (median of repeats)",
           "params": {"prompt_len": args.prompt_len, "gen_len": args.gen_len, "repeats": args.repeats,
                      "chunk_size": 256, "dtype": "bfloat16", "logprobs": False},
           "environment": {"torch": torch.__version__, "vllm": version("vllm-cpu"), "cpus": os.cpu_count(),
                           "machine": platform.machine(), "processor": platform.processor() or None,
                           "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind (runner default)")},
           "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
