#!/usr/bin/env bash
# One GPU session for the Triton backend (issue 3): versions, the GPU tests, the benchmark.
#
#   bash benchmarks/gpu_session.sh                 # from the repository root; results under $OUT
#   GIT_COMMIT=<sha> QUICK=1 BENCH_ARGS=--skip-prefill bash benchmarks/gpu_session.sh
#
# Needs .anchors/ (mamba_ssm's Triton files, see benchmarks/README.md) for the upstream columns;
# runs without it (those columns are then null). Writes to $OUT (default ./gpu_out):
#   env.log, pytest_gpu.log, bench.log, h200.json
# Budget: the tests get at most TEST_S seconds (default 240), the benchmark what is left of
# TOTAL_S (default 470); the benchmark saves its JSON after every entry, so a timeout keeps what
# was measured.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
TEST_S="${TEST_S:-240}"
TOTAL_S="${TOTAL_S:-470}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .anchors ]; then export PYTHONPATH="$PYTHONPATH:$PWD/.anchors"; fi
export PYTHONDONTWRITEBYTECODE=1
unset TRITON_INTERPRET
if [ -z "${GIT_COMMIT:-}" ]; then GIT_COMMIT="$(git rev-parse HEAD 2>/dev/null || true)"; fi
export GIT_COMMIT
t0=$(date +%s)

{
  echo "== session start $(date -u +%FT%TZ), commit ${GIT_COMMIT:-unknown}"
  nvidia-smi || echo "nvidia-smi failed"
  python3 - <<'EOF'
import sys, torch, triton
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print("triton", triton.__version__)
for mod in ("einops", "pytest", "hypothesis", "mamba_ssm.ops.triton.selective_state_update", "mamba_ssm.ops.triton.ssd_combined"):
    try:
        __import__(mod)
        print("import ok:", mod)
    except Exception as e:  # noqa: BLE001
        print("import FAILED:", mod, type(e).__name__, e)
EOF
} 2>&1 | tee "$OUT/env.log"

# GPU tests. test_triton_interpreter.py is left out: it has no GPU tests, and collecting it sets
# TRITON_INTERPRET=1 in the environment of the whole session (Triton reads that while compiling).
echo "== pytest -m gpu ($(date -u +%T))" | tee "$OUT/pytest_gpu.log"
timeout "$TEST_S" python3 -m pytest -vv -m gpu tests/ --ignore=tests/test_triton_interpreter.py \
  -p no:cacheprovider --continue-on-collection-errors -rfEs --durations=10 2>&1 | tee -a "$OUT/pytest_gpu.log"
echo "== pytest exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/pytest_gpu.log"

left=$(( TOTAL_S - ($(date +%s) - t0) ))
if [ "$left" -lt 60 ]; then left=60; fi
echo "== benchmark, ${left} s budget ($(date -u +%T))" | tee "$OUT/bench.log"
QUICK_FLAG=""
if [ -n "${QUICK:-}" ]; then QUICK_FLAG="--quick"; fi
timeout "$left" python3 benchmarks/bench_h200.py --out "$OUT/h200.json" $QUICK_FLAG ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
echo "== benchmark exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s total" | tee -a "$OUT/bench.log"

python3 - "$OUT/h200.json" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001
    sys.exit(f"no h200.json: {e}")
f = lambda v, d=3: "-" if v is None else (f"{v:.{d}f}" if isinstance(v, float) else str(v))  # noqa: E731
print(f"{r['gpu']} torch {r['torch']} triton {r['triton']} commit {r['commit']} copy {f(r['bandwidth'].get('copy_GBps'), 0)} GB/s")
print("decode: shape batch mode bitwise replay_ms ssu_ms ratio | graph: replay ssu ratio")
for d in r["decode"]:
    print(" ", d["shape"], d["batch"], d["mode"], d["bitwise"], f(d["replay_ms"]), f(d["ssu_ms"]), f(d["ratio"]), "|",
          f(d.get("replay_graph_ms")), f(d.get("ssu_graph_ms")), f(d.get("ratio_graph")))
print("prefill: shape tokens ours_ms (scan only) mamba_ssm_ms ratio | variants: tile/warps/loop ms bitwise")
for p in r["prefill"]:
    vs = " ".join(f"{v['row_tile']}/{v['tile_warps']}/{v['k_loop']}/{v.get('pass_block_p')}/bk{v.get('block_k')}/{v.get('tile_opts')}={f(v.get('ms'))}{'' if v['bitwise'] else '(BITS DIFFER)'}"
                  for v in (p.get("variants") or []))
    print(" ", p["shape"], p["tokens"], f(p["ours_ms"]), f"({f(p.get('ours_scan_only_ms'))})",
          f(p["mamba_ssm_ms"]), f(p["ratio"]), "|", vs)
for k, m in r["memory"].items():
    print("memory", k, m["replay_ssm_bytes"], "budget", m["budget_bytes"], "within", m["within_budget"])
print("errors:", r.get("errors"), "schema:", r.get("schema_errors"))
EOF
