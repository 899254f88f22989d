"""The Triton prefill path: a fused-dequant GEMM (`triton_gemm`) and dequantize + vendor GEMM (`dequant_blas_gemm`).

Import-light: triton and the kernels load on first use. Tile tables: `configs/<arch>.json`, selected in configs.py.
On CPU the kernels run under the Triton interpreter, which needs TRITON_INTERPRET=1 in the environment before the
kernel modules are first imported (triton.jit reads it at decoration time).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..arch import arch as _arch
from ..layout import QuantizedWeight
from ..reference import check_gemm_args
from .configs import INT32_MAX as _INT32_MAX

_DTYPES = (torch.float16, torch.bfloat16)


def _kernel_module():
    from . import gemm_kernel

    return gemm_kernel


@functools.cache
def _interpreting() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kernel_module().w4a16_gemm_kernel, InterpretedFunction)


def unavailable_reason(device: torch.device | str, route: str = "triton",
                       dtype: torch.dtype | None = None) -> str | None:
    """None when the route's Triton kernels ("triton": the table's GEMM kernels; "dequant_blas": the
    dequantization kernel) can run on `device` (for activations of `dtype`, where given); otherwise why not (for
    dispatch and skips)."""
    device = torch.device(device)
    try:
        interpreting = _interpreting()
    except Exception as exc:  # a missing or broken triton is a reason, not a crash
        return f"triton is not importable: {type(exc).__name__}: {exc}"
    if device.type == "cpu":
        if not interpreting:
            return ("the Triton kernel runs on CPU only under the interpreter: set TRITON_INTERPRET=1 before "
                    "w4a16.triton's kernels are imported")
        if dtype == torch.bfloat16:
            return "the Triton interpreter computes bfloat16 wrong (an upstream limitation): bfloat16 needs a GPU"
        return None
    if device.type == "cuda":
        if interpreting:
            return "TRITON_INTERPRET=1 was set when the kernels were imported: the GPU path is off in this process"
        return _wgmma_reason(device) if route == "triton" else None
    return f"no Triton backend for device type {device.type!r}"


def index_limit_reason(m: int, n: int, k: int, route: str) -> str | None:
    """Why a call is too large for a route's 32-bit offsets (None if it fits). The fused kernels index x [M, K],
    y [M, N] and W [N, K]; dequant_blas indexes only W (its matmul is torch's), so it takes any M."""
    sizes = {"M*K": m * k, "M*N": m * n, "N*K": n * k} if route == "triton" else {"N*K": n * k}
    for what, elements in sizes.items():
        if elements > _INT32_MAX:
            return f"{what}={elements} exceeds the kernel's 32-bit indexing (2^31 - 1)"
    return None


def _wgmma_reason(device: torch.device) -> str | None:
    """Where the device's tile table selects the wgmma kernel (sm_90), why that kernel cannot run here, if it
    cannot: every call the table routes to it would fail."""
    from .configs import load_table

    if not any(config.kernel == "wgmma" for config in load_table(table_arch(device)).all_configs()):
        return None
    try:
        from .wgmma_kernel import unsupported_reason
    except ImportError as exc:
        import triton

        return (f"the {table_arch(device)} tile table selects the wgmma kernel, which needs triton's Gluon (triton "
                f">= 3.6; this is triton {triton.__version__}): {exc}")
    return unsupported_reason(device)


def _validate(x2d: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
              route: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Checks shared by both routes ("triton", "dequant_blas"); returns x2d with unit stride along K and a
    contiguous bias."""
    name = f"{route}_gemm"
    check_gemm_args(x2d, qw, bias)
    if x2d.dim() != 2:
        raise ValueError(f"{name}: x2d must be 2-D [M, K], got shape {tuple(x2d.shape)}")
    if x2d.dtype not in _DTYPES:
        raise TypeError(f"{name}: x must be float16 or bfloat16, got {x2d.dtype}")
    if qw.scales.dtype != x2d.dtype:
        raise TypeError(f"{name}: scales dtype {qw.scales.dtype} must equal x's dtype {x2d.dtype} "
                        f"(convert once with qw.to(dtype={x2d.dtype}))")
    m, k = x2d.shape
    too_large = index_limit_reason(m, qw.n, k, route)
    if too_large is not None:
        raise ValueError(f"{name}: {too_large}")
    reason = unavailable_reason(x2d.device, route, x2d.dtype)
    if reason is not None:
        raise RuntimeError(f"{name}: {reason}")
    if bias is not None:
        bias = bias.contiguous()
    # The kernels index x as row * stride + column in 32 bits: a row stride past K may overflow where M * K did not.
    strided_past_int32 = m > 1 and (m - 1) * x2d.stride(0) + k > _INT32_MAX
    return (x2d if x2d.stride(1) == 1 and not strided_past_int32 else x2d.contiguous()), bias


def _on(device: torch.device):
    """Makes `device` current for a launch: Triton launches on the current device and its stream, not on that of
    the tensors (a model split over GPUs calls layers on cuda:1 while cuda:0 is current)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@functools.cache
def table_arch(device: torch.device) -> str:
    """The tile table's arch for `device` (the interpreter on CPU uses the generic table)."""
    name = _arch(device)
    return "generic" if name == "cpu" else name


def triton_gemm(x2d: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x2d @ dequant(W)^T (+ bias) with the fused kernel: x2d [M, K] fp16/bf16 -> [M, N] in x's dtype."""
    from .configs import select_config

    x2d, bias = _validate(x2d, qw, bias, "triton")
    m = x2d.shape[0]
    if m == 0:
        return x2d.new_empty((0, qw.n))
    config = select_config(table_arch(x2d.device), m, qw.n, qw.k, qw.group_size)
    with _on(x2d.device):
        return _kernel_module().launch_gemm(x2d, qw, bias, config)


def dequant_blas_gemm(x2d: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `triton_gemm`, by dequantizing W into a reused workspace and calling torch.matmul.

    Extra memory: one N*K workspace in x's dtype per device and dtype, kept between calls."""
    from .dequant_blas import launch_dequant_blas

    x2d, bias = _validate(x2d, qw, bias, "dequant_blas")
    if x2d.shape[0] == 0:
        return x2d.new_empty((0, qw.n))
    with _on(x2d.device):
        return launch_dequant_blas(x2d, qw, bias)


__all__ = ["dequant_blas_gemm", "index_limit_reason", "triton_gemm", "unavailable_reason"]
