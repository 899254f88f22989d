"""Kernel benchmarks: the catalogue's model shapes (w4a16.bench.catalogue) x M values, our backends and the peers, in one process.

Run through `python -m w4a16.bench` (or `nox -s bench`), which picks the set and makes pytest-benchmark time with
the device clock. Each case: check the backend can run it, check its output once (ours against the fp32
reference with the tolerance rule; the int4 peers loosely, to catch a mis-packed peer), size a graph over a
rotation of weight copies >= 4x L2, and time replays; pytest-benchmark's stats are per-call device seconds.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from w4a16.bench import catalogue, metrics, peers, timing

SET = os.environ.get("W4A16_BENCH_SET")
if not SET:
    pytest.skip("kernel benchmarks run through `python -m w4a16.bench` / `nox -s bench` (W4A16_BENCH_SET unset)",
                allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("kernel benchmarks need a CUDA or ROCm device", allow_module_level=True)

from w4a16_testing import assert_matches_reference  # noqa: E402

import w4a16  # noqa: E402  (after the skips)

_MODELS = os.environ.get("W4A16_BENCH_MODELS")
CASES = [c for c in catalogue.cases(SET) if not _MODELS or c.model in _MODELS.split(",")]
ROUNDS = 10
TARGET_REPLAY_SECONDS = 2e-3
MAX_CALLS = 1000
# The int4 peers are checked loosely (relative Frobenius error): tinygemm rounds its zero points to bf16, so the
# tolerance rule for our kernels does not apply to it, but a wrongly packed weight is off by ~100%.
PEER_RELATIVE_ERROR = 2e-2

_weights: dict[tuple, object] = {}
_prepared: dict[tuple, object] = {}
_CLOCKS = timing.ClockState.open()  # None where NVML cannot be read: then no wait and no clock record


def _weight(case: catalogue.Case):
    """The random weight of a shape and format (same seed for every backend); one kept at a time."""
    key = case.shape_key
    if key not in _weights:
        _weights.clear()
        _prepared.clear()
        torch.cuda.empty_cache()
        gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(key).encode()) % 2**31)
        _weights[key] = peers.random_weight(case.n, case.k, case.group_size, case.symmetric,
                                            peers.DTYPES[case.dtype], gen)
    return _weights[key]


def _prepare(case: catalogue.Case, cache_bytes):
    key = (case.shape_key, case.backend)
    if key not in _prepared:
        for other in [k for k in _prepared if k[0] == case.shape_key]:  # one backend's rotation at a time
            del _prepared[other]
        _prepared[key] = peers.prepare(case.backend, _weight(case), cache_bytes)
    return _prepared[key]


def _check_output(case, out, x, qw):
    if case.backend in catalogue.OURS:
        assert_matches_reference(out, x, qw)
    elif case.backend in ("naive", "tinygemm"):
        ref = torch.nn.functional.linear(x.float(), w4a16.dequantize(qw, torch.float32))
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < PEER_RELATIVE_ERROR, f"{case.backend} output off by {err:.3g} (relative) from the reference"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gemm(benchmark, request, gpu_info, case):
    # The option holds the timer's dotted name (a NameWrapper in older pytest-benchmark; str() gives the name).
    if benchmark.enabled and str(request.config.getoption("benchmark_timer")) != timing.DEVICE_CLOCK_NAME:
        pytest.skip("pytest-benchmark must time with the device clock: run `python -m w4a16.bench`, or pass "
                    f"--benchmark-timer={timing.DEVICE_CLOCK_NAME}")
    dtype = peers.DTYPES[case.dtype]
    device = torch.device("cuda", torch.cuda.current_device())
    reason = peers.unavailable_reason(case.backend, case.m, case.k, dtype, device)
    if reason is not None:
        pytest.skip(f"{case.backend}: {reason}")
    try:
        prepared = _prepare(case, gpu_info["cache_bytes"])
    except peers.Unavailable as exc:
        pytest.skip(f"{case.backend}: {exc}")

    gen = torch.Generator(device="cuda").manual_seed(case.m * 7919 + case.k)
    x = torch.randn(case.m, case.k, device=device, dtype=torch.float32, generator=gen).to(dtype)
    try:
        out = prepared.call(x, 0)
        torch.cuda.synchronize()
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        # A peer library may lack this case on this machine; an error of ours is a failure, never a skip (a
        # skipped case would drop out of the next stored baseline).
        if case.backend in catalogue.PEERS and any(
                words in str(exc) for words in ("unavailable", "not available", "not supported")):
            pytest.skip(f"{case.backend}: {str(exc).splitlines()[0]}")
        raise
    _check_output(case, out, x, prepared.weight)
    del out

    graph, calls = timing.sized_graph(lambda i: prepared.call(x, i), prepared.copies, TARGET_REPLAY_SECONDS,
                                      MAX_CALLS)
    timer = timing.GraphTimer(graph, calls, settle_seconds=timing.SETTLE_SECONDS, clocks=_CLOCKS)
    benchmark.group = f"{case.model} {case.layer} M={case.m} {case.dtype} g{case.group_size}"
    benchmark.pedantic(timer.round, rounds=ROUNDS, iterations=1)
    seconds = timer.median()
    nbytes = metrics.case_bytes(case.backend, case.n, case.k, case.m, case.group_size, case.symmetric)
    benchmark.extra_info.update(case.as_info())
    benchmark.extra_info.update(
        us_per_call=round(seconds * 1e6, 3),
        gbps=round(metrics.gbps(nbytes, seconds), 1),
        tflops=round(metrics.tflops(case.n, case.k, case.m, seconds), 3),
        pct_copy_bw=round(100 * metrics.gbps(nbytes, seconds) / gpu_info["copy_gbps"], 1),
        bytes=nbytes,
        copies=prepared.copies,
        calls=calls,
        rounds=len(timer.per_call),
    )
    if _CLOCKS is not None:  # the clock state of the timed rounds (timing.py: the power cap after heavy cases)
        benchmark.extra_info.update(cooldown_s=round(timer.cooldown_seconds, 3), slowed_rounds=timer.slowed_rounds,
                                    sm_mhz_min=min(timer.sm_mhz), sm_mhz_max=max(timer.sm_mhz))
    del graph, timer
