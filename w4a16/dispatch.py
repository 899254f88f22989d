"""The hybrid GEMM entry point: route each call to the skinny kernel, the Triton kernel, dequant + BLAS, or the reference.

The rule, for x flattened to M rows of K:

    skinny        if the skinny op runs on this device and dtype, 1 <= M <= skinny_max_m (lower for a weight
                  shape measured apart) and K * M fits the kernel's on-chip staging (skinny_staging_elements)
    dequant_blas  else, if the route exists for this device and the arch's table sets dequant_blas_min_m <= M
                  (the table's entry for this weight's exact (N, K) where it has one), or if the call is past
                  the fused kernel's 32-bit offsets (M * N or M * K >= 2^31; dequant_blas takes any M)
    triton        else, if the Triton kernel runs on this device
    reference     otherwise (CPU, fp32 activations, no GPU kernel for the device)

The per-arch numbers have one owner each and are only read here: `w4a16.skinny.limits(arch)` gives
(skinny_max_m, skinny_staging_elements), the same constants its host check and device code use;
`dispatch_rules.json` lowers skinny_max_m where the skinny kernel measured slower than the Triton kernel (per arch,
and per weight shape); the Triton table
`w4a16/triton/configs/<arch>.json` gives `dequant_blas_min_m` (absent or null: the route is never chosen
automatically) and its per-shape `dequant_blas_overrides`. `rules(arch)` collects them and `decide(...)` is the pure
decision, testable on any machine.

The op is registered with torch.library as `w4a16::gemm` (tensors only, a fake implementation for tracing), so it
works under torch.compile(fullgraph=True) and inside CUDA-graph capture: nothing in the call path synchronises
with the device. The kernels read scales and bias in the activation dtype; `gemm` refuses a mismatch (with the
fix in the message) instead of casting per call, and `W4A16Linear` keeps them in its dtype.
"""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from .arch import arch
from .layout import QuantizedWeight, check_group_size
from .reference import check_gemm_args, dequantize, reference_gemm

# "reference_fp64": the reference accumulated in float64, never chosen by "auto" (the accuracy gate's control).
BACKENDS = ("auto", "skinny", "triton", "dequant_blas", "reference", "reference_fp64")
REFERENCES = ("reference", "reference_fp64")
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class DispatchRules:
    """The per-arch numbers of the hybrid rule (read from their owners by `rules`)."""

    arch: str
    skinny_max_m: int  # most activation rows "auto" sends to the skinny kernel (0: no skinny kernel here)
    skinny_staging_elements: int  # bound on K * M, the activation elements staged in shared memory / LDS
    dequant_blas_min_m: int | None  # dequant + BLAS from this M up; None: never chosen by "auto"
    skinny_kernel_rows: int | None = None  # most rows the kernel itself takes when forced (None: skinny_max_m)
    # {(N, K): dequant_blas_min_m for that weight shape}, where the tuner measured a crossover of its own
    dequant_blas_overrides: dict[tuple[int, int], int | None] = field(default_factory=dict)
    # {(N, K): skinny_max_m for that weight shape}, where the skinny kernel measured slower below skinny_max_m
    skinny_max_m_overrides: dict[tuple[int, int], int] = field(default_factory=dict)

    @property
    def skinny_rows(self) -> int:
        return self.skinny_max_m if self.skinny_kernel_rows is None else self.skinny_kernel_rows

    def dequant_blas_from(self, n: int, k: int) -> int | None:
        """The M from which "auto" sends an [N, K] weight to dequant_blas (None: never)."""
        return self.dequant_blas_overrides.get((n, k), self.dequant_blas_min_m)

    def skinny_max_m_for(self, n: int, k: int) -> int:
        """The most rows "auto" sends to the skinny kernel for an [N, K] weight."""
        return min(self.skinny_max_m, self.skinny_max_m_overrides.get((n, k), self.skinny_max_m))

    def skinny_takes(self, m: int, k: int) -> bool:
        """Whether the skinny kernel can run M rows of K at all (a forced call): its own row and staging limits."""
        return 1 <= m <= self.skinny_rows and k * m <= self.skinny_staging_elements

    def skinny_fits(self, m: int, n: int, k: int) -> bool:
        """Whether "auto" sends M rows of K times an [N, K] weight to the skinny kernel."""
        return m <= self.skinny_max_m_for(n, k) and self.skinny_takes(m, k)


# ---------------------------------------------------------------------------------------------------------------
# The backend modules, imported lazily: `import w4a16` must not import triton or load the C++ extension.


def _module(name: str) -> tuple[ModuleType | None, str | None]:
    try:
        return importlib.import_module(name), None
    except ImportError as exc:
        return None, f"{name} is not importable ({type(exc).__name__}: {exc})"


@functools.cache
def rules(arch_name: str) -> DispatchRules:
    """The dispatch numbers for a normalised arch name, read from the skinny module and the Triton table."""
    max_m, staging = 0, 0
    skinny, _ = _module("w4a16.skinny")
    if skinny is not None and arch_name != "cpu":
        try:
            max_m, staging = (int(v) for v in skinny.limits(arch_name))
        except (KeyError, ValueError):  # no skinny build for this arch: the route is off
            max_m, staging = 0, 0
    measured = _measured_skinny_max_m().get(arch_name, {})
    auto_max_m = min(max_m, measured.get("skinny_max_m", max_m))
    skinny_by_shape = {(o["n"], o["k"]): o["skinny_max_m"] for o in measured.get("shape_overrides", [])}
    min_m, by_shape = _dequant_blas_thresholds(arch_name)
    return DispatchRules(arch_name, auto_max_m, staging, min_m, skinny_kernel_rows=max_m,
                         dequant_blas_overrides=by_shape, skinny_max_m_overrides=skinny_by_shape)


@functools.cache
def _measured_skinny_max_m() -> dict[str, dict]:
    """Per-arch crossovers measured against the Triton kernel (`dispatch_rules.json`): where the skinny kernel
    takes more rows than it wins on, "auto" stops earlier, for the arch or (`shape_overrides`) for one weight
    shape. Absent arch: the kernel's own row limit."""
    return json.loads((Path(__file__).with_name("dispatch_rules.json")).read_text())["archs"]


def _dequant_blas_thresholds(arch_name: str) -> tuple[int | None, dict[tuple[int, int], int | None]]:
    """`dequant_blas_min_m` and `dequant_blas_overrides` of the arch's Triton table (its owner, w4a16.triton,
    measures them with the tuner)."""
    configs, _ = _module("w4a16.triton.configs")
    if configs is None or arch_name == "cpu":
        return None, {}
    return configs.dequant_blas_min_m(arch_name), configs.dequant_blas_overrides(arch_name)


def decide(m: int, n: int, k: int, rules: DispatchRules, *, skinny: bool, triton: bool, dequant_blas: bool) -> str:
    """The hybrid rule for M rows of K times an [N, K] weight, given which backends can run this call (pure: no
    device, no imports). dequant_blas also takes what the fused kernel cannot (a call past its 32-bit offsets)."""
    if skinny and rules.skinny_fits(m, n, k):
        return "skinny"
    min_m = rules.dequant_blas_from(n, k)
    if dequant_blas and (not triton or (min_m is not None and m >= min_m)):
        return "dequant_blas"
    if triton:
        return "triton"
    return "reference"


def _uncached_unavailable_reason(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    if backend in REFERENCES:
        return None
    if dtype not in KERNEL_DTYPES:
        return f"the {backend} kernel takes float16 or bfloat16 activations, got {dtype}"
    name = "w4a16.skinny" if backend == "skinny" else "w4a16.triton"
    module, reason = _module(name)
    if module is None:
        return reason
    if backend == "skinny":
        return module.unavailable_reason(device, dtype)
    return module.unavailable_reason(device, backend, dtype)


@functools.cache
def _cached_unavailable_reason(backend: str, device: torch.device, dtype: torch.dtype) -> str | None:
    return _uncached_unavailable_reason(backend, device, dtype)


def unavailable_reason(backend: str, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """None when `backend` can run on `device` for activations of `dtype`, else why not (one sentence)."""
    if backend not in BACKENDS or backend == "auto":
        raise ValueError(f"backend must be one of {BACKENDS[1:]}, got {backend!r}")
    device = torch.device(device)
    # GPU answers cannot change within a process (the extension loads or not); CPU answers may depend on
    # TRITON_INTERPRET, so they are not cached.
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"no usable GPU: torch {torch.__version__} sees none"
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return _cached_unavailable_reason(backend, device, dtype)
    return _uncached_unavailable_reason(backend, device, dtype)


@functools.cache
def _device_arch(device: torch.device) -> str:
    return arch(device)


def choose_backend(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device | str) -> str:
    """The backend "auto" uses for M rows of K times an [N, K] weight on `device` (CPU, or no kernel for it:
    "reference")."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "reference"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    available = {b: unavailable_reason(b, device, dtype) is None for b in ("skinny", "triton", "dequant_blas")}
    for route in ("triton", "dequant_blas"):  # and whether the call fits the route's 32-bit offsets
        if available[route]:
            available[route] = importlib.import_module("w4a16.triton").index_limit_reason(m, n, k, route) is None
    return decide(m, n, k, rules(_device_arch(device)), **available)


def describe_rule(device: torch.device | str, dtype: torch.dtype = torch.float16) -> str:
    """One line naming what "auto" does on `device`, for reprs and `python -m w4a16 info`."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"reference on {device.type}" + ("" if device.type != "cuda" else " (torch sees no GPU)")
    r = rules(_device_arch(device if device.index is not None else torch.device("cuda", torch.cuda.current_device())))
    parts = []
    if unavailable_reason("skinny", device, dtype) is None and r.skinny_max_m:
        apart = len(r.skinny_max_m_overrides)
        shapes = f"; {apart} weight shape{'s' * (apart > 1)} measured apart" if apart else ""
        parts.append(f"skinny for M <= {r.skinny_max_m} (K*M <= {r.skinny_staging_elements}{shapes})")
    triton, blas = (unavailable_reason(b, device, dtype) is None for b in ("triton", "dequant_blas"))
    if blas and triton:  # as decide(): dequant_blas from its crossover, else the fused kernel
        tuned = len(r.dequant_blas_overrides)
        apart = f"{tuned} weight shape{'s' * (tuned > 1)} tuned apart" if tuned else ""
        if r.dequant_blas_min_m is not None:
            parts.append(f"dequant_blas for M >= {r.dequant_blas_min_m}" + (f" ({apart})" if apart else ""))
        elif apart:
            parts.append(f"dequant_blas for {apart}")
    parts.append("triton otherwise" if triton else "dequant_blas otherwise" if blas else "reference otherwise")
    return f"{r.arch}: " + ", ".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# Argument checks and the call into a backend.


def _weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int) -> QuantizedWeight:
    """A QuantizedWeight over tensors that already passed its checks (a W4A16Linear's buffers, a gemm's qw).

    Skips the constructor's value checks (zero points in 0..15), which read the data back to the host: that would
    synchronise every call and break CUDA-graph capture.
    """
    qw = object.__new__(QuantizedWeight)
    qw.qweight, qw.scales, qw.zeros, qw.group_size = qweight, scales, zeros, group_size
    return qw


def _check_call(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, backend: str) -> None:
    """Metadata-only checks (shapes, dtypes, devices): they run unchanged on fake tensors while tracing."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if qw.qweight.dim() != 2 or qw.scales.dim() != 2:  # before anything reads N or K from their shapes
        raise ValueError(f"qweight [N, K // 8] and scales [N, K // G] must be 2-D, got shapes "
                         f"{tuple(qw.qweight.shape)} and {tuple(qw.scales.shape)}")
    check_gemm_args(x, qw, bias)
    check_group_size(qw.group_size)
    for name, tensor in (("qweight", qw.qweight), ("scales", qw.scales), ("zeros", qw.zeros)):
        if tensor is not None and tensor.device != x.device:  # the op skips QuantizedWeight's own device check
            raise ValueError(f"{name} is on {tensor.device} but x is on {x.device}")
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernels index it as a dense row-major array), got "
                             f"strides {tuple(tensor.stride())} for shape {tuple(tensor.shape)}")
    if qw.qweight.dtype != torch.int32 or tuple(qw.qweight.shape) != (qw.n, qw.k // 8):
        raise ValueError(f"qweight must be int32 [N, K // 8], got {qw.qweight.dtype} {tuple(qw.qweight.shape)}")
    if qw.k % qw.group_size or tuple(qw.scales.shape) != (qw.n, qw.k // qw.group_size):
        raise ValueError(
            f"scales must have shape [N, K // G] = [{qw.n}, {qw.k // qw.group_size}] for group_size={qw.group_size}, "
            f"got {tuple(qw.scales.shape)}"
        )
    if qw.zeros is not None and (qw.zeros.dtype != torch.uint8 or qw.zeros.shape != qw.scales.shape):
        raise ValueError(f"zeros must be uint8 of the scales' shape {tuple(qw.scales.shape)}, got "
                         f"{qw.zeros.dtype} {tuple(qw.zeros.shape)}")
    if backend in REFERENCES:
        return  # the references compute in fp32 or fp64 and take any float dtypes
    if qw.scales.dtype != x.dtype:
        raise TypeError(
            f"scales are {qw.scales.dtype} but x is {x.dtype}: the kernels read scales in the activation dtype; "
            f"convert the weight once with qw.to(dtype={x.dtype}) (W4A16Linear does this when it is built or cast)"
        )
    if bias is not None and bias.dtype != x.dtype:
        raise TypeError(f"bias is {bias.dtype} but x is {x.dtype}: pass the bias in the activation dtype")


def _check_forced(backend: str, m: int, k: int, x: torch.Tensor) -> None:
    """A forced backend must be able to run this call: otherwise say why, before any launch."""
    reason = unavailable_reason(backend, x.device, x.dtype)
    if reason is not None:
        raise RuntimeError(f"backend={backend!r} is unavailable on {x.device} for {x.dtype}: {reason}")
    if backend == "skinny" and m > 0:
        r = rules(_device_arch(x.device))
        if not r.skinny_takes(m, k):
            raise ValueError(
                f"backend='skinny' takes 1 <= M <= {r.skinny_rows} rows with K*M <= {r.skinny_staging_elements} "
                f"on {r.arch}, got M={m}, K={k} (K*M={k * m}); use backend='auto' to route larger M elsewhere"
            )


def _run(backend: str, x2d: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Call one backend on a contiguous 2-D x. (Tests wrap this to record which backend ran.)"""
    if backend in REFERENCES:
        return reference_gemm(x2d, qw, bias, torch.float64 if backend == "reference_fp64" else torch.float32)
    if backend == "skinny":
        return importlib.import_module("w4a16.skinny").skinny_gemm(x2d, qw, bias)
    module = importlib.import_module("w4a16.triton")
    if backend == "triton":
        return module.triton_gemm(x2d, qw, bias)
    return module.dequant_blas_gemm(x2d, qw, bias)


# ---------------------------------------------------------------------------------------------------------------
# The custom op and its public wrapper.


@torch.library.custom_op("w4a16::gemm", mutates_args=())
def gemm_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """torch.ops.w4a16.gemm: `gemm` on the QuantizedWeight's tensors (qweight, scales, zeros, group_size)."""
    qw = _weight(qweight, scales, zeros, group_size)
    _check_call(x, qw, bias, backend)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, qw.k)
    m = x2d.shape[0]
    if backend != "auto":  # before the empty shortcut: a forced backend that cannot run here says so for any M
        _check_forced(backend, m, qw.k, x)
    if m == 0:
        return x.new_empty((*lead, qw.n))
    # The kernels stream rows of K from 16-byte aligned rows: a strided x, or a contiguous view that starts off a
    # 16-byte boundary (buf[1:].view(...)), is copied once here, and so is a strided bias.
    if not x2d.is_contiguous() or x2d.data_ptr() % 16:
        x2d = x2d.clone(memory_format=torch.contiguous_format)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if backend == "auto":
        backend = choose_backend(m, qw.n, qw.k, x.dtype, x.device)
    return _run(backend, x2d, qw, bias).reshape(*lead, qw.n)


@gemm_op.register_fake
def _gemm_fake(x, qweight, scales, zeros, group_size, bias, backend):
    qw = _weight(qweight, scales, zeros, group_size)
    _check_call(x, qw, bias, backend)
    return x.new_empty((*x.shape[:-1], qw.n))


def _setup_context(ctx, inputs, output):
    _, qweight, scales, zeros, group_size, bias, _ = inputs
    ctx.save_for_backward(qweight, scales, zeros)
    ctx.group_size = group_size
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad):
    """Gradients for x (grad @ dequant(W), in fp32) and bias (grad summed over the rows); the weight is frozen."""
    if ctx.needs_input_grad[2]:
        raise RuntimeError("w4a16.gemm: scales require grad, but the quantized weight is frozen (gradients reach x "
                           "and bias only); detach the scales or train a floating-point copy of the weight")
    qweight, scales, zeros = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        w = dequantize(_weight(qweight, scales, zeros, ctx.group_size), torch.float32)
        grad_x = (grad.to(torch.float32) @ w).to(grad.dtype)
    if ctx.needs_input_grad[5]:
        grad_bias = grad.reshape(-1, grad.shape[-1]).to(torch.float32).sum(0).to(ctx.bias_dtype)
    return grad_x, None, None, None, None, grad_bias, None


gemm_op.register_autograd(_backward, setup_context=_setup_context)


def gemm(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [..., K] -> [..., N] in x's dtype.

    backend: "auto" (the hybrid rule above), or force "skinny", "triton", "dequant_blas", "reference" or
    "reference_fp64" (the reference accumulated in float64) (a forced backend that cannot run here raises, saying
    why). Except for the references, the scales and bias must be in x's dtype (convert once with
    `qw.to(dtype=x.dtype)`).
    """
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a QuantizedWeight, got {type(qw).__name__}")
    return gemm_op(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, bias, backend)
