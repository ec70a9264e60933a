"""A readable table of an ``h200.json`` written by ``bench_h200.py``.

    python3 benchmarks/summarize.py benchmarks/results/h200.json [more.json ...]

Decode: replay and SSU per step, eager and in CUDA graphs (the graph step without the completion
kernels in brackets), and the fraction of the measured copy bandwidth each moves. Prefill: a whole
``ssd_advance`` (the scan kernels alone in brackets) against ``mamba_chunk_scan_combined``, the
plan's host cost and the error against the fp64 reference next to the bf16 floor. Then memory.
"""

from __future__ import annotations

import json
import sys


def fmt(v: object, d: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{d}e}" if 0 < abs(v) < 1e-2 else f"{v:.{d}f}"
    return str(v)


def summarize(r: dict) -> str:
    out = [f"{r['gpu']} torch {r['torch']} triton {r['triton']} commit {r['commit']} "
           f"copy {fmt(r['bandwidth'].get('copy_GBps'), 0)} GB/s",
           f"script: {r['script']} {' '.join(r.get('argv') or [])}; {r['dtype']}; {r['date']}",
           "decode: shape batch mode bitwise replay_ms ssu_ms ratio | graph: replay (no completion) ssu ratio"
           " | frac of copy bw: replay ssu"]
    for d in r["decode"]:
        out.append(f"  {d['shape']} {d['batch']} {d['mode']} {d['bitwise']} {fmt(d['replay_ms'])} {fmt(d['ssu_ms'])} "
                   f"{fmt(d['ratio'])} | {fmt(d.get('replay_graph_ms'))} "
                   f"({fmt(d.get('replay_graph_nocompletion_ms'))}) "
                   f"{fmt(d.get('ssu_graph_ms'))} {fmt(d.get('ratio_graph'))} | "
                   f"{fmt(d.get('replay_frac_copy_bw'), 2)} {fmt(d.get('ssu_frac_copy_bw'), 2)}")
    out.append("prefill: shape tokens ours_ms (scan only) mamba_ssm_ms ratio | plan host ms (once per step)"
               " | slot reset ms | error vs fp64 (bf16 floor) | variants: ms")
    for p in r["prefill"]:
        err = "-" if p.get("error_vs_fp64") is None else f"{fmt(p['error_vs_fp64'], 4)} ({fmt(p.get('bf16_floor'), 4)})"
        vs = " ".join(f"{v.get('tile_opts')}={fmt(v.get('ms'))}{'' if v['bitwise'] else '(other bits)'}"
                      for v in (p.get("variants") or []))
        out.append(f"  {p['shape']} {p['tokens']} {fmt(p['ours_ms'])} ({fmt(p.get('ours_scan_only_ms'))}) "
                   f"{fmt(p['mamba_ssm_ms'])} {fmt(p['ratio'])} | {fmt(p.get('plan_host_ms'))} | "
                   f"{fmt(p.get('reset_ms'))} | {err} | {vs}")
    for k, m in r["memory"].items():
        out.append(f"memory {k} {m['replay_ssm_bytes']} budget {m['budget_bytes']} within {m['within_budget']}")
    out.append(f"errors: {r.get('errors')} schema: {r.get('schema_errors')}")
    return "\n".join(out)


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for path in paths:
        try:
            r = json.load(open(path))
        except (OSError, ValueError) as e:
            print(f"{path}: not a readable h200.json ({e})", file=sys.stderr)
            return 1
        print(summarize(r))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
