"""The skinny split-K decode kernel (csrc/), loaded lazily as `torch.ops.w4a16.skinny_gemm`.

Nothing is built or loaded at import. The first call looks for the library that `nox -s build` (or
`python -m w4a16.skinny_build`) left in the build cache for this torch, these GPUs and these sources, and loads it;
with W4A16_SKINNY_AUTOBUILD=1 it builds it instead. `unavailable_reason` says why the kernel cannot run (and how
to build it); `limits(arch)` gives the per-architecture row and staging limits without a GPU or a build, read from
the one table in csrc/portability.h.
"""

from __future__ import annotations

import functools
import os
import re

import torch

from . import skinny_build
from .arch import arch as device_arch
from .arch import normalize_arch
from .layout import QuantizedWeight
from .reference import check_gemm_args

_TABLE_ROW = re.compile(r"^\s*ROW\((\w+),\s*(\d+),\s*(\d+),\s*(\d+)\)", re.M)
_DTYPES = (torch.float16, torch.bfloat16)
BUILD_HINT = ("build it with `nox -s build` (or `python -m w4a16.skinny_build`), then start a new process (this "
              "answer is kept for the process's life)")


@functools.cache
def arch_table() -> dict[str, tuple[int, int, int]]:
    """csrc/portability.h's W4A16_ARCH_TABLE: arch -> (max_rows, staging_elements, hw_shared_bytes)."""
    text = (skinny_build.CSRC / "portability.h").read_text()
    rows = {name: (int(r), int(e), int(b)) for name, r, e, b in _TABLE_ROW.findall(text)}
    unread = [line.strip() for line in text.splitlines() if line.lstrip().startswith("ROW(") and not _TABLE_ROW.match(line)]
    if unread:  # a row this parser skipped would silently fall back to the generic row
        raise RuntimeError(f"csrc/portability.h: W4A16_ARCH_TABLE rows Python cannot read: {unread} (write each as "
                           "ROW(name, rows, elements, bytes) with decimal literals)")
    if "generic" not in rows:
        raise RuntimeError("csrc/portability.h: W4A16_ARCH_TABLE has no 'generic' row")
    return rows


def limits(arch: str) -> tuple[int, int]:
    """(max_rows, staging_elements) for a normalised arch name; unknown GPUs get the generic row.

    The kernel takes 1..max_rows activation rows, and M * K must not exceed staging_elements.
    """
    rows = arch_table()
    name = arch if arch in rows else normalize_arch(arch)
    max_rows, elements, _ = rows.get(name, rows["generic"])
    return max_rows, elements


@functools.cache
def _load() -> str | None:
    """Load the extension once; None on success, else the reason it is unavailable."""
    if _registered():
        return None
    archs = skinny_build.device_archs()
    if not archs:
        return "no GPU is visible to torch"
    try:
        library = skinny_build.library_path(archs)
        if library.exists():
            torch.ops.load_library(str(library))
        elif os.environ.get("W4A16_SKINNY_AUTOBUILD") == "1":
            skinny_build.build()
        else:
            return f"the skinny extension is not built for {', '.join(archs)} (expected {library}): {BUILD_HINT}"
    except Exception as exc:  # a broken build or toolchain: report it, the caller falls back
        return f"loading the skinny extension failed ({type(exc).__name__}: {exc}); rebuild: {BUILD_HINT}"
    return None if _registered() else f"the skinny extension loaded but registered no op; rebuild: {BUILD_HINT}"


def _registered() -> bool:
    try:
        torch.ops.w4a16.skinny_gemm.default  # noqa: B018 - attribute lookup raises when the op is missing
        return True
    except (AttributeError, RuntimeError):
        return False


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the skinny kernel can run on `device` for activations of `dtype`; otherwise why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the skinny kernel runs on CUDA/ROCm GPUs, not on {device.type}"
    if dtype not in _DTYPES:
        return f"the skinny kernel takes float16 or bfloat16 activations, got {dtype}"
    if not torch.cuda.is_available():
        return f"this torch ({torch.__version__}) has no usable GPU"
    return _load()


def device_limits(device: torch.device | None = None) -> tuple[int, int]:
    """(max_rows, staging_elements) for a GPU, from the same table (no build needed)."""
    return limits(device_arch(device))


def skinny_gemm(x2d: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, *,
                cluster_blocks: int = 0) -> torch.Tensor:
    """y[M, N] = x2d[M, K] @ dequant(qw)^T (+ bias) with the skinny kernel; M in 1..max_rows, M * K within staging.

    cluster_blocks: how many blocks (one thread-block cluster, NVIDIA sm_90+) split the K of each row range: 1, 2
    or 4, or 0 to choose from the shape (the default; tests and benchmarks pin it).

    Raises RuntimeError (with the reason and how to build) when the kernel is unavailable, and ValueError /
    TypeError for arguments it does not take.
    """
    check_gemm_args(x2d, qw, bias)
    if x2d.dim() != 2:
        raise ValueError(f"x2d must be 2-D [M, K], got shape {tuple(x2d.shape)}")
    reason = unavailable_reason(x2d.device, x2d.dtype)
    if reason:
        raise RuntimeError(f"skinny kernel unavailable: {reason}")
    return torch.ops.w4a16.skinny_gemm(x2d, qw.qweight, qw.scales, qw.zeros, bias, qw.group_size, cluster_blocks)
