"""Round-to-nearest quantization into the shared layout, one scale (and zero point) per group of G along K.

symmetric (uint4b8):  s = max|w| / 7.5,            q = clamp(round(w / s) + 8, 0, 15)
asymmetric (uint4):   s = (max(w, 0) - min(w, 0)) / 15, z = clamp(round(-min(w, 0) / s), 0, 15),
                      q = clamp(round(w / s) + z, 0, 15)
The range includes 0 so that z lands in 0..15. s is rounded up to its dtype, never down: a smaller s would put
the group's extreme values past the code range, where the clamp costs more than half a step. q is computed from the
scale as stored, so dequantize() reproduces exactly what was rounded against, within half a step of w.
"""

from __future__ import annotations

import torch

from .layout import SYMMETRIC_ZERO, QuantizedWeight, check_group_size, check_symmetric, pack_int4


def _rounded_up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest `dtype` value >= each non-negative float32 scale. A positive scale below the dtype's smallest
    subnormal becomes that subnormal, not 0."""
    stored = scale.to(dtype)
    if dtype == torch.float32:
        return stored
    # For a non-negative finite 16-bit float the next value up is the next bit pattern.
    next_up = (stored.view(torch.int16) + 1).view(dtype)
    return torch.where(stored.to(torch.float32) < scale, next_up, stored)


def quantize(w: torch.Tensor, group_size: int = 128, symmetric: bool = True) -> QuantizedWeight:
    """Quantize a float weight [N, K] (nn.Linear layout) to 4 bits; scales keep w's dtype (fp32 for fp64)."""
    if not isinstance(w, torch.Tensor) or not w.dtype.is_floating_point:
        got = w.dtype if isinstance(w, torch.Tensor) else type(w).__name__
        raise TypeError(f"w must be a floating-point tensor [N, K], got {got}")
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [N, K], got shape {tuple(w.shape)}")
    if w.device.type == "meta":
        raise ValueError("w is on the meta device (it holds no values): load the weights before quantizing")
    check_group_size(group_size)
    check_symmetric(symmetric)
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size}")
    scale_dtype = w.dtype if w.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32
    groups = w.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    # Checked after the cast: a float64 beyond float32's range becomes inf there.
    if not torch.isfinite(groups).all():
        raise ValueError("w contains NaN or inf (or float64 values beyond float32's range); cannot quantize it")
    if symmetric:
        scale = groups.abs().amax(dim=-1) / 7.5
    else:
        lo = groups.amin(dim=-1).clamp(max=0)
        hi = groups.amax(dim=-1).clamp(min=0)
        scale = hi / 15 - lo / 15  # not (hi - lo) / 15: hi - lo can overflow float32
    # An all-zero group (scale 0) gets scale 1: its values round to q == z, which dequantizes to 0.
    scale = _rounded_up(scale, scale_dtype)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    stored = scale.to(torch.float32).unsqueeze(-1)
    if symmetric:
        zero = torch.full_like(stored, SYMMETRIC_ZERO)
    else:
        zero = torch.round(-lo.unsqueeze(-1) / stored).clamp(0, 15)
    q = torch.clamp(torch.round(groups / stored) + zero, 0, 15)
    # Near the dtype's limit the code range can reach past it (q - z = -8 at a scale of max / 7.5): refuse rather
    # than store weights that dequantize to inf.
    if ((q - zero).abs().amax(dim=-1) * stored.squeeze(-1) > torch.finfo(scale_dtype).max).any():
        raise ValueError(f"w has values too close to {scale_dtype}'s largest; they would dequantize to inf")
    q = q.to(torch.uint8).reshape(n, k)
    zeros = None if symmetric else zero.squeeze(-1).to(torch.uint8)
    return QuantizedWeight(pack_int4(q), scale, zeros, group_size)
