"""Converters between checkpoint formats and the shared layout, bit-exact both ways.

    AWQ (AutoAWQ GEMM)       qweight [K, N // 8] packed along N, shuffle order; qzeros [K // G, N // 8]
                             likewise (raw zero points); scales [K // G, N].
    GPTQ (AutoGPTQ v1,       qweight [K // 8, N] packed along K, sequential order; qzeros [K // G, N // 8]
    GPTQModel v2)            packed along N, sequential, stored as z - 1 (v1, "gptq") or z (v2, "gptq_v2");
                             scales [K // G, N].
    compressed-tensors       weight_packed [N, K // 8] packed along K, sequential, values signed + 8;
    (pack-quantized)         weight_scale [N, K // G]; weight_zero_point [N // 8, K // G] packed along N,
                             sequential, signed + 8; weight_shape [N, K].

Act-order (`g_idx` that is not k // G) is rejected: the shared layout assumes contiguous groups.
"""

from .awq import from_awq, to_awq
from .compressed_tensors import from_compressed_tensors, to_compressed_tensors
from .gptq import from_gptq, to_gptq

__all__ = ["from_awq", "to_awq", "from_gptq", "to_gptq", "from_compressed_tensors", "to_compressed_tensors"]
