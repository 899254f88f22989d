"""GPTQ checkpoints: packed along K sequentially. AutoGPTQ's format ("gptq", v1) stores each zero point as z - 1
(a historical quirk), so it holds 1..16 and z = 0 is lost; GPTQModel's "gptq_v2" stores z itself. A checkpoint's
quantization_config says which (`checkpoint_format`, "gptq" when absent); the tensors cannot.
"""

from __future__ import annotations

import torch

from ..layout import (
    SEQUENTIAL_ORDER,
    SYMMETRIC_ZERO,
    QuantizedWeight,
    pack_int4,
    pack_nibbles,
    unpack_int4,
    unpack_nibbles,
)
from ._common import check_groups, check_int32, check_shape, check_trivial_g_idx

# checkpoint_format -> what is added to a stored zero point to get z
ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


def _zero_offset(checkpoint_format: str) -> int:
    if checkpoint_format not in ZERO_OFFSET:
        raise ValueError(f"checkpoint_format must be one of {sorted(ZERO_OFFSET)}, got {checkpoint_format!r}")
    return ZERO_OFFSET[checkpoint_format]


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    checkpoint_format: str = "gptq",
) -> QuantizedWeight:
    """GPTQ qweight [K // 8, N], qzeros [K // G, N // 8] (z - 1 for "gptq", z for "gptq_v2"), scales [K // G, N]
    -> QuantizedWeight.

    All zero points equal to 8 give a symmetric (uint4b8) weight; anything else an asymmetric one.
    """
    offset = _zero_offset(checkpoint_format)
    check_int32(qweight, "qweight")
    check_int32(qzeros, "qzeros")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = check_groups(k, group_size)
    if n % 8:
        raise ValueError(f"GPTQ packs qzeros along N: N={n} must be a multiple of 8")
    check_shape(qzeros, "qzeros", (groups, n // 8), "[K // G, N // 8]")
    check_shape(scales, "scales", (groups, n), "[K // G, N]")
    check_trivial_g_idx(g_idx, k, group_size)
    # qweight packs 8 consecutive k of one column: unpack along dim 0 by unpacking the transpose.
    q = unpack_nibbles(qweight.t().contiguous(), SEQUENTIAL_ORDER, "qweight")  # [N, K]
    stored = unpack_nibbles(qzeros, SEQUENTIAL_ORDER, "qzeros").t().to(torch.int16)  # [N, K // G]
    if offset and (stored == 15).any():
        # Kernels disagree on it: some compute 16, some wrap to 0. Refused rather than guessed.
        raise ValueError(
            "qzeros holds the stored value 15, i.e. zero point 16 after GPTQ's +1: outside 0..15, not representable "
            "(a checkpoint that stores z itself is checkpoint_format='gptq_v2')"
        )
    zeros = (stored + offset).to(torch.uint8)
    symmetric = bool((zeros == SYMMETRIC_ZERO).all())
    return QuantizedWeight(pack_int4(q), scales.t().contiguous(), None if symmetric else zeros.contiguous(), group_size)


def to_gptq(qw: QuantizedWeight, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """The inverse of `from_gptq`: {'qweight', 'qzeros', 'scales', 'g_idx'}. Needs N % 8 == 0, and z >= 1 for
    "gptq"."""
    offset = _zero_offset(checkpoint_format)
    if qw.n % 8:
        raise ValueError(f"GPTQ packs qzeros along N: N={qw.n} must be a multiple of 8")
    zeros = qw.zero_points()
    if offset and (zeros == 0).any():
        raise ValueError("GPTQ v1 stores z - 1 in 4 bits: zero point 0 cannot be represented "
                         "(checkpoint_format='gptq_v2' stores z itself)")
    q = unpack_int4(qw.qweight)
    return {
        "qweight": pack_nibbles(q, SEQUENTIAL_ORDER, "q").t().contiguous(),
        "qzeros": pack_nibbles((zeros - offset).t().contiguous(), SEQUENTIAL_ORDER, "zeros"),
        "scales": qw.scales.t().contiguous(),
        "g_idx": torch.arange(qw.k, dtype=torch.int32, device=qw.device) // qw.group_size,
    }
