"""Test helpers: the tolerance rule, random data, and skips that CI turns into failures."""

from __future__ import annotations

import contextlib
import importlib
import math
import os

import pytest
import torch

import w4a16
from w4a16.reference import dequantize

IN_CI = os.environ.get("CI", "").lower() == "true"

# Relative floor per activation dtype: one unit in the last place, relative to the largest output. On cases with a
# few outputs, torch's own error is a small sample, and the skinny kernel measured 1.5 ulp on an fp16 output of 2
# (M = 2, N = 1, K = 4160, on the H200): an eighth of an ulp failed it there.
RELATIVE_FLOOR = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-20}
# The tolerance rule: the kernel may be at most this many times worse than torch's own matmul in the
# activation dtype on the same dequantized weights (both measured against the fp32 reference).
TORCH_ERROR_FACTOR = 2.0


def require_tool(available: bool, reason: str) -> None:
    """Skip when a build tool is missing, except under CI=true, where a missing tool is a failure."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"CI=true and a required tool is missing: {reason}")
    pytest.skip(reason)


def require_module(name: str, reason: str):
    """pytest.importorskip, except under CI=true, where a module the test extras install is missing from a broken
    install and that is a failure. Works at module level too."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if IN_CI:
            pytest.fail(f"CI=true and {name} is not importable ({exc}): {reason}", pytrace=False)
        pytest.skip(f"{name} is not importable: {reason}", allow_module_level=True)


def random_weight(n: int, k: int, group_size: int, symmetric: bool, dtype: torch.dtype, device="cpu",
                  generator: torch.Generator | None = None) -> w4a16.QuantizedWeight:
    """A random QuantizedWeight with every nibble and zero-point value in play, and scales of both signs, none
    zero (no format forbids a negative scale, and a kernel that took a scale's magnitude would be wrong)."""
    q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int32)
    groups = k // group_size
    sign = torch.randint(0, 2, (n, groups), generator=generator) * 2 - 1
    scales = ((torch.rand(n, groups, generator=generator) * 0.02 + 0.002) * sign).to(dtype)
    zeros = None if symmetric else torch.randint(0, 16, (n, groups), generator=generator, dtype=torch.uint8)
    return w4a16.QuantizedWeight(w4a16.pack_int4(q), scales, zeros, group_size).to(device)


_torch_empty = torch.empty


def nan_empty(*size, **kwargs) -> torch.Tensor:
    """torch.empty whose floating-point results are NaN: monkeypatched over torch.empty, it shows a kernel that
    reads a workspace it was meant to write first (whatever the allocator would have reused)."""
    tensor = _torch_empty(*size, **kwargs)
    return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor


def random_activation(m: int, k: int, dtype: torch.dtype, device="cpu",
                      generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.randn(m, k, generator=generator).to(dtype=dtype, device=device)


@contextlib.contextmanager
def full_precision_reductions():
    """torch's fp16 and bf16 GPU matmuls with every reduction in fp32. By default cuBLAS may reduce split-K
    partials in the 16-bit dtype, which makes the plain matmul of the tolerance rule less accurate than it has to be
    and so loosens the bound on the kernel under test."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_fp16_reduced_precision_reduction = matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = saved


def plain_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The tolerance rule's yardstick: torch's own matmul in x's dtype on the dequantized weight (+ bias)."""
    with full_precision_reductions():
        y = torch.matmul(x, w.t())
    return y if bias is None else y + bias.to(x.dtype)


def assert_matches_reference(out: torch.Tensor, x: torch.Tensor, qw: w4a16.QuantizedWeight,
                             bias: torch.Tensor | None = None) -> None:
    """Check `out` against the fp32 reference with the tolerance rule; report counts and first indices."""
    assert out.dtype == x.dtype, f"output dtype {out.dtype} != activation dtype {x.dtype}"
    expected_shape = (*x.shape[:-1], qw.n)
    assert tuple(out.shape) == expected_shape, f"output shape {tuple(out.shape)} != {expected_shape}"
    ref = w4a16.reference_gemm(x.to(torch.float32), qw.to(dtype=torch.float32),
                               None if bias is None else bias.to(torch.float32))
    plain = plain_matmul(x, dequantize(qw, x.dtype), bias)
    plain_err = (plain.to(torch.float32) - ref).abs().max().item() if ref.numel() else 0.0
    assert math.isfinite(plain_err), (
        f"torch's {x.dtype} matmul overflows on this case (largest reference output {ref.abs().max().item():.3g}): "
        "the case is outside the dtype's range and proves nothing")
    bound = TORCH_ERROR_FACTOR * plain_err + RELATIVE_FLOOR[x.dtype] * ref.abs().max().item()
    err = (out.to(torch.float32) - ref).abs()
    bad = ~(err <= bound) | ~torch.isfinite(out)  # NaN compares false; inf never passes either
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} outputs off by more than {bound:.3g} "
            f"(torch {x.dtype} matmul error {plain_err:.3g}); max error {err.nan_to_num(float('inf')).max().item():.3g}; "
            f"first at {idx}: got {[out[tuple(i)].item() for i in idx]}, want {[ref[tuple(i)].item() for i in idx]}"
        )
