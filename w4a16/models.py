"""transformers integration: quantize a model's linear layers in place, or load a W4A16 checkpoint.

    quantize_model(model, group_size=128, symmetric=True, skip=("lm_head",))
        replaces every nn.Linear (except the skipped ones) by a W4A16Linear quantized round-to-nearest.
    set_backend(model, backend)
        points every W4A16Linear of the model at one backend ("auto", "reference", ...).
    load_quantized(path, device=None, dtype=None)
        reads a local compressed-tensors (pack-quantized W4A16) or AutoAWQ (GEMM) checkpoint: config.json with a
        quantization_config plus safetensors shards.

Names in `skip` match a module's full name exactly, by its last components ("lm_head" matches
"model.lm_head"), as a glob ("model.layers.0.*"), or as a regular expression with a "re:" prefix (the spelling
of compressed-tensors' `ignore` lists).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

from torch import nn

from .linear import W4A16Linear

DEFAULT_SKIP = ("lm_head",)


def _matches(name: str, patterns: Iterable[str]) -> bool:
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern):
            return True
    return False


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def quantize_model(
    model: nn.Module,
    group_size: int = 128,
    symmetric: bool = True,
    skip: Iterable[str] = DEFAULT_SKIP,
    backend: str = "auto",
) -> nn.Module:
    """Replace the model's nn.Linear layers by W4A16Linear (round-to-nearest), in place; returns the model.

    Embeddings are not nn.Linear and stay as they are; `lm_head` is skipped by default (pass skip=() to
    quantize it too). A layer whose in_features is not a multiple of group_size is an error naming the layer.
    """
    if isinstance(skip, str):
        skip = (skip,)
    skip = tuple(skip)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and not _matches(name, skip)]
    for name, linear in targets:
        if linear.in_features % group_size:
            raise ValueError(
                f"{name}: in_features={linear.in_features} is not a multiple of group_size={group_size}; "
                f"add {name!r} to skip or choose another group size"
            )
    for name, linear in targets:
        _set_submodule(model, name, W4A16Linear.from_linear(linear, group_size, symmetric, backend))
    return model


def set_backend(model: nn.Module, backend: str) -> int:
    """Set `backend` on every W4A16Linear of the model; returns how many there are."""
    layers = [m for m in model.modules() if isinstance(m, W4A16Linear)]
    for layer in layers:
        layer.backend = backend
    return len(layers)
