// The AMD dot2 kernel (csrc/skinny_kernel.cuh) run on the CPU, for tests/csrc/test_emulate_dot2.py: the kernel's
// own source, one std::thread per GPU thread, block by block. No AMD GPU is here; this runs its indexing, staging,
// row split, chunk loop, offset removal, wave reduction and epilogue as written. What is emulated: the thread
// indices, __syncthreads (a barrier of the block), __shfl_xor (an exchange through memory between two barriers of
// the wave) and dot2 (portability.h: in double, rounded to fp32 once). Compiled by clang (_Float16, __bf16 and
// __builtin_nontemporal_load on the host), -std=c++20.
//
// Usage: emulate_dot2 DIR DTYPE G SYMMETRIC M N K GRID HAS_BIAS
//   DIR holds x.bin [M, K], qweight.bin [N, K/8] int32, scales.bin [N, K/G], zeros.bin [N, K/G] uint8 (asymmetric),
//   bias.bin [N] (HAS_BIAS), 16-bit values as raw bits; writes out.bin [M, N]. GRID is the number of blocks.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local Dim3 threadIdx;
inline Dim3 blockIdx, blockDim, gridDim;

// What one GPU thread needs of its block: the block's barrier and its wave's barrier and exchange slots.
struct Block {
  explicit Block(int threads) : sync(threads), exchange(threads) {
    for (int w = 0; w < threads / 32; ++w) waves.push_back(std::make_unique<std::barrier<>>(32));
  }
  std::barrier<> sync;
  std::vector<std::unique_ptr<std::barrier<>>> waves;
  std::vector<float> exchange;
};
inline thread_local Block* block_of_thread = nullptr;

inline void __syncthreads() { block_of_thread->sync.arrive_and_wait(); }
// Every lane of the wave calls it with the same mask (the kernel's butterfly), as on the GPU.
inline float __shfl_xor(float v, int mask, int width) {
  const int t = int(threadIdx.x), base = t - t % width;
  std::barrier<>& wave = *block_of_thread->waves[t / 32];
  block_of_thread->exchange[t] = v;
  wave.arrive_and_wait();
  const float other = block_of_thread->exchange[base + ((t - base) ^ mask)];
  wave.arrive_and_wait();
  return other;
}
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
[[noreturn]] inline void __trap() { std::abort(); }

#include "skinny_kernel.cuh"

namespace w4a16 {
// The kernel's `extern __shared__ Words4 smem[]`: one block runs at a time, so one array serves them all.
alignas(16) Words4 smem[65536 / sizeof(Words4)];
}  // namespace w4a16

using namespace w4a16;

template <typename T>
static std::vector<T> read_file(const std::string& path, size_t count) {
  std::vector<T> data(count);
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f || std::fread(data.data(), sizeof(T), count, f) != count) {
    std::fprintf(stderr, "cannot read %zu values from %s\n", count, path.c_str());
    std::exit(2);
  }
  std::fclose(f);
  return data;
}

struct Problem {
  std::vector<uint16_t> x, scales, bias, out;
  std::vector<int32_t> qweight;
  std::vector<uint8_t> zeros;
  int m, n, k, grid;
};

template <typename Tag, int G, bool kSymmetric, int M>
static void launch(Problem& p) {
  const int threads = block_threads<M>();
  blockDim.x = threads;
  gridDim.x = p.grid;
  for (int b = 0; b < p.grid; ++b) {
    blockIdx.x = b;
    std::memset(smem, 0xFF, sizeof(smem));  // NaN bits: a read of anything the block did not stage shows
    Block block(threads);
    std::vector<std::thread> lanes;
    for (int t = 0; t < threads; ++t)
      lanes.emplace_back([&, t] {
        threadIdx.x = t;
        block_of_thread = &block;
        skinny_gemm_kernel<Tag, G, kSymmetric, M>(
            p.x.data(), reinterpret_cast<const Words4*>(p.qweight.data()), p.scales.data(),
            kSymmetric ? nullptr : p.zeros.data(), p.bias.empty() ? nullptr : p.bias.data(), p.out.data(), p.n, p.k);
      });
    for (auto& lane : lanes) lane.join();
    // The HIP launcher gives a block staging_bytes(M * K) of dynamic LDS (skinny_kernel.cu, launch_shared_bytes):
    // a write past it would land outside the block's allocation on the GPU.
    const auto* bytes = reinterpret_cast<const unsigned char*>(smem);
    for (size_t i = staging_bytes(M * p.k); i < sizeof(smem); ++i)
      if (bytes[i] != 0xFF) {
        std::fprintf(stderr, "block %d wrote shared byte %zu, past the %d bytes the launcher allocates\n", b, i,
                     staging_bytes(M * p.k));
        std::exit(3);
      }
  }
}

template <typename Tag, int G, bool kSymmetric, int M = 1>
static bool dispatch_rows(Problem& p) {
  if constexpr (M > 5) {
    return false;
  } else {
    if (p.m == M) return launch<Tag, G, kSymmetric, M>(p), true;
    return dispatch_rows<Tag, G, kSymmetric, M + 1>(p);
  }
}

template <typename Tag>
static bool dispatch(Problem& p, int group, bool symmetric) {
  switch (group * 2 + symmetric) {
    case 64: return dispatch_rows<Tag, 32, false>(p);
    case 65: return dispatch_rows<Tag, 32, true>(p);
    case 128: return dispatch_rows<Tag, 64, false>(p);
    case 129: return dispatch_rows<Tag, 64, true>(p);
    case 256: return dispatch_rows<Tag, 128, false>(p);
    case 257: return dispatch_rows<Tag, 128, true>(p);
    default: return false;
  }
}

int main(int argc, char** argv) {
  if (argc != 10) {
    std::fprintf(stderr, "usage: %s DIR DTYPE G SYMMETRIC M N K GRID HAS_BIAS\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1], dtype = argv[2];
  const int group = std::atoi(argv[3]), symmetric = std::atoi(argv[4]);
  Problem p;
  p.m = std::atoi(argv[5]), p.n = std::atoi(argv[6]), p.k = std::atoi(argv[7]), p.grid = std::atoi(argv[8]);
  const size_t groups = size_t(p.n) * (p.k / group);
  p.x = read_file<uint16_t>(dir + "/x.bin", size_t(p.m) * p.k);
  p.qweight = read_file<int32_t>(dir + "/qweight.bin", size_t(p.n) * p.k / 8);
  p.scales = read_file<uint16_t>(dir + "/scales.bin", groups);
  if (!symmetric) p.zeros = read_file<uint8_t>(dir + "/zeros.bin", groups);
  if (std::atoi(argv[9])) p.bias = read_file<uint16_t>(dir + "/bias.bin", p.n);
  p.out.assign(size_t(p.m) * p.n, 0xFFFF);  // NaN bits: an output the kernel does not write fails the check
  if (size_t(p.m) * p.k > size_t(W4A16_DEVICE_LIMITS.staging_elements)) {
    std::fprintf(stderr, "M * K = %d is past the staging budget %d\n", p.m * p.k, W4A16_DEVICE_LIMITS.staging_elements);
    return 2;
  }
  const bool ran = dtype == "bf16" ? dispatch<Bf16Tag>(p, group, symmetric) : dispatch<Fp16Tag>(p, group, symmetric);
  if (!ran) {
    std::fprintf(stderr, "no instantiation for dtype %s, G %d, symmetric %d, M %d\n", dtype.c_str(), group, symmetric,
                 p.m);
    return 2;
  }
  FILE* f = std::fopen((dir + "/out.bin").c_str(), "wb");
  std::fwrite(p.out.data(), sizeof(uint16_t), p.out.size(), f);
  std::fclose(f);
  return 0;
}
