"""w4a16: 4-bit-weight, 16-bit-activation linear layers.

One packed int4 weight (`QuantizedWeight`, see `w4a16.layout`) feeds two GEMMs: a split-K "skinny" C++ kernel
for decode (small M) and a Triton fused-dequant GEMM for prefill; `gemm` routes each call between them.
"""

from . import formats
from .arch import arch, normalize_arch
from .dispatch import gemm
from .layout import QuantizedWeight, pack_int4, unpack_int4
from .linear import W4A16Linear
from .quantize import quantize
from .reference import dequantize, reference_gemm

__version__ = "0.1.0"

__all__ = [
    "QuantizedWeight",
    "W4A16Linear",
    "arch",
    "dequantize",
    "formats",
    "gemm",
    "normalize_arch",
    "pack_int4",
    "quantize",
    "reference_gemm",
    "unpack_int4",
]
