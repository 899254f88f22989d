#!/usr/bin/env bash
# One GPU round for the Triton GEMM (run from the repo root on the GPU machine; $OUT collects the results):
#   1. GPU correctness tests (fp16 + bf16, model shapes, odd shapes, both routes)
#   2. the tuner (writes the arch's table and every timing) unless SKIP_TUNE=1; TUNE_ARGS passes it options (for
#      example "--m 64,128 --merge" to re-tune two buckets into the shipped table). Its table replaces the shipped
#      one only when the tuner finished: a run cut short by the time limit leaves the shipped table as it is.
#   3. the comparison table: ours (table pick), dequant_blas, torch bf16 at M = 16, 128, 512, 2048
#   4. compute-sanitizer memcheck and synccheck on the wgmma kernel's producer form
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
# The suite is bound by Triton's compiles, which run on the CPU: with pytest-xdist, 8 workers share the GPU (on the
# H200 all 527 tests took 73 s that way; one process had not finished them in 330 s).
WORKERS=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${PYTEST_WORKERS:-8}")
timeout ${PYTEST_S:-330} python3 -m pytest -q -x $WORKERS tests/triton --ignore=tests/triton/test_aot.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -15
if [ "${SKIP_TUNE:-0}" != 1 ]; then
  timeout ${TUNE_S:-480} python3 -m w4a16.triton.tune ${TUNE_ARGS:-} --out "$OUT/sm_90.json" \
    --results "$OUT/tune_results.json" 2>&1 | tee "$OUT/tune.log" | grep -v "^    skip"
  tuned=${PIPESTATUS[0]}
  if [ "$tuned" = 0 ]; then
    cp "$OUT/sm_90.json" w4a16/triton/configs/sm_90.json
  else
    echo "the tuner did not finish (exit $tuned): the shipped table stays" | tee -a "$OUT/tune.log"
  fi
fi
timeout ${COMPARE_S:-300} python3 -m w4a16.triton.compare --m 16,128,512,2048 --json "$OUT/compare.json" 2>&1 | tee "$OUT/compare.log"
for tool in memcheck synccheck; do
  compute-sanitizer --tool $tool --error-exitcode 3 python3 tests/triton/sanitize_wgmma.py 2>&1 | tail -3 | tee "$OUT/$tool.log"
done
