"""Bytes, FLOPs and rotation sizing: the arithmetic behind every GB/s, TFLOP/s and floor the bench prints.

Bytes are what a backend must move for one call, at least once each:

    weight   packed int4 (N * K / 2) plus its metadata: our scales (and zero points, uint8, asymmetric only)
             [N, K / G], or tinygemm's scale-and-zero pairs [K / G, N, 2] in bf16; the dense N * K weight in the
             activation dtype for the torch matmul peer
    x        M * K activations, read
    y        M * N outputs, written

The naive peer is charged the int4 bytes of its inputs (what it starts from), so its GB/s says how far it is
from what the problem needs. The bandwidth floor of a case is its int4 bytes (our format) at the measured copy
bandwidth: no W4A16 kernel can beat it with weights coming from DRAM.
"""

from __future__ import annotations

import math

ACTIVATION_BYTES = 2  # fp16 and bf16
# Copies in the rotation: total weight bytes >= ROTATION_FACTOR x the last-level cache (L2, or AMD's Infinity
# Cache: timing.last_level_cache_bytes), so each call streams its weight from DRAM.
ROTATION_FACTOR = 4
MAX_COPIES = 512
# Used when the device's cache size is not known (older ROCm builds): larger than any current GPU's L2.
DEFAULT_CACHE_BYTES = 128 * 2**20


def int4_weight_bytes(n: int, k: int, group_size: int, symmetric: bool) -> int:
    """Our layout: qweight int32 [N, K/8], scales [N, K/G] in the activation dtype, zeros uint8 [N, K/G]."""
    groups = n * (k // group_size)
    return n * k // 2 + groups * ACTIVATION_BYTES + (0 if symmetric else groups)


def weight_bytes(backend: str, n: int, k: int, group_size: int, symmetric: bool) -> int:
    """Bytes of the weight as the backend reads it (see the module docstring)."""
    if backend in ("torch_bf16", "torch_fp16"):
        return n * k * ACTIVATION_BYTES
    if backend == "tinygemm":  # packed int4 plus a (scale, zero) bf16 pair per group
        return n * k // 2 + n * (k // group_size) * 2 * ACTIVATION_BYTES
    return int4_weight_bytes(n, k, group_size, symmetric)


def case_bytes(backend: str, n: int, k: int, m: int, group_size: int, symmetric: bool) -> int:
    """Weight + activations + output bytes of one call."""
    return weight_bytes(backend, n, k, group_size, symmetric) + (m * k + m * n) * ACTIVATION_BYTES


def floor_bytes(n: int, k: int, m: int, group_size: int, symmetric: bool) -> int:
    """The bytes any W4A16 kernel on our layout must move: the bandwidth floor's numerator."""
    return case_bytes("auto", n, k, m, group_size, symmetric)


def flops(n: int, k: int, m: int) -> int:
    return 2 * m * n * k


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def tflops(n: int, k: int, m: int, seconds: float) -> float:
    return flops(n, k, m) / seconds / 1e12


def rotation_copies(bytes_per_copy: int, cache_bytes: int | None, factor: int = ROTATION_FACTOR,
                    max_copies: int = MAX_COPIES) -> int:
    """How many weight copies to cycle through so that they total >= factor x the last-level cache (at least 1,
    at most max)."""
    if bytes_per_copy <= 0:
        raise ValueError(f"bytes_per_copy must be positive, got {bytes_per_copy}")
    cache = cache_bytes if cache_bytes and cache_bytes > 0 else DEFAULT_CACHE_BYTES
    return max(1, min(max_copies, math.ceil(factor * cache / bytes_per_copy)))


def settle_replays(first_replay_seconds: float, settle_seconds: float, minimum: int) -> int:
    """Warm-up replays of a graph whose first replay took first_replay_seconds: at least `minimum`, and enough
    to run for settle_seconds."""
    if first_replay_seconds <= 0:
        return minimum
    return max(minimum, math.ceil(settle_seconds / first_replay_seconds))


def calls_per_replay(copies: int, seconds_per_call: float, target_seconds: float, max_calls: int) -> int:
    """Calls in one graph: every copy at least once, enough for the replay to last about target_seconds."""
    wanted = math.ceil(target_seconds / seconds_per_call) if seconds_per_call > 0 else max_calls
    return max(copies, min(max_calls, wanted))
