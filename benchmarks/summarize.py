"""A readable table of an ``h200.json`` written by ``bench_h200.py``, or markdown tables of a
``bench_mamba_ssm_h200.py`` result against issue 31's targets.

    python3 benchmarks/summarize.py benchmarks/results/h200.json [more.json ...]

Decode: replay and SSU per step, eager and in CUDA graphs (the graph step without the completion
kernels in brackets), and the fraction of the measured copy bandwidth each moves. Prefill: a whole
``ssd_advance`` (the scan kernels alone in brackets) against ``mamba_chunk_scan_combined``, the
plan's host cost and the error against the fp64 reference next to the bf16 floor. Then memory.

Against mamba_ssm's own model (the file's ``script`` is ``bench_mamba_ssm_h200.py``): one table per part
present (train, forward, decode, accuracy), each cell's ratio beside its target (fwd+bwd and peak at most
1.0x, forward at most 0.9x, graph decode at most 1.0x the bf16-state stock, logits error at most the stock's
bf16 error), "met" or "not met"; a cell that errored or did not run says so.
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


VS_MAMBA_SSM = "benchmarks/bench_mamba_ssm_h200.py"


def _ms(v: object) -> str:
    return "-" if v is None else f"{v:.3f}" if v < 10 else f"{v:.2f}" if v < 100 else f"{v:.1f}"


def _ratio(v: float | None, at_most: float) -> tuple[str, str]:
    if v is None:
        return "-", "not run"
    return f"{v:.3f}x", "met" if v <= at_most else "not met"


def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: tuple[str, ...], rows: list[str]) -> list[str]:
    """A markdown table (nothing if no rows), then a blank line."""
    return [_row(*header), "|" + " --- |" * len(header), *rows, ""] if rows else []


def _decode_row(e: dict) -> str:
    ratio, ok = _ratio(e.get("ratio_stock_bf16"), 1.0)
    if e.get("ours_ms") is None:
        ok = "not run: " + (e.get("ours_error") or e.get("error") or "?").split(".")[0][:60]
    r32 = e.get("ratio_stock_fp32")
    rows = f"{e['graph_rows_equal_forward']} / {e['graph_rows_checked']}" if "graph_rows_checked" in e else "-"
    return _row(f"{e['shape']} b{e['batch']}", _ms(e.get("ours_ms")), _ms(e.get("stock_bf16_ms")), ratio, ok,
                _ms(e.get("stock_fp32_ms")), "-" if r32 is None else f"{r32:.3f}x",
                ", ".join(_ms(v) for v in e.get("ours_round_ms") or []) or "-", rows)


def _accuracy_row(e: dict) -> str:
    o, st = e.get("ours_rel_err_vs_stock_fp32"), e.get("stock_bf16_rel_err_vs_stock_fp32")
    if o is None or st is None:
        return _row(str(e.get("shape")), "-", "-", f"not run: {str(e.get('error'))[:60]}", "-")
    return _row(e["shape"], f"{100 * o:.3f}%", f"{100 * st:.3f}%", "met" if o <= st else "not met",
                f"{100 * e['ours_top1_agree']:.1f}% / {100 * e['stock_bf16_top1_agree']:.1f}%")


def _timed(e: dict, at_most: float) -> tuple[str, ...]:
    """A train or forward cell's ours ms, stock ms, ratio and verdict: from the rounds in turns where they ran
    (``ratio_turns``), else from each side's own block."""
    if e.get("ratio_turns") is not None:
        return _ms(e.get("turns_ours_ms")), _ms(e.get("turns_stock_ms")), *_ratio(e["ratio_turns"], at_most)
    return _ms(e.get("ours_ms")), _ms(e.get("stock_ms")), *_ratio(e.get("ratio"), at_most)


def vs_mamba_ssm(r: dict) -> str:
    """Markdown tables of a ``bench_mamba_ssm_h200.py`` result, each ratio beside issue 31's target."""
    gib = [[e.get(k) and e[k] / 2 ** 30 for k in ("ours_peak_bytes", "stock_peak_bytes")] for e in r.get("train") or []]
    train = [_row(f"{e['shape']} {e.get('label', '')}", *_timed(e, 1.0), f"{_ms(g[0])} / {_ms(g[1])}",
                  *_ratio(e.get("peak_ratio"), 1.0))
             for e, g in zip(r.get("train") or [], gib)]
    forward = [_row(f"{e['shape']} {e.get('label', '')}", *_timed(e, 0.9)) for e in r.get("forward") or []]
    out = [f"{r['gpu']}, torch {r['torch']}, triton {r['triton']}, commit {r['commit']}, {r['date']}",
           f"stock: {r['stock']}", ""]
    out += _table(("train", "ours ms", "stock ms", "ratio (<= 1.0x)", "", "peak GiB ours / stock", "peak (<= 1.0x)",
                   ""), train)
    out += _table(("forward", "ours ms", "stock ms", "ratio (<= 0.9x)", ""), forward)
    out += _table(("decode (CUDA graphs)", "ours ms", "stock bf16 ms", "ratio (<= 1.0x)", "", "stock fp32 ms", "ratio",
                   "rounds (ours)", "rows equal forward"), [_decode_row(e) for e in r.get("decode") or []])
    out += _table(("accuracy (logits vs the fp32 stock)", "ours", "stock bf16", "(ours <= stock)",
                   "top-1 ours / stock"), [_accuracy_row(e) for e in r.get("accuracy") or []])
    return "\n".join(out).rstrip()


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
        try:
            text = vs_mamba_ssm(r) + "\n" if isinstance(r, dict) and r.get("script") == VS_MAMBA_SSM else summarize(r)
        except (KeyError, TypeError, AttributeError) as e:
            what = f"no key {e}" if isinstance(e, KeyError) else type(e).__name__
            print(f"{path}: not a result of bench_h200.py or bench_mamba_ssm_h200.py ({what})", file=sys.stderr)
            return 1
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
