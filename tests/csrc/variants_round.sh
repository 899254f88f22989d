#!/usr/bin/env bash
# The device round for the prepared skinny-kernel variants (tests/csrc/variants/*.patch, csrc/PERF.md says why each
# exists). Two steps, each one device call of its own (about 5-8 minutes each on an H200):
#
#   bash tests/csrc/variants_round.sh ab             # A/B: the working tree's kernel against every variant
#   bash tests/csrc/variants_round.sh check NAME     # one variant's full round: build, GPU tests, sanitizer, timings
#
# `check` runs tests/csrc/gpu_round.sh in a copy of the tree with the patch applied, so the working tree is never
# edited (the GPU tests cover what the A/B harness does not time: asymmetric G = 128, clusters, odd shapes).
# Logs and tables go to $OUT (or ./out).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$(mkdir -p "${OUT:-out}" && cd "${OUT:-out}" && pwd)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true
case "${1:-}" in
  ab)
    # The timing-only bounds (bound-*) fail their float64 checks by design, so exit status 1 is expected.
    python3 tests/csrc/ab_skinny.py . tests/csrc/variants/*.patch --passes "${PASSES:-3}" \
      > "$OUT/ab.md" 2> "$OUT/ab.log" || echo "ab_skinny exit $? (the bound-* variants fail their checks)"
    cat "$OUT/ab.md"
    ;;
  check)
    patch=tests/csrc/variants/${2:?which variant: the name of a tests/csrc/variants/*.patch}.patch
    copy=$(mktemp -d)
    cp -r w4a16 tests pyproject.toml "$copy"
    python3 tests/csrc/ab_skinny.py --export "$copy" "$patch" > /dev/null  # csrc/ with the patch (and its bases)
    echo "checking $patch in $copy" | tee "$OUT/check.txt"
    (cd "$copy" && OUT="$OUT" bash tests/csrc/gpu_round.sh)
    ;;
  *)
    echo "usage: $0 ab | check VARIANT" >&2
    exit 2
    ;;
esac
