// The skinny split-K decode kernel on AMD (dot2): y[M, N] = x[M, K] @ dequant(W)[N, K]^T for M = 1..max_rows.
// (NVIDIA runs the tensor-core kernel of skinny_mma.cuh on the same operands.)
//
// Decode is bound by reading the 4-bit weights once (K * N / 2 bytes); everything else is arranged so that this
// stream runs at memory speed:
//   * Persistent grid, about one block per SM / CU. Each block first stages the M activation rows in shared
//     memory / LDS (once, not once per output row), with one fp32 sum per 32-element chunk for the dequant
//     correction (dequant.h).
//   * The N output rows are split in contiguous, balanced ranges over all waves of the grid; a wave works on
//     kRowsPerWave rows at a time so each activation chunk read from shared memory serves several weight rows.
//   * Lanes split K: one lane reads 32 consecutive k of a row (16 bytes = 4 words, one load) per chunk; a 32-k
//     chunk never crosses a group (G in {32, 64, 128}), so the chunk's partial sum takes its group's scale and
//     zero point directly. kChunkUnroll chunks per row are loaded before any is used, to keep
//     kRowsPerWave * kChunkUnroll 16-byte loads in flight per lane.
//   * Dot products on raw (offset + q) pairs (the magic-number trick), fp32 accumulation, the offset removed per
//     chunk with the staged sum of x; a butterfly reduction across the wave; bias and the cast in the epilogue.
//
// Operands (all row-major, 16-bit values as raw bits):
//   x       [M, K]      fp16/bf16        qweight [N, K/8] int32 (shuffle order; read as [N, K/32] 16-byte chunks)
//   scales  [N, K/G]    x's dtype        zeros   [N, K/G] uint8 raw 0..15 (asymmetric only)
//   bias    [N] or null x's dtype        out     [M, N]   x's dtype
// Shared memory: xs [M][K] 16-bit (the four 16-byte pieces of every chunk rotated, see xs_piece), sx [M][K/32] fp32.
// Without an AMD GPU the tests run this kernel on the CPU (tests/csrc/emulate_dot2.cpp, test_emulate_dot2.py).
#pragma once

#include "skinny_common.cuh"

namespace w4a16 {

// 16 waves per block (one block per SM / CU) keep loads in flight while other waves compute; the register cap
// this implies holds every variant without spills except M = 5, which gets 12 waves. (Measured on the H200, when
// this kernel also ran on NVIDIA: at 8 waves with 4 rows per wave the weight stream stalled behind the arithmetic.)
template <int M>
W4A16_HD constexpr int block_threads() {
  return M <= 4 ? 512 : 384;
}
constexpr int kRowsPerWave = 2;
constexpr int kChunkUnroll = 2;

template <typename Tag, int G, bool kSymmetric, int M>
__global__ void __launch_bounds__(block_threads<M>(), 1)
    skinny_gemm_kernel(const uint16_t* __restrict__ x, const Words4* __restrict__ qweight,
                       const uint16_t* __restrict__ scales, const uint8_t* __restrict__ zeros,
                       const uint16_t* __restrict__ bias, uint16_t* __restrict__ out, int n, int k) {
  static_assert(G % kChunkK == 0, "a chunk must sit inside one group");
  static_assert(M >= 1 && M <= W4A16_DEVICE_LIMITS.max_rows, "M beyond this architecture's max_rows");
  static_assert(kRowsPerWave * M <= kWaveSize, "one lane per output in the epilogue");
  constexpr int kChunksPerGroup = G / kChunkK;
  extern __shared__ Words4 smem[];
  const int chunks = k / kChunkK;  // per row; K % G == 0 makes this exact
  const int groups = k / G;
  Words4* xs = smem;                                          // [M][chunks * 4] pieces
  float* sx = reinterpret_cast<float*>(smem + M * chunks * 4);  // [M][chunks]

  // ---- this wave's rows: a balanced contiguous share of N -----------------------------------------------------
  const int lane = threadIdx.x % kWaveSize;
  const int waves_per_block = blockDim.x / kWaveSize;
  const long long total_waves = (long long)gridDim.x * waves_per_block;
  const long long wave = (long long)blockIdx.x * waves_per_block + threadIdx.x / kWaveSize;
  const int row_begin = (int)(wave * n / total_waves);
  const int row_end = (int)((wave + 1) * n / total_waves);

  // ---- stage the activations once per block -------------------------------------------------------------------
  for (int i = threadIdx.x; i < M * chunks; i += blockDim.x) {
    const int m = i / chunks, c = i - m * chunks;
    const Words4* src = reinterpret_cast<const Words4*>(x + (size_t)m * k) + c * 4;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      Words4 v = src[j];
      xs[m * chunks * 4 + xs_piece(m, c, j)] = v;
#pragma unroll
      for (int e = 0; e < 4; ++e)
        sum += to_float(uint16_t(v.w[e] & 0xFFFFu), Tag{}) + to_float(uint16_t(v.w[e] >> 16), Tag{});
    }
    sx[m * chunks + c] = sum;
  }
  __syncthreads();

  for (int r0 = row_begin; r0 < row_end; r0 += kRowsPerWave) {
    float acc[kRowsPerWave][M];
#pragma unroll
    for (int r = 0; r < kRowsPerWave; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] = 0.f;

    for (int c0 = lane; c0 < chunks; c0 += kWaveSize * kChunkUnroll) {
      // Issue every load of this step before any arithmetic (rows past row_end read as zero nibbles; their
      // sums are discarded).
      Words4 w[kChunkUnroll][kRowsPerWave];
      float s[kChunkUnroll][kRowsPerWave];
      int z[kChunkUnroll][kRowsPerWave];
#pragma unroll
      for (int u = 0; u < kChunkUnroll; ++u) {
        const int c = c0 + u * kWaveSize;
#pragma unroll
        for (int r = 0; r < kRowsPerWave; ++r) {
          const int row = r0 + r;
          const bool live = c < chunks && row < row_end;
          const size_t meta = (size_t)row * groups + c / kChunksPerGroup;
          w[u][r] = live ? load_stream(qweight + (size_t)row * chunks + c) : Words4{{0u, 0u, 0u, 0u}};
          s[u][r] = live ? to_float(load_cached(scales + meta), Tag{}) : 0.f;
          z[u][r] = kSymmetric ? 8 : (live ? int(load_cached(zeros + meta)) : 0);
        }
      }
#pragma unroll
      for (int u = 0; u < kChunkUnroll; ++u) {
        const int c = c0 + u * kWaveSize;
        if (c >= chunks) break;
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const Words4* xc = xs + m * chunks * 4;
          XOperand<Tag> xo[16];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const Words4 piece = xc[xs_piece(m, c, j)];
#pragma unroll
            for (int p = 0; p < 4; ++p) xo[j * 4 + p] = x_operand<Tag>(piece.w[p]);
          }
          const float sum_x = sx[m * chunks + c];
#pragma unroll
          for (int r = 0; r < kRowsPerWave; ++r) {
            float raw = 0.f;
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
              for (int p = 0; p < 4; ++p) raw = dot2(magic_pair<Tag>(w[u][r].w[j], p), xo[j * 4 + p], raw);
            acc[r][m] = fmaf(s[u][r], remove_offset<Tag>(raw, sum_x, z[u][r]), acc[r][m]);
          }
        }
      }
    }

    // ---- reduce across the wave, then lane r * M + m writes output (m, r0 + r) ---------------------------------
#pragma unroll
    for (int r = 0; r < kRowsPerWave; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int offset = kWaveSize / 2; offset > 0; offset >>= 1) acc[r][m] += lane_xor(acc[r][m], offset);
#pragma unroll
    for (int r = 0; r < kRowsPerWave; ++r) {
      const int row = r0 + r;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (lane == r * M + m && row < row_end) {
          const float b = bias ? to_float(bias[row], Tag{}) : 0.f;
          out[(size_t)m * n + row] = from_float(acc[r][m] + b, Tag{});
        }
      }
    }
  }
}

}  // namespace w4a16
