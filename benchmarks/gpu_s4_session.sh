#!/usr/bin/env bash
# One H200 session, steps in priority order: every GPU-marked test of the ops and the decode graphs;
# 20 Megatron REINFORCE steps on a dense and a MoE hybrid with the sampler's logits compared after
# every step; the whole-model cells of a Nemotron-3-Nano-30B-A3B-shaped model (forward, decode in CUDA
# graphs) and its 8-layer fwd+bwd slice against the stock model; the Nemotron-H-8B-shaped ones.
#
#   OUT=/path bash benchmarks/gpu_s4_session.sh        # from the repository root
#   STEPS="tests megatron tiny nano nanotrain h8b" DEADLINE_S=560 MEGATRON_MODELS="hybrid moe" ...
#   WHOLE_ARGS="--quick" TEST_WORKERS=6 MAMBA_SSM=.anchors/mamba_ssm WHEELS=.whl ...
#
# Needs mamba_ssm's package (MAMBA_SSM, see benchmarks/README.md) for the stock model, and in WHEELS
# megatron-core 0.16.1's cp312 wheel and this project's (`pip wheel --no-deps .`: its entry points name
# the Megatron trainer), both installed with --no-deps into /tmp/site; the tree's own code stays first.
# Every step's logs and JSON go to a work folder packed into $OUT/s4.tgz after each step (written
# aside, then renamed), so a call cut at its limit keeps what finished; each step's timeout is cut
# to what is left of DEADLINE_S (counted from the start).
SESSION=s4
STEPS="${STEPS:-tests megatron tiny nano nanotrain h8b}"
DEADLINE_S="${DEADLINE_S:-560}"
MAMBA_SSM="${MAMBA_SSM:-.anchors/mamba_ssm}"
RESULTS="${RESULTS:-benchmarks/results/h200_hybrid.json}"
source "$(dirname "$0")/gpu_prelude.sh"  # strict mode, the repository root, OUT, W, pack/left/note/want

hybrid() {  # bench_hybrid_h200.py sections, merged into the latest h200_hybrid.json
  local base="$RESULTS"
  [ -f "$W/h200_hybrid.json" ] && cp "$W/h200_hybrid.json" "$W/h200_hybrid_before_$1.json" && base="$W/h200_hybrid_before_$1.json"
  timeout "$(left "$2")" python3 benchmarks/bench_hybrid_h200.py --sections "$1" --merge "$base" \
    --mamba-ssm "$MAMBA_SSM" --out "$W/h200_hybrid.json" ${WHOLE_ARGS:-} 2>&1 | tee "$W/hybrid_$1.log"
  note "hybrid $1 exit ${PIPESTATUS[0]}"
}

if want tests; then
  # every GPU-marked test outside the engine integrations (vLLM is not on the GPU machine)
  timeout "$(left "${TESTS_S:-170}")" python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs --durations=15 \
    -n "${TEST_WORKERS:-6}" ${TEST_FILES:-tests/ops/moe/test_moe_experts.py tests/ops/attention \
    tests/ops/linear/test_linear_relu2.py tests/ops/elementwise/test_elementwise.py \
    tests/ops/test_triton_ops.py tests/ops/linear/test_linear_gemm.py tests/ops/norm/test_norm_forward.py \
    tests/ops/conv1d/test_conv1d_forward.py tests/ops/logprobs/test_logprobs_triton.py tests/ops/test_triton_backward.py \
    tests/ops/ssd/test_triton_decode.py tests/core/test_decode_graph.py} 2>&1 | tee "$W/pytest_gpu.log"
  note "tests exit ${PIPESTATUS[0]}: $(tail -n 1 "$W/pytest_gpu.log")"; pack
fi
if want megatron; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      "${WHEELS:-.whl}"/*.whl > "$W/pip.log" 2>&1; then
    for m in ${MEGATRON_MODELS:-hybrid moe}; do
      PYTHONPATH="$PYTHONPATH:/tmp/site" timeout "$(left "${MEGATRON_S:-110}")" python3 \
        benchmarks/train_megatron_h200.py --model "$m" --out "$W/h200_megatron_$m.json" 2>&1 \
        | grep -v -i "warn" | tee "$W/megatron_$m.log"
      note "megatron $m exit ${PIPESTATUS[0]}: $(grep summary "$W/megatron_$m.log" | tail -n 1)"
    done
  else
    note "megatron: the wheel did not install ($(tail -n 1 "$W/pip.log"))"
  fi
  pack
fi
if want tiny; then  # the whole-model code on a small hybrid (a smoke run, not merged)
  timeout "$(left "${TINY_S:-60}")" python3 benchmarks/bench_hybrid_h200.py --sections tiny \
    --mamba-ssm "$MAMBA_SSM" --out "$W/tiny.json" 2>&1 | tee "$W/tiny.log"
  note "tiny exit ${PIPESTATUS[0]}"; pack
fi
if want nano; then hybrid nano "${NANO_S:-220}"; pack; fi
if want nanotrain; then hybrid nano_train "${NANOTRAIN_S:-120}"; pack; fi
if want h8b; then hybrid h8b "${H8B_S:-150}"; pack; fi
note "done"
pack
