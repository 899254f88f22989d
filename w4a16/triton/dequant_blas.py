"""The large-M route: dequantize W once per call into a reused workspace, then the vendor GEMM.

    W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]   ->  workspace [N, K] in x's dtype
    y = x @ W^T (+ bias)                                   (torch.matmul / addmm: cuBLAS or hipBLASLt)

The dequantization kernel is bandwidth bound: it reads N*K/2 + metadata bytes and writes 2*N*K bytes, so at M >= ~1024
its cost is small next to the GEMM, which then runs at the vendor library's full speed. Peak extra memory: one
workspace of max(N*K) elements in x's dtype per (device, dtype), kept between calls (e.g. 235 MB for Llama-3.1-8B's
gate_up 28672 x 4096 in bf16); `release_workspaces()` frees it. The workspace is shared by all calls on a device, so
calls on concurrent streams must not overlap. A call captured into a CUDA graph takes an N*K buffer of the graph's
own memory pool instead (freed with the graph, reused by the capture's later calls): the shared one may grow, and
be freed, after the capture, while the graph would still write to its old address.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import GRID_YZ_MAX
from .dequant_tile import BF16_MAGIC, FP16_MAGIC, dequantize_tile
from .gemm_kernel import ptx_dequant_for

# (device, dtype) -> flat workspace; grows to the largest N*K seen.
_WORKSPACES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

# Elements per program: large enough for wide stores, small enough to keep every SM busy on small weights.
TILE_ELEMENTS = 16384


@triton.jit
def w4a16_dequant_kernel(
    qw_ptr, scales_ptr, zeros_ptr, w_ptr,  # qweight int32 [N, K//8], scales/zeros [N, K//G], w [N, K] out
    N, K,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PTX_DEQUANT: tl.constexpr,
):
    DTYPE: tl.constexpr = w_ptr.dtype.element_ty
    MAGIC: tl.constexpr = BF16_MAGIC if DTYPE == tl.bfloat16 else FP16_MAGIC
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K  # BLOCK_K divides GROUP_SIZE and K: whole tiles, one group per row
    mask_n = offs_n < N
    words = tl.load(qw_ptr + offs_n[:, None] * (K // 8) + k0 // 8 + tl.arange(0, BLOCK_K // 8)[None, :],
                    mask=mask_n[:, None], other=0)
    group = k0 // GROUP_SIZE
    scales = tl.load(scales_ptr + offs_n * (K // GROUP_SIZE) + group, mask=mask_n, other=0.0)
    if HAS_ZEROS:
        zeros = tl.load(zeros_ptr + offs_n * (K // GROUP_SIZE) + group, mask=mask_n, other=8)
        zero_bias = (zeros.to(tl.float32) + MAGIC).to(DTYPE)
    else:
        zero_bias = tl.full((BLOCK_N,), MAGIC + 8.0, DTYPE)
    w = dequantize_tile(words, scales, zero_bias, DTYPE, PTX_DEQUANT)
    tl.store(w_ptr + offs_n[:, None] * K + k0 + tl.arange(0, BLOCK_K)[None, :], w, mask=mask_n[:, None])


def _k_tile(qw) -> int:
    """The dequantization kernel's K tile (one group, at most 128); its K tiles are the grid's y extent."""
    block_k = min(128, qw.group_size)
    if qw.k // block_k > GRID_YZ_MAX:
        raise ValueError(f"K={qw.k} with group_size={qw.group_size} makes {qw.k // block_k} K tiles of {block_k}, "
                         f"past the {GRID_YZ_MAX} a launch grid's y extent allows: too large for the dequantization "
                         "kernel")
    return block_k


def dequantize_into(qw, out: torch.Tensor, tile_elements: int = TILE_ELEMENTS, num_warps: int = 8) -> torch.Tensor:
    """Write dequant(W) into `out` ([N, K], fp16/bf16, contiguous) on the GPU; returns `out`."""
    n, k = qw.n, qw.k
    block_k = _k_tile(qw)
    block_n = max(1, tile_elements // block_k)
    grid = (triton.cdiv(n, block_n), k // block_k)
    zeros = qw.zeros if qw.zeros is not None else qw.scales  # never read when HAS_ZEROS is false
    w4a16_dequant_kernel[grid](
        qw.qweight, qw.scales, zeros, out, n, k,
        GROUP_SIZE=qw.group_size, HAS_ZEROS=qw.zeros is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, PTX_DEQUANT=ptx_dequant_for(out.device), num_warps=num_warps,
    )
    return out


def workspace(device: torch.device, dtype: torch.dtype, n: int, k: int) -> torch.Tensor:
    """The reused [N, K] workspace for (device, dtype), grown when a larger weight comes; while a CUDA graph is
    being captured, a buffer of the graph's pool (see the module docstring)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return torch.empty((n, k), dtype=dtype, device=device)
    key = (device, dtype)
    flat = _WORKSPACES.get(key)
    if flat is None or flat.numel() < n * k:
        _WORKSPACES.pop(key, None)  # free the old one before allocating the larger
        flat = torch.empty(n * k, dtype=dtype, device=device)
        _WORKSPACES[key] = flat
    return flat[: n * k].view(n, k)


def release_workspaces() -> None:
    _WORKSPACES.clear()


def launch_dequant_blas(x2d: torch.Tensor, qw, bias: torch.Tensor | None) -> torch.Tensor:
    _k_tile(qw)  # refused before the workspace grows to N * K for it
    w = dequantize_into(qw, workspace(x2d.device, x2d.dtype, qw.n, qw.k))
    # Outside autograd: a graph saving `w` would hold a view of the shared workspace, which the next call overwrites
    # through a raw pointer (no version bump), so a later backward would use another layer's weight. Gradients come
    # from w4a16.gemm's own formula (dispatch.py), as for the Triton GEMMs.
    with torch.no_grad():
        if bias is None:
            return x2d @ w.t()
        return torch.addmm(bias.to(x2d.dtype), x2d, w.t())
