"""Hopper (sm_90) W4A16 GEMM with the dequantized weight as wgmma's register operand, written in Gluon.

Same contract as gemm_kernel.py: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias), fp32 accumulation, output in x's
dtype, reading the shared [N, K // 8] int32 layout (w4a16.layout) with no repacking.

Why a second kernel. wgmma reads its left operand from registers, but only in one register layout. The fused Triton
kernel builds the dequantized tile in another layout and moves it into that one through shared memory every K tile;
on Hopper that round trip, not the arithmetic, kept it at 1.3-3.6x the time of torch bf16 (PERF.md). Gluon states
layouts explicitly, so here the packed words are loaded straight into the threads that own them in the operand
layout and never leave registers.

How. acc[BLOCK_N, BLOCK_M] += W[BLOCK_N, 128] @ x^T[128, BLOCK_M] per K tile of 128 (weight rows are wgmma's M: 64
per warpgroup; tokens its N). In the operand layout, lane (g, t) of a warp holds rows g and g + 8 of its 16 rows at
logical k {16b + 2t + e, 16b + 8 + 2t + e} (b = 0..7, e = 0, 1). Any permutation of k applied to both operands leaves
the product unchanged, so logical k = 16b + 8s + 2t + e is made to read physical k = 32t + 4b + 2s + e: each lane
then owns one contiguous 16-byte chunk (32 k, 4 words) of each of its rows, and word w, pair p = 2h + s of the
magic-number dequantization (dequant_tile.py) is exactly the operand register of block b = 2w + h, half s. x is
permuted the same way: once per call into a copy (`operand_order`), or, with `x_gather`, by the loads themselves
(4-byte pieces; no extra kernel, which pays off at small M). A lane's 32 k always share one group (G >= 32), so it
needs one scale (and zero) per row and tile, for every G in {32, 64, 128}.

Pipeline. x tiles and packed weight tiles go through a ring of `num_stages` shared-memory stages. The weights come
by cp.async; each thread copies the weight chunks it will read back, so they need no barrier of their own. The
operand-ordered x copy comes by TMA, one copy per stage completing that stage's mbarrier; a gathered x comes by
cp.async and then needs a generic-to-async proxy fence before wgmma reads it, which ptxas emits as a MEMBAR that
also waits for the thread's loads in flight. (TMA instead of cp.async for the x copy: 10-15% faster at M = 128..512
on the H200, PERF.md.) Per K tile: wait for the stage, build the operand in registers (the source requests the
scales one tile ahead, but the compiled code still waits for a scale load in every tile: PERF.md), issue the wgmma
asynchronously and wait for the previous one, which overlaps each tile's dequantization with the previous tile's
MMA. The loop handles two tiles per iteration so that consecutive operands live in different registers: ptxas
serializes every wgmma if an operand register is redefined while an earlier wgmma may still read it. With several
warpgroups (8 or 16 warps) a stage is refilled only after a barrier that every warpgroup reaches after its wgmma on
that stage has completed.

Producer form (config.producer, w4a16_wgmma_ws_kernel below). The same operand and dequantization, but one extra
warp (Gluon's warp_specialize) issues every copy: x and the packed weight tile both by TMA, into a ring whose stages
carry a "ready" and an "empty" mbarrier. The consumer warps only wait, dequantize, multiply and release stages, and
the registers the producer warp gives back allow 256-token tiles (acc 64 x 256 per warpgroup). The tuner offers it
from M = 64; in its run on the H200 the form's best config beat every other config at each case from M = 64, by
1.02-1.22x at M = 64..256 (PERF.md).

Natural x (config.x_natural, producer form): x is read by TMA as it is, with no permuted copy made first (the copy
is a kernel of its own, 1.5-2 µs per call at M = 64..128). The permutation then moves to the weights' side: see the
comment above _natural_layout. Faster than the copying form by 1.03-1.17x in 15 of 16 cases at M = 64..128 on the
H200 (PERF.md); the table picks it there.

split_k > 1 works as in gemm_kernel.py: fp32 slices of a workspace, added in split order by add_splits.

The last wave (producer form, last_wave_rows). A grid of equal tiles runs in waves of as many CTAs as the GPU holds
at once; tiles past the last whole wave run while the other SMs idle, for a whole tile's time (Llama-3.1-8B qkv at
M = 512: 192 tiles of 256 tokens on 132 SMs, 60 of them in a second wave). So the weight rows of those tiles go to a
second launch of tiles a half or a quarter as tall in tokens, which spread over the idle SMs, and the first launch
keeps the rows that fill whole waves.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .configs import GRID_YZ_MAX, WGMMA_BLOCK_K, TileConfig, last_wave_configs
from .dequant_tile import BF16_MAGIC, FP16_MAGIC, magic_pair_hex, ptx_dequant_asm
from .gemm_kernel import add_splits

# The K tile: 4 lanes x 32 k, the width the operand permutation above is built for.
BLOCK_K = WGMMA_BLOCK_K
_BK = gl.constexpr(BLOCK_K)

# Names that moved between Triton releases (3.6 has the first, later releases the second).
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

# Registers the producer warp of the warp-specialized form keeps (it only issues TMA copies and waits).
PRODUCER_REGISTERS = 40
_PRODUCER_REGISTERS = gl.constexpr(PRODUCER_REGISTERS)

_DEQUANT_BF16 = gl.constexpr(ptx_dequant_asm(True))
_DEQUANT_FP16 = gl.constexpr(ptx_dequant_asm(False))


@triton.constexpr_function
def _mma_layout(block_m, warps):
    """The accumulator [BLOCK_N, BLOCK_M]: weight rows are wgmma's M (64 per warpgroup), tokens its N."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_m, 16])


@triton.constexpr_function
def _words_layout(block_n, warps, split_words):
    """Where the packed words of a K tile live in the operand layout: lane (g, t) of a warp holds words 4t..4t+3 of
    rows g and g + 8 of the warp's 16 rows. With split_words the tile is [block_n, 4 (lane t), 4 (word w)], else
    [block_n, 16] words (the TMA tile of the producer form); the registers are the same."""
    if split_words:
        row, word = (lambda r: [r, 0, 0]), (lambda w: [0, w // 4, w % 4])
        shape = [block_n, 4, 4]
    else:
        row, word = (lambda r: [r, 0]), (lambda w: [0, w])
        shape = [block_n, 16]
    return gl.DistributedLinearLayout(
        reg_bases=[word(1), word(2), row(8)], lane_bases=[word(4), word(8), row(1), row(2), row(4)],
        warp_bases=[row(16 << i) for i in range(warps.bit_length() - 1)], block_bases=[], shape=shape)


@gluon.jit
def _operand(words, scale, zero, DTYPE: gl.constexpr, HAS_ZEROS: gl.constexpr, a_layout: gl.constexpr):
    """Packed words [BN, 4 (t), 4 (w)] -> the dequantized operand [BN, BLOCK_K] in a_layout, in place (no data
    moves)."""
    IS_BF16: gl.constexpr = DTYPE == gl.bfloat16
    MAGIC: gl.constexpr = BF16_MAGIC if IS_BF16 else FP16_MAGIC
    if HAS_ZEROS:
        zero_bias = (zero.to(gl.float32) + MAGIC).to(DTYPE)
    else:
        zero_bias = gl.full(scale.shape, MAGIC + 8.0, DTYPE, layout=scale.type.layout)
    s_bits = gl.broadcast(gl.expand_dims(scale.to(gl.int16, bitcast=True), 2), words)[0]
    z_bits = gl.broadcast(gl.expand_dims(zero_bias.to(gl.int16, bitcast=True), 2), words)[0]
    v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
        _DEQUANT_BF16 if IS_BF16 else _DEQUANT_FP16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [words, z_bits, s_bits],
        dtype=(gl.int16,) * 8, is_pure=True, pack=1)
    # v_j[n, t, w] is physical k = 32t + 8w + j with j = 4h + 2s + e; the operand wants logical
    # k = 16(2w + h) + 8s + 2t + e, i.e. the dims [n, w, h, s, t, e].
    p00 = gl.join(gl.permute(v0, [0, 2, 1]), gl.permute(v1, [0, 2, 1]))  # h = 0, s = 0: [n, w, t, e]
    p01 = gl.join(gl.permute(v2, [0, 2, 1]), gl.permute(v3, [0, 2, 1]))  # h = 0, s = 1
    p10 = gl.join(gl.permute(v4, [0, 2, 1]), gl.permute(v5, [0, 2, 1]))  # h = 1, s = 0
    p11 = gl.join(gl.permute(v6, [0, 2, 1]), gl.permute(v7, [0, 2, 1]))  # h = 1, s = 1
    tile = gl.permute(gl.join(gl.join(p00, p01), gl.join(p10, p11)), [0, 1, 5, 4, 2, 3])  # [n, w, t, e, s, h] ->
    tile = gl.reshape(tile, [words.shape[0], _BK]).to(DTYPE, bitcast=True)  # [n, w, h, s, t, e]
    return gl.convert_layout(tile, a_layout, assert_trivial=True)


@gluon.jit
def _load_scales(s_ptr, z_ptr, meta_off, lane_k, k0, K, GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr):
    """The scale (and zero) of each (row, lane chunk) of the K tile at k0; past K: scale 0, so the weights are 0."""
    k = k0 + lane_k
    in_k = k < K
    scale = gl.load(s_ptr + meta_off + k // GROUP_SIZE, mask=in_k, other=0.0)
    if HAS_ZEROS:
        zero = gl.load(z_ptr + meta_off + k // GROUP_SIZE, mask=in_k, other=8)
    else:
        zero = scale  # unused
    return scale, zero


# x in its natural order (config.x_natural, producer form only): no operand-ordered copy of x. Then logical k is
# physical k, and lane (g, t) needs, for each 16-k block b, k = 16b + 2t + e and 16b + 8 + 2t + e of its rows: pair t
# of words 2b and 2b + 1 (a word holds 8 consecutive k; its pair p is the nibbles of k 2p and 2p + 1). So the four
# lanes of a quad all read the 16 words of their two rows (the same addresses: shared-memory broadcasts) and each
# dequantizes its own pair of every word: a shift, a lop3, a sub and a mul per pair, as many instructions as the
# operand-ordered form, with 4x the shared-memory reads of the weights. A lane's k now span the whole K tile, so with
# G = 32 or 64 its words fall into 4 or 2 groups.


@triton.constexpr_function
def _natural_layout(block_n, warps, groups):
    """[BLOCK_N, 4 (lane t), groups, 16 // groups (words of a group)]: lane (g, t) holds the 16 words of rows g and
    g + 8 of its warp's 16 rows (the same words for every t)."""
    per_group = 16 // groups
    row = lambda r: [r, 0, 0, 0]  # noqa: E731
    word = lambda w: [0, 0, w // per_group, w % per_group]  # noqa: E731
    return gl.DistributedLinearLayout(
        reg_bases=[word(1), word(2), word(4), word(8), row(8)],
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], row(1), row(2), row(4)],
        warp_bases=[row(16 << i) for i in range(warps.bit_length() - 1)], block_bases=[],
        shape=[block_n, 4, groups, per_group])


@triton.constexpr_function
def _natural_words_layout(block_n, warps):
    """The [BLOCK_N, 16] words tile as _natural_layout holds it: no lane bits for t (a broadcast load)."""
    row = lambda r: [r, 0]  # noqa: E731
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], row(8)], lane_bases=[[0, 0], [0, 0], row(1), row(2), row(4)],
        warp_bases=[row(16 << i) for i in range(warps.bit_length() - 1)], block_bases=[], shape=[block_n, 16])


def natural_dequant_asm(is_bf16: bool) -> str:
    """PTX for one pair of a word: inputs $2 the word, $3 the shift (4 * pair), $4 the bits of MAGIC + z, $5 the bits
    of the scale; outputs $0 (the pair's lower k) and $1."""
    magic = magic_pair_hex(is_bf16)
    kind = "bf16x2" if is_bf16 else "f16x2"
    return "\n".join([
        "{", ".reg .b32 p, zb, sc;", "mov.b32 zb, {$4, $4};", "mov.b32 sc, {$5, $5};", "shr.u32 p, $2, $3;",
        f"lop3.b32 p, p, 0x000f000f, {magic}, 0xea;", f"sub.rn.{kind} p, p, zb;", f"mul.rn.{kind} p, p, sc;",
        "mov.b32 {$0, $1}, p;", "}"])


_NATURAL_BF16 = gl.constexpr(natural_dequant_asm(True))
_NATURAL_FP16 = gl.constexpr(natural_dequant_asm(False))


@gluon.jit
def _natural_operand(words, scale, zero, DTYPE: gl.constexpr, HAS_ZEROS: gl.constexpr, layout: gl.constexpr,
                     a_layout: gl.constexpr):
    """Words [BN, 16] (every lane of a quad holding the same) and the scales (and zeros) [BN, 1, groups, 1] ->
    the dequantized operand [BN, BLOCK_K] in a_layout."""
    IS_BF16: gl.constexpr = DTYPE == gl.bfloat16
    MAGIC: gl.constexpr = BF16_MAGIC if IS_BF16 else FP16_MAGIC
    BN: gl.constexpr = layout.shape[0]
    GROUPS: gl.constexpr = layout.shape[2]
    words = gl.convert_layout(gl.reshape(words, [BN, GROUPS, 16 // GROUPS]), gl.SliceLayout(1, layout),
                              assert_trivial=True)
    shift = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, layout)))) * 4
    words, shift = gl.broadcast(gl.expand_dims(words, 1), gl.expand_dims(gl.expand_dims(gl.expand_dims(shift, 0),
                                                                                           2), 3))
    if HAS_ZEROS:
        zero_bias = (zero.to(gl.float32) + MAGIC).to(DTYPE)
    else:
        zero_bias = gl.full(scale.shape, MAGIC + 8.0, DTYPE, layout=scale.type.layout)
    s_bits = gl.broadcast(scale.to(gl.int16, bitcast=True), words)[0]
    z_bits = gl.broadcast(zero_bias.to(gl.int16, bitcast=True), words)[0]
    lo, hi = gl.inline_asm_elementwise(_NATURAL_BF16 if IS_BF16 else _NATURAL_FP16, "=h,=h,r,r,h,h",
                                       [words, shift, z_bits, s_bits], dtype=(gl.int16, gl.int16), is_pure=True,
                                       pack=1)
    # [n, t, group, word, e] is k = 8 * (group * 16 // GROUPS + word) + 2t + e: order the dims [n, group, word, t, e].
    tile = gl.permute(gl.join(lo, hi), [0, 2, 3, 1, 4])
    tile = gl.reshape(tile, [BN, _BK]).to(DTYPE, bitcast=True)
    return gl.convert_layout(tile, a_layout, assert_trivial=True)


@gluon.jit
def _natural_scales(s_ptr, z_ptr, meta_off, group, k0, K, GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr):
    """The scales (and zeros) [BN, 1, groups, 1] of the K tile at k0 for the natural form; past K: scale 0."""
    in_k = k0 + group * GROUP_SIZE < K
    index = meta_off + k0 // GROUP_SIZE + group
    scale = gl.load(s_ptr + index, mask=in_k, other=0.0)
    if HAS_ZEROS:
        zero = gl.load(z_ptr + index, mask=in_k, other=8)
    else:
        zero = scale  # unused
    return scale, zero


@gluon.jit
def _issue(x_ring, w_ring, x_bars, x_desc, x_row0, x_ptrs, x_k, qw_ptr, w_off, lane_word, words_per_row, K, tile,
           stage, X_GATHER: gl.constexpr):
    """K tile `tile` into ring stage `stage`: x by TMA (operand-ordered copy) or cp.async (gather), the packed
    weights by cp.async."""
    if X_GATHER:  # natural-order x is not padded to whole tiles
        _async_load(x_ring.index(stage), x_ptrs + tile * _BK, mask=(tile * _BK + x_k) < K)
    else:  # rows past M and k past the padded K arrive as zeros
        mbarrier.expect(x_bars.index(stage), x_desc.block_type.nbytes)
        _tma_load(x_desc, [x_row0, tile * _BK], x_bars.index(stage), x_ring.index(stage))
    word0 = tile * (_BK // 8)
    _async_load(w_ring.index(stage), qw_ptr + w_off + word0,
                mask=gl.expand_dims((word0 + lane_word) < words_per_row, 2))


@gluon.jit
def _tile_step(acc, scale, zero, i, t0, t1, n_t, x_ring, w_ring, x_bars, x_desc, x_row0, x_ptrs, x_k, qw_ptr, s_ptr,
               z_ptr, w_off, meta_off, lane_word, lane_k, words_per_row, K, w_layout: gl.constexpr,
               a_layout: gl.constexpr,
               DTYPE: gl.constexpr, GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, STAGES: gl.constexpr,
               ONE_WARPGROUP: gl.constexpr, X_GATHER: gl.constexpr):
    """K tile t0 + i: returns the accumulator (its wgmma still in flight) and the next tile's scales and zeros."""
    # The next tile's scales (the last tile reloads its own: an unconditional load).
    scale_next, zero_next = _load_scales(s_ptr, z_ptr, meta_off, lane_k, gl.minimum(t0 + i + 1, t1 - 1) * _BK, K,
                                         GROUP_SIZE, HAS_ZEROS)
    stage = i % STAGES
    if ONE_WARPGROUP:
        async_copy.wait_group(STAGES - 2)
        _cta_barrier()  # every thread's copies of this stage have landed
    else:
        # Refill the stage of tile i - 2 first: after this barrier every warpgroup has waited for its wgmma i - 2.
        async_copy.wait_group(STAGES - 3)
        _cta_barrier()
        if i + STAGES - 2 < n_t:
            _issue(x_ring, w_ring, x_bars, x_desc, x_row0, x_ptrs, x_k, qw_ptr, w_off, lane_word, words_per_row, K,
                   t0 + i + STAGES - 2, (i + STAGES - 2) % STAGES, X_GATHER)
        async_copy.commit_group()
    words = w_ring.index(stage).load(w_layout)
    a = _operand(words, scale, zero, DTYPE, HAS_ZEROS, a_layout)
    if X_GATHER:
        # cp.async writes x through the generic proxy and wgmma reads it through the async proxy. This fence
        # also waits for all of the thread's loads in flight (the next scales), which TMA avoids.
        fence_async_shared()
    else:
        mbarrier.wait(x_bars.index(stage), (i // STAGES) & 1)
    acc = warpgroup_mma(a, x_ring.index(stage).permute((1, 0)), acc, is_async=True)
    acc, a = warpgroup_mma_wait(num_outstanding=1, deps=[acc, a])  # the wgmma of tile i - 1 is done
    if ONE_WARPGROUP:  # its stage is free: this warpgroup was its only reader
        if i + STAGES - 1 < n_t:
            _issue(x_ring, w_ring, x_bars, x_desc, x_row0, x_ptrs, x_k, qw_ptr, w_off, lane_word, words_per_row, K,
                   t0 + i + STAGES - 1, (i + STAGES - 1) % STAGES, X_GATHER)
        async_copy.commit_group()
    return acc, scale_next, zero_next


@gluon.jit
def _store(acc, bias_ptr, out_ptr, M, N, stride_om, split_stride, pid_n, pid_m, pid_k, HAS_BIAS: gl.constexpr,
           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT_K: gl.constexpr, WARPS: gl.constexpr):
    """The epilogue of both kernels: acc [BLOCK_N, BLOCK_M] (+ bias) into out, or split pid_k's fp32 slice."""
    # out[m, n] is contiguous along n, the accumulator's rows, so each thread stores 8 consecutive n.
    out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [BLOCK_N // 8, 256 // BLOCK_N], [1, WARPS], [0, 1])
    result = gl.convert_layout(acc, out_layout)
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))
    if HAS_BIAS and SPLIT_K == 1:  # with split-K the reduction adds it
        result += gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)[:, None]
    if SPLIT_K > 1:  # out_ptr is the fp32 workspace, one [M, N] slice per split
        out_ptr += pid_k * split_stride
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    gl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))


@gluon.jit
def w4a16_wgmma_kernel(
    x_ptr, x_desc, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,  # see the module docstring and launch_wgmma
    M, N, K, stride_xm, stride_om, split_stride,
    GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr,
    WARPS: gl.constexpr, X_GATHER: gl.constexpr,
):
    DTYPE: gl.constexpr = x_ptr.dtype.element_ty
    BK: gl.constexpr = _BK
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)

    # Layouts. Weight rows: 16 per warp (64 per warpgroup), rows g and g + 8 in lane group g.
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, WARPS)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    w_layout: gl.constexpr = _words_layout(BLOCK_N, WARPS, True)
    meta_layout: gl.constexpr = gl.SliceLayout(2, w_layout)  # [BLOCK_N, 4]: one scale per row and lane chunk

    # Rows past N are clamped to the last row: loaded and computed like any other, never stored.
    rows = gl.minimum(pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, meta_layout)), N - 1)
    lane_t = gl.arange(0, 4, layout=gl.SliceLayout(0, meta_layout))
    word_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_layout)))
    words_per_row = gl.multiple_of(K // 8, 4)  # K % 32 == 0 since G >= 32 divides K
    lane_word = lane_t[None, :] * 4  # a lane's first word in a tile
    w_off = (gl.expand_dims(gl.expand_dims(rows, 1) * words_per_row + lane_word, 2)
             + gl.expand_dims(gl.expand_dims(word_w, 0), 1))
    meta_off = gl.expand_dims(rows, 1) * (K // GROUP_SIZE)
    lane_k = lane_t[None, :] * 32  # a lane's first k in a tile

    if X_GATHER:  # natural-order x by cp.async: logical k = 16b + 8s + 2t + e reads physical k = 32t + 4b + 2s + e
        x_layout: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [WARPS, 1], [1, 0])  # 4-byte pairs
        x_rows = gl.minimum(pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout)), M - 1)
        x_k = gl.arange(0, BK, layout=gl.SliceLayout(0, x_layout))
        x_k = (x_k % 8 // 2) * 32 + x_k // 16 * 4 + x_k % 16 // 8 * 2 + x_k % 2
        x_k = gl.max_contiguous(gl.multiple_of(x_k, 2), 2)[None, :]
        x_ptrs = x_ptr + gl.expand_dims(x_rows, 1) * stride_xm + x_k
    else:  # the operand-ordered copy by TMA (x_desc)
        x_k = None
        x_ptrs = None

    k_tiles = gl.cdiv(K, BK)
    per_split = gl.cdiv(k_tiles, SPLIT_K)
    t0 = pid_k * per_split
    t1 = gl.minimum(t0 + per_split, k_tiles)
    n_t = t1 - t0  # may be <= 0 for the last splits: they store zeros

    x_ring = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_M, BK],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BK], DTYPE))
    x_row0 = pid_m * BLOCK_M
    if X_GATHER:
        x_bars = None
    else:  # one barrier per stage, completed by the bytes of its TMA copy
        x_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(x_bars.index(s), count=1)
        _cta_barrier()  # initialised before any thread waits on them
    w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 4, 4], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    ONE_WARPGROUP: gl.constexpr = WARPS == 4
    AHEAD: gl.constexpr = STAGES - 1 if ONE_WARPGROUP else STAGES - 2  # tiles in flight before the loop
    for i in gl.static_range(AHEAD):
        if i < n_t:
            _issue(x_ring, w_ring, x_bars, x_desc, x_row0, x_ptrs, x_k, qw_ptr, w_off, lane_word, words_per_row, K,
                   t0 + i, i, X_GATHER)
        async_copy.commit_group()

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
    scale, zero = _load_scales(scales_ptr, zeros_ptr, meta_off, lane_k, t0 * BK, K, GROUP_SIZE, HAS_ZEROS)
    # Two tiles per iteration, unconditionally, so consecutive operands are distinct registers (module docstring).
    for i in range(0, n_t - 1, 2):
        acc, scale, zero = _tile_step(acc, scale, zero, i, t0, t1, n_t, x_ring, w_ring, x_bars, x_desc, x_row0,
                                      x_ptrs, x_k, qw_ptr, scales_ptr, zeros_ptr, w_off, meta_off, lane_word,
                                      lane_k, words_per_row, K, w_layout, a_layout, DTYPE, GROUP_SIZE, HAS_ZEROS,
                                      STAGES, ONE_WARPGROUP, X_GATHER)
        acc, scale, zero = _tile_step(acc, scale, zero, i + 1, t0, t1, n_t, x_ring, w_ring, x_bars, x_desc, x_row0,
                                      x_ptrs, x_k, qw_ptr, scales_ptr, zeros_ptr, w_off, meta_off, lane_word,
                                      lane_k, words_per_row, K, w_layout, a_layout, DTYPE, GROUP_SIZE, HAS_ZEROS,
                                      STAGES, ONE_WARPGROUP, X_GATHER)
    if n_t % 2 == 1:
        acc, scale, zero = _tile_step(acc, scale, zero, n_t - 1, t0, t1, n_t, x_ring, w_ring, x_bars, x_desc, x_row0,
                                      x_ptrs, x_k, qw_ptr, scales_ptr, zeros_ptr, w_off, meta_off, lane_word,
                                      lane_k, words_per_row, K, w_layout, a_layout, DTYPE, GROUP_SIZE, HAS_ZEROS,
                                      STAGES, ONE_WARPGROUP, X_GATHER)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    async_copy.wait_group(0)

    _store(acc, bias_ptr, out_ptr, M, N, stride_om, split_stride, pid_n, pid_m, pid_k, HAS_BIAS, BLOCK_M, BLOCK_N,
           SPLIT_K, WARPS)


# The warp-specialized form (config.producer). One producer warp copies each K tile's x (the operand-ordered copy)
# and packed weights by TMA into a ring of stages, completing the stage's "ready" mbarrier; the consumer warps (one
# or two warpgroups) wait on it, read the words into the operand layout, dequantize, issue the wgmma, and release
# the stage of the tile before through its "empty" mbarrier once that tile's wgmma is done. The consumers then issue
# no copies and do no address arithmetic for them, and the copies run up to the whole ring ahead. With it and
# 256-token tiles the tuner's best per case was 1.02-1.39x faster at M = 128..4096 on the H200 (PERF.md).


@gluon.jit
def _produce(x_desc, w_desc, x_ring, w_ring, ready, empty, x_row0, w_row0, t0, n_t):
    STAGES: gl.constexpr = x_ring.type.shape[0]
    for i in range(n_t):
        stage = i % STAGES
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        mbarrier.expect(ready.index(stage), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        _tma_load(x_desc, [x_row0, (t0 + i) * _BK], ready.index(stage), x_ring.index(stage))
        _tma_load(w_desc, [w_row0, (t0 + i) * (_BK // 8)], ready.index(stage), w_ring.index(stage))


@gluon.jit
def _consume_tile(acc, scale, zero, i, t0, n_t, x_ring, w_ring, ready, empty, s_ptr, z_ptr, meta_off, lane_k, K,
                  words_layout: gl.constexpr, w_layout: gl.constexpr, a_layout: gl.constexpr, DTYPE: gl.constexpr,
                  GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, X_NATURAL: gl.constexpr):
    """K tile t0 + i: returns the accumulator (its wgmma still in flight) and the next tile's scales and zeros."""
    STAGES: gl.constexpr = x_ring.type.shape[0]
    BLOCK_N: gl.constexpr = w_ring.type.shape[1]
    stage = i % STAGES
    mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
    words = w_ring.index(stage).load(words_layout)
    fence_async_shared()  # these generic reads come before the producer's next (async proxy) copy into the stage
    next_k0 = gl.minimum(t0 + i + 1, t0 + n_t - 1) * _BK
    if X_NATURAL:  # w_layout: _natural_layout; lane_k: the group index [1, 1, groups, 1]
        scale_next, zero_next = _natural_scales(s_ptr, z_ptr, meta_off, lane_k, next_k0, K, GROUP_SIZE, HAS_ZEROS)
        a = _natural_operand(words, scale, zero, DTYPE, HAS_ZEROS, w_layout, a_layout)
    else:
        words = gl.convert_layout(gl.reshape(words, [BLOCK_N, 4, 4]), w_layout, assert_trivial=True)
        scale_next, zero_next = _load_scales(s_ptr, z_ptr, meta_off, lane_k, next_k0, K, GROUP_SIZE, HAS_ZEROS)
        a = _operand(words, scale, zero, DTYPE, HAS_ZEROS, a_layout)
    acc = warpgroup_mma(a, x_ring.index(stage).permute((1, 0)), acc, is_async=True)
    acc, a = warpgroup_mma_wait(num_outstanding=1, deps=[acc, a])  # tile i - 1's wgmma is done: free its stage
    mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    return acc, scale_next, zero_next


@gluon.jit
def _consume(x_ring, w_ring, ready, empty, s_ptr, z_ptr, rows, t0, n_t, K, BLOCK_M: gl.constexpr,
             WARPS: gl.constexpr, DTYPE: gl.constexpr, GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr,
             X_NATURAL: gl.constexpr):
    BLOCK_N: gl.constexpr = w_ring.type.shape[1]
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, WARPS)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    if X_NATURAL:
        GROUPS: gl.constexpr = _BK // GROUP_SIZE if GROUP_SIZE < _BK else 1
        w_layout: gl.constexpr = _natural_layout(BLOCK_N, WARPS, GROUPS)
        words_layout: gl.constexpr = _natural_words_layout(BLOCK_N, WARPS)
        row_slice: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, w_layout)))
        meta_off = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.convert_layout(rows, row_slice), 1), 2), 3)
        meta_off = meta_off * (K // GROUP_SIZE)
        lane_k = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, w_layout))))
        lane_k = gl.expand_dims(gl.expand_dims(gl.expand_dims(lane_k, 0), 1), 3)  # the group index [1, 1, G, 1]
        scale, zero = _natural_scales(s_ptr, z_ptr, meta_off, lane_k, t0 * _BK, K, GROUP_SIZE, HAS_ZEROS)
    else:
        w_layout: gl.constexpr = _words_layout(BLOCK_N, WARPS, True)
        words_layout: gl.constexpr = _words_layout(BLOCK_N, WARPS, False)  # the same registers as the TMA tile's
        meta_layout: gl.constexpr = gl.SliceLayout(2, w_layout)
        meta_off = gl.expand_dims(gl.convert_layout(rows, gl.SliceLayout(1, meta_layout)), 1) * (K // GROUP_SIZE)
        lane_k = gl.arange(0, 4, layout=gl.SliceLayout(0, meta_layout))[None, :] * 32
        scale, zero = _load_scales(s_ptr, z_ptr, meta_off, lane_k, t0 * _BK, K, GROUP_SIZE, HAS_ZEROS)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
    # Two tiles per iteration, so consecutive operands are distinct registers (module docstring).
    for i in range(0, n_t - 1, 2):
        acc, scale, zero = _consume_tile(acc, scale, zero, i, t0, n_t, x_ring, w_ring, ready, empty, s_ptr, z_ptr,
                                         meta_off, lane_k, K, words_layout, w_layout, a_layout, DTYPE, GROUP_SIZE,
                                         HAS_ZEROS, X_NATURAL)
        acc, scale, zero = _consume_tile(acc, scale, zero, i + 1, t0, n_t, x_ring, w_ring, ready, empty, s_ptr,
                                         z_ptr, meta_off, lane_k, K, words_layout, w_layout, a_layout, DTYPE,
                                         GROUP_SIZE, HAS_ZEROS, X_NATURAL)
    if n_t % 2 == 1:
        acc, scale, zero = _consume_tile(acc, scale, zero, n_t - 1, t0, n_t, x_ring, w_ring, ready, empty, s_ptr,
                                         z_ptr, meta_off, lane_k, K, words_layout, w_layout, a_layout, DTYPE,
                                         GROUP_SIZE, HAS_ZEROS, X_NATURAL)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    return (acc, )  # a tuple: Triton 3.6 takes the default partition's result as a sequence


@gluon.jit
def w4a16_wgmma_ws_kernel(
    x_desc, w_desc, scales_ptr, zeros_ptr, bias_ptr, out_ptr,  # see launch_wgmma
    M, N, K, stride_om, split_stride,
    GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr, WARPS: gl.constexpr,
    X_NATURAL: gl.constexpr,
):
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    k_tiles = gl.cdiv(K, _BK)
    per_split = gl.cdiv(k_tiles, SPLIT_K)
    t0 = pid_k * per_split
    n_t = gl.maximum(gl.minimum(t0 + per_split, k_tiles) - t0, 0)  # the last splits may be empty: they store zeros
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, _BK], x_desc.layout)
    w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, _BK // 8], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    # Rows past N are clamped to the last row for the scales; their weights arrive as TMA zeros; never stored.
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    rows = gl.minimum(pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=row_layout), N - 1)
    acc = gl.warp_specialize([
        (_consume, (x_ring, w_ring, ready, empty, scales_ptr, zeros_ptr, rows, t0, n_t, K, BLOCK_M, WARPS,
                    x_desc.dtype, GROUP_SIZE, HAS_ZEROS, X_NATURAL)),
        (_produce, (x_desc, w_desc, x_ring, w_ring, ready, empty, pid_m * BLOCK_M, pid_n * BLOCK_N, t0, n_t)),
    ], [1], [_PRODUCER_REGISTERS])[0]
    _store(acc, bias_ptr, out_ptr, M, N, stride_om, split_stride, pid_n, pid_m, pid_k, HAS_BIAS, BLOCK_M, BLOCK_N,
           SPLIT_K, WARPS)


# The packed weight tile of the producer form: [BLOCK_N, 16] words, unswizzled, so a consumer lane's 16 bytes of
# a row are contiguous and a warp's loads cover 512 consecutive bytes (no bank conflicts).
W_TILE_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
# With x_natural every lane reads whole 64-byte rows, 8 rows per warp at once: unswizzled, rows r and r + 2 would share
# banks. The 64-byte swizzle moves each pair of rows' 16-byte pieces to other banks.
W_TILE_LAYOUT_NATURAL = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32, rank=2)


def w_tile_layout(config: TileConfig) -> gl.NVMMASharedLayout:
    return W_TILE_LAYOUT_NATURAL if config.x_natural else W_TILE_LAYOUT


def producer_ctas_per_sm(block_m: int, num_warps: int, num_stages: int) -> int:
    """CTAs of a producer-form launch that one SM holds at once: two where one consumer warpgroup's ring leaves
    room for a second (producer_max_registers sizes the registers for it), else one."""
    ring_bytes = num_stages * (block_m * BLOCK_K * 2 + 16 * num_warps * BLOCK_K // 2)
    return 2 if num_warps == 4 and ring_bytes <= 110 * 1024 else 1


def producer_max_registers(block_m: int, num_warps: int, num_stages: int) -> int:
    """maxnreg of a producer-form launch: the register file split over its warps (the producer warp counts as a
    whole warpgroup) and over the CTAs an SM holds; at most 232, what the consumers can be given while the producer
    keeps PRODUCER_REGISTERS."""
    ctas = producer_ctas_per_sm(block_m, num_warps, num_stages)
    return min(232, 65536 // (32 * (num_warps + 4) * ctas) // 8 * 8)


def last_wave_rows(config: TileConfig, m: int, n: int, sms: int) -> tuple[int, TileConfig] | None:
    """Where a producer-form launch would end in a partial wave (tiles past a multiple of the CTAs the GPU holds at
    once, running while the other SMs idle): (rows, config for the rest). Weight rows [0, rows) fill whole waves
    with `config`; the rows after them form a second launch of last_wave_configs' smaller token tiles, the smallest
    of them that still make at most one tile per SM. Not more: tiles of fewer tokens dequantize each weight tile for
    fewer tokens, and two or three of them on an SM lost to one larger one (PERF.md). None where the tiles fill no
    whole wave or no smaller tiles fit."""
    slots = sms * producer_ctas_per_sm(config.block_m, config.num_warps, config.num_stages)
    token_tiles = triton.cdiv(m, config.block_m)
    row_tiles = triton.cdiv(n, config.block_n)
    waves = row_tiles * token_tiles // slots
    full_rows = waves * slots // token_tiles  # row tiles whose tiles fill the whole waves
    if waves == 0 or full_rows >= row_tiles:
        return None
    fitting = [rest for rest in last_wave_configs(config)
               if (row_tiles - full_rows) * triton.cdiv(m, rest.block_m) <= sms]
    return (full_rows * config.block_n, fitting[-1]) if fitting else None


@triton.jit
def operand_order_kernel(x_ptr, out_ptr, M, K, stride_xm, stride_om, BLOCK_R: tl.constexpr):
    """One [BLOCK_R, BLOCK_K] tile of operand_order: loaded in physical order, permuted in registers, stored in
    operand order, so both sides are whole-row vector accesses."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1) * _BK + tl.arange(0, _BK)
    tile = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                   other=0.0)
    tile = tl.reshape(tile, [BLOCK_R, 4, 8, 2, 2])  # physical k = 32t + 4b + 2s + e: [r, t, b, s, e]
    tile = tl.reshape(tl.permute(tile, [0, 2, 3, 1, 4]), [BLOCK_R, _BK])  # [r, b, s, t, e]: 16b + 8s + 2t + e
    tl.store(out_ptr + rows[:, None] * stride_om + k[None, :], tile, mask=rows[:, None] < M)


def operand_order(x2d: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> [M, K rounded up to 128] with each 128-wide tile in the kernel's operand order (zero padded):
    column 16b + 8s + 2t + e of a tile holds physical k = 32t + 4b + 2s + e. On a GPU one Triton kernel does it
    (torch's strided copy of the same permutation took 2.2-7.1 µs at M = 64..128, PERF.md); elsewhere torch."""
    m, k = x2d.shape
    padded = triton.cdiv(k, BLOCK_K) * BLOCK_K
    if x2d.is_cuda:
        out = torch.empty((m, padded), dtype=x2d.dtype, device=x2d.device)
        block_r = 16
        operand_order_kernel[(triton.cdiv(m, block_r), padded // BLOCK_K)](
            x2d, out, m, k, x2d.stride(0), out.stride(0), BLOCK_R=block_r, num_warps=4)
        return out
    if padded != k:
        x2d = torch.nn.functional.pad(x2d, (0, padded - k))
    return x2d.view(m, padded // BLOCK_K, 4, 8, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(m, padded)


def x_layout_for(block_m: int, dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of an x tile [block_m, BLOCK_K]: the kernel's ring and the TMA descriptor agree on
    it. dtype: a Gluon or torch 16-bit float type."""
    if isinstance(dtype, torch.dtype):
        dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]
    return gl.NVMMASharedLayout.get_default_for([block_m, BLOCK_K], dtype)


def x_descriptor(x_ordered: torch.Tensor, block_m: int):
    """The TMA descriptor of x (the operand-ordered copy, or x itself for x_natural), in [block_m, BLOCK_K] boxes;
    rows past M and k past K read as zeros."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(x_ordered, [block_m, BLOCK_K], x_layout_for(block_m, x_ordered.dtype))


def weight_descriptor(qweight: torch.Tensor, config: TileConfig):
    """The TMA descriptor of the packed weights [N, K // 8] in [block_n, 16]-word boxes (one K tile of block_n rows);
    rows past N and words past K // 8 read as zeros."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if qweight.data_ptr() % 16:  # TMA needs a 16-byte aligned base; a view into a larger buffer may not have one
        qweight = qweight.clone()
    return TensorDescriptor.from_tensor(qweight, [config.block_n, BLOCK_K // 8], w_tile_layout(config))


@functools.cache
def unsupported_reason(device: torch.device) -> str | None:
    """None where this kernel can run on `device`, else why not."""
    if device.type != "cuda" or getattr(torch.version, "hip", None):
        return "the wgmma kernel is NVIDIA-only"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return f"the wgmma kernel needs an sm_90 GPU (this is sm_{''.join(map(str, torch.cuda.get_device_capability(device)))})"
    return None


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_wgmma(x2d: torch.Tensor, qw, bias: torch.Tensor | None, config: TileConfig,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch on a validated, row-contiguous x2d [M, K] with a `kernel == "wgmma"` config; [M, N] in x's dtype."""
    reason = unsupported_reason(x2d.device)
    if reason is not None:
        raise RuntimeError(f"tile config {config} selects the wgmma kernel, but {reason}")
    m, k = x2d.shape
    n = qw.n
    if triton.cdiv(m, config.block_m) > GRID_YZ_MAX:
        raise ValueError(f"M={m} makes {triton.cdiv(m, config.block_m)} token tiles of {config.block_m}, past the "
                         f"{GRID_YZ_MAX} a launch grid's y extent allows: too many rows for the wgmma kernel")
    if out is None:
        out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    if config.x_gather:
        # cp.async copies 16-byte pieces of x, which Triton compiles only with its alignment hints on x: a 16-byte
        # aligned base and a row stride divisible by 16 (elements). Any other view is copied once.
        gather_ready = x2d.data_ptr() % 16 == 0 and x2d.stride(0) % 16 == 0
        x_in = x2d if gather_ready else torch.empty((m, k), dtype=x2d.dtype, device=x2d.device).copy_(x2d)
    elif config.x_natural:  # TMA reads x as it is, if its base and row stride are 16-byte multiples
        tma_ready = x2d.data_ptr() % 16 == 0 and x2d.stride(0) % 8 == 0 and x2d.stride(0) >= k
        x_in = x2d if tma_ready else torch.empty((m, k), dtype=x2d.dtype, device=x2d.device).copy_(x2d)
    else:
        x_in = operand_order(x2d)
    plan = last_wave_rows(config, m, n, _sm_count(x2d.device))
    if plan is None:
        _launch_rows(x_in, qw, 0, n, bias, config, out, m, k)
    else:  # whole waves, then the rows of the last one in smaller tiles
        rows, rest = plan
        _launch_rows(x_in, qw, 0, rows, bias, config, out, m, k)
        _launch_rows(x_in, qw, rows, n, bias, rest, out, m, k)
    return out


def _launch_rows(x_in, qw, start: int, stop: int, bias, config: TileConfig, out: torch.Tensor, m: int,
                 k: int) -> None:
    """One launch for weight rows [start, stop): out[:, start:stop] = x @ W[start:stop]^T (+ bias)."""
    n = stop - start
    x_desc = None if config.x_gather else x_descriptor(x_in, config.block_m)
    qweight, scales = qw.qweight[start:stop], qw.scales[start:stop]
    zeros = qw.zeros[start:stop] if qw.zeros is not None else scales  # never read when HAS_ZEROS is false
    bias = bias[start:stop] if bias is not None else None
    out = out[:, start:stop]
    split_k = config.for_shape(m, n, k).split_k
    target = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=out.device)
    bias_or_any = bias if bias is not None else scales  # never read when HAS_BIAS is false
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), split_k)
    common = dict(GROUP_SIZE=qw.group_size, HAS_ZEROS=qw.zeros is not None, HAS_BIAS=bias is not None,
                  BLOCK_M=config.block_m, BLOCK_N=config.block_n, STAGES=config.num_stages, SPLIT_K=split_k,
                  WARPS=config.num_warps, num_warps=config.num_warps)
    if config.producer:
        w_desc = weight_descriptor(qweight, config)
        w4a16_wgmma_ws_kernel[grid](
            x_desc, w_desc, scales, zeros, bias_or_any, target, m, n, k, target.stride(-2), m * n, **common,
            X_NATURAL=config.x_natural, maxnreg=producer_max_registers(config.block_m, config.num_warps, config.num_stages))
    else:
        w4a16_wgmma_kernel[grid](
            x_in, x_desc, qweight, scales, zeros, bias_or_any, target,
            m, n, k, x_in.stride(0), target.stride(-2), m * n, X_GATHER=config.x_gather, **common)
    if split_k > 1:
        add_splits(target, bias, out)
