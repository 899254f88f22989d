#!/usr/bin/env bash
# One GPU round for the skinny kernel: build, GPU tests, compute-sanitizer, timings. Logs to $OUT (or ./out).
# Every step runs; the exit status is 1 if the build, a test, the sanitizer or the timing run failed.
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD W4A16_BUILD_DIR=/tmp/w4a16-build
failed=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/gpu.txt"
( time python3 -m w4a16.skinny_build ) 2>&1 | tee "$OUT/build.log" || exit 1
# With pytest-xdist (where the machine has it) 8 workers share the GPU; the tests marked "alone" (error paths,
# graph capture) run after them, alone.
WORKERS=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${PYTEST_WORKERS:-8}" || true)
python3 -m pytest tests/csrc/test_skinny_gpu.py tests/csrc/test_skinny_python.py -q --maxfail=20 -p no:cacheprovider \
  $WORKERS -m "not alone" 2>&1 | tail -25 | tee "$OUT/pytest.log" || failed+=(tests)
compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/csrc/sanitize_skinny.py 2>&1 | tail -8 \
  | tee "$OUT/sanitizer.log" || failed+=(sanitizer)
python3 tests/csrc/bench_skinny.py "$OUT/bench.json" > "$OUT/bench.log" 2>&1 || failed+=(bench)
python3 -m pytest tests/csrc/test_skinny_gpu.py -q -p no:cacheprovider -m alone 2>&1 | tail -15 \
  | tee "$OUT/pytest_errors.log" || failed+=(error-tests)
python3 tests/csrc/error_path_probe.py 2>&1 | tail -3 || \
  cuda-gdb -batch -ex run -ex bt --args python3 tests/csrc/error_path_probe.py 2>&1 | grep -E "^#|signal" | head -30
cat "$OUT/bench.log"
echo "failed steps: ${failed[*]:-none}" | tee "$OUT/status.txt"
[ ${#failed[@]} -eq 0 ]
