"""The callables the bench times: our op per backend, and the peers measured beside it in the same process.

    auto, skinny, triton, dequant_blas   w4a16.gemm(x, qw, backend=...)
    torch_bf16 / torch_fp16              F.linear(x, W) on the weight dequantized once (cuBLAS / hipBLASLt): what
                                         the unquantized model runs
    naive                                F.linear(x, w4a16.dequantize(qw, x.dtype)) each call: what a user without
                                         kernels writes
    tinygemm                             torch.ops.aten._weight_int4pack_mm (bf16, CUDA), weight repacked into its
                                         own tile format once

Each backend gets its own rotation of weight copies, sized from the bytes it reads (`metrics.weight_bytes`).
The same random int4 weight (same seed) underlies every backend of a shape, so all of them compute the same
product.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import w4a16
from w4a16.layout import QuantizedWeight, unpack_int4

from . import metrics
from .catalogue import OURS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# tinygemm's weight tile: K split in tiles of 16 x INNER_K_TILES (the value torchao uses); K % 128 == 0 here.
TINYGEMM_INNER_K_TILES = 8
# Set by `python -m w4a16.bench --inject-slowdown`: our backends run twice per timed call. It exists only to show
# that --compare catches a regression (a 2x slowdown is far past any threshold).
SLOWDOWN_ENV = "W4A16_BENCH_INJECT_SLOWDOWN"


class Unavailable(Exception):
    """The backend cannot run this case on this machine; the message says why (the benchmark is skipped)."""


@dataclass
class Prepared:
    """A backend ready to time: `call(x, i)` runs it on weight copy i; `weight` is copy 0 in our layout."""

    backend: str
    copies: int
    call: Callable[[torch.Tensor, int], torch.Tensor]
    weight: QuantizedWeight


def random_weight(n: int, k: int, group_size: int, symmetric: bool, dtype: torch.dtype,
                  generator: torch.Generator) -> QuantizedWeight:
    """A random int4 weight on the generator's device: every nibble value in play, scales never zero."""
    device = generator.device
    qweight = torch.randint(-(2**31), 2**31, (n, k // 8), dtype=torch.int32, device=device, generator=generator)
    groups = k // group_size
    scales = (torch.rand(n, groups, device=device, generator=generator) * 0.02 + 0.002).to(dtype)
    zeros = None if symmetric else torch.randint(0, 16, (n, groups), dtype=torch.uint8, device=device,
                                                 generator=generator)
    return QuantizedWeight(qweight, scales, zeros, group_size)


def _clone_weight(qw: QuantizedWeight) -> QuantizedWeight:
    zeros = None if qw.zeros is None else qw.zeros.clone()
    return QuantizedWeight(qw.qweight.clone(), qw.scales.clone(), zeros, qw.group_size)


def _copies_of(tensors: list[torch.Tensor], copies: int) -> list[list[torch.Tensor]]:
    return [tensors] + [[t.clone() for t in tensors] for _ in range(copies - 1)]


def tinygemm_operands(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Our weight in tinygemm's input format: (uint8 [N, K / 2] nibble pairs, scale-and-zero [K / G, N, 2] bf16).

    tinygemm dequantizes (q - 8) * scale + zero, so our (q - z) * s becomes zero = (8 - z) * s. Its CUDA packing
    op takes element 2j of a row in the high nibble of byte j and element 2j + 1 in the low one.
    """
    q = unpack_int4(qw.qweight).to(torch.int32)
    nibble_pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
    s = qw.scales.to(torch.float32)
    zero = (8.0 - qw.zero_points().to(torch.float32)) * s
    scales_and_zeros = torch.stack([s, zero], dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)
    return nibble_pairs, scales_and_zeros


def tinygemm_pack(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int4 tiles for _weight_int4pack_mm, scale-and-zero pairs): CUDA only."""
    nibble_pairs, scales_and_zeros = tinygemm_operands(qw)
    return torch.ops.aten._convert_weight_to_int4pack(nibble_pairs, TINYGEMM_INNER_K_TILES), scales_and_zeros


def prepare(backend: str, qw: QuantizedWeight, cache_bytes: int | None) -> Prepared:
    """Build the backend's rotation from `qw` (copy 0) and the callable that runs it."""
    n, k, g, sym = qw.n, qw.k, qw.group_size, qw.symmetric
    copies = metrics.rotation_copies(metrics.weight_bytes(backend, n, k, g, sym), cache_bytes)

    if backend in OURS:
        weights = [qw] + [_clone_weight(qw) for _ in range(copies - 1)]
        repeat = 2 if os.environ.get(SLOWDOWN_ENV) == "1" else 1

        def call(x: torch.Tensor, i: int) -> torch.Tensor:
            for _ in range(repeat - 1):
                w4a16.gemm(x, weights[i], backend=backend)
            return w4a16.gemm(x, weights[i], backend=backend)

        return Prepared(backend, copies, call, qw)

    if backend in ("torch_bf16", "torch_fp16"):
        dtype = torch.bfloat16 if backend == "torch_bf16" else torch.float16
        if qw.dtype != dtype:
            raise Unavailable(f"{backend} is the peer for {dtype} activations, the weight's scales are {qw.dtype}")
        dense = [c[0] for c in _copies_of([w4a16.dequantize(qw, dtype)], copies)]
        return Prepared(backend, copies, lambda x, i: F.linear(x, dense[i]), qw)

    if backend == "naive":
        weights = [qw] + [_clone_weight(qw) for _ in range(copies - 1)]
        return Prepared(backend, copies, lambda x, i: F.linear(x, w4a16.dequantize(weights[i], x.dtype)), qw)

    if backend == "tinygemm":
        if qw.device.type != "cuda" or getattr(torch.version, "hip", None):
            raise Unavailable("tinygemm (_weight_int4pack_mm) is timed on CUDA builds only")
        if qw.dtype != torch.bfloat16:
            raise Unavailable(f"tinygemm takes bf16 activations, the weight's scales are {qw.dtype}")
        try:
            packed, sz = tinygemm_pack(qw)
        except (RuntimeError, NotImplementedError) as exc:
            raise Unavailable(f"torch cannot pack for tinygemm here: {str(exc).splitlines()[0]}") from exc
        pairs = _copies_of([packed, sz], copies)
        op = torch.ops.aten._weight_int4pack_mm
        return Prepared(backend, copies, lambda x, i: op(x, pairs[i][0], g, pairs[i][1]), qw)

    raise ValueError(f"unknown backend {backend!r}")


def unavailable_reason(backend: str, m: int, k: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why one of our backends cannot take this case, asked of the dispatch module where it can say; None if
    it can (or if only a call can tell). The skinny kernel is timed wherever it can run, also where "auto" sends
    the call elsewhere (the "auto" column shows the route)."""
    if backend not in OURS or backend == "auto":
        return None
    dispatch = w4a16.dispatch
    reason = dispatch.unavailable_reason(backend, device, dtype)
    if reason is not None:
        return reason
    if backend == "skinny":
        rules = dispatch.rules(w4a16.arch(device))
        if not rules.skinny_takes(m, k):
            return (f"skinny takes 1 <= M <= {rules.skinny_rows} with K*M <= {rules.skinny_staging_elements} on "
                    f"{rules.arch}; M={m}, K={k}")
    return None
