#!/usr/bin/env bash
# The GPU checks of every component in one round on an NVIDIA machine without a package registry, from the repo
# root; logs under $OUT (or ./out). Two phases, because the embedded accuracy gate's files come in two folders
# (see regression/gpu_accuracy.sh and regression/gpu_prepare.sh):
#   phase 1 (.whl/ present):  stage the accuracy files, build the skinny extension, GPU tests, kernel benchmarks
#   phase 2 (.whl2/ present): the embedded accuracy gate with the real kernels, then the end-to-end table
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/tests:$PWD W4A16_BUILD_DIR=/tmp/w4a16-build
step() { echo "== $1: rc=$2 (at ${SECONDS} s)" | tee -a "$OUT/summary.txt"; }
# With pytest-xdist (where the machine has it) 8 workers share the GPU; the skinny tests marked "alone" run
# alone afterwards, as in tests/csrc/gpu_round.sh.
WORKERS=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${PYTEST_WORKERS:-8}" || true)
if [ "${1:-1}" = 1 ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
  bash regression/gpu_accuracy.sh stage > "$OUT/stage.log" 2>&1; step stage $?
  python3 -m w4a16.skinny_build > "$OUT/build.log" 2>&1; step build $?
  python3 -m pytest -q -p no:cacheprovider $WORKERS -m "not alone" tests/csrc/test_skinny_gpu.py \
    tests/csrc/test_skinny_python.py tests/gpu tests/test_dispatch.py tests/test_linear.py 2>&1 \
    | tee "$OUT/pytest-gpu.log" | tail -25; step pytest-gpu $?
  python3 -m pytest -q -p no:cacheprovider -m alone tests/csrc/test_skinny_gpu.py 2>&1 \
    | tee "$OUT/pytest-errors.log" | tail -5; step pytest-error-paths $?
  python3 -m w4a16 info 2>&1 | tee "$OUT/info.log"
  # Against the newest stored quick baseline of this GPU; stored as the next one only if it passes.
  python3 -m w4a16.bench --quick --compare --save --no-build > "$OUT/bench-compare.log" 2>&1
  step "bench-compare-save (expect 0)" $?
  python3 -m w4a16.bench --quick --compare --inject-slowdown --no-build > "$OUT/bench-slowdown.log" 2>&1
  step "bench-compare with injected slowdown (expect 1)" $?
  tail -52 "$OUT/bench-compare.log"; tail -12 "$OUT/bench-slowdown.log"
  tar czf "$OUT/baselines-sm_90.tgz" baselines/sm_90
else
  ( time bash regression/gpu_accuracy.sh ) > "$OUT/accuracy.log" 2>&1; step accuracy $?
  tar czf "$OUT/accuracy.tgz" -C "$OUT" accuracy 2>/dev/null
  grep -v "it/s\|%|" "$OUT/accuracy.log" | tail -30
  timeout "${E2E_S:-150}" python3 -m w4a16.bench --e2e --e2e-models llama3.1-8b --save --no-build > "$OUT/e2e.log" 2>&1
  step e2e $?; tail -20 "$OUT/e2e.log"
  tar czf "$OUT/e2e-sm_90.tgz" baselines/sm_90 2>/dev/null
fi
cat "$OUT/summary.txt"
