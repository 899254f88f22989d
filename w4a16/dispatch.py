"""The hybrid GEMM entry point: route each call to the skinny kernel, the Triton kernel or the reference."""

from __future__ import annotations

import torch

from .layout import QuantizedWeight
from .reference import check_gemm_args, reference_gemm

BACKENDS = ("auto", "reference")


def gemm(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [..., K] -> [..., N] in x's dtype."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_gemm_args(x, qw, bias)
    return reference_gemm(x, qw, bias)
