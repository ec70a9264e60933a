#!/usr/bin/env bash
# One H200 session for the whole model on the triton backend: the GPU tests, the model benchmark
# against a stock engine's parts, and `aligned-mamba check --backend triton`.
#
#   OUT=/path bash benchmarks/gpu_model_session.sh        # from the repository root
#   STEPS="tests bench check" TEST_S=200 BENCH_S=330 BENCH_ARGS="--quick" CHECK="tiny 130m 1.3b" CHECK_JOBS=2 ...
#   STEPS="tests scanbwd train" TEST_FILES=tests/ops/test_triton_backward.py TRAIN_ARGS="--quick --profile"  (training)
#   STEPS=vsms VSMS_ARGS="--parts train --profile"   (against mamba_ssm's MambaLMHeadModel)
#
# Needs .anchors/ (mamba_ssm's Triton files, see benchmarks/README.md) for the stock columns.
# Writes under $OUT: env.log, pytest_gpu.log, model.log, h200_model.json, check_<model>.json/.log,
# scan_backward.log, h200_scan_backward.json, train.log, h200_train.json, vs_mamba_ssm.log,
# h200_train_mamba_ssm.json, h200_model_mamba_ssm.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .anchors ]; then export PYTHONPATH="$PYTHONPATH:$PWD/.anchors"; fi
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
STEPS="${STEPS:-tests bench check}"
t0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
  git rev-parse HEAD 2>/dev/null || echo "commit ${GIT_COMMIT:-unknown}"; } 2>&1 | tee "$OUT/env.log"

if [[ " $STEPS " == *" tests "* ]]; then
  timeout "${TEST_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs --durations=8 \
    ${TEST_FILES:-tests/core/test_decode_graph.py tests/ops/linear/test_linear_gemm.py tests/ops/norm/test_norm_forward.py \
    tests/ops/conv1d/test_conv1d_forward.py tests/ops/logprobs/test_logprobs_triton.py tests/ops/test_triton_ops.py \
    tests/ops/ssd/test_triton_decode.py} \
    2>&1 | tee "$OUT/pytest_gpu.log"
  echo "== tests exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/pytest_gpu.log"
fi
if [[ " $STEPS " == *" bench "* ]]; then
  timeout "${BENCH_S:-330}" python3 benchmarks/bench_model_h200.py --out "$OUT/h200_model.json" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/model.log"
  echo "== bench exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/model.log"
fi
if [[ " $STEPS " == *" scanbwd "* ]]; then
  timeout "${SCANBWD_S:-150}" python3 benchmarks/bench_scan_backward_h200.py --out "$OUT/h200_scan_backward.json" \
    2>&1 | tee "$OUT/scan_backward.log"
  echo "== scanbwd exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/scan_backward.log"
fi
if [[ " $STEPS " == *" train "* ]]; then
  timeout "${TRAIN_S:-330}" python3 benchmarks/bench_train_h200.py --shapes mamba2-1.3b --out "$OUT/h200_train.json" \
    ${TRAIN_ARGS:---quick} 2>&1 | tee "$OUT/train.log"
  echo "== train exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/train.log"
fi
if [[ " $STEPS " == *" vsms "* ]]; then
  # against mamba_ssm's own MambaLMHeadModel (needs the whole mamba_ssm package in .anchors/)
  timeout "${VSMS_S:-400}" python3 benchmarks/bench_mamba_ssm_h200.py --out-dir "$OUT" ${VSMS_ARGS:-} \
    2>&1 | tee "$OUT/vs_mamba_ssm.log"
  echo "== vsms exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/vs_mamba_ssm.log"
fi
if [[ " $STEPS " == *" check "* ]]; then
  for m in ${CHECK:-tiny}; do
    args=()
    if [ "$m" != tiny ]; then
      # drawn on the GPU by the benchmark's rules: models.tiny's CPU generation takes minutes at 1.3b
      python3 - "$m" "/tmp/ckpt_$m" <<'PY'
import sys
import torch
from aligned_mamba.models.mamba2 import save_checkpoint
from benchmarks.bench_model_h200 import SHAPES, device_weights, make_config
config = make_config(SHAPES["mamba2-" + sys.argv[1]], 256, "bfloat16")
tensors = {name: t.cpu() for name, t in device_weights(config, torch.device("cuda"), 0).items()}
save_checkpoint(sys.argv[2], config, tensors)
PY
      args=(--model "/tmp/ckpt_$m" ${CHECK_ARGS:-})
    fi
    timeout "${CHECK_S:-240}" python3 -m aligned_mamba.cli check --backend triton --jobs "${CHECK_JOBS:-1}" "${args[@]}" \
      --json "$OUT/check_$m.json" 2>&1 | tee "$OUT/check_$m.log"
    echo "== check $m exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/check_$m.log"
  done
fi
