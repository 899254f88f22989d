"""One rejected skinny-kernel call (M = max_rows + 1), for a debugger backtrace when the error path misbehaves."""

import torch

import w4a16
from w4a16 import skinny

assert skinny.unavailable_reason(torch.device("cuda"), torch.float16) is None
qw = w4a16.QuantizedWeight(torch.zeros(8, 8, dtype=torch.int32, device="cuda"),
                           torch.ones(8, 2, dtype=torch.float16, device="cuda"), None, 32)
too_many_rows = skinny.device_limits()[0] + 1
try:
    torch.ops.w4a16.skinny_gemm(torch.ones(too_many_rows, 64, dtype=torch.float16, device="cuda"), qw.qweight,
                                qw.scales, None, None, 32)
except ValueError as exc:
    print("rejected as expected:", exc)
