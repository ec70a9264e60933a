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
timeout "$TEST_S" python3 -m pytest -vv -m gpu tests/ --ignore=tests/ops/ssd/test_triton_chunk.py \
  -p no:cacheprovider --continue-on-collection-errors -rfEs --durations=10 2>&1 | tee -a "$OUT/pytest_gpu.log"
echo "== pytest exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/pytest_gpu.log"

left=$(( TOTAL_S - ($(date +%s) - t0) ))
if [ "$left" -lt 60 ]; then left=60; fi
echo "== benchmark, ${left} s budget ($(date -u +%T))" | tee "$OUT/bench.log"
QUICK_FLAG=""
if [ -n "${QUICK:-}" ]; then QUICK_FLAG="--quick"; fi
timeout "$left" python3 benchmarks/bench_h200.py --out "$OUT/h200.json" $QUICK_FLAG ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
echo "== benchmark exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s total" | tee -a "$OUT/bench.log"

python3 benchmarks/summarize.py "$OUT/h200.json" 2>&1 | tee "$OUT/summary.txt"
