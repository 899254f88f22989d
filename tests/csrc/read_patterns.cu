// How fast can the skinny kernel's weight stream go? Reads the packed weights of the bench shapes with no
// arithmetic, in the kernel's access pattern and in variants of it, and prints µs per call and GB/s.
// csrc/PERF.md gives the figures measured on the H200 and what they decided.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o /tmp/read_patterns tests/csrc/read_patterns.cu
//   /tmp/read_patterns               # every pattern, on four of the bench shapes
//   /tmp/read_patterns --contiguous  # the contiguous read and the kernel's stream, on all eight
//
// Protocol as bench_skinny.py: CUDA-graph replay over copies of the weights totalling 512 MB (>= 4x the L2),
// median of 9 replays. Each kernel folds what it reads into a value it stores only if it hits a magic number, so
// the loads cannot be removed.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "graph_timing.cuh"

struct alignas(16) Piece {
  uint32_t w[4];
};

// The kernel's weight load (portability.h: load_stream): L2::256B as the kernel had it when most figures in
// csrc/PERF.md were taken, L2::128B as it ships since its cache-hint change (load_stream<false> there).
template <int kL2Bytes = 256>
__device__ __forceinline__ Piece load_stream(const Piece* p) {
  static_assert(kL2Bytes == 128 || kL2Bytes == 256, "the L2 prefetch sizes the kernel has used");
  Piece r;
  if constexpr (kL2Bytes == 256)
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3])
                 : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3])
                 : "l"(p));
  return r;
}
__device__ __forceinline__ uint32_t fold(const Piece& v) { return v.w[0] + v.w[1] * 3 + v.w[2] * 5 + v.w[3]; }

// The ceiling: every thread reads consecutive 16-byte pieces, grid-stride, four in flight.
__global__ void contiguous(const Piece* p, size_t pieces, uint32_t* sink) {
  uint32_t acc = 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  for (; i + 3 * stride < pieces; i += 4 * stride)
    acc ^= fold(load_stream(p + i)) ^ fold(load_stream(p + i + stride)) ^ fold(load_stream(p + i + 2 * stride)) ^
           fold(load_stream(p + i + 3 * stride));
  for (; i < pieces; i += stride) acc ^= fold(load_stream(p + i));
  if (acc == 0x12345678u) sink[0] = acc;
}

// The kernel's pipeline: units 0 .. units - 1 pass through kDepth slots; before slot d's unit is consumed, the
// slot consumed last receives the unit kDepth - 1 ahead. Unrolled by the depth so that every slot index is static
// (a register ring stays in registers).
template <int kDepth, typename Load, typename Consume>
__device__ __forceinline__ void pipeline(int units, Load load, Consume consume) {
#pragma unroll
  for (int d = 0; d + 1 < kDepth; ++d) load(d);
  for (int base = 0; base < units; base += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (base + d < units) {
        load((d + kDepth - 1) % kDepth);
        consume(d);
      }
    }
  }
}

// The skinny kernel's split: a block owns rounds of 32 weight rows (one contiguous range of rounds per block, or
// rounds dealt round-robin over the blocks), its warps split the 2 KB units of each round (kRows rows x 2048 /
// kRows bytes; the kernel's unit is 32 rows x 64 bytes), each warp holds kDepth units, the one being consumed
// included. kAsync: the units travel by cp.async into a per-warp ring in shared memory; else by 16-byte loads into
// registers, as the kernel does.
template <int kDepth, int kWarps, int kRows, bool kRoundRobin, bool kAsync>
__global__ void __launch_bounds__(kWarps * 32, 1) skinny_split(const Piece* q, int n, int k, uint32_t* sink) {
  extern __shared__ Piece ring_memory[];
  constexpr int kColumns = 128 / kRows;  // 16-byte pieces per row in a unit
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row_pieces = k / 32;
  const int units_per_row = row_pieces / kColumns;
  const int per_round = (32 / kRows) * units_per_row;
  const int total_rounds = (n + 31) / 32;
  const int first_round = kRoundRobin ? blockIdx.x : (int)((long long)blockIdx.x * total_rounds / gridDim.x);
  const int rounds = kRoundRobin ? (total_rounds - blockIdx.x + gridDim.x - 1) / gridDim.x
                                 : (int)((long long)(blockIdx.x + 1) * total_rounds / gridDim.x) - first_round;
  const int unit_begin = warp * per_round / kWarps, my_units = (warp + 1) * per_round / kWarps - unit_begin;
  const int units = rounds * my_units;
  if (units <= 0) return;
  Piece* ring = ring_memory + warp * kDepth * 128;
  Piece held[kDepth][4];
  auto address = [&](int i, int r) {
    const int round = i / my_units, u = unit_begin + i % my_units;
    const int round_row = (kRoundRobin ? first_round + round * gridDim.x : first_round + round) * 32;
    const int p = r * 32 + lane;
    const int row = min(round_row + (u / units_per_row) * kRows + p / kColumns, n - 1);
    return q + (size_t)row * row_pieces + (u % units_per_row) * kColumns + p % kColumns;
  };
  int next = 0;
  auto load = [&](int slot) {
    const int i = min(next++, units - 1);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      if (kAsync) {
        const unsigned dst = (unsigned)__cvta_generic_to_shared(ring + slot * 128 + r * 32 + lane);
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(address(i, r)));
      } else {
        held[slot][r] = load_stream(address(i, r));
      }
    }
    if (kAsync) asm volatile("cp.async.commit_group;");
  };
  uint32_t acc = 0;
  pipeline<kDepth>(units, load, [&](int slot) {
    if (kAsync) asm volatile("cp.async.wait_group %0;" ::"n"(kDepth - 1));
#pragma unroll
    for (int r = 0; r < 4; ++r) acc ^= fold(kAsync ? ring[slot * 128 + r * 32 + lane] : held[slot][r]);
  });
  if (acc == 0x12345678u) sink[0] = acc;
}

// The register split again, plus a bulk L2 prefetch of each warp's part of a round, kAhead rounds ahead.
template <int kAhead>
__global__ void __launch_bounds__(384, 1) skinny_split_prefetch(const Piece* q, int n, int k, uint32_t* sink) {
  constexpr int kDepth = 3, kWarps = 12;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane >> 2, t = lane & 3;
  const int row_pieces = k / 32, steps = k / 128;
  const int total_rounds = (n + 31) / 32;
  const int first_round = (int)((long long)blockIdx.x * total_rounds / gridDim.x);
  const int rounds = (int)((long long)(blockIdx.x + 1) * total_rounds / gridDim.x) - first_round;
  const int step_begin = warp * steps / kWarps, my_steps = (warp + 1) * steps / kWarps - step_begin;
  const int units = rounds * my_steps;
  if (units <= 0) return;
  auto prefetch_round = [&](int round) {
    const int row = (first_round + round) * 32 + lane;
    if (round < rounds && row < n)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(q + (size_t)row * row_pieces + step_begin * 4),
                   "r"(my_steps * 64)
                   : "memory");
  };
  for (int r = 0; r <= kAhead; ++r) prefetch_round(r);
  Piece held[kDepth][4];
  int next = 0;
  auto load = [&](int slot) {
    const int i = min(next++, units - 1);
    const int round = i / my_steps, step = step_begin + i % my_steps;
    if (i % my_steps == 0 && round > 0 && next <= units) prefetch_round(round + kAhead);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = min((first_round + round) * 32 + g + r * 8, n - 1);
      held[slot][r] = load_stream(q + (size_t)row * row_pieces + step * 4 + t);
    }
  };
  uint32_t acc = 0;
  pipeline<kDepth>(units, load, [&](int slot) {
#pragma unroll
    for (int r = 0; r < 4; ++r) acc ^= fold(held[slot][r]);
  });
  if (acc == 0x12345678u) sink[0] = acc;
}

// The shipped kernel's stream exactly (skinny_mma.cuh, single blocks): a block owns a balanced range of 16-row
// tiles, walked 32 rows (a round) at a time; its 12 warps split the k-steps (contiguous); each lane loads chunk t of
// rows g and g + 8 of each 16-row half, hint L2::128B, 3 units held. kPairs: units of one 16-row half x two k-steps
// instead (chunks t and t + 4), so a quad reads whole 128-byte lines within one unit; both halves of a round's
// k-step pair follow each other. The mma takes either operand order.
template <bool kPairs>
__global__ void __launch_bounds__(384, 1) mma_units(const Piece* q, int n, int k, uint32_t* sink) {
  constexpr int kDepth = 3, kWarps = 12;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane >> 2, t = lane & 3;
  const int chunks = k / 32, steps = k / 128;
  const int tiles = (n + 15) / 16;
  const int row_begin = (int)((long long)blockIdx.x * tiles / gridDim.x) * 16;
  const int row_end = min(n, (int)((long long)(blockIdx.x + 1) * tiles / gridDim.x) * 16);
  const int rounds = (row_end - row_begin + 31) / 32;
  const int items = kPairs ? steps / 2 : steps;  // what the warps split: k-steps, or pairs of them
  const int item_begin = warp * items / kWarps, my_items = (warp + 1) * items / kWarps - item_begin;
  const int per_round = kPairs ? 2 * my_items : my_items;
  const int units = rounds * per_round;
  if (units <= 0) return;
  Piece held[kDepth][4];
  int next = 0;
  auto load = [&](int slot) {
    const int i = min(next++, units - 1);
    const int r0 = row_begin + i / per_round * 32, u = i % per_round;
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // r: row g or g + 8 (bit 0), half or k-step of the pair (bit 1)
      const int h = r & 1, other = r >> 1;
      const int row = kPairs ? r0 + 16 * (u & 1) + g + 8 * h : r0 + 16 * other + g + 8 * h;
      const int chunk = kPairs ? 8 * (item_begin + u / 2) + 4 * other + t : 4 * (item_begin + u) + t;
      held[slot][r] = load_stream<128>(q + (size_t)min(row, row_end - 1) * chunks + chunk);
    }
  };
  // The shipped kernel's order, not pipeline()'s: all slots filled first, each refilled right after it is read.
  uint32_t acc = 0;
#pragma unroll
  for (int d = 0; d < kDepth; ++d) load(d);
  for (int base = 0; base < units; base += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (base + d < units) {
#pragma unroll
        for (int r = 0; r < 4; ++r) acc ^= fold(held[d][r]);
        if (next < units) load(d);
      }
    }
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

// A TMA stream (the idea left open by the producer-warp trials in csrc/PERF.md): the shipped kernel's grid of
// balanced 16-row tiles walked 32 rows at a time, each round's rows read kBoxBytes of each row per unit by one or
// two tensor-map copies of 16 rows (the second only where the block's range has it), into a ring of kStages stages
// in shared memory. One producer thread issues the copies; kConsumerWarps warps wait on each stage's "full"
// mbarrier, read all of it with 16-byte shared loads and release it on its "empty" mbarrier. kSwizzled: the 3-D
// map's swizzled stages, read as the mma's A fragments would be (warp w takes k-steps w, w + kConsumerWarps, ...;
// lane (g, t) the 16 bytes t of rows g and g + 8 of each 16-row half); else the flat stages, read in order.
template <int kStages, int kBoxBytes, int kConsumerWarps, bool kSwizzled>
__global__ void __launch_bounds__((kConsumerWarps + 1) * 32, 1)
    tma_stream(const __grid_constant__ CUtensorMap map, int n, int k, uint32_t* sink) {
  // The stages, then the mbarriers: no static shared memory, so the stages start where the 128-byte swizzle's
  // 1024-byte pattern does (checked below).
  extern __shared__ __align__(1024) unsigned char stages[];
  constexpr int kStageBytes = 32 * kBoxBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(stages + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tiles = (n + 15) / 16;
  const int row_begin = (int)((long long)blockIdx.x * tiles / gridDim.x) * 16;
  const int row_end = min(n, (int)((long long)(blockIdx.x + 1) * tiles / gridDim.x) * 16);
  const int boxes_per_row = k / 2 / kBoxBytes;
  const int units = (row_end - row_begin + 31) / 32 * boxes_per_row;
  if (threadIdx.x == 0) {
    if (kSwizzled && smem_address(stages) % 1024) __trap();
    for (int s = 0; s < kStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(&full[s])));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(&empty[s])), "r"(kConsumerWarps));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == kConsumerWarps) {  // the producer
    if (lane == 0)
      for (int i = 0; i < units; ++i) {
        const int s = i % kStages, use = i / kStages;
        if (use > 0) mbarrier_wait(&empty[s], (use - 1) & 1);
        const int r0 = row_begin + i / boxes_per_row * 32, c0 = i % boxes_per_row * (kBoxBytes / 4);
        const int halves = r0 + 16 < row_end ? 2 : 1;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(&full[s])),
                     "r"(halves * 16 * kBoxBytes)
                     : "memory");
        for (int h = 0; h < halves; ++h) {
          const unsigned dst = smem_address(stages + s * kStageBytes + h * 16 * kBoxBytes);
          if (kSwizzled)
            asm volatile(
                "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {0, %2, %3}], "
                "[%4];" ::"r"(dst),
                "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0 / 32), "r"(r0 + 16 * h), "r"(smem_address(&full[s]))
                : "memory");
          else
            asm volatile(
                "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
                "[%4];" ::"r"(dst),
                "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(r0 + 16 * h), "r"(smem_address(&full[s]))
                : "memory");
        }
      }
    return;
  }
  uint32_t acc = 0;
  for (int i = 0; i < units; ++i) {
    const int s = i % kStages;
    mbarrier_wait(&full[s], (i / kStages) & 1);
    const Piece* stage = reinterpret_cast<const Piece*>(stages + s * kStageBytes);
    if (kSwizzled) {
      constexpr int kLines = kBoxBytes / 128;  // 128-byte lines per row in a stage; a k-step is half a line
      const int g = lane >> 2, t = lane & 3;
#pragma unroll
      for (int step = warp; step < 2 * kLines; step += kConsumerWarps)
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // rows g, g + 8 of the first 16-row half, then of the second
          const int line = ((r >> 1) * 16 + g + 8 * (r & 1)) * kLines + step / 2, unit = (step % 2) * 4 + t;
          acc ^= fold(stage[line * 8 + (unit ^ (line % 8))]);
        }
    } else {
#pragma unroll
      for (int p = threadIdx.x; p < kStageBytes / 16; p += kConsumerWarps * 32) acc ^= fold(stage[p]);
    }
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(&empty[s])) : "memory");
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

using Launch = void (*)(const Piece*, int, int, uint32_t*);
struct Variant {
  const char* name;
  Launch kernel;
  int warps, depth;
  bool async;
  int grid_rows;  // one block per this many weight rows, at most one per SM
};
// Named "split d<depth> w<warps> rows<rows per unit> [rr: round-robin rounds] regs|async".
#define SPLIT(D, W, R, RR, A, NAME) {NAME, skinny_split<D, W, R, RR, A>, W, D, A, 32}

// The protocol these figures were taken with: the rotation captured 4 times over, median of 9 replays.
template <typename F>
float per_call_us(F launch, int copies) {
  return graph_per_call_us(launch, copies, 4, 9);
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line out as it is measured, even when piped to a log
  // --contiguous: the floor of every bench layer (what 1.6x tinygemm is held against), without the variants.
  const bool contiguous_only = argc > 1 && std::strcmp(argv[1], "--contiguous") == 0;
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  struct Shape {
    const char* name;
    int n, k;
  } shapes[] = {{"llama3.1-8b gate_up", 28672, 4096},
                {"llama3.1-8b down", 4096, 14336},
                {"llama3.1-8b qkv", 6144, 4096},
                {"qwen3-4b o", 2560, 4096},
                {"llama3.1-8b o", 4096, 4096},
                {"qwen3-4b qkv", 6144, 2560},
                {"qwen3-4b gate_up", 19456, 2560},
                {"qwen3-4b down", 2560, 9728}};
  const int variant_shapes = 4;  // every pattern runs on the first four
  const Variant variants[] = {
      {"the shipped kernel's stream (L2::128B, its grid)", mma_units<false>, 12, 3, false, 16},
      {"the same, units of 16 rows x 2 k-steps", mma_units<true>, 12, 3, false, 16},
      SPLIT(3, 12, 32, false, false, "split d3 w12 rows32 regs (the kernel's before L2::128B)"),
      SPLIT(4, 12, 32, false, false, "split d4 w12 rows32 regs"),
      SPLIT(6, 12, 32, false, false, "split d6 w12 rows32 regs"),
      SPLIT(3, 12, 32, false, true, "split d3 w12 rows32 async"),
      SPLIT(4, 12, 32, false, true, "split d4 w12 rows32 async"),
      SPLIT(6, 12, 32, false, true, "split d6 w12 rows32 async"),
      SPLIT(3, 12, 16, true, true, "split d3 w12 rows16 rr async"),
      SPLIT(4, 12, 8, false, true, "split d4 w12 rows8 async"),
      SPLIT(4, 8, 16, true, true, "split d4 w8 rows16 rr async"),
      {"split d3 w12 rows32 regs + L2 prefetch 1 round ahead", skinny_split_prefetch<1>, 12, 0, false, 32},
      {"split d3 w12 rows32 regs + L2 prefetch 2 rounds ahead", skinny_split_prefetch<2>, 12, 0, false, 32}};
  struct TmaVariant {
    const char* name;
    void (*kernel)(CUtensorMap, int, int, uint32_t*);
    int stages, box_bytes, consumer_warps;
    bool swizzled;
  };
  // Named "tma s<stages> box<bytes per row> c<consumer warps> [swizzled]": bytes in flight per block = stages x 32
  // x box.
#define TMA(S, B, C, SW, NAME) {NAME, tma_stream<S, B, C, SW>, S, B, C, SW}
  const TmaVariant tma_variants[] = {TMA(16, 128, 4, false, "tma s16 box128 c4"),
                                     TMA(8, 256, 4, false, "tma s8 box256 c4"),
                                     TMA(12, 256, 8, false, "tma s12 box256 c8"),
                                     TMA(6, 512, 8, false, "tma s6 box512 c8"),
                                     TMA(4, 1024, 8, false, "tma s4 box1024 c8"),
                                     TMA(6, 512, 8, true, "tma s6 box512 c8 swizzled, fragment reads"),
                                     TMA(4, 1024, 8, true, "tma s4 box1024 c8 swizzled, fragment reads"),
                                     TMA(3, 1024, 8, true, "tma s3 box1024 c8 swizzled, fragment reads")};
  auto tma_shared_bytes = [](const TmaVariant& v) { return v.stages * (32 * v.box_bytes + 16); };  // + mbarriers
  for (const TmaVariant& v : tma_variants)
    CHECK(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, tma_shared_bytes(v)));
  for (const Variant& v : variants)
    if (v.async)
      CHECK(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, v.warps * v.depth * 2048));
  uint32_t* sink;
  CHECK(cudaMalloc(&sink, 4));
  const size_t total = 512ull << 20;
  char* weights;
  CHECK(cudaMalloc(&weights, total));
  CHECK(cudaMemset(weights, 0x5A, total));
  std::printf("%-20s %-56s %8s %8s\n", "shape", "pattern", "us", "GB/s");
  for (int shape = 0; shape < int(sizeof(shapes) / sizeof(shapes[0])); ++shape) {
    const Shape& s = shapes[shape];
    if (!contiguous_only && shape >= variant_shapes) break;
    const size_t bytes = (size_t)s.n * s.k / 2;
    const int copies = (int)std::max<size_t>(2, total / bytes);
    auto copy = [&](int c) { return reinterpret_cast<const Piece*>(weights + (size_t)c * bytes); };
    auto report = [&](const char* name, float us) {
      std::printf("%-20s %-56s %8.2f %8.0f\n", s.name, name, us, bytes / us / 1e3);
    };
    report("contiguous, 4 blocks per SM x 256 threads", per_call_us([&](int c, cudaStream_t st) {
             contiguous<<<sms * 4, 256, 0, st>>>(copy(c), bytes / 16, sink);
           }, copies));
    for (const Variant& v : variants) {
      if (contiguous_only && &v != &variants[0]) break;
      const int blocks = std::min(sms, (s.n + v.grid_rows - 1) / v.grid_rows);
      const int shared = v.async ? v.warps * v.depth * 2048 : 0;
      report(v.name, per_call_us([&](int c, cudaStream_t st) {
               v.kernel<<<blocks, v.warps * 32, shared, st>>>(copy(c), s.n, s.k, sink);
             }, copies));
    }
    for (const TmaVariant& v : tma_variants) {
      if (contiguous_only) break;
      std::vector<CUtensorMap> maps;
      for (int c = 0; c < copies; ++c) maps.push_back(weight_map(copy(c), s.n, s.k, v.box_bytes, v.swizzled));
      const int blocks = std::min(sms, (s.n + 15) / 16), shared = tma_shared_bytes(v);
      report(v.name, per_call_us([&](int c, cudaStream_t st) {
               v.kernel<<<blocks, (v.consumer_warps + 1) * 32, shared, st>>>(maps[c], s.n, s.k, sink);
             }, copies));
    }
  }
  CHECK(cudaGetLastError());
  return 0;
}
