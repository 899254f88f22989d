"""compressed-tensors "pack-quantized" W4A16 checkpoints (e.g. RedHatAI's): packed along K sequentially.

Values are stored as signed + 8 (0..15), so a symmetric checkpoint is exactly uint4b8; the optional zero
point tensor is packed along N, also signed + 8, so the stored nibble is our raw zero point.
"""

from __future__ import annotations

import torch

from ..layout import SEQUENTIAL_ORDER, QuantizedWeight, pack_int4, pack_nibbles, unpack_int4, unpack_nibbles
from ._common import check_groups, check_int32, check_shape, check_trivial_g_idx


def from_compressed_tensors(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor | tuple[int, int],
    weight_zero_point: torch.Tensor | None = None,
    group_size: int | None = None,
    weight_g_idx: torch.Tensor | None = None,
) -> QuantizedWeight:
    """weight_packed [N, K // 8], weight_scale [N, K // G], weight_shape [N, K] -> QuantizedWeight.

    group_size defaults to K // weight_scale.shape[1]; when given it must agree with the scales. weight_g_idx (a
    checkpoint quantized with actorder="group" has one) must be the plain order k // G: other orders are refused.
    """
    check_int32(weight_packed, "weight_packed")
    raw = weight_shape.tolist() if isinstance(weight_shape, torch.Tensor) else weight_shape
    shape = list(raw) if isinstance(raw, (list, tuple)) else [raw]  # a 0-d tensor or a bare number: one value
    if len(shape) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape):
        raise ValueError(f"weight_shape must be two positive integers [N, K], got {shape}")
    n, k = shape
    if k % 8:
        raise ValueError(f"weight_shape K={k} must be a multiple of 8")
    check_shape(weight_packed, "weight_packed", (n, k // 8), "[N, K // 8] from weight_shape")
    if not isinstance(weight_scale, torch.Tensor) or weight_scale.dim() != 2:
        raise ValueError(f"weight_scale must be a 2-D tensor [N, K // G], got {getattr(weight_scale, 'shape', None)}")
    if group_size is None:
        if weight_scale.shape[1] == 0 or k % weight_scale.shape[1]:
            raise ValueError(f"cannot infer group_size: K={k} over weight_scale of shape {list(weight_scale.shape)}")
        group_size = k // weight_scale.shape[1]
    groups = check_groups(k, group_size)
    check_shape(weight_scale, "weight_scale", (n, groups), "[N, K // G]")
    check_trivial_g_idx(weight_g_idx, k, group_size)
    q = unpack_nibbles(weight_packed, SEQUENTIAL_ORDER, "weight_packed")
    zeros = None
    if weight_zero_point is not None:
        check_int32(weight_zero_point, "weight_zero_point")
        if n % 8:
            raise ValueError(f"weight_zero_point packs along N: N={n} must be a multiple of 8")
        check_shape(weight_zero_point, "weight_zero_point", (n // 8, groups), "[N // 8, K // G]")
        zeros = unpack_nibbles(weight_zero_point.t().contiguous(), SEQUENTIAL_ORDER, "weight_zero_point").t()
    return QuantizedWeight(pack_int4(q), weight_scale.contiguous(), None if zeros is None else zeros.contiguous(), group_size)


def to_compressed_tensors(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The inverse of `from_compressed_tensors`; 'weight_zero_point' only for asymmetric weights."""
    out = {
        "weight_packed": pack_nibbles(unpack_int4(qw.qweight), SEQUENTIAL_ORDER, "q"),
        "weight_scale": qw.scales.contiguous(),
        "weight_shape": torch.tensor([qw.n, qw.k], dtype=torch.int64),
    }
    if qw.zeros is not None:
        if qw.n % 8:
            raise ValueError(f"weight_zero_point packs along N: N={qw.n} must be a multiple of 8")
        out["weight_zero_point"] = pack_nibbles(qw.zeros.t().contiguous(), SEQUENTIAL_ORDER, "zeros").t().contiguous()
    return out
