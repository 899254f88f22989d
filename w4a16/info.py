"""`python -m w4a16 info`: what this machine is and which backends can run here."""

from __future__ import annotations

import argparse
import platform

import torch

from .arch import arch


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
    print("backends reference: usable (pure torch)")
    return 0
