// A timing probe, not the shipped kernel: skinny_mma.cuh's arithmetic fed by a TMA weight stream (csrc/PERF.md,
// "The kernel's arithmetic on the TMA stream"). bf16 or fp16, G = 128, symmetric, K % 256 == 0 only.
// tests/csrc/time_skinny.cu times it in place of the shipped kernel when built with -DTIME_SKINNY_TMA, with the same
// float64 check.
//
// The block: one producer warp and kConsumerWarps consumer warps. A block owns the shipped kernel's balanced range
// of 16-row tiles, walked 32 rows (a round) at a time. The producer's first lane copies each round's rows a stage at
// a time (kStageSteps k-steps: 512 bytes of each of 32 rows, two 3-D tensor-map copies of 16 rows with the 128-byte
// swizzle) into a ring of kStages stages, each with a "full" and an "empty" mbarrier. Consumer warp w takes k-step w
// of every stage: it reads its unit (32 rows x 1 k-step, the shipped kernel's Unit) from the stage with
// conflict-free 16-byte loads, frees the stage, and runs the shipped mma_unit on it; each consumer warp stages the
// part of x it reads. The producer warp's lanes copy each stage's scales (cp.async, 4 bytes each) next to it, and
// the stage's "full" mbarrier waits for them too: scales loaded by the consumers into registers, even 8 units ahead,
// left them waiting on those loads (ncu: 20% of the samples at their first use). At a round's end the consumers add
// their partial sums in shared memory (a named barrier that the producer is not part of, so the stream runs on
// through it).
//
// Leave-one-out switches, for timing only (the results are wrong; csrc/PERF.md, "Where the probe's time goes"):
// LOO_NO_SCALES (no scale copies, every scale one constant), LOO_NO_MMA (the units' words folded into the sums
// instead of dequantized and multiplied), LOO_NO_ROUND_END (the partial sums meet only at the last round's end),
// LOO_NO_X (x not staged). TMA_CONSUMERS (even; 8 by default) sets the consumer warps and with them the k-steps per
// stage.
#pragma once

#include "graph_timing.cuh"
#include "skinny_mma.cuh"

namespace w4a16 {
namespace tma_probe {

using tensor_core::kSubTiles;
using tensor_core::Unit;

#if !defined(TMA_CONSUMERS)
#define TMA_CONSUMERS 8
#endif
constexpr int kConsumerWarps = TMA_CONSUMERS;
static_assert(kConsumerWarps % 2 == 0, "a stage holds whole 128-byte lines: two k-steps each");
constexpr int kStageSteps = kConsumerWarps;                      // one k-step per consumer warp
constexpr int kLineBytes = 128;                                  // the swizzle's line: two k-steps of a row
constexpr int kStageLines = kStageSteps * 64 / kLineBytes;       // lines per row in a stage
constexpr int kStageBytes = kSplitKTileRows * kStageSteps * 64;  // 16 KB with 8 consumers
constexpr int kThreads = (kConsumerWarps + 1) * 32;
constexpr int kStageScaleBytes = kSplitKTileRows * kStageSteps * 2;  // a stage's scales: [32 rows][its k-steps]

// Dynamic shared memory: the stages (first: the swizzle's pattern repeats every 1024 bytes), their scales, x, the
// consumers' partial sums, the mbarriers.
__host__ __device__ constexpr int shared_bytes(int stages, int m, int k) {
  return stages * (kStageBytes + kStageScaleBytes) + m * k * 2 + kConsumerWarps * m * kSplitKPartialStride * 4 +
         2 * stages * 8;
}

// Barrier over the consumer warps only (the producer never waits on it).
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumerWarps * 32) : "memory");
}

// The end of a round: every consumer warp's partial sums meet in shared memory, then one output per thread.
template <typename Tag, int M>
__device__ __forceinline__ void finish_round(float (&acc)[kSubTiles][4], float* partials, int r0, int row_end,
                                             uint16_t* __restrict__ out, int n) {
  tensor_core::store_partials<M>(acc, partials);
  consumers_sync();
  for (int i = threadIdx.x; i < M * kSplitKTileRows; i += kConsumerWarps * 32) {
    const int m = i / kSplitKTileRows, row = r0 + i % kSplitKTileRows;
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kConsumerWarps; ++w)
      total += partials[(w * M + m) * kSplitKPartialStride + i % kSplitKTileRows];
    if (row < row_end) out[(size_t)m * n + row] = from_float(total, Tag{});
  }
  consumers_sync();  // the partials are rewritten next round
}

template <typename Tag, int M, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    tma_skinny_kernel(const __grid_constant__ CUtensorMap map, const uint16_t* __restrict__ x,
                      const uint16_t* __restrict__ scales, uint16_t* __restrict__ out, int n, int k) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int chunks = k / kChunkK, steps = k / 128, groups = k / 128;
  unsigned char* ring = smem;
  uint16_t* stage_scales = reinterpret_cast<uint16_t*>(smem + kStages * kStageBytes);  // [kStages][32][kStageSteps]
  Words4* xs = reinterpret_cast<Words4*>(smem + kStages * (kStageBytes + kStageScaleBytes));
  float* partials = reinterpret_cast<float*>(xs + M * chunks * 4);
  uint64_t* full = reinterpret_cast<uint64_t*>(partials + kConsumerWarps * M * kSplitKPartialStride);
  uint64_t* empty = full + kStages;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int tiles = (n + 15) / 16;
  const int row_begin = (int)((long long)blockIdx.x * tiles / gridDim.x) * 16;
  const int row_end = min(n, (int)((long long)(blockIdx.x + 1) * tiles / gridDim.x) * 16);
  const int stages_per_round = (steps + kStageSteps - 1) / kStageSteps;
  const int units = (row_end - row_begin + kSplitKTileRows - 1) / kSplitKTileRows * stages_per_round;
  if (threadIdx.x == 0) {
    if (smem_address(ring) % 1024) __trap();
    for (int s = 0; s < kStages; ++s) {
      // "full": the copies' arrive (with their bytes) and one arrive per producer lane for its scale copies
#if defined(LOO_NO_SCALES)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(&full[s])));
#else
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 33;" ::"r"(smem_address(&full[s])));
#endif
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(&empty[s])), "r"(kConsumerWarps));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  tensor_core::wait_for_preceding_grid();
  if (warp == kConsumerWarps) {  // the producer: lane 0 the weights, every lane a share of the scales
    for (int i = 0; i < units; ++i) {
      const int s = i % kStages, use = i / kStages;
      if (use > 0) mbarrier_wait(&empty[s], (use - 1) & 1);
      const int r0 = row_begin + i / stages_per_round * kSplitKTileRows;
      const int step0 = i % stages_per_round * kStageSteps;
      if (lane == 0) {
        const int halves = r0 + 16 < row_end ? 2 : 1;  // past K a box is filled with zeros and counted whole
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(&full[s])),
                     "r"(halves * kStageBytes / 2)
                     : "memory");
        for (int h = 0; h < halves; ++h)
          asm volatile(
              "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {0, %2, %3}], "
              "[%4];" ::"r"(smem_address(ring + s * kStageBytes + h * kStageBytes / 2)),
              "l"(reinterpret_cast<uint64_t>(&map)), "r"(step0 / 2), "r"(r0 + 16 * h), "r"(smem_address(&full[s]))
              : "memory");
      }
#if !defined(LOO_NO_SCALES)
      // The stage's scales, 4 bytes (two k-steps of a row) per copy; rows past the range and k-steps past K read
      // valid neighbours, never used. groups is even for every K the probe times (K % 256 == 0).
#pragma unroll
      for (int e = lane; e < kSplitKTileRows * kStageSteps / 2; e += 32) {
        const int row = min(r0 + e / (kStageSteps / 2), row_end - 1);
        const int group = min(step0 + 2 * (e % (kStageSteps / 2)), groups - 2);
        const unsigned dst = smem_address(stage_scales + s * kStageScaleBytes / 2 + 2 * e);
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(scales + (size_t)row * groups + group)
                     : "memory");
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_address(&full[s])) : "memory");
#endif
    }
    return;
  }
  // x: each consumer warp stages the k-steps it reads (w, w + kStageSteps, ...), so no barrier is needed.
  constexpr int kPieces = tensor_core::kSlicePieces;  // 16-byte pieces of x per row and k-step
#if defined(LOO_NO_X)
  const int x_steps = 0;
#else
  const int x_steps = (steps - warp + kStageSteps - 1) / kStageSteps;
#endif
  for (int i = lane; i < M * x_steps * kPieces; i += 32) {
    const int slice = i / kPieces, piece = i % kPieces;
    const int m = slice % M, step = warp + slice / M * kStageSteps, c = step * 4 + piece / 4;
    tensor_core::copy_async_16(xs + m * chunks * 4 + xs_piece(m, c, piece % 4),
                               reinterpret_cast<const Words4*>(x + (size_t)m * k) + step * kPieces + piece);
  }
  tensor_core::copy_async_wait_all();
  __syncwarp();

  const int g = lane >> 2, t = lane & 3;
  float acc[kSubTiles][4] = {};
  // Unit `warp` of stage s into u (nothing where the k-step is past K), then the stage is freed.
  auto take = [&](int s, int phase, bool live, Unit& u) {
    mbarrier_wait(&full[s], phase);
    if (live) {
      const Words4* stage = reinterpret_cast<const Words4*>(ring + s * kStageBytes);
#pragma unroll
      for (int sub = 0; sub < kSubTiles; ++sub)
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // chunk t of k-step `warp` of row sub * 16 + g + 8h, swizzled
          const int line = (sub * 16 + g + 8 * h) * kStageLines + warp / 2, piece = (warp % 2) * 4 + t;
          u.w[sub][h] = stage[line * 8 + (piece ^ (line % 8))];
#if defined(LOO_NO_SCALES)
          u.scale[sub][h] = 0x3c00;
#else
          u.scale[sub][h] = stage_scales[s * kStageScaleBytes / 2 + (sub * 16 + g + 8 * h) * kStageSteps + warp];
#endif
          u.zero[sub][h] = 8;
        }
    }
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(&empty[s])) : "memory");
  };
  auto compute = [&](const Unit& u, int step) {
#if defined(LOO_NO_MMA)
    for (int sub = 0; sub < kSubTiles; ++sub)
      for (int h = 0; h < 2; ++h) acc[sub][h] += (float)((u.w[sub][h].w[0] ^ u.w[sub][h].w[3]) & 7) + u.scale[sub][h];
#else
    tensor_core::mma_unit<Tag, 128, M>(acc, u, xs, step, chunks, lane);
#endif
  };
  int s = 0, phase = 0, round = 0, stage_of_round = 0;
  for (int i = 0; i < units; ++i) {
    const int step = stage_of_round * kStageSteps + warp;
    const bool live = step < steps;
    Unit u;
    take(s, phase, live, u);
    if (live) compute(u, step);
    if (++s == kStages) s = 0, phase ^= 1;
    if (++stage_of_round == stages_per_round) {
#if defined(LOO_NO_ROUND_END)
      if (i == units - 1)
#endif
        finish_round<Tag, M>(acc, partials, row_begin + round * kSplitKTileRows, row_end, out, n);
      stage_of_round = 0;
      ++round;
    }
  }
}

}  // namespace tma_probe
}  // namespace w4a16
