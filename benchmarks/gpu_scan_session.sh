#!/usr/bin/env bash
# One H200 session for the training step's scan and conv backward: their GPU tests, a sweep of the scan
# backward's launch choices (bench_scan_backward_h200.py), and the training cells against mamba_ssm's
# own model run with the sweep's fastest choices (bench_mamba_ssm_h200.py --scan-bwd).
#
#   OUT=/path bash benchmarks/gpu_scan_session.sh        # from the repository root
#   STEPS="tests sweep vsms" DEADLINE_S=540 VSMS_ARGS="--shapes mamba2-1.3b" ...
#
# Logs and JSON go to a work folder, packed into $OUT/scan.tgz after every step (summary.txt beside
# it), so a call cut at its limit keeps what finished. Needs .anchors/ (mamba_ssm) for vsms.
SESSION=scan
STEPS="${STEPS:-tests sweep vsms}"
DEADLINE_S="${DEADLINE_S:-540}"
source "$(dirname "$0")/gpu_prelude.sh"  # strict mode, the repository root, OUT, W, pack/left/note/want

if want tests; then
  timeout "$(left "${TESTS_S:-120}")" python3 -m pytest -q -p no:cacheprovider -rfEs --durations=8 \
    tests/ops/ssd/test_triton_backward_layout.py tests/ops/test_triton_backward.py \
    tests/ops/conv1d/test_conv1d_backward_walk.py \
    -k "gpu_bf16_rows or gpu_bf16_scan_backward_dots or gpu_ssd_prefill_gradients or gpu_1_3b_layer_model or conv_backward_kernel or (kernel_functions and conv)" \
    2>&1 | tee "$W/pytest.log"
  note "tests exit ${PIPESTATUS[0]}: $(tail -n 1 "$W/pytest.log")"; pack
fi
if want sweep; then
  timeout "$(left "${SWEEP_S:-120}")" python3 benchmarks/bench_scan_backward_h200.py --out "$W/h200_scan_backward.json" \
    --best "$W/scan_bwd_best.json" --no-stock ${SWEEP_ARGS:-} 2>&1 | tee "$W/sweep.log"
  note "sweep exit ${PIPESTATUS[0]}: $(tail -n 1 "$W/sweep.log")"; pack
fi
if want vsms; then
  best=()
  [ -f "$W/scan_bwd_best.json" ] && best=(--scan-bwd "$W/scan_bwd_best.json")
  PYTHONPATH="$PYTHONPATH:$PWD/.anchors" timeout "$(left "${VSMS_S:-420}")" python3 benchmarks/bench_mamba_ssm_h200.py \
    --out-dir "$W" --parts train --quick "${best[@]}" ${VSMS_ARGS:-} 2>&1 | tee "$W/vs_mamba_ssm.log"
  note "vsms exit ${PIPESTATUS[0]}: $(grep 'train mamba' "$W/vs_mamba_ssm.log" | tail -n 4 | tr '\n' ' ')"; pack
fi
note "done"
pack
