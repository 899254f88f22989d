#!/usr/bin/env bash
# One GPU round for the skinny kernel: build, GPU tests, compute-sanitizer, timings. Logs to $OUT (or ./out).
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD W4A16_BUILD_DIR=/tmp/w4a16-build
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/gpu.txt"
( time python3 -m w4a16.skinny_build ) 2>&1 | tee "$OUT/build.log" || exit 1
python3 -m pytest tests/csrc/test_skinny_gpu.py tests/csrc/test_skinny_python.py -q --maxfail=20 -p no:cacheprovider --durations=5 ${PYTEST_ARGS:-} 2>&1 | tail -60 | tee "$OUT/pytest.log"
compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/csrc/sanitize_skinny.py 2>&1 | tail -30 | tee "$OUT/sanitizer.log"
echo "compute-sanitizer exit: $?" | tee -a "$OUT/sanitizer.log"
python3 tests/csrc/bench_skinny.py "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
