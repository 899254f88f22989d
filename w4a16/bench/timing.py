"""GPU timing: graph replay over a rotation of weight copies, timed with device events.

Decode GEMMs take a few microseconds, less than a kernel launch costs the host. So one timed round is a CUDA
graph (a HIP graph on ROCm) that holds `calls` invocations cycling over the weight copies; the replay is bracketed
by two events and per-call time = replay time / calls. Before the events, a short spin kernel keeps the GPU busy
while the host enqueues event, replay and event, so the host's launch latency is not inside the bracket.

pytest-benchmark times with a host clock of its choosing: `device_clock` is a clock that advances only by the
per-call device time each timed round reports (`--benchmark-timer=w4a16.bench.timing.device_clock`), so the
stats pytest-benchmark stores and compares are per-call GPU seconds.

A heavy case (a large prefill GEMM) leaves an NVIDIA GPU at its power cap for about half a second after it ends
(measured on an H100 by tests/bench/power_cap_probe.py, after a second of 8192^3 bf16 matmuls: NVML's "SW power cap"
reason stayed set 0.50-0.53 s, idle or under a decode load; the SM clock read 1155-1905 MHz 0.1 s after the load,
1965 at 0.3 s and 1980 at 0.6 s). A decode case timed in that window, which outlasts the 0.25 s settle below, runs
at a lower clock. So where NVML can be read (`ClockState`), a case first waits, idle, until no slowdown reason is
set (`cool_down`), and each timed round notes whether one was set and the SM clock, which the bench stores with the
case.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from . import metrics

# Spin before each bracketed replay: about 0.1 ms at 2 GHz, several times a graph launch's host latency.
LEAD_SPIN_CYCLES = 200_000
WARMUP_REPLAYS = 2
# How long the bench replays a case before timing it. After a heavy case (a large prefill GEMM), an H200 runs at
# its power cap (measured: 1515-1530 MHz, "SW power cap") and a decode case timed next read 5-13% slow for about
# 0.15 s, until the clock came back to 1980 MHz. The settle time makes a case's figure independent of the case
# before it, so peers timed at different points of the run compare fairly.
SETTLE_SECONDS = 0.25
# NVML's clock event reasons that slow a busy GPU's SM clock (nvml.h): SW power cap 0x4, HW slowdown 0x8, SW thermal
# slowdown 0x20, HW thermal slowdown 0x40, HW power brake 0x80. Idle, application clocks, sync boost and display
# clock settings are not slowdowns of a busy GPU.
SW_POWER_CAP = 0x4
SLOWDOWN_REASONS = SW_POWER_CAP | 0x8 | 0x20 | 0x40 | 0x80
# The longest idle wait for them to clear before a case (they cleared within 0.53 s after 1 s of 8192^3 bf16
# matmuls); a case still slowed after it is timed anyway, and its rounds say so.
COOLDOWN_MAX_SECONDS = 3.0
COOLDOWN_POLL_SECONDS = 0.02


class DeviceClock:
    """A monotonic clock in seconds that moves only when a timed round `advance`s it by its device time."""

    def __init__(self, name: str = "device_clock") -> None:
        self._seconds = 0.0
        self.__name__ = name  # pytest-benchmark stores a timer as module.__name__

    def __call__(self) -> float:
        return self._seconds

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:  # also refuses NaN
            raise ValueError(f"a device time must be >= 0 s, got {seconds}")
        self._seconds += seconds


# The one clock pytest-benchmark loads by name (it takes a module attribute, not a factory).
device_clock = DeviceClock()
DEVICE_CLOCK_NAME = f"{__name__}.device_clock"


# AMD's Infinity Cache (MALL) sits past L2, and torch reports only L2 (2 MiB on gfx1151): a weight rotation sized
# on L2 alone fits the Infinity Cache there and times it instead of DRAM. Its size on the archs this project
# targets (Strix Halo: 32 MiB; RDNA 4's RX 9070 family: 64 MiB).
INFINITY_CACHE_BYTES = {"gfx1151": 32 * 2**20, "gfx1201": 64 * 2**20}


def l2_cache_bytes(device: torch.device | int | None = None) -> int | None:
    """The device's L2 size in bytes, where torch reports it (None elsewhere)."""
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    size = getattr(props, "L2_cache_size", None)
    return int(size) if size else None


def last_level_cache_bytes(device: torch.device | int | None = None) -> int | None:
    """What a weight rotation must exceed for its reads to come from DRAM: L2, or the Infinity Cache behind it
    where the arch has one (None where neither is known)."""
    from w4a16.arch import arch

    sizes = [size for size in (l2_cache_bytes(device), INFINITY_CACHE_BYTES.get(arch(device))) if size]
    return max(sizes) if sizes else None


def nvml_handle(nvml, device: int):
    """NVML's handle of torch's CUDA device `device`, matched by UUID: torch's index is not NVML's where
    CUDA_VISIBLE_DEVICES reorders the devices."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")


class ClockState:
    """The GPU's SM clock and clock slowdown reasons, read through NVML (the nvidia-ml-py package).

    `open` gives None where they cannot be read: no NVML (ROCm, or the package missing), or a device NVML does not
    know. Then nothing waits and nothing is recorded."""

    def __init__(self, nvml, handle) -> None:
        self._nvml, self._handle = nvml, handle

    @classmethod
    def open(cls, device: int | None = None) -> ClockState | None:
        if getattr(torch.version, "hip", None):
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
            state = cls(pynvml, nvml_handle(pynvml, torch.cuda.current_device() if device is None else device))
            state.slowdown(), state.sm_mhz()  # both readable, or None
            return state
        except Exception:  # ImportError, NVMLError, a torch without the uuid property: not readable here
            return None

    def slowdown(self) -> int:
        """The slowdown reasons set now (bits of SLOWDOWN_REASONS; 0: none)."""
        return int(self._nvml.nvmlDeviceGetCurrentClocksThrottleReasons(self._handle)) & SLOWDOWN_REASONS

    def sm_mhz(self) -> int:
        return int(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))


def cool_down(clocks: ClockState, max_seconds: float = COOLDOWN_MAX_SECONDS,
              poll_seconds: float = COOLDOWN_POLL_SECONDS, sleep: Callable[[float], None] = time.sleep,
              now: Callable[[], float] = time.monotonic) -> float:
    """Wait, idle, until no slowdown reason is set, at most max_seconds; the seconds waited."""
    start = now()
    while clocks.slowdown() and now() - start < max_seconds:
        sleep(poll_seconds)
    return now() - start


def _spin() -> None:
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(LEAD_SPIN_CYCLES)


def capture(fn: Callable[[int], object], copies: int, calls: int) -> torch.cuda.CUDAGraph:
    """A graph of `calls` invocations fn(0), fn(1), ... cycling over the copies; outputs are dropped.

    fn must already have run once eagerly (lazy compilation and allocation happen outside the capture); the
    warm-up on a side stream is what torch asks for before capturing.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(copies, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    torch.cuda.synchronize()
    return graph


def sized_graph(fn: Callable[[int], object], copies: int, target_seconds: float,
                max_calls: int) -> tuple[torch.cuda.CUDAGraph, int]:
    """(graph, calls): a graph of fn over the copies whose replay lasts about target_seconds.

    The size comes from the device time of a probe graph (one call per copy), not from eager calls: eager calls of
    a decode GEMM measure the host's dispatch (about 0.1 ms against 25 us on the GPU), which made graphs of 10-16
    calls where about 80 were meant."""
    probe = capture(fn, copies, copies)
    probe.replay()
    seconds_per_call = time_replay(probe) / copies
    del probe
    calls = metrics.calls_per_replay(copies, seconds_per_call, target_seconds, max_calls)
    return capture(fn, copies, calls), calls


def time_replay(graph: torch.cuda.CUDAGraph) -> float:
    """Device seconds of one replay, bracketed by events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _spin()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


class GraphTimer:
    """One captured case: `round()` replays it once and returns the per-call seconds (also advancing
    `device_clock`, which is what pytest-benchmark reads); `per_call` keeps every round's figure. With a
    ClockState, `cooldown_seconds` is the idle wait before the warm-up, and each round's end is sampled:
    `slowed_rounds` counts those with a slowdown reason set, `sm_mhz` keeps the SM clocks."""

    def __init__(self, graph: torch.cuda.CUDAGraph, calls: int, settle_seconds: float = 0.0,
                 clocks: ClockState | None = None) -> None:
        """Waits for the clock (cool_down) where `clocks` can read it, then replays WARMUP_REPLAYS times, and more
        until about settle_seconds of replays have run (SETTLE_SECONDS)."""
        self.graph, self.calls, self.clocks = graph, calls, clocks
        self.per_call: list[float] = []
        self.slowed_rounds = 0
        self.sm_mhz: list[int] = []
        self.cooldown_seconds = cool_down(clocks) if clocks is not None else None
        first = time_replay(graph)
        for _ in range(metrics.settle_replays(first, settle_seconds, WARMUP_REPLAYS) - 1):
            graph.replay()
        torch.cuda.synchronize()

    def round(self) -> float:
        seconds = time_replay(self.graph) / self.calls
        self.per_call.append(seconds)
        device_clock.advance(seconds)
        if self.clocks is not None:
            self.slowed_rounds += bool(self.clocks.slowdown())
            self.sm_mhz.append(self.clocks.sm_mhz())
        return seconds

    def median(self) -> float:
        return statistics.median(self.per_call)


def copy_gbps(nbytes: int = 2**30, rounds: int = 10, device: torch.device | int | None = None) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read plus bytes written), median over rounds.

    A 1 GiB buffer is many times any L2, so this is DRAM bandwidth: the roofline the GB/s columns are read
    against.
    """
    dev = torch.device("cuda", device if isinstance(device, int) else torch.cuda.current_device()) \
        if not isinstance(device, torch.device) else device
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(dev)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e9
