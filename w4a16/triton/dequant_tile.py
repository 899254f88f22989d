"""Dequantize one [BLOCK_N, BLOCK_K] tile of the shared int4 layout inside a Triton kernel.

Input: `words` int32 [BLOCK_N, BLOCK_K // 8] (shuffle order, see `w4a16.layout`), `scales` [BLOCK_N] in the
activation dtype and `zero_bias` [BLOCK_N] = MAGIC + z in the activation dtype (one group per row: BLOCK_K divides
the group size, so a K tile never straddles two groups).

The magic-number trick (as in csrc/dequant.h): `(word >> 4p) & 0x000F000F` puts the nibbles of k = 2p and 2p + 1 into the low
mantissa bits of two 16-bit lanes; OR-ing the exponent pattern of MAGIC (1024.0 = 0x6400 in fp16, 128.0 = 0x4300
in bf16, both with a ulp of 1) makes each lane the float MAGIC + q exactly. Then

    w = ((MAGIC + q) - (MAGIC + z)) * s

is one exact subtraction and one rounding multiply per element: no integer-to-float conversion at all.

Two implementations of the same arithmetic, picked at trace time by the PTX constexpr:
- PTX (NVIDIA sm_90 only): one `lop3` (shift-and-mask-or in one instruction) per pair, then packed
  `sub.rn.{f16,bf16}x2` and `mul.rn.{f16,bf16}x2`: about 1.5-2 instructions per weight element. Compilers fold
  the portable bit tricks back into scalar work, so the packed form is spelled out.
- portable (HIP, the interpreter, other NVIDIA): the same bit pattern built with Triton integer ops and bitcasts.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The magic number of each dtype, the one owner of these constants for every kernel here: OR-ing its bits over a
# nibble q in the low mantissa bits makes the 16-bit float MAGIC + q exactly. *_PAIR: those bits in both halves of
# a 32-bit word (two lanes at once).
FP16_MAGIC = tl.constexpr(1024.0)  # 0x6400
BF16_MAGIC = tl.constexpr(128.0)  # 0x4300
FP16_MAGIC_PAIR = tl.constexpr(0x64006400)
BF16_MAGIC_PAIR = tl.constexpr(0x43004300)


def magic_pair_hex(is_bf16: bool) -> str:
    """The *_PAIR bits as a PTX immediate."""
    return f"{(BF16_MAGIC_PAIR if is_bf16 else FP16_MAGIC_PAIR).value:#010x}"

# lop3 truth table for (a & b) | c with the PTX operand encodings a = 0xF0, b = 0xCC, c = 0xAA.
_LOP3_AND_OR = 0xEA


def ptx_dequant_asm(is_bf16: bool) -> str:
    """PTX for one int32 word -> 8 dequantized 16-bit values (outputs $0..$7 in k order, inputs $8 word,
    $9 the bits of MAGIC + z, $10 the bits of the scale)."""
    magic = magic_pair_hex(is_bf16)
    kind = "bf16x2" if is_bf16 else "f16x2"
    lines = [
        "{",
        ".reg .b32 p0, p1, p2, p3, zb, sc;",
        "mov.b32 zb, {$9, $9};",
        "mov.b32 sc, {$10, $10};",
        f"lop3.b32 p0, $8, 0x000f000f, {magic}, {_LOP3_AND_OR:#x};",
    ]
    for p in (1, 2, 3):
        lines += [f"shr.u32 p{p}, $8, {4 * p};", f"lop3.b32 p{p}, p{p}, 0x000f000f, {magic}, {_LOP3_AND_OR:#x};"]
    for p in range(4):
        lines += [f"sub.rn.{kind} p{p}, p{p}, zb;", f"mul.rn.{kind} p{p}, p{p}, sc;"]
    # Low lane holds k = 2p, high lane k = 2p + 1 (the shuffle order).
    lines += [f"mov.b32 {{${2 * p}, ${2 * p + 1}}}, p{p};" for p in range(4)]
    lines.append("}")
    return "\n".join(lines)


_PTX_FP16 = tl.constexpr(ptx_dequant_asm(False))
_PTX_BF16 = tl.constexpr(ptx_dequant_asm(True))


@triton.jit
def _interleave8(v0, v1, v2, v3, v4, v5, v6, v7):
    """Eight [R, C] tensors (v_j = element j of each 8-run) -> [R, 8 C] with column 8 c + j = v_j[:, c].

    tl.join appends an innermost axis, so join on the highest bit of j first: the flattened index of the
    [R, C, 2, 2, 2] result is 4 * b2 + 2 * b1 + b0 = j."""
    a0 = tl.join(v0, v4)
    a1 = tl.join(v1, v5)
    a2 = tl.join(v2, v6)
    a3 = tl.join(v3, v7)
    b0 = tl.join(a0, a2)
    b1 = tl.join(a1, a3)
    c = tl.join(b0, b1)
    return tl.reshape(c, (v0.shape[0], v0.shape[1] * 8))


@triton.jit
def dequantize_tile(words, scales, zero_bias, DTYPE: tl.constexpr, PTX: tl.constexpr):
    """words int32 [R, C], scales [R] and zero_bias [R] in DTYPE -> the dequantized [R, 8 C] tile in DTYPE."""
    IS_BF16: tl.constexpr = DTYPE == tl.bfloat16
    if PTX:
        s_bits = tl.broadcast_to(scales.to(tl.int16, bitcast=True)[:, None], words.shape)
        z_bits = tl.broadcast_to(zero_bias.to(tl.int16, bitcast=True)[:, None], words.shape)
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _PTX_BF16 if IS_BF16 else _PTX_FP16,
            "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h",
            [words, z_bits, s_bits],
            dtype=(tl.int16,) * 8,
            is_pure=True,
            pack=1,
        )
        w = _interleave8(
            v0.to(DTYPE, bitcast=True), v1.to(DTYPE, bitcast=True), v2.to(DTYPE, bitcast=True),
            v3.to(DTYPE, bitcast=True), v4.to(DTYPE, bitcast=True), v5.to(DTYPE, bitcast=True),
            v6.to(DTYPE, bitcast=True), v7.to(DTYPE, bitcast=True),
        )
    else:
        MAGIC_BITS: tl.constexpr = BF16_MAGIC_PAIR if IS_BF16 else FP16_MAGIC_PAIR
        # Pair p = nibbles of k = 2p (low lane) and 2p + 1 (high lane), each lane now MAGIC + q.
        p0 = (words & 0x000F000F) | MAGIC_BITS
        p1 = ((words >> 4) & 0x000F000F) | MAGIC_BITS
        p2 = ((words >> 8) & 0x000F000F) | MAGIC_BITS
        p3 = ((words >> 12) & 0x000F000F) | MAGIC_BITS
        # The high lanes are positive (< 0x8000), so the arithmetic shift leaves a clean 16-bit value.
        w = _interleave8(
            (p0 & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True), (p0 >> 16).to(tl.int16).to(DTYPE, bitcast=True),
            (p1 & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True), (p1 >> 16).to(tl.int16).to(DTYPE, bitcast=True),
            (p2 & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True), (p2 >> 16).to(tl.int16).to(DTYPE, bitcast=True),
            (p3 & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True), (p3 >> 16).to(tl.int16).to(DTYPE, bitcast=True),
        )
        # Exact: both operands are integers below 2^11 (fp16) / 2^8 (bf16); then one rounding multiply.
        w = ((w - zero_bias[:, None]) * scales[:, None]).to(DTYPE)
    return w
