"""A representative set of skinny-kernel launches for `compute-sanitizer --tool memcheck` (small, every variant
family once): python tests/csrc/sanitize_skinny.py; prints one line per case and 'all cases match'."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ for w4a16_testing
from w4a16_testing import assert_matches_reference  # noqa: E402

import w4a16  # noqa: E402
from w4a16 import skinny  # noqa: E402


def main() -> int:
    reason = skinny.unavailable_reason(torch.device("cuda"), torch.float16)
    if reason:
        print(reason)
        return 1
    gen = torch.Generator(device="cuda").manual_seed(7)
    max_rows, elements = skinny.device_limits()
    rows = sorted({1, 3, 5, max_rows})
    cases = list(itertools.product((torch.float16, torch.bfloat16), ("uint4b8", "uint4"), (32, 64, 128), rows))
    # Every cluster size in turn where the device has clusters (0: the shape's own choice).
    clusters = (0, 1, 2, 4) if torch.version.cuda and torch.cuda.get_device_capability() >= (9, 0) else (0,)
    for i, (dtype, fmt, g, m) in enumerate(cases):
        cluster_blocks = clusters[i % len(clusters)]
        # With G < 128 a K-step of 128 can end inside K: one group past a multiple of 128 reads the K tail.
        n, k = (257, 1024) if m < 5 else (33, 4096)
        k += 0 if g == 128 else g
        q = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.int32)
        scales = (torch.rand(n, k // g, device="cuda", generator=gen) * 0.02 + 0.002).to(dtype)
        zeros = None if fmt == "uint4b8" else torch.randint(0, 16, (n, k // g), device="cuda", generator=gen,
                                                            dtype=torch.uint8)
        qw = w4a16.QuantizedWeight(w4a16.pack_int4(q), scales, zeros, g)
        x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
        bias = torch.randn(n, device="cuda", generator=gen).to(dtype) if m == 3 else None
        out = skinny.skinny_gemm(x, qw, bias, cluster_blocks=cluster_blocks)
        torch.cuda.synchronize()
        assert_matches_reference(out, x, qw, bias)
        print(f"ok {dtype} {fmt} G={g} M={m} N={n} K={k} bias={bias is not None} cluster_blocks={cluster_blocks}")
    # The staging limit itself: M * K at the budget (rounded down to whole 32-element chunks).
    for m in (4, max_rows):
        k = elements // m // 32 * 32  # whole chunks of the G = 32 weight below
        qw = w4a16.QuantizedWeight(w4a16.pack_int4(torch.randint(0, 16, (8, k), device="cuda", dtype=torch.int32)),
                                   torch.full((8, k // 32), 0.01, device="cuda", dtype=torch.bfloat16), None, 32)
        x = torch.randn(m, k, device="cuda").bfloat16()
        assert_matches_reference(skinny.skinny_gemm(x, qw), x, qw)
        print(f"ok staging limit M={m} K={k}")
    print("all cases match")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
