# Sourced by the gpu_*_session.sh scripts, with SESSION (the name of
# the archive, $OUT/$SESSION.tgz, and of the default work folder, /tmp/${SESSION}work), STEPS and
# DEADLINE_S set. Turns on strict mode (set -uo pipefail), moves to the repository root, sets OUT, W
# (the work folder, empty at the start: an earlier call's is moved aside) and the environment, writes
# env.log, and defines:
#   pack          the work folder packed into $OUT/$SESSION.tgz (written aside, then renamed, so a
#                 call cut at its limit keeps what finished) and summary.txt copied beside it
#   left SECONDS  a step's own limit cut to what DEADLINE_S (counted from here) leaves, at least 1
#   note TEXT     a line in summary.txt with the seconds since the start
#   want STEP     whether STEP is in STEPS
#   step NAME LIMIT CMD...  CMD under a timeout cut to what DEADLINE_S leaves, its output in
#                 $W/NAME.log, its exit status noted, then the work folder packed
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/gpu_out}"
W="${WORK_DIR:-/tmp/${SESSION}work}"
# a warm machine keeps an earlier call's work folder: moved aside (not packed), so this call's archive and logs
# hold this call's files only
if [ -n "$(ls -A "$W" 2>/dev/null)" ]; then
  mv "$W" "$W.before.$(date +%s%N)"
fi
mkdir -p "$OUT" "$W"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
t0=$(date +%s)

pack() {
  tar czf "$OUT/.$SESSION.tgz" -C "$W" . && mv "$OUT/.$SESSION.tgz" "$OUT/$SESSION.tgz"
  cp "$W/summary.txt" "$OUT/summary.txt" 2>/dev/null || true
}
left() {
  local l=$(( DEADLINE_S - ($(date +%s) - t0) - 5 ))
  (( l > $1 )) && l=$1
  (( l < 1 )) && l=1
  echo "$l"
}
note() { echo "== $* after $(( $(date +%s) - t0 )) s" | tee -a "$W/summary.txt"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() {
  local name="$1" limit="$2"
  shift 2
  timeout "$(left "$limit")" "$@" 2>&1 | tee -a "$W/$name.log"
  note "$name exit ${PIPESTATUS[0]}: $(tail -n 1 "$W/$name.log")"
  pack
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
  # GIT_COMMIT from the caller: a lent machine's copy of .git can be older than the tree it runs
  echo "commit ${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"; } 2>&1 | tee "$W/env.log"
cat "$W/env.log" >> "$W/summary.txt"

# causal_conv1d for the fused mamba_ssm stock, where a built wheel is carried in .whl/ (build_causal_conv1d.sh)
if ls .whl/causal_conv1d-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/cc1d .whl/causal_conv1d-*.whl \
    > "$W/pip_cc1d.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/cc1d" && echo "causal_conv1d: $(ls .whl/causal_conv1d-*.whl)" \
    | tee -a "$W/summary.txt"
fi
