#!/usr/bin/env bash
# One H200 session validating the merged GPU kernels, steps in priority order: the MoE GPU tests,
# bench_moe_h200.py and `check --backend triton` on small MoE hybrids; the attention GPU tests and
# the attention backward's determinism cells; `check --backend triton` on Mamba2 at the 130m and
# 1.3b shapes and the training cells against mamba_ssm's own model.
#
#   OUT=/path bash benchmarks/gpu_s3_session.sh        # from the repository root
#   STEPS="moetests moebench moecheck attntests bwddet race mcheck vsms" DEADLINE_S=540 MOETESTS_K=stock ...
#   MOEBENCH_ARGS="--sweep" VSMS_ARGS="--shapes mamba2-2.7b" MOECHECK="top2 top6-groups" ...
#
# Every step's logs and JSON go to a work folder; after each step the folder is packed into
# $OUT/s3.tgz (written aside, then renamed), so a call cut at its time limit keeps what finished.
# Each step's timeout is cut to what is left of DEADLINE_S (counted from the start).
# Needs .anchors/ (mamba_ssm's package, see benchmarks/README.md) for the vsms step.
SESSION=s3
STEPS="${STEPS:-moetests moebench moecheck attntests bwddet race mcheck vsms}"
DEADLINE_S="${DEADLINE_S:-540}"
source "$(dirname "$0")/gpu_prelude.sh"  # strict mode, the repository root, OUT, W, pack/left/note/want

if want moetests; then
  timeout "$(left "${MOETESTS_S:-240}")" python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs --durations=10 \
    ${MOETESTS_K:+-k "$MOETESTS_K"} tests/ops/moe/test_moe_experts.py 2>&1 | tee "$W/pytest_moe.log"
  note "moetests exit ${PIPESTATUS[0]}: $(tail -n 1 "$W/pytest_moe.log")"; pack
fi
if want moebench; then
  timeout "$(left "${MOEBENCH_S:-200}")" python3 benchmarks/bench_moe_h200.py --out "$W/h200_moe.json" \
    ${MOEBENCH_ARGS:-} 2>&1 | tee "$W/moe.log"
  note "moebench exit ${PIPESTATUS[0]}"; pack
fi
if want moecheck; then
  # small MoE hybrids (attention and Mamba2 around them, a shared expert in every MoE layer)
  for name in ${MOECHECK:-top2 top2-groups top6 top6-groups}; do
    python3 - "$name" "$W/ckpt_$name" <<'PY'
import sys
from aligned_mamba.models.nemotron_h import make_tiny_hybrid, save_checkpoint
name, path = sys.argv[1], sys.argv[2]
k = 2 if name.startswith("top2") else 6
groups = dict(n_group=4, topk_group=2) if name.endswith("groups") else dict(n_group=1, topk_group=1)
cfg, tensors = make_tiny_hybrid(5, dtype="bfloat16", pattern="MEM*E", hidden_size=256, vocab_size=512,
                                mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=32, chunk_size=64,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                n_routed_experts=16, num_experts_per_tok=k, moe_intermediate_size=256,
                                moe_shared_expert_intermediate_size=384, **groups)
save_checkpoint(path, cfg, tensors)
PY
    timeout "$(left "${CHECK_S:-120}")" python3 -m aligned_mamba.cli check --backend triton --model "$W/ckpt_$name" \
      --json "$W/check_moe_$name.json" 2>&1 | tee "$W/check_moe_$name.log"
    note "moecheck $name exit ${PIPESTATUS[0]}"
    rm -rf "$W/ckpt_$name"
  done
  pack
fi
if want attntests; then
  timeout "$(left "${ATTNTESTS_S:-240}")" python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs --durations=10 \
    tests/ops/attention tests/ops/linear/test_linear_relu2.py tests/ops/elementwise/test_elementwise.py \
    2>&1 | tee "$W/pytest_attn.log"
  note "attntests exit ${PIPESTATUS[0]}: $(tail -n 1 "$W/pytest_attn.log")"; pack
fi
if want bwddet; then
  timeout "$(left "${BWDDET_S:-150}")" python3 benchmarks/bench_hybrid_h200.py --sections bwd_determinism \
    --merge benchmarks/results/h200_hybrid.json --out "$W/h200_hybrid.json" 2>&1 | tee "$W/bwddet.log"
  note "bwddet exit ${PIPESTATUS[0]}"; pack
fi
if want race; then
  # which backward launches change dK's bits run to run, then racecheck on one such launch's dK/dV kernel
  timeout "$(left "${RACE_S:-150}")" python3 benchmarks/attn_bwd_race_probe.py --out "$W/attn_bwd_race.json" \
    2>&1 | tee "$W/race.log"
  note "race exit ${PIPESTATUS[0]}"; pack
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -n 1)
  if [ -n "$CS" ]; then
    timeout "$(left "${RACECHECK_S:-150}")" "$CS" --tool racecheck --racecheck-report all --print-limit 20 \
      --kernel-name kns=_dkdv_kernel python3 benchmarks/attn_bwd_race_probe.py --one "${RACE_ONE:-64,32,64,32,4,2}" \
      --tokens "${RACE_TOKENS:-512}" 2>&1 | tail -n 200 | tee "$W/racecheck.log"
    note "racecheck exit ${PIPESTATUS[0]}: $(grep -c -i hazard "$W/racecheck.log") hazard lines"
  else
    note "racecheck: no compute-sanitizer"
  fi
  pack
fi
if want mcheck; then
  for m in ${MCHECK:-130m 1.3b}; do
    # drawn on the GPU by the benchmark's rules (as gpu_model_session.sh's check step)
    python3 - "$m" "$W/ckpt_$m" <<'PY'
import sys
import torch
from aligned_mamba.models.mamba2 import save_checkpoint
from benchmarks.bench_model_h200 import SHAPES, device_weights, make_config
config = make_config(SHAPES["mamba2-" + sys.argv[1]], 256, "bfloat16")
tensors = {name: t.cpu() for name, t in device_weights(config, torch.device("cuda"), 0).items()}
save_checkpoint(sys.argv[2], config, tensors)
PY
    timeout "$(left "${MCHECK_S:-200}")" python3 -m aligned_mamba.cli check --backend triton --jobs 2 \
      --model "$W/ckpt_$m" --json "$W/check_$m.json" 2>&1 | tee "$W/check_$m.log"
    note "mcheck $m exit ${PIPESTATUS[0]}"
    rm -rf "$W/ckpt_$m"
  done
  pack
fi
if want vsms; then
  # training cells against mamba_ssm's MambaLMHeadModel (needs the whole mamba_ssm package in .anchors/)
  PYTHONPATH="$PYTHONPATH:$PWD/.anchors" timeout "$(left "${VSMS_S:-400}")" python3 benchmarks/bench_mamba_ssm_h200.py \
    --out-dir "$W" --parts train --quick ${VSMS_ARGS:-} 2>&1 | tee "$W/vs_mamba_ssm.log"
  note "vsms exit ${PIPESTATUS[0]}"; pack
fi
note "done"
pack
