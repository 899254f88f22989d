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
//   Every operand ends where an inaccessible page begins: a read or write past its end stops the run.
// Usage: emulate_dot2 round DIR DTYPE COUNT
//   The epilogue's rounding alone: DIR/values.bin holds COUNT fp32; writes out.bin, from_float of each.
#include <sys/mman.h>
#include <unistd.h>

#include <barrier>
#include <cmath>
#include <csignal>
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
// Every lane of the wave calls it with the same mask (the kernel's butterfly), as on the GPU. The partner lane is
// HIP's (amd_warp_functions.h): lane ^ mask, or the lane itself where that lies past the end of its width-wide
// segment, so a butterfly with too small a width sums a lane's own value twice, as it would on the GPU.
inline float __shfl_xor(float v, int mask, int width) {
  const int t = int(threadIdx.x), lane = t % 32;
  std::barrier<>& wave = *block_of_thread->waves[t / 32];
  int partner = lane ^ mask;
  if (partner >= ((lane + width) & ~(width - 1))) partner = lane;
  block_of_thread->exchange[t] = v;
  wave.arrive_and_wait();
  const float other = block_of_thread->exchange[t - lane + partner];
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

// A copy of `data` that ends where an inaccessible page begins, so that the kernel's first access past the end faults
// (on the GPU it would read or overwrite a neighbour's memory unseen). The process exits after one launch; the
// mapping is never released.
template <typename T>
static T* ending_at_a_guard_page(const std::vector<T>& data) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE)), bytes = data.size() * sizeof(T);
  const size_t pages = (bytes + page - 1) / page;
  void* mapping = mmap(nullptr, (pages + 1) * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapping == MAP_FAILED) {
    std::perror("mmap");
    std::exit(2);
  }
  auto* guard = static_cast<unsigned char*>(mapping) + pages * page;
  mprotect(guard, page, PROT_NONE);
  T* copy = reinterpret_cast<T*>(guard - bytes);  // x and qweight, read in 16-byte pieces, are 16-byte multiples
  std::memcpy(copy, data.data(), bytes);
  return copy;
}

static void on_guard_page_fault(int) {
  static const char message[] = "the kernel touched memory past the end of an operand\n";
  (void)write(2, message, sizeof(message) - 1);
  _exit(4);
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
  const uint16_t* x = ending_at_a_guard_page(p.x);
  const auto* qweight = reinterpret_cast<const Words4*>(ending_at_a_guard_page(p.qweight));
  const uint16_t* scales = ending_at_a_guard_page(p.scales);
  const uint8_t* zeros = kSymmetric ? nullptr : ending_at_a_guard_page(p.zeros);
  const uint16_t* bias = p.bias.empty() ? nullptr : ending_at_a_guard_page(p.bias);
  uint16_t* out = ending_at_a_guard_page(p.out);
  std::signal(SIGSEGV, on_guard_page_fault);
  // Blocks run one at a time, the last first: a block that writes past its rows then overwrites outputs its
  // neighbour has already written, which the check sees (in grid order the neighbour would write them again).
  for (int b = p.grid - 1; b >= 0; --b) {
    blockIdx.x = b;
    std::memset(smem, 0xFF, sizeof(smem));  // NaN bits: a read of anything the block did not stage shows
    Block block(threads);
    std::vector<std::thread> lanes;
    for (int t = 0; t < threads; ++t)
      lanes.emplace_back([&, t] {
        threadIdx.x = t;
        block_of_thread = &block;
        skinny_gemm_kernel<Tag, G, kSymmetric, M>(x, qweight, scales, zeros, bias, out, p.n, p.k);
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
  std::memcpy(p.out.data(), out, p.out.size() * sizeof(uint16_t));
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

static void write_file(const std::string& path, const std::vector<uint16_t>& data) {
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(data.data(), sizeof(uint16_t), data.size(), f);
  std::fclose(f);
}

// The epilogue's cast of the fp32 sum to the output dtype, on every value of DIR/values.bin.
static int round_values(const std::string& dir, const std::string& dtype, size_t count) {
  const std::vector<float> values = read_file<float>(dir + "/values.bin", count);
  std::vector<uint16_t> out(count);
  for (size_t i = 0; i < count; ++i)
    out[i] = dtype == "bf16" ? from_float(values[i], Bf16Tag{}) : from_float(values[i], Fp16Tag{});
  write_file(dir + "/out.bin", out);
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 5 && std::string(argv[1]) == "round")
    return round_values(argv[2], argv[3], std::strtoull(argv[4], nullptr, 10));
  if (argc != 10) {
    std::fprintf(stderr, "usage: %s DIR DTYPE G SYMMETRIC M N K GRID HAS_BIAS\n       %s round DIR DTYPE COUNT\n",
                 argv[0], argv[0]);
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
  write_file(dir + "/out.bin", p.out);
  return 0;
}
