// Bit-level dequantization of the shared int4 layout: the "magic number" trick. Host and device code.
//
// A qweight word holds 8 nibbles in shuffle order: (word >> 4p) & 0x000F000F puts k = 2p in the low 16-bit lane
// and k = 2p + 1 in the high lane (w4a16/layout.py). OR-ing that pair into the bits of a 16-bit float whose ulp
// is 1 turns each nibble q into the float (offset + q) exactly, with no int->float conversion:
//   fp16: 0x6400 = 1024.0 (ulp 1 on [1024, 2048))  -> 1024 + q
//   bf16: 0x4300 =  128.0 (ulp 1 on [128, 256))    ->  128 + q
// The kernel feeds these raw (offset + q) pairs to its dot products and removes the offset afterwards, per
// 32-element chunk c of one group:  sum_k (q_k - z) x_k = sum_k (offset + q_k) x_k - (offset + z) * sum_k x_k.
// That costs one precomputed sum of x per chunk instead of a packed subtraction per pair (AMD has no packed bf16
// subtraction). In fp32 the offset costs at most ~log2(1024 / |q - z|) bits of the partial sum, far below the
// 16-bit output precision.
//
// The compiler must not turn the OR back into a conversion: the instruction summaries (w4a16 asm) show it stays a
// bitwise op (v_and_or_b32 / v_bfi on AMD, LOP3 on NVIDIA).
#pragma once

#include "portability.h"

namespace w4a16 {

template <typename Tag>
struct Magic;
template <>
struct Magic<Fp16Tag> {
  static constexpr uint32_t kPair = 0x64006400u;  // two fp16 1024.0
  static constexpr int kOffset = 1024;
};
template <>
struct Magic<Bf16Tag> {
  static constexpr uint32_t kPair = 0x43004300u;  // two bf16 128.0
  static constexpr int kOffset = 128;
};

// Nibbles of k = 2p (low lane) and k = 2p + 1 (high lane) of a shuffle-order word, p in 0..3.
W4A16_HD constexpr uint32_t nibble_pair(uint32_t word, int p) { return (word >> (4 * p)) & 0x000F000Fu; }

// The pair (offset + q[2p], offset + q[2p + 1]) as two packed 16-bit floats of the Tag's type.
template <typename Tag>
W4A16_HD constexpr uint32_t magic_pair(uint32_t word, int p) {
  return nibble_pair(word, p) | Magic<Tag>::kPair;
}

// fp16 also has room for a nibble four bits up: 0x5400 is 64.0, whose ulp is 1/16, so (word & 0x00F000F0) | 0x5400
// is the pair (64 + q[2p], 64 + q[2p + 1]) of p = 1, and the same of word >> 8 that of p = 3. The odd pairs then
// need no shift of their own (the skinny kernel's tensor-core path, G = 128). bf16's 7 mantissa bits leave no room.
constexpr uint32_t kFp16HighPair = 0x54005400u;  // two fp16 64.0

// The pair (64 + q[2p], 64 + q[2p + 1]) as two packed fp16, p odd.
W4A16_HD constexpr uint32_t fp16_high_pair(uint32_t word, int p) {
  return ((word >> (4 * (p - 1))) & 0x00F000F0u) | kFp16HighPair;
}

// (offset + z): what the raw dot of a chunk carries per unit of sum(x); z = 8 for symmetric weights.
template <typename Tag>
W4A16_HD constexpr float raw_zero(int z) {
  return static_cast<float>(Magic<Tag>::kOffset + z);
}

// The true partial sum sum_k (q_k - z) x_k of one chunk, from its raw dot and its sum of activations.
template <typename Tag>
W4A16_HD float remove_offset(float raw_dot, float sum_x, int z) {
  return raw_dot - raw_zero<Tag>(z) * sum_x;
}

}  // namespace w4a16
