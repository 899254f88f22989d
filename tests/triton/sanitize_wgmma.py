"""Launches of the wgmma kernel for `compute-sanitizer` (memcheck, synccheck): python tests/triton/sanitize_wgmma.py;
prints one line per case and 'all cases match'. The warp-specialized (producer) form with x copied into operand
order and with x read as it is (natural), and the form that gathers x by cp.async (the sm_90 table's pick at small
M): 256/128/64-token and 16/32-token tiles, one and two consumer warpgroups, split-K, G = 32/64/128, sym and asym,
bias, and tile remainders in M, N and K (TMA zero fill)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ for w4a16_testing
from w4a16_testing import assert_matches_reference, random_activation, random_weight  # noqa: E402

from w4a16.triton.configs import WGMMA_BLOCK_K, TileConfig  # noqa: E402
from w4a16.triton.gemm_kernel import launch_gemm  # noqa: E402
from w4a16.triton.wgmma_kernel import unsupported_reason  # noqa: E402


def producer(block_m: int, warps: int, stages: int, split: int, natural: bool = False) -> TileConfig:
    return TileConfig(block_m, 16 * warps, WGMMA_BLOCK_K, warps, stages, split, kernel="wgmma", producer=True,
                      x_natural=natural)


def gather(block_m: int, block_n: int, warps: int, stages: int, split: int) -> TileConfig:
    return TileConfig(block_m, block_n, WGMMA_BLOCK_K, warps, stages, split, kernel="wgmma", x_gather=True)


CASES = [((300, 200, 384, 128), producer(256, 8, 3, 1)), ((77, 520, 1056, 32), producer(64, 4, 4, 3)),
         ((513, 264, 4160, 64), producer(128, 4, 3, 2)), ((257, 4096, 640, 128), producer(256, 4, 3, 1)),
         ((300, 200, 384, 128), producer(256, 8, 3, 1, natural=True)),
         ((77, 520, 1056, 32), producer(64, 4, 4, 3, natural=True)),
         ((130, 264, 4160, 64), producer(128, 4, 4, 2, natural=True)),
         ((9, 200, 1056, 32), gather(16, 64, 4, 4, 6)), ((33, 520, 640, 64), gather(32, 128, 8, 4, 4))]


def main() -> int:
    reason = unsupported_reason(torch.device("cuda"))
    if reason:
        print(reason)
        return 1
    gen = torch.Generator().manual_seed(11)
    for (m, n, k, g), config in CASES:
        for symmetric in (True, False):
            qw = random_weight(n, k, g, symmetric, torch.bfloat16, "cuda", gen)
            x = random_activation(m, k, torch.bfloat16, "cuda", gen)
            bias = torch.randn(n, generator=gen).to(dtype=torch.bfloat16, device="cuda")
            out = launch_gemm(x, qw, bias, config, out=torch.full((m, n), float("nan"), dtype=x.dtype, device="cuda"))
            torch.cuda.synchronize()
            assert_matches_reference(out, x, qw, bias)
            print(f"ok M={m} N={n} K={k} G={g} {'sym' if symmetric else 'asym'} {config}")
    print("all cases match")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
