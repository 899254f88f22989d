"""Architecture names, normalised in one place: `gfx1151`, `gfx1201`, `sm_90`, ... or `cpu`."""

from __future__ import annotations

import re

import torch


def normalize_arch(name: str | tuple[int, int]) -> str:
    """`gfx1151:sramecc-:xnack-` -> `gfx1151`; `sm_90a`, `sm90`, (9, 0) -> `sm_90`; `cpu` stays."""
    if isinstance(name, tuple):
        major, minor = name
        return f"sm_{major}{minor}"
    if not isinstance(name, str):
        raise TypeError(f"arch name must be a string or a (major, minor) tuple, got {type(name).__name__}")
    text = name.strip().lower()
    if text == "cpu":
        return "cpu"
    gfx = re.fullmatch(r"(gfx[0-9a-f]+)(:.*)?", text)
    if gfx:
        return gfx.group(1)
    sm = re.fullmatch(r"(?:sm_?|compute_?)?([0-9]{2,3})[a-z]?", text)
    if sm:
        return f"sm_{sm.group(1)}"
    raise ValueError(f"unrecognised architecture name {name!r}: expected e.g. 'gfx1151', 'sm_90' or 'cpu'")


def arch(device: torch.device | str | int | None = None) -> str:
    """The normalised architecture of `device` (default: the current GPU, or `cpu` when there is none)."""
    if device is not None:
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type == "cpu":
            return "cpu"
    elif not torch.cuda.is_available():
        return "cpu"
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    if getattr(torch.version, "hip", None):
        return normalize_arch(props.gcnArchName)
    return normalize_arch((props.major, props.minor))


def is_amd(arch_name: str) -> bool:
    return arch_name.startswith("gfx")
