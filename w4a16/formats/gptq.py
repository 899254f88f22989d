"""AutoGPTQ (v1) checkpoints: packed along K sequentially; zero points stored as z - 1 (a historical quirk)."""

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


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> QuantizedWeight:
    """GPTQ qweight [K // 8, N], qzeros [K // G, N // 8] (z - 1), scales [K // G, N] -> QuantizedWeight.

    All zero points equal to 8 give a symmetric (uint4b8) weight; anything else an asymmetric one.
    """
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
    if (stored == 15).any():
        raise ValueError(
            "qzeros holds the stored value 15, i.e. zero point 16 after GPTQ's +1: outside 0..15, not representable"
        )
    zeros = (stored + 1).to(torch.uint8)
    symmetric = bool((zeros == SYMMETRIC_ZERO).all())
    return QuantizedWeight(pack_int4(q), scales.t().contiguous(), None if symmetric else zeros.contiguous(), group_size)


def to_gptq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The inverse of `from_gptq`: {'qweight', 'qzeros', 'scales', 'g_idx'}. Needs N % 8 == 0 and z >= 1."""
    if qw.n % 8:
        raise ValueError(f"GPTQ packs qzeros along N: N={qw.n} must be a multiple of 8")
    zeros = qw.zero_points()
    if (zeros == 0).any():
        raise ValueError("GPTQ v1 stores z - 1 in 4 bits: zero point 0 cannot be represented")
    q = unpack_int4(qw.qweight)
    return {
        "qweight": pack_nibbles(q, SEQUENTIAL_ORDER, "q").t().contiguous(),
        "qzeros": pack_nibbles((zeros - 1).t().contiguous(), SEQUENTIAL_ORDER, "zeros"),
        "scales": qw.scales.t().contiguous(),
        "g_idx": torch.arange(qw.k, dtype=torch.int32, device=qw.device) // qw.group_size,
    }
