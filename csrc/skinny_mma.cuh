// The skinny decode kernel on NVIDIA (sm_80 and later): the same y[M, N] = x[M, K] @ dequant(W)[N, K]^T as
// skinny_kernel.cuh, with the inner product on the tensor cores.
//
// Why: NVIDIA has no fp32-accumulating packed dot on the CUDA cores, so the dot2 kernel spends two FFMAs per weight
// and activation row and becomes arithmetic-bound from M = 2 on (csrc/PERF.md). Here one mma.sync m16n8k16 takes
// 16 weight rows x 16 k as its A operand and up to 8 activation rows as B: the cost per weight no longer depends
// on M (M = 1..8 use 1..8 of its 8 columns), and what is left per weight is the unpack.
//
// Operand mapping. In m16n8k16 the lane with group g = lane / 4 and t = lane % 4 holds A rows g and g + 8 at
// logical k {2t, 2t+1, 2t+8, 2t+9} and B column g at the same logical k. Any permutation of k applied to both A
// and B leaves the product unchanged, so every lane reads one whole 16-byte chunk (32 consecutive k) of weight rows
// g and g + 8 straight from global memory: lane t of a quad takes chunk 4s + t of k-step s (128 k), word j of the
// chunk feeds two mmas, and its pairs (p = 0..3, shuffle order, dequant.h) are the A registers. The same lane reads
// the matching 32 activations of row m = g from shared memory as B. No shuffles, no weight staging.
//
// Dequantization: one LOP3 per pair (plus its shift) makes the magic (offset + q) pairs (dequant.h). With G = 128 a
// k-step is exactly one group, so A is those raw pairs and the group's correction comes after the mma, in fp32:
// sum_k (q - z) s x = s * (D - (offset + z) * sum_k x) (the raw-dot variant, dequant.h; nothing is rounded before
// accumulation), with sum_k x from the tensor cores too: the unit's B against an A of ones (mma_unit). With fp16
// at G = 128 the odd pairs are (64 + q), which saves their shifts (raw_pair), and half of that A's rows carry the
// offsets.
// With G = 32 or 64 the four chunks of a k-step belong to different groups, so A is dequantized before the mma: a
// packed FMA by 1.0 subtracts (offset + z) exactly and a second multiplies by s, rounded to the activation dtype
// once per weight (as torch on a dequantized weight, and as the Triton path).
//
// Work split. A cluster of 1, 2 or 4 blocks (the launcher picks; skinny_kernel.cu) owns a balanced contiguous range
// of 16-row tiles and walks it kSplitKTileRows rows (a round) at a time. Its blocks split the k-steps, and each
// block's kWarps warps split the block's k-steps (contiguous, balanced). Each warp keeps the weights of its next
// (rows, k-step) units in flight in a ring of kPipelineDepth register slots, across row boundaries, so the weight
// stream does not drain at the end of a round; a slot is refilled right after its unit is computed (see the loop).
// The warps' partial sums meet in shared memory, the blocks' sums in distributed shared memory; bias and the cast
// happen in that reduction. In a cluster each block stages only the part of x its k-steps read; since x is staged
// by cp.async that pays off only for the largest x (M * K; skinny_kernel.cu, csrc/PERF.md).
//
// Shared memory (dynamic, shared_bytes below): xs [M][K] 16-bit (pieces rotated, xs_piece), the split-K partials
// [kWarps][M][kSplitKPartialStride] fp32, then the block's round sums [kClusterRoundSlots][M][kSplitKTileRows] fp32
// (clusters only). Each warp stages (and alone reads) the k-steps of xs that it owns.
#pragma once

#include <cooperative_groups.h>
#include <type_traits>

#include "skinny_common.cuh"

namespace w4a16 {
namespace tensor_core {

constexpr int kWarps = kSplitKWarps;
constexpr int kThreads = kWarps * 32;
constexpr int kSubTiles = kSplitKTileRows / 16;  // 16-row mma tiles per warp and step
constexpr int kStepK = 128;                      // 4 lanes x 32 k
// Units (one k-step of 32 rows, 64 bytes of weights per lane) held per warp, the one being computed included.
// 3 units at 12 warps (168 registers) measured best of 8, 12 and 16 warps at depths 2-4 (csrc/PERF.md); 16 warps
// cannot hold a third unit in 128 registers without spilling, and a fourth does not fit 12 warps' 168.
constexpr int kPipelineDepth = 3;
// Independent accumulators per sub-tile for a unit's 8 mmas: 2 measured 0-2% faster than 1, 4 no better.
constexpr int kMmaChains = 2;

W4A16_HD constexpr int k_steps(int k) { return (k / kChunkK + 3) / 4; }
// Dynamic shared memory of one launch. Within staging_bytes(m * k) + split_k_partial_bytes(m), which the table's
// budget guarantees (portability.h).
W4A16_HD constexpr int shared_bytes(int m, int k) { return m * k * 2 + split_k_partial_bytes(m); }

template <typename Tag>
struct Packed;
template <>
struct Packed<Fp16Tag> {
  static constexpr uint32_t kOne = 0x3C003C00u;  // two fp16 1.0
};
template <>
struct Packed<Bf16Tag> {
  static constexpr uint32_t kOne = 0x3F803F80u;  // two bf16 1.0
};

// With fp16 and G = 128 the odd pairs are (64 + q) pairs (fp16_high_pair of dequant.h): they come from the word
// and word >> 8 that the even pairs use, 1 shift and 4 LOP3 per word instead of 3 and 4. Measured 1-4% faster on
// the fp16 G = 128 layers; with G < 128 (where the packed subtraction would take the pair's own offset) it gained
// nothing measurable, so those keep one offset (csrc/PERF.md, "fp16's odd pairs without shifts").
template <typename Tag, int G>
constexpr bool kHighPairs = std::is_same<Tag, Fp16Tag>::value && G == kStepK;

// magic_pair (or fp16_high_pair) of dequant.h as one LOP3 ((w >> shift) & mask) | magic: written out because the
// compiler emits an AND and an OR (LOP3 takes one immediate, and it keeps both constants as immediates).
template <typename Tag, int G>
__device__ __forceinline__ uint32_t raw_pair(uint32_t word, int p) {
  uint32_t d;
  if (kHighPairs<Tag, G> && (p & 1))
    asm("lop3.b32 %0, %1, 0x00F000F0, %2, 0xEA;" : "=r"(d) : "r"(word >> (4 * (p - 1))), "r"(kFp16HighPair));
  else
    asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;" : "=r"(d) : "r"(word >> (4 * p)), "r"(Magic<Tag>::kPair));
  return d;
}

// The 16-bit float -(offset + z): the magic number's bits with z in the mantissa (ulp 1) and the sign set.
template <typename Tag>
__device__ __forceinline__ uint16_t neg_raw_zero_bits(int z) {
  return uint16_t(0x8000u | (Magic<Tag>::kPair & 0xFFFFu) | uint32_t(z));
}

// 16-bit bits of a float pair, both lanes the same value.
__device__ __forceinline__ uint32_t splat(uint16_t bits) { return uint32_t(bits) * 0x10001u; }

// Where a lane's four weight rows (rows g and g + 8 of each sub-tile) start, as element offsets (the binding
// keeps N * K / 32 within int). Rows past the block's range are clamped to its last row: they are loaded (from
// the cache, mostly) and computed like any other, and the reduction never writes them, so no load is predicated.
struct Rows {
  int chunk[kSubTiles][2];  // row * chunks + t: this lane's chunk of k-step 0
  int meta[kSubTiles][2];   // row * groups
};

__device__ __forceinline__ Rows rows_at(int r0, int row_end, int chunks, int groups, int lane) {
  Rows r;
#pragma unroll
  for (int s = 0; s < kSubTiles; ++s)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(r0 + s * 16 + (lane >> 2) + h * 8, row_end - 1);
      r.chunk[s][h] = row * chunks + (lane & 3);
      r.meta[s][h] = row * groups;
    }
  return r;
}

// One lane's operands of one (rows, k-step) unit: the chunk words of its four rows, their scales and zeros.
struct Unit {
  Words4 w[kSubTiles][2];
  uint16_t scale[kSubTiles][2];
  uint8_t zero[kSubTiles][2];
};

// No load is predicated per lane: past the end of K (G < 128, K % 128 != 0) a lane reads the row's last chunk
// instead, and its activations are zero (mma_unit).
template <int G, bool kSymmetric>
__device__ __forceinline__ void load_unit(Unit& u, const Rows& r, const Words4* __restrict__ qweight,
                                          const uint16_t* __restrict__ scales, const uint8_t* __restrict__ zeros,
                                          int step, int chunks, int lane) {
  // The chunk this lane reads, less its lane offset (r.chunk holds it). K % 128 == 0 when G = 128.
  const int c = G == kStepK ? step * 4 : min(step * 4 + (lane & 3), chunks - 1) - (lane & 3);
  const int group = G == kStepK ? step : (c + (lane & 3)) * kChunkK / G;
#pragma unroll
  for (int s = 0; s < kSubTiles; ++s)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      u.w[s][h] = load_stream<(G < kStepK)>(qweight + r.chunk[s][h] + c);  // in L1 with G < 128: see load_stream
      u.scale[s][h] = load_cached(scales + r.meta[s][h] + group);
      u.zero[s][h] = kSymmetric ? uint8_t(8) : load_cached(zeros + r.meta[s][h] + group);
    }
}

// The A register of pair p of word j, rows of (sub-tile s, half h).
template <typename Tag, int G>
__device__ __forceinline__ uint32_t a_pair(const Unit& u, int s, int h, int j, int p) {
  const uint32_t raw = raw_pair<Tag, G>(u.w[s][h].w[j], p);
  if constexpr (G == kStepK) return raw;
  const uint32_t q_minus_z = fma2(raw, Packed<Tag>::kOne, splat(neg_raw_zero_bits<Tag>(u.zero[s][h])), Tag{});
  return fma2(q_minus_z, splat(u.scale[s][h]), 0x80008000u, Tag{});  // + (-0): a plain product, one rounding
}

// acc += this unit's 32 rows x 128 k against the staged activations of k-step `step`.
template <typename Tag, int G, int M>
__device__ __forceinline__ void mma_unit(float (&acc)[kSubTiles][4], const Unit& u, const Words4* xs, int step,
                                         int chunks, int lane) {
  const int g = lane >> 2, t = lane & 3;
  // B: the 32 activations of row g matching this lane's chunk. Columns g >= M are padding whose results are
  // never stored, so they read row M - 1 (no predicate, see load_unit); past K (G < 128) B must be zero.
  const int c = step * 4 + t;
  const int xrow = min(g, M - 1);
  uint32_t b[16];
  const bool x_live = G == kStepK || c < chunks;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const Words4 piece = x_live ? xs[xrow * chunks * 4 + xs_piece(xrow, c, p)] : Words4{{0u, 0u, 0u, 0u}};
#pragma unroll
    for (int e = 0; e < 4; ++e) b[p * 4 + e] = piece.w[e];
  }
  // With G = 128, the sums of x over the k-step for columns 2t, 2t + 1 (the C fragment's): the same B against an A
  // of ones, whose every product row is the column sum (exact products, fp32 sums). Staging these sums from the
  // pieces of x instead (fp32 adds and shuffles per slice) made x staging the M = 5 penalty (csrc/PERF.md).
  // With fp16's high pairs the offsets differ by pair (1024 on the even pairs, which meet x's k lo; 64 on the odd,
  // k hi): A's rows g then carry those offsets and its rows g + 8 ones, so C's rows g give the offsets' share of the
  // raw dot and its rows g + 8 the sums of x.
  constexpr bool kHigh = kHighPairs<Tag, G>;
  float2 sum_x = make_float2(0.f, 0.f), offsets = make_float2(0.f, 0.f);
  if constexpr (G == kStepK) {
    constexpr uint32_t kOne = Packed<Tag>::kOne;
    const uint32_t ones_or_offsets[4] = {kHigh ? Magic<Tag>::kPair : kOne, kOne, kHigh ? kFp16HighPair : kOne, kOne};
    float d[2][4] = {};
#pragma unroll
    for (int q = 0; q < 8; ++q) mma_16x8x16(d[q % 2], ones_or_offsets, b[2 * q], b[2 * q + 1], Tag{});
    const int sums = kHigh ? 2 : 0;  // the C fragment's rows g + 8 (elements 2, 3) or g (0, 1)
    sum_x = make_float2(d[0][sums] + d[1][sums], d[0][sums + 1] + d[1][sums + 1]);
    if constexpr (kHigh) offsets = make_float2(d[0][0] + d[1][0], d[0][1] + d[1][1]);
  }
#pragma unroll
  for (int s = 0; s < kSubTiles; ++s) {
    // The unit's 8 mmas per sub-tile go round-robin into kMmaChains independent accumulators, so consecutive
    // mmas need not wait for each other (a small measured gain, see kMmaChains).
    float d[kMmaChains][4] = {};
#pragma unroll
    for (int w = 0; w < 4; ++w)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // Registers {row g k lo, row g+8 k lo, row g k hi, row g+8 k hi} <- pairs 2*half and 2*half+1 of word w.
        const uint32_t a[4] = {a_pair<Tag, G>(u, s, 0, w, 2 * half), a_pair<Tag, G>(u, s, 1, w, 2 * half),
                               a_pair<Tag, G>(u, s, 0, w, 2 * half + 1), a_pair<Tag, G>(u, s, 1, w, 2 * half + 1)};
        mma_16x8x16(d[(2 * w + half) % kMmaChains], a, b[4 * w + 2 * half], b[4 * w + 2 * half + 1], Tag{});
      }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float dot = d[0][e];
#pragma unroll
      for (int chain = 1; chain < kMmaChains; ++chain) dot += d[chain][e];
      if constexpr (G == kStepK) {  // raw pairs: remove the offset, then scale (one group per k-step)
        const int h = e >> 1;
        const float column_sum_x = (e & 1) ? sum_x.y : sum_x.x;
        const float corrected =
            kHigh ? fmaf(-float(u.zero[s][h]), column_sum_x, dot - ((e & 1) ? offsets.y : offsets.x))
                  : fmaf(-raw_zero<Tag>(u.zero[s][h]), column_sum_x, dot);
        acc[s][e] = fmaf(to_float(u.scale[s][h], Tag{}), corrected, acc[s][e]);
      } else {
        acc[s][e] += dot;
      }
    }
  }
}

// Thread-block clusters (sm_90): the blocks of a cluster own the same rows and split their k-steps; their partial
// sums meet through distributed shared memory. Without clusters (older GPUs, or a launch without the attribute)
// a cluster is one block.
struct Cluster {
  int rank, size;
};
__device__ __forceinline__ Cluster this_cluster() {
#if __CUDA_ARCH__ >= 900
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  return {int(cluster.block_rank()), int(cluster.num_blocks())};
#else
  return {0, 1};
#endif
}
// Barrier over every thread of the cluster; its release/acquire makes shared-memory writes visible to the peers.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();
#else
  __syncthreads();
#endif
}
// The same shared-memory address in block `rank` of the cluster.
__device__ __forceinline__ const float* cluster_peer(float* p, int rank) {
#if __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(p, rank);
#else
  return p;
#endif
}

// A warp's partial sums of a round into its [M][kSplitKPartialStride] slice of `partials`, and its accumulators
// back to zero. C fragment: acc[s][0..1] = rows s*16 + g, columns 2t, 2t+1; acc[s][2..3] = row + 8. Columns are x
// rows.
template <int M>
__device__ __forceinline__ void store_partials(float (&acc)[kSubTiles][4], float* partials) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane >> 2, t = lane & 3;
  float* mine = partials + warp * M * kSplitKPartialStride;
#pragma unroll
  for (int s = 0; s < kSubTiles; ++s)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int m = 2 * t + (e & 1), row = s * 16 + g + (e >> 1) * 8;
      if (m < M) mine[m * kSplitKPartialStride + row] = acc[s][e];
      acc[s][e] = 0.f;
    }
}

// The end of round `round` (rows row_begin + round * kSplitKTileRows onwards): every warp's partial sums meet in
// shared memory and the block's threads add them up, one output each, in a fixed order (deterministic). A block
// on its own then adds the bias and stores. In a cluster, the block keeps its sums in a round slot; when the slots
// are full or the last round is done, the cluster adds up every block's sums in rank order, each block finishing
// its share of the outputs. Cluster barriers come only then: their release semantics order the weight loads in
// flight too, and a barrier at every round end doubled Llama gate_up's time (csrc/PERF.md). Every warp of the
// cluster calls this once per round, in the same order (it holds the barriers).
template <typename Tag, int M, bool kClustered>
__device__ __forceinline__ void finish_round(float (&acc)[kSubTiles][4], float* partials, float* round_sums,
                                             int round, int rounds, int row_begin, int row_end,
                                             const uint16_t* __restrict__ bias, uint16_t* __restrict__ out, int n,
                                             Cluster cluster) {
  store_partials<M>(acc, partials);
  __syncthreads();
  // Output i of a round is x row i / kSplitKTileRows, weight row i % kSplitKTileRows of the round.
  constexpr int kOutputs = M * kSplitKTileRows;
  auto store = [&](int r0, int i, float total) {
    const int m = i / kSplitKTileRows, row = r0 + i % kSplitKTileRows;
    if (row < row_end) {
      const float b = bias ? to_float(bias[row], Tag{}) : 0.f;
      out[(size_t)m * n + row] = from_float(total + b, Tag{});
    }
  };
  auto warps_total = [&](int i) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w)
      total += partials[(w * M + i / kSplitKTileRows) * kSplitKPartialStride + i % kSplitKTileRows];
    return total;
  };
  const int r0 = row_begin + round * kSplitKTileRows;
  if constexpr (!kClustered) {
    for (int i = threadIdx.x; i < kOutputs; i += kThreads) store(r0, i, warps_total(i));
    __syncthreads();  // the partials are rewritten by the next round
    return;
  }
  const int slot = round % kClusterRoundSlots;
  for (int i = threadIdx.x; i < kOutputs; i += kThreads) round_sums[slot * kOutputs + i] = warps_total(i);
  if (slot + 1 < kClusterRoundSlots && round + 1 < rounds) {
    __syncthreads();  // the partials are rewritten by the next round
    return;
  }
  cluster_sync();
  const int held = (slot + 1) * kOutputs;  // the rounds round - slot .. round
  for (int i = cluster.rank * held / cluster.size + threadIdx.x; i < (cluster.rank + 1) * held / cluster.size;
       i += kThreads) {
    float total = 0.f;
    for (int q = 0; q < cluster.size; ++q) total += cluster_peer(round_sums, q)[i];
    store(r0 - (slot - i / kOutputs) * kSplitKTileRows, i % kOutputs, total);
  }
  cluster_sync();  // the peers' round sums and this block's partials are rewritten next; the reads come first
}

// Staging x. A warp stages the (row m, k-step) slices of x that its own k-steps read: 256 bytes each, 16 pieces of
// 16 bytes, dealt to its lanes in turn and copied global -> shared by cp.async, all in flight at once and holding no
// registers. With loads into registers (4 per lane in flight, then stores) the staging took several round trips
// before the first unit, and at M = 5 it cost Llama down 30% over M = 1 (csrc/PERF.md).
constexpr int kSlicePieces = kStepK * 2 / 16;

__device__ __forceinline__ void copy_async_16(Words4* dst, const Words4* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(uint32_t(__cvta_generic_to_shared(dst))),
               "l"(src)
               : "memory");
}
// Waits for this thread's cp.async copies; they are then visible to it (other lanes: after __syncwarp).
__device__ __forceinline__ void copy_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Programmatic dependent launch (sm_90 and later). The launcher (skinny_kernel.cu) sets the programmatic-
// serialization attribute where the loaded kernel was compiled with this wait, so a block may start while the
// kernel ahead of it on the stream is still finishing. The wait returns once that kernel has completed and its
// writes are visible, so no global memory may be touched before it: x, the weights, bias and the output alike
// (tests/csrc/test_device_compile.py checks the SASS for it). Starting early saved 2-5% on the small layers on an
// H100; reading the weights before the wait gained nothing more, and early triggers only help back-to-back calls of
// this kernel, as a benchmark makes them (csrc/PERF.md, "Programmatic dependent launch").
#define W4A16_PROGRAMMATIC_LAUNCH 1  // the timing harness (tests/csrc/time_skinny.cu) launches alike where defined
__device__ __forceinline__ void wait_for_preceding_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Requests every piece of this warp's slices into xs (none past K when G < 128: mma_unit reads zeros there).
template <int G, int M>
__device__ __forceinline__ void copy_x_slices(Words4* xs, const uint16_t* __restrict__ x, int step_begin, int steps,
                                              int k, int chunks, int lane) {
  const int pieces = M * steps * kSlicePieces;
  for (int i = lane; i < pieces; i += 32) {
    const int slice = i / kSlicePieces, piece = i % kSlicePieces;
    const int m = slice / steps, step = step_begin + slice - m * steps, c = step * 4 + piece / 4;
    if (G == kStepK || c < chunks)
      copy_async_16(xs + m * chunks * 4 + xs_piece(m, c, piece % 4),
                    reinterpret_cast<const Words4*>(x + (size_t)m * k) + step * kSlicePieces + piece);
  }
}

// kClustered: launched in clusters of more than one block. The single-block kernel is a separate instantiation
// with none of the cluster code, so it keeps its registers and schedule.
template <typename Tag, int G, bool kSymmetric, int M, bool kClustered>
__global__ void __launch_bounds__(kThreads, 1)
    skinny_gemm_kernel(const uint16_t* __restrict__ x, const Words4* __restrict__ qweight,
                       const uint16_t* __restrict__ scales, const uint8_t* __restrict__ zeros,
                       const uint16_t* __restrict__ bias, uint16_t* __restrict__ out, int n, int k) {
  static_assert(G % kChunkK == 0 && kStepK % G == 0, "a chunk sits inside one group, a group inside a k-step");
  static_assert(M >= 1 && M <= 8, "M beyond the mma's 8 columns");
  // One host pass serves every device pass, so rows past this architecture's max_rows are instantiated too; the
  // binding never launches them (it checks M against the same table row), and they trap if anything else does.
  if constexpr (M > W4A16_DEVICE_LIMITS.max_rows) {
    __trap();
    return;
  }
  extern __shared__ Words4 smem[];
  const int chunks = k / kChunkK;
  const int groups = k / G;
  const int steps = k_steps(k);
  Words4* xs = smem;                                                   // [M][chunks * 4] pieces
  float* partials = reinterpret_cast<float*>(smem + M * chunks * 4);   // [kWarps][M][kSplitKPartialStride]
  float* round_sums = partials + kWarps * M * kSplitKPartialStride;     // [kClusterRoundSlots][M][kSplitKTileRows]

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // A cluster owns a balanced contiguous range of 16-row tiles; its blocks split the k-steps, their warps split
  // the block's k-steps (1-D grid: a cluster's blocks are consecutive).
  const Cluster cluster = kClustered ? this_cluster() : Cluster{0, 1};
  const int clusters = gridDim.x / cluster.size, cluster_id = blockIdx.x / cluster.size;
  const int tiles = (n + 15) / 16;
  const int row_begin = (int)((long long)cluster_id * tiles / clusters) * 16;
  const int row_end = min(n, (int)((long long)(cluster_id + 1) * tiles / clusters) * 16);
  const int block_step_begin = cluster.rank * steps / cluster.size;
  const int block_steps = (cluster.rank + 1) * steps / cluster.size - block_step_begin;
  const int step_begin = block_step_begin + warp * block_steps / kWarps;
  const int my_steps = block_step_begin + (warp + 1) * block_steps / kWarps - step_begin;
  const int rounds = (row_end - row_begin + kSplitKTileRows - 1) / kSplitKTileRows;

  // A warp's work is one stream of units, round-major: (round 0, its first k-step), (round 0, next), ... The
  // loads run up to kPipelineDepth units ahead of the mmas, in a ring of registers (static indices, see the loop).
  const int units = rounds * my_steps;
  int loaded = 0, load_round = 0, load_j = 0;  // the next unit to load
  Rows load_rows = rows_at(row_begin, row_end, chunks, groups, lane);
  // A warp with fewer units than slots loads its last unit again to fill the ring (cached, never computed).
  auto load_next = [&](Unit& u) {
    load_unit<G, kSymmetric>(u, load_rows, qweight, scales, zeros, step_begin + load_j, chunks, lane);
    if (++loaded < units && ++load_j == my_steps) {
      load_j = 0;
      ++load_round;
      load_rows = rows_at(row_begin + load_round * kSplitKTileRows, row_end, chunks, groups, lane);
    }
  };
  Unit ring[kPipelineDepth];
  wait_for_preceding_grid();  // before the first global access: what comes before is index arithmetic
#pragma unroll
  for (int d = 0; d < kPipelineDepth; ++d) load_next(ring[d]);
  // Each warp stages the part of x its own k-steps read, while its first units' weights are in flight. No other
  // warp reads that part, so a warp starts computing as soon as its own part is in, without a block-wide barrier
  // (measured 0-6% faster than staging by the whole block; csrc/PERF.md).
  copy_x_slices<G, M>(xs, x, step_begin, my_steps, k, chunks, lane);
  copy_async_wait_all();
  __syncwarp();

  float acc[kSubTiles][4];
#pragma unroll
  for (int s = 0; s < kSubTiles; ++s)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[s][e] = 0.f;
  // Wait for the ring's first units here, before the loop. Without a use of them before the loop, ptxas (CUDA 13.0)
  // waits for every load in flight before each unit, the refills just issued included, instead of once per pass
  // over the ring: Llama gate_up took 26% longer (csrc/PERF.md). `never` is 0 for every launch (n > 0), but the
  // compiler cannot know it, so the use survives and adds +0.0f. Two words suffice, except at M = 8 with G = 128
  // and no zero points, where ptxas gives those two loads a scoreboard of their own: there the use takes a word of
  // every load the ring issued. Elsewhere that larger use reschedules loops that need no change (untimed), so it
  // is kept to those. tests/csrc/test_device_compile.py checks the outcome for every instantiation.
  {
    const uint32_t never = uint32_t(n) >> 31;
    uint32_t words = ring[0].w[0][0].w[0] ^ ring[kPipelineDepth - 1].w[0][0].w[0];
    if constexpr (M == 8 && G == kStepK && kSymmetric) {
      words = 0;
#pragma unroll
      for (int d = 0; d < kPipelineDepth; ++d)
#pragma unroll
        for (int s = 0; s < kSubTiles; ++s)
#pragma unroll
          for (int h = 0; h < 2; ++h) words ^= ring[d].w[s][h].w[0] ^ ring[d].scale[s][h];
    }
    acc[0][0] += __uint_as_float(words & never);
  }
  if (units == 0) {  // more warps than k-steps: this one only takes part in the reductions
    for (int round = 0; round < rounds; ++round)
      finish_round<Tag, M, kClustered>(acc, partials, round_sums, round, rounds, row_begin, row_end, bias, out, n,
                                       cluster);
    return;
  }
  // Unit i sits in ring[i % kPipelineDepth]: unrolling by the depth makes every index static. Once unit i is
  // computed, its slot receives unit i + kPipelineDepth.
  // Why refill after computing, not before: ptxas gives every weight load one scoreboard, so the first use of a
  // unit waits for all loads in flight. With the refill issued before the mma (the previous order), one slot of
  // the unrolled loop used its unit right after issuing the next loads, and the warp waited for those too (on
  // Llama gate_up at M = 1, 18% of ncu's stall samples sat on that use). A refill of the slot just read cannot
  // move above those reads, and ptxas now waits once per pass over the ring, for the previous pass's loads.
  // Measured 10% faster on Llama gate_up at M = 1 and 5 (csrc/PERF.md).
  int round = 0, j = 0;
  for (int base = 0; base < units; base += kPipelineDepth) {
#pragma unroll
    for (int d = 0; d < kPipelineDepth; ++d) {
      if (base + d < units) {
        mma_unit<Tag, G, M>(acc, ring[d], xs, step_begin + j, chunks, lane);
        if (loaded < units) load_next(ring[d]);
        if (++j == my_steps) {
          finish_round<Tag, M, kClustered>(acc, partials, round_sums, round, rounds, row_begin, row_end, bias, out,
                                           n, cluster);
          j = 0;
          ++round;
        }
      }
    }
  }
}

}  // namespace tensor_core
}  // namespace w4a16
