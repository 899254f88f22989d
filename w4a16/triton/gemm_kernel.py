"""Fused-dequant W4A16 GEMM (the prefill path): y = x @ dequant(W)^T (+ bias), fp32 accumulation.

    x       [M, K]       fp16/bf16, rows contiguous along K (stride_xm between rows)
    qweight int32 [N, K // 8]   shuffle order (w4a16.layout): word c of row n holds k = 8c .. 8c + 7
    scales  [N, K // G]  x's dtype;  zeros uint8 [N, K // G] or none (symmetric: z = 8)
    y       [M, N]       x's dtype (stride_om between rows); bias [N] optional

    dequant(W)[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]

Each program owns a BLOCK_M x BLOCK_N output tile and walks K in BLOCK_K steps. BLOCK_K divides G, so every K tile
has one scale (and zero) per weight row: the tile is dequantized with the magic-number trick of dequant_tile.py
(no int->float conversions) straight into the dot's input, and the packed weight is read once per M tile, in the
shared layout, with no per-call repacking.

Two orientations (TileConfig.w_left):
- x-left: acc[BM, BN] += x[BM, BK] @ W[BN, BK]^T. On Hopper the weight, the right operand, must go through shared
  memory before wgmma can read it.
- w-left (the transposed product): acc[BN, BM] += W[BN, BK] @ x^T[BK, BM], stored transposed. wgmma reads its left
  operand from registers, so the dequantized weight goes register -> tensor core, and the small token count M becomes
  the MMA's N dimension (8..256), which suits M = 16..128.

split_k > 1 splits the K loop over grid axis 1: each split stores its fp32 partial sums in its own [M, N] slice of a
workspace, and reduce_splits_kernel adds the slices in split order (deterministic, unlike atomic adds), adds the
bias and casts to x's dtype. Programs are ordered in groups of GROUP_M tiles along M so the weight tiles they share
stay in L2.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .configs import TileConfig
from .dequant_tile import BF16_MAGIC, FP16_MAGIC, dequantize_tile

GROUP_M = 8


@triton.jit
def w4a16_gemm_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,  # shapes and dtypes: see the module docstring
    M, N, K, stride_xm, stride_om, split_stride,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, W_LEFT: tl.constexpr, PTX_DEQUANT: tl.constexpr,
):
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    MAGIC: tl.constexpr = BF16_MAGIC if DTYPE == tl.bfloat16 else FP16_MAGIC

    # Grouped ordering: GROUP_M consecutive M tiles per column of N tiles.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (pid // tiles_per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_per_group) % group_rows
    pid_n = (pid % tiles_per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // 8)
    words_per_row = K // 8
    groups_per_row = K // GROUP_SIZE

    # K % GROUP_SIZE == 0 and BLOCK_K | GROUP_SIZE, so K tiles are whole: no K masks anywhere.
    k_tiles = K // BLOCK_K
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    t_begin = pid_k * tiles_per_split
    t_end = min(t_begin + tiles_per_split, k_tiles)

    qw_ptrs = qw_ptr + offs_n[:, None] * words_per_row + offs_kw[None, :]
    if W_LEFT:
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # x^T tile [BK, BM]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # x tile [BM, BK]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    for t in range(t_begin, t_end):
        k0 = t * BLOCK_K
        words = tl.load(qw_ptrs + k0 // 8, mask=mask_n[:, None], other=0)
        group = k0 // GROUP_SIZE
        scales = tl.load(scales_ptr + offs_n * groups_per_row + group, mask=mask_n, other=0.0)
        if HAS_ZEROS:
            zeros = tl.load(zeros_ptr + offs_n * groups_per_row + group, mask=mask_n, other=8)
            zero_bias = (zeros.to(tl.float32) + MAGIC).to(DTYPE)
        else:
            zero_bias = tl.full((BLOCK_N,), MAGIC + 8.0, DTYPE)
        w = dequantize_tile(words, scales, zero_bias, DTYPE, PTX_DEQUANT)  # [BN, BK]
        if W_LEFT:
            xt = tl.load(x_ptrs + k0, mask=mask_m[None, :], other=0.0)
            acc = tl.dot(w, xt, acc)
        else:
            xs = tl.load(x_ptrs + k0, mask=mask_m[:, None], other=0.0)
            acc = tl.dot(xs, tl.trans(w), acc)

    if W_LEFT:
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        out_mask = mask_m[None, :] & mask_n[:, None]
    else:
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        out_mask = mask_m[:, None] & mask_n[None, :]
    if HAS_BIAS and SPLIT_K == 1:  # with split-K the reduction adds it
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc += bias[:, None] if W_LEFT else bias[None, :]
    # Split-K: out_ptr is the fp32 workspace, one [M, N] slice (split_stride elements) per split.
    tl.store(out_ptrs + pid_k * split_stride, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def reduce_splits_kernel(ws_ptr, bias_ptr, out_ptr, M, N, stride_om, split_stride,
                         SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[M, N] = sum over s of ws[s] (fp32, [SPLIT_K, M, N], in split order) + bias, in out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        total += tl.load(ws_ptr + s * split_stride + offs, mask=mask, other=0.0)
    col = offs % N
    if HAS_BIAS:
        total += tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offs // N) * stride_om + col, total.to(out_ptr.dtype.element_ty), mask=mask)


def ptx_dequant_for_arch(arch: str) -> bool:
    """Whether the inline-PTX dequantization applies on `arch` (a normalised name, e.g. "sm_90" or "gfx1151"):
    NVIDIA sm_90+, where the packed bf16x2 sub/mul exist; every other target runs the portable integer form."""
    return arch.startswith("sm_") and int(arch[3:]) >= 90


@functools.cache  # asked on every launch
def ptx_dequant_for(device: torch.device) -> bool:
    """ptx_dequant_for_arch for a device: CPU (the interpreter) and ROCm never take the PTX form."""
    if device.type != "cuda" or getattr(torch.version, "hip", None):
        return False
    from ..arch import normalize_arch

    return ptx_dequant_for_arch(normalize_arch(torch.cuda.get_device_capability(device)))


def launch_gemm(x2d: torch.Tensor, qw, bias: torch.Tensor | None, config: TileConfig,
                ptx_dequant: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch on a validated, row-contiguous x2d [M, K] with `config`; returns [M, N] in x's dtype.

    `out` (optional, [M, N] in x's dtype, rows contiguous) receives the result; tests pass one filled with NaN.
    A config with kernel == "wgmma" runs the Hopper kernel of wgmma_kernel.py instead (ptx_dequant does not apply)."""
    if config.kernel == "wgmma":
        try:  # Gluon: imported only where a table selects it
            from .wgmma_kernel import launch_wgmma
        except ImportError as exc:
            raise RuntimeError(f"tile config {config} selects the wgmma kernel, which needs triton's Gluon "
                               f"(triton >= 3.6; this is triton {triton.__version__}): {exc}") from exc
        return launch_wgmma(x2d, qw, bias, config, out=out)
    if qw.group_size % config.block_k:
        raise ValueError(f"config.block_k={config.block_k} must divide group_size={qw.group_size}: the kernel applies "
                         "one scale per K tile (select_config clamps BLOCK_K to G)")
    m, k = x2d.shape
    n = qw.n
    if ptx_dequant is None:
        ptx_dequant = ptx_dequant_for(x2d.device)
    if out is None:
        out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    split_k = config.for_shape(m, n, k).split_k
    # Split-K: every split writes its whole [M, N] slice (zeros where its K range is empty), so the workspace
    # needs no initialisation. It holds split_k * M * N fp32 for the duration of the call.
    target = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x2d.device)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split_k)
    zeros = qw.zeros if qw.zeros is not None else qw.scales  # never read when HAS_ZEROS is false
    bias_or_any = bias if bias is not None else qw.scales  # never read when HAS_BIAS is false
    w4a16_gemm_kernel[grid](
        x2d, qw.qweight, qw.scales, zeros, bias_or_any, target,
        m, n, k, x2d.stride(0), target.stride(-2), m * n,
        GROUP_SIZE=qw.group_size, HAS_ZEROS=qw.zeros is not None, HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split_k, GROUP_M=GROUP_M, W_LEFT=config.w_left, PTX_DEQUANT=ptx_dequant,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split_k > 1:
        add_splits(target, bias, out)
    return out


def add_splits(workspace: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = the sum of the fp32 split-K slices workspace[s] (in split order) + bias, in out's dtype."""
    split_k, m, n = workspace.shape
    block = 1024
    reduce_splits_kernel[(triton.cdiv(m * n, block),)](
        workspace, bias if bias is not None else workspace, out, m, n, out.stride(0), m * n,
        SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
    )
