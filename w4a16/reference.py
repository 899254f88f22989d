"""The independent reference: dequantize from the layout spec and multiply in fp32. Never calls a kernel.

Every kernel test compares against this; it is written from the layout description in `layout.py`
(unpack, subtract the zero point, multiply by the group's scale) and shares no code with any kernel.
"""

from __future__ import annotations

import torch

from .layout import QuantizedWeight, unpack_int4


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - z) * s as a [N, K] tensor, computed in fp32 (float64 when `dtype` is float64) and returned in `dtype`."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    q = unpack_int4(qw.qweight).to(work)
    z = qw.zero_points().to(work).repeat_interleave(qw.group_size, dim=1)
    s = qw.scales.to(work).repeat_interleave(qw.group_size, dim=1)
    return ((q - z) * s).to(dtype)


def check_gemm_args(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> None:
    """Argument checks shared by every GEMM entry point (reference and kernels alike)."""
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a QuantizedWeight, got {type(qw).__name__}")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a float16, bfloat16 or float32 tensor, got {got}")
    if x.dim() < 1 or x.shape[-1] != qw.k:
        raise ValueError(f"x's last dim must equal K={qw.k}, got x of shape {tuple(x.shape)}")
    if x.device != qw.device:
        raise ValueError(f"x is on {x.device} but the weight is on {qw.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (qw.n,):
            got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"bias must be a tensor of shape [N] = [{qw.n}], got {got}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")


def reference_gemm(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                   accumulate: torch.dtype = torch.float32) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [..., K] -> [..., N] in x's dtype, accumulated in `accumulate`.

    float32 is the reference every kernel is compared with. float64 is a second, more exact computation of the same
    result: the accuracy gate uses it to measure how far rounding alone moves a model's outputs."""
    if accumulate not in (torch.float32, torch.float64):
        raise ValueError(f"accumulate must be torch.float32 or torch.float64, got {accumulate}")
    check_gemm_args(x, qw, bias)
    w = dequantize(qw, accumulate)  # exact in float64; in fp32 too where the scales are 16-bit
    y = x.to(accumulate) @ w.t()
    if bias is not None:
        y = y + bias.to(accumulate)
    return y.to(x.dtype)
