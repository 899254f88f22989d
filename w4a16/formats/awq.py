"""AutoAWQ GEMM checkpoints: packed along N with the same in-word shuffle order as the shared layout."""

from __future__ import annotations

import torch

from ..layout import SHUFFLE_ORDER, QuantizedWeight, pack_int4, pack_nibbles, unpack_int4, unpack_nibbles
from ._common import check_groups, check_int32, check_shape


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> QuantizedWeight:
    """AWQ qweight [K, N // 8], qzeros [K // G, N // 8], scales [K // G, N] -> QuantizedWeight (asymmetric)."""
    check_int32(qweight, "qweight")
    check_int32(qzeros, "qzeros")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = check_groups(k, group_size)
    check_shape(qzeros, "qzeros", (groups, n // 8), "[K // G, N // 8]")
    check_shape(scales, "scales", (groups, n), "[K // G, N]")
    q = unpack_nibbles(qweight, SHUFFLE_ORDER, "qweight").t()  # [N, K]
    zeros = unpack_nibbles(qzeros, SHUFFLE_ORDER, "qzeros").t()  # [N, K // G]
    return QuantizedWeight(pack_int4(q.contiguous()), scales.t().contiguous(), zeros.contiguous(), group_size)


def to_awq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The inverse of `from_awq`: {'qweight', 'qzeros', 'scales'} as AutoAWQ stores them. Needs N % 8 == 0."""
    if qw.n % 8:
        raise ValueError(f"AWQ packs along N: N={qw.n} must be a multiple of 8")
    q = unpack_int4(qw.qweight)
    return {
        "qweight": pack_nibbles(q.t().contiguous(), SHUFFLE_ORDER, "q"),
        "qzeros": pack_nibbles(qw.zero_points().t().contiguous(), SHUFFLE_ORDER, "zeros"),
        "scales": qw.scales.t().contiguous(),
    }
