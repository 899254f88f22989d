"""`python -m w4a16 info`: what this machine is and which backends can run here."""

from __future__ import annotations

import argparse
import hashlib
import platform
from pathlib import Path

import torch

from .arch import arch

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("w4a16", "csrc")
SOURCE_SUFFIXES = (".py", ".json", ".h", ".cuh", ".cu", ".cpp")


def source_digest(root: Path = REPO_ROOT) -> str:
    """12 hex digits of a SHA-256 over the sources that decide what the kernels compute and how fast: the path and
    bytes of every .py, .json, .h, .cuh, .cu and .cpp file under w4a16/ and csrc/, in path order.

    Stored benchmark runs record it beside the git commit, because a copy of the tree on a GPU machine may carry a
    stale .git (a stored run once named the commit its copy was first made from, not the one it measured)."""
    digest = hashlib.sha256()
    for directory in SOURCE_DIRS:
        for path in sorted((root / directory).rglob("*")):
            if path.suffix in SOURCE_SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                digest.update(path.relative_to(root).as_posix().encode() + b"\0")
                digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def _version(module_name: str) -> str:
    try:
        module = __import__(module_name)
    except Exception as exc:  # a broken install is reported, not raised
        return f"not importable ({type(exc).__name__}: {exc})"
    return getattr(module, "__version__", "unknown")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options yet


def run(args: argparse.Namespace) -> int:
    del args
    name = arch()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    backend_build = f"ROCm {torch.version.hip}" if getattr(torch.version, "hip", None) else (
        f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU")
    print(f"arch     {name}")
    print(f"device   {device}")
    print(f"python   {platform.python_version()}")
    print(f"torch    {torch.__version__} ({backend_build})")
    print(f"triton   {_version('triton')}")
    print(f"sources  {source_digest()} (w4a16/ and csrc/ under {REPO_ROOT})")
    _print_backends(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    return 0


def _print_backends(device: torch.device) -> None:
    """Each backend's availability on `device`, then what "auto" picks at a few M (K = N = 4096)."""
    from . import dispatch

    dtypes = (torch.float16, torch.bfloat16)
    print(f"backends on {device} (fp16 / bf16):")
    for backend in dispatch.BACKENDS[1:]:
        reasons = [dispatch.unavailable_reason(backend, device, dtype) for dtype in dtypes]
        if reasons[0] == reasons[1]:
            print(f"  {backend:<14} {reasons[0] or 'usable'}")
        else:
            for dtype, reason in zip(dtypes, reasons, strict=True):
                print(f"  {backend:<14} {str(dtype).removeprefix('torch.')}: {reason or 'usable'}")
    for dtype in dtypes:
        print(f"rule ({str(dtype).removeprefix('torch.')}): {dispatch.describe_rule(device, dtype)}")
    # Either side of this arch's skinny edge, then a prefill size each side of the dequant_blas threshold.
    edge = dispatch.rules(arch(device)).skinny_max_m or 5
    ms = (1, edge, edge + 1, 128, 2048)
    print("auto picks at K=N=4096:  " + "  ".join(f"M={m}" for m in ms))
    for dtype in dtypes:
        picks = [dispatch.choose_backend(m, 4096, 4096, dtype, device) for m in ms]
        print(f"  {str(dtype).removeprefix('torch.'):<9} " + "  ".join(picks))
