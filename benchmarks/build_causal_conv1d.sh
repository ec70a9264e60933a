#!/usr/bin/env bash
# causal_conv1d 1.7.0 (mamba_ssm's fused path: its conv forward, backward and decode update) built for sm_90 on
# the GPU machine, so the mamba_ssm stock can run `use_mem_eff_path=True` (`bench_mamba_ssm_h200.py --stock-mem-eff`).
#
#   here:   mkdir -p .whl && (cd .whl && CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE ../.venv/bin/pip download \
#               --no-build-isolation --no-deps --no-binary :all: causal-conv1d==1.7.0)     # a 30 KB sdist
#   device: OUT=... bash benchmarks/build_causal_conv1d.sh   (carry .whl; about 450-510 s with 16 cores)
#   here:   cat <files_at>/causal_conv1d.whl.part-* > .whl/causal_conv1d-1.7.0-cp312-cp312-linux_x86_64.whl
#
# Its setup.py compiles for nine architectures; only sm_90 is kept. The 26 MB wheel comes back in 15 MB parts
# (a returned file is limited to 16 MiB); carried in .whl/, gpu_prelude.sh installs it for every later call.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
SDIST="$(ls .whl/causal_conv1d-*.tar.gz | head -n 1)"
WORK=$(mktemp -d)
tar xzf "$SDIST" -C "$WORK"
SRC="$(ls -d "$WORK"/causal_conv1d-*/)"
python3 - "$SRC/setup.py" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
marker = "    # HACK: The compiler flag -D_GLIBCXX_USE_CXX11_ABI"
if marker not in text:
    raise SystemExit(f"{path}: no line to cut the architectures before (another causal_conv1d version?)")
text = text.replace(marker, '    cc_flag = ["-gencode", "arch=compute_90,code=sm_90"]\n' + marker, 1)
open(path, "w").write(text)
PY
mkdir -p "$WORK/dist" "$OUT"
t0=$(date +%s)
(cd "$SRC" && CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-16}" python3 -m pip wheel -q --no-build-isolation \
  --no-deps --no-index -w "$WORK/dist" .) 2>&1 | tail -n 5
WHEEL="$(ls "$WORK"/dist/causal_conv1d-*.whl)"
echo "built $(basename "$WHEEL") in $(( $(date +%s) - t0 )) s, sha256 $(sha256sum "$WHEEL" | cut -c1-16)"
split -b 15M -d "$WHEEL" "$OUT/causal_conv1d.whl.part-"
basename "$WHEEL" > "$OUT/causal_conv1d.whl.name"
