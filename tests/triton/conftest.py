"""Triton tests run the real kernels on a GPU and the Triton interpreter on CPU.

triton.jit reads TRITON_INTERPRET when a kernel module is first imported, so it is set here, at collection, before
any test imports w4a16.triton's kernels (w4a16.triton itself imports them lazily). The ahead-of-time compile tests
need real JIT functions and run in a subprocess without it (see test_aot.py).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
