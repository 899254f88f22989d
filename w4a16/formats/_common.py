"""Checks shared by the checkpoint converters."""

from __future__ import annotations

import torch

from ..layout import check_group_size


def check_int32(t: torch.Tensor, name: str, dims: int = 2) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name} must be an int32 packed tensor, got {got}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")


def check_shape(t: torch.Tensor, name: str, expected: tuple[int, ...], what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} must have shape {what} = {list(expected)}, got {list(t.shape)}")


def check_groups(k: int, group_size: int) -> int:
    check_group_size(group_size)
    if k % group_size:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size}")
    return k // group_size


def check_trivial_g_idx(g_idx: torch.Tensor | None, k: int, group_size: int) -> None:
    """Accept g_idx only when it is the plain order k // G (act-order checkpoints are not supported)."""
    if g_idx is None:
        return
    if not isinstance(g_idx, torch.Tensor) or tuple(g_idx.shape) != (k,):
        raise ValueError(f"g_idx must be a tensor of shape [K] = [{k}], got {getattr(g_idx, 'shape', type(g_idx))}")
    if g_idx.is_floating_point() or g_idx.is_complex() or g_idx.dtype == torch.bool:
        raise TypeError(f"g_idx must be an integer tensor, got {g_idx.dtype}")  # a cast would truncate 0.5 to 0
    expected = torch.arange(k, device=g_idx.device) // group_size
    if not torch.equal(g_idx.to(torch.int64), expected):
        raise ValueError(
            "g_idx must be the trivial order k // group_size: act-order (desc_act) checkpoints are not supported"
        )
