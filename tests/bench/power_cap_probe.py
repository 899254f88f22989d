"""How long an NVIDIA GPU's power-cap slowdown outlasts a heavy load (the figures behind w4a16.bench.timing's wait).

    PYTHONPATH=$PWD python3 tests/bench/power_cap_probe.py [--rounds 4] [--heavy-seconds 1.0]

Each round runs bf16 8192^3 matmuls for --heavy-seconds, then for 2 s either idles or runs a decode-sized load
(F.linear of 4 x 4096 activations on a 28672 x 4096 weight), alternating, and reads NVML every ~5 ms: when the
"SW power cap" reason was last set, and the SM clock and board power at a few points after the load. Needs a CUDA
GPU and nvidia-ml-py (pynvml).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from w4a16.bench import timing


def at(trace: list[tuple], seconds: float, field: int):
    """Field `field` of the first sample taken at least `seconds` after the load."""
    return next(sample[field] for sample in trace if sample[0] >= seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--heavy-seconds", type=float, default=1.0)
    args = parser.parse_args()
    import pynvml

    pynvml.nvmlInit()
    handle = timing.nvml_handle(pynvml, torch.cuda.current_device())
    print(torch.cuda.get_device_name(), pynvml.nvmlDeviceGetUUID(handle))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16)
    for r in range(args.rounds):
        mode = "idle" if r % 2 == 0 else "decode load"
        start = time.monotonic()
        while time.monotonic() - start < args.heavy_seconds:
            for _ in range(10):
                a @ a
            torch.cuda.synchronize()
        t0, trace = time.monotonic(), []
        while time.monotonic() - t0 < 2.0:
            if mode == "idle":
                time.sleep(0.005)
            else:
                for _ in range(20):
                    F.linear(x, w)
                torch.cuda.synchronize()
            reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
            trace.append((time.monotonic() - t0, bool(reasons & timing.SW_POWER_CAP),
                          pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                          pynvml.nvmlDeviceGetPowerUsage(handle) / 1000))
        last_cap = max((t for t, cap, _, _ in trace if cap), default=None)

        print(f"{mode:11s}: power cap last set {'never' if last_cap is None else f'{last_cap:.2f} s'} after the load; "
              "SM MHz at 0.1 / 0.3 / 0.6 / 1.0 s: " + " / ".join(str(at(trace, s, 2)) for s in (0.1, 0.3, 0.6, 1.0))
              + f"; board W at 0.1 / 0.5 s: {at(trace, 0.1, 3):.0f} / {at(trace, 0.5, 3):.0f}")


if __name__ == "__main__":
    main()
