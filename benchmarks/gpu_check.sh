#!/usr/bin/env bash
# `aligned-mamba check --backend triton` on a GPU: the embedded default and a random-init model of
# mamba2-130m's shape (24 layers, hidden 768, 24 heads x 64, state 128, vocab 50280).
#
#   OUT=/path bash benchmarks/gpu_check.sh          # from the repository root
#   WHICH=130m OUT=/path bash benchmarks/gpu_check.sh   # one model only: tiny or 130m (default both)
#
# Writes $OUT/check_tiny.json, $OUT/check_130m.json and their logs (the table each check prints).
# On the H200 the tiny check takes about 40 s and the 130m-shaped one more than 200 s (its first
# two of five cases took 120 s), so a session with a tight time limit runs them apart.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
WHICH="${WHICH:-both}"
if [ "$WHICH" != "130m" ]; then
  python3 -m aligned_mamba.cli check --backend triton --jobs 1 --json "$OUT/check_tiny.json" 2>&1 | tee "$OUT/check_tiny.log"
  echo "== tiny exit ${PIPESTATUS[0]}"
fi
[ "$WHICH" = "tiny" ] && exit 0
M130="${M130:-/tmp/m130}"
python3 - "$M130" <<'PY'
import sys
from aligned_mamba.models.mamba2 import make_tiny, save_checkpoint
cfg, tensors = make_tiny(0, vocab_size=50280, hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64,
                         state_size=128)
save_checkpoint(sys.argv[1], cfg, tensors)
PY
python3 -m aligned_mamba.cli check --model "$M130" --backend triton --jobs 1 --json "$OUT/check_130m.json" 2>&1 \
  | tee "$OUT/check_130m.log"
echo "== 130m exit ${PIPESTATUS[0]}"
