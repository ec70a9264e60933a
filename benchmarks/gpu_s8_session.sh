#!/usr/bin/env bash
# One H200 session, steps in priority order: every GPU-marked test; the gated norm's backward at its
# launches against mamba_ssm's (`bench_norm_backward_h200.py`); split keys against one program per
# KV head (`bench_paged_attention_h200.py`); the conv backward's walk against its tile kernel (and its
# forward's walk launches, `convfwd`); the
# 8-layer fwd+bwd slices of the dense and the MoE hybrid against the stock model; the whole models'
# cells `--quick` leaves out (forward 1 x 32768, decode at 16k contexts); the decode step's inputs read
# in place (`--views`); training against mamba_ssm's own model; the row-parallel tree GEMM and its
# variants, the split-slices grid among them (`bench_tree_gemm_h200.py`); `tp` (several GPUs): the TP
# forward over NCCL (`tp_forward_gpus.py --megatron`); `tp1gpu`: its bits with every rank on one GPU.
#
#   OUT=/path bash benchmarks/gpu_s8_session.sh        # from the repository root
#   STEPS="ccbuild tests norms split walk convfwd train nanotrain h8blong nanolong views scanacc vsms vsms2 tree ops tp tp1gpu
#          prep"
#   TP_SIZES=1,2,4 WHEELS=.whl ...   (tp: megatron-core 0.16.1's wheel and `pip wheel --no-deps .` in WHEELS)
#   TEST_FILES="tests/ops/attention ..." TEST_WORKERS=8 MAMBA_SSM=.anchors/mamba_ssm ...
#   PYTEST_ARGS=-vv: a line per test as it ends (pyproject's addopts hold -q), kept when a step is cut
#
# Needs mamba_ssm's package (MAMBA_SSM, see benchmarks/README.md) for the stock models. Every step's
# logs and JSON go to a work folder packed into $OUT/s8.tgz after each step, so a call cut at its limit
# keeps what finished; each step's timeout is cut to what is left of DEADLINE_S.
SESSION=s8
STEPS="${STEPS:-tests split walk train nanotrain}"
DEADLINE_S="${DEADLINE_S:-560}"
MAMBA_SSM="${MAMBA_SSM:-.anchors/mamba_ssm}"
source "$(dirname "$0")/gpu_prelude.sh"  # strict mode, the repository root, OUT, W, pack/left/note/want

hybrid() {  # SECTION LIMIT ARGS...: bench_hybrid_h200.py sections, merged into the latest h200_hybrid.json
  local section="$1" limit="$2" base="${RESULTS:-benchmarks/results/h200_hybrid.json}"
  shift 2
  [ -f "$W/h200_hybrid.json" ] && cp "$W/h200_hybrid.json" "$W/h200_hybrid_before_$section.json" \
    && base="$W/h200_hybrid_before_$section.json"
  step "hybrid_$section" "$limit" python3 benchmarks/bench_hybrid_h200.py --sections "$section" --merge "$base" \
    --mamba-ssm "$MAMBA_SSM" --out "$W/h200_hybrid.json" "$@"
}

# pytest workers: 8 fit the H200's 141 GB; an 80 GB H100 holds 3 (the decode and backward tests' GB buffers)
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
(( ${MIB:-0} >= 120000 )) && WORKERS=8 || WORKERS=3
# causal_conv1d's sm_90 wheel for the fused stock, returned in parts under $OUT (build_causal_conv1d.sh)
want ccbuild && step ccbuild "${CCBUILD_S:-560}" env OUT="$OUT" bash benchmarks/build_causal_conv1d.sh
want tests && step pytest_gpu "${TESTS_S:-200}" python3 -m pytest -m gpu -p no:cacheprovider -rfEs --durations=20 \
  ${PYTEST_ARGS:-} -n "${TEST_WORKERS:-$WORKERS}" ${TEST_FILES:-tests/ops tests/core/test_decode_graph.py}
want norms && PYTHONPATH="$PYTHONPATH:$(dirname "$MAMBA_SSM")" step norms "${NORMS_S:-60}" python3 \
  benchmarks/bench_norm_backward_h200.py --out "$W/h200_norm_backward.json" ${NORMS_ARGS:-}
want split && step split "${SPLIT_S:-80}" python3 benchmarks/bench_paged_attention_h200.py \
  --out "$W/h200_paged_attention.json" ${SPLIT_ARGS:-}
want walk && step walk "${WALK_S:-50}" python3 benchmarks/bench_conv_backward_h200.py \
  --out "$W/h200_conv_backward.json" --reps 10 ${WALK_ARGS:-}
want convfwd && step convfwd "${CONVFWD_S:-50}" python3 benchmarks/bench_conv_backward_h200.py \
  --out "$W/h200_conv_forward.json" --reps 10 --walk= --forward "${CONVFWD:-32x128x1,64x128x1,32x256x2}" \
  ${CONVFWD_ARGS:-}
want train && hybrid train "${TRAIN_S:-100}" --quick
want nanotrain && hybrid nano_train "${NANOTRAIN_S:-130}" --quick
want h8blong && hybrid h8b "${H8B_S:-150}" --long
want nanolong && hybrid nano "${NANO_S:-150}" --long
want views && step views "${VIEWS_S:-60}" python3 benchmarks/bench_decode_step_h200.py \
  --out "$W/h200_decode_step_views.json" --views --variants rt
want scanacc && PYTHONPATH="$PYTHONPATH:$(dirname "$MAMBA_SSM")" step scanacc "${SCANACC_S:-90}" python3 \
  benchmarks/bench_scan_backward_h200.py --out "$W/h200_scan_backward_accuracy.json" --sweep accuracy ${SCANACC_ARGS:-}
want vsms && PYTHONPATH="$PYTHONPATH:$(dirname "$MAMBA_SSM")" step vsms "${VSMS_S:-200}" python3 \
  benchmarks/bench_mamba_ssm_h200.py --out-dir "$W" ${VSMS_ARGS:---shapes mamba2-1.3b --parts train --quick}
# a second run (another variant of ours, its own stock), its JSON files in a folder of their own
want vsms2 && mkdir -p "$W/vsms2" && PYTHONPATH="$PYTHONPATH:$(dirname "$MAMBA_SSM")" step vsms2 "${VSMS2_S:-150}" \
  python3 benchmarks/bench_mamba_ssm_h200.py --out-dir "$W/vsms2" ${VSMS2_ARGS:---shapes mamba2-1.3b --parts train --quick}
# the fused ops (norms, conv, log-softmax) at their pinned configs and the variants (the log-softmax's split grid)
want ops && step ops "${OPS_S:-150}" python3 benchmarks/bench_ops_h200.py --out "$W/h200_ops.json" --sections ops \
  --op-variants ${OPS_ARGS:-}
# issue 33 (several GPUs): the trainer's and sampler's TP forward over NCCL, Megatron hooked and stock beside the
# core (megatron-core's wheel and this project's in WHEELS, installed --no-deps into /tmp/site as gpu_s4 does)
if want tp; then
  MEG=""
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "${WHEELS:-.whl}"/*.whl > "$W/pip_tp.log" 2>&1 && MEG="--megatron" || note "tp: no Megatron ($(tail -n 1 "$W/pip_tp.log"))"
  PYTHONPATH="$PYTHONPATH:/tmp/site" step tp "${TP_S:-300}" python3 benchmarks/tp_forward_gpus.py \
    --out "$W/h200_tp_forward.json" --sizes "${TP_SIZES:-1,2}" $MEG ${TP_ARGS:-}
fi
# the TP forward's bits on one GPU: every rank on GPU 0 over gloo, the all-gathers through the host (times not a TP run's)
want tp1gpu && step tp1gpu "${TP1_S:-200}" python3 benchmarks/tp_forward_gpus.py --dist gloo \
  --out "$W/h200_tp_one_gpu.json" --sizes "${TP1_SIZES:-1,2,4}" --repeats 1 ${TP1_ARGS:-}
# the decode prep kernel split over head blocks (PREP_HEADS): one layer's step, then the model against the fused stock
want prep && step prep_layer "${PREP_S:-90}" python3 benchmarks/bench_decode_step_h200.py \
  --out "$W/h200_decode_step_prep.json" --variants= --prep-heads "${PREP_HEADS_LIST:-16,32}"
want prep && mkdir -p "$W/prep" && PYTHONPATH="$PYTHONPATH:$(dirname "$MAMBA_SSM")" step prep_model "${PREPM_S:-150}" \
  python3 benchmarks/bench_mamba_ssm_h200.py --out-dir "$W/prep" --shapes mamba2-1.3b,mamba2-2.7b --batches "${PREP_BATCHES:-1,64}" \
  --parts decode --stock-mem-eff --prep-heads "${PREP_HEADS_MODEL:-16}"
want tree && step tree "${TREE_S:-150}" python3 benchmarks/bench_tree_gemm_h200.py --out "$W/h200_tree_gemm.json" \
  --warm 15 --deadline-s "$(( $(left "${TREE_S:-150}") - 30 ))" ${TREE_ARGS:-}
note "done"
pack
