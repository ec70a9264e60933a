#!/usr/bin/env bash
# One GPU session for hybrids on the triton backend: the attention/MLP GPU tests, `aligned-mamba
# check --backend triton` on small dense hybrid checkpoints, and benchmarks/bench_hybrid_h200.py.
#
#   OUT=/path bash benchmarks/gpu_hybrid_session.sh        # from the repository root
#   STEPS="tests check bench" TEST_S=240 CHECK_S=150 BENCH_S=240 BENCH_ARGS="--quick" ...
#   BENCH_ARGS="--sections train --merge benchmarks/results/h200_hybrid.json" MAMBA_SSM=DIR ...
#
# Writes under $OUT: env.log, pytest_gpu.log, check_<layout>.json/.log, hybrid.log, h200_hybrid.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
STEPS="${STEPS:-tests check bench}"
t0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
  git rev-parse HEAD 2>/dev/null || echo "commit ${GIT_COMMIT:-unknown}"; } 2>&1 | tee "$OUT/env.log"

if [[ " $STEPS " == *" tests "* ]]; then
  timeout "${TEST_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs --durations=8 -x \
    ${TEST_FILES:-tests/ops/attention tests/ops/linear/test_linear_relu2.py \
    tests/ops/elementwise/test_elementwise.py} 2>&1 | tee "$OUT/pytest_gpu.log"
  echo "== tests exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/pytest_gpu.log"
fi
if [[ " $STEPS " == *" check "* ]]; then
  # dense hybrids: attention first (GQA 1, head_dim 64), last (GQA 4, head_dim 128), two in a row (GQA 8)
  for spec in "first:*M-M:4:4:64" "last:M-M*:8:2:128" "two:M**-M:8:1:64"; do
    IFS=: read -r name pattern heads kv hd <<< "$spec"
    python3 - "$pattern" "$heads" "$kv" "$hd" "/tmp/ckpt_$name" <<'PY'
import sys
from aligned_mamba.models.nemotron_h import make_tiny_hybrid, save_checkpoint
pattern, heads, kv, hd, path = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
cfg, tensors = make_tiny_hybrid(3, dtype="bfloat16", pattern=pattern, hidden_size=256, vocab_size=512,
                                mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=32, intermediate_size=512,
                                chunk_size=64, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd)
save_checkpoint(path, cfg, tensors)
PY
    timeout "${CHECK_S:-150}" python3 -m aligned_mamba.cli check --backend triton --model "/tmp/ckpt_$name" \
      --json "$OUT/check_$name.json" 2>&1 | tee "$OUT/check_$name.log"
    echo "== check $name exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/check_$name.log"
  done
fi
if [[ " $STEPS " == *" bench "* ]]; then
  # the stock training step needs mamba_ssm's Triton files (environment.md: the sdist's package folder)
  MS=""; [ -d "${MAMBA_SSM:-.anchors/mamba_ssm}" ] && MS="--mamba-ssm ${MAMBA_SSM:-.anchors/mamba_ssm}"
  timeout "${BENCH_S:-240}" python3 benchmarks/bench_hybrid_h200.py --out "$OUT/h200_hybrid.json" $MS ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/hybrid.log"
  echo "== bench exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/hybrid.log"
fi
