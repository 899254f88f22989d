// Times the sm_90 skinny kernel without torch or the extension build, so that variants of its header can be
// compared in seconds: build this file twice, against csrc/ and against an edited copy of skinny_mma.cuh placed in
// a directory searched first, and run both in one device round. csrc/PERF.md ("Load order and x staging") gives
// the figures it measured.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 [-I<dir of the variant header>] -Icsrc \
//        -o /tmp/time_skinny tests/csrc/time_skinny.cu
//   /tmp/time_skinny                      # the eight bench layers at M = 1, 5 and 8, then fp16 and G < 128 cases
//   TIME_SKINNY_LAYER=llama_gate_up /tmp/time_skinny     # M = 1 of one layer (for ncu)
//   TIME_SKINNY_MORE=1 /tmp/time_skinny   # and M = 1 and 5 of the bench catalogue's other models
//   (built with -DTIME_SKINNY_TMA: the TMA-fed probe of tma_skinny.cuh instead; G = 128, symmetric, K % 256 == 0;
//   -DTMA_STAGES=N: its ring's stages, 6 by default, 4 where N do not fit)
//
// Protocol as bench_skinny.py, but single-block launches only (no clusters): CUDA-graph replay over >= 512 MB of
// weight copies, median of 15 replays. Each line ends with a checksum of the last call's output (a weighted sum and
// the sum of magnitudes): a variant that computes the same thing in the same order prints the same checksum. Then
// "check ok" or "check FAILED": about 512 sampled output rows of that call against a float64 reference computed
// here from the layout's definition (outputs start as NaN, so an unwritten one fails too); the exit status is 1
// if any case failed. tests/csrc/ab_skinny.py builds and runs this file against several versions of csrc/.
#include <cmath>
#include <cstring>

#include "graph_timing.cuh"
#include "skinny_mma.cuh"
#if defined(TIME_SKINNY_TMA)  // the TMA-fed probe (tma_skinny.cuh) in place of the shipped kernel
#include "tma_skinny.cuh"
#endif

using namespace w4a16;

__device__ __forceinline__ uint32_t mix(uint32_t h) {
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  h *= 3266489917u;
  return h ^ (h >> 16);
}

// Random words: packed weights (every nibble pattern occurs).
__global__ void fill_words(uint32_t* p, size_t words, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x)
    p[i] = mix((uint32_t)i * 2654435761u ^ seed);
}

// 16-bit floats (bf16 or fp16 bits) uniform in [lo, hi).
template <typename Tag>
__global__ void fill_floats(uint16_t* p, size_t n, uint32_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const float f = lo + (hi - lo) * (mix((uint32_t)i * 2654435761u ^ seed) & 0xFFFFFF) / 16777216.f;
    p[i] = from_float(f, Tag{});
  }
}

template <typename Tag>
float host_float(uint16_t bits) {
  if constexpr (std::is_same_v<Tag, Bf16Tag>) {
    const uint32_t wide = (uint32_t)bits << 16;
    float f;
    std::memcpy(&f, &wide, 4);
    return f;
  } else {
    return (float)*reinterpret_cast<const __half*>(&bits);
  }
}

// Whether every case so far passed its check.
bool all_checks_passed = true;

template <typename T>
std::vector<T> download(const void* device, size_t count) {
  std::vector<T> host(count);
  CHECK(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

// The sampled rows of y[M, n] against sum_k x[m, k] (q[row, k] - z) s in float64, q read by the layout's own rule
// (w4a16/layout.py: k-offset j of a word at bit shift (j / 2) * 4 + (j % 2) * 16), independent of dequant.h.
// Allowed error: the output's rounding (2^-8 relative) plus 2^-10 of sum_k |x w| (a 16-bit weight rounding is
// 2^-11 of it, fp32 accumulation far less); a wrong scale, row or k-step is off by far more.
template <typename Tag, int G, bool kSymmetric>
const char* check_rows(int M, int n, int k, const char* qweight, const char* scales, const char* zeros,
                       const uint16_t* x, const std::vector<uint16_t>& y) {
  static char verdict[160];
  const std::vector<uint16_t> xh = download<uint16_t>(x, (size_t)M * k);
  const int groups = k / G;
  double worst = 0;
  for (int i = 0; i < 512; ++i) {
    const int row = (int)((long long)i * (n - 1) / 511);
    if (i && row == (int)((long long)(i - 1) * (n - 1) / 511)) continue;
    const std::vector<uint32_t> words = download<uint32_t>(qweight + (size_t)row * k / 2, k / 8);
    const std::vector<uint16_t> s = download<uint16_t>(scales + (size_t)row * groups * 2, groups);
    const std::vector<uint8_t> z = kSymmetric ? std::vector<uint8_t>(groups, 8)
                                              : download<uint8_t>(zeros + (size_t)row * groups, groups);
    for (int m = 0; m < M; ++m) {
      double ref = 0, magnitude = 0;
      for (int kk = 0; kk < k; ++kk) {
        const int j = kk % 8, q = (words[kk / 8] >> ((j / 2) * 4 + (j % 2) * 16)) & 15;
        const double w = (q - z[kk / G]) * (double)host_float<Tag>(s[kk / G]);
        const double term = w * host_float<Tag>(xh[(size_t)m * k + kk]);
        ref += term;
        magnitude += std::fabs(term);
      }
      const double got = host_float<Tag>(y[(size_t)m * n + row]);
      const double error = std::fabs(got - ref), allowed = std::fabs(ref) / 256 + magnitude / 1024;
      if (!(error <= allowed)) {  // also NaN
        all_checks_passed = false;
        std::snprintf(verdict, sizeof verdict, "check FAILED (row %d, x row %d: %.6g, expected %.6g)", row, m, got,
                      ref);
        return verdict;
      }
      worst = std::max(worst, error / allowed);
    }
  }
  std::snprintf(verdict, sizeof verdict, "check ok (worst %.2f of the allowed error)", worst);
  return verdict;
}

template <int M, typename Tag = Bf16Tag, int G = 128, bool kSymmetric = true>
void time_layer(const char* name, int n, int k, int sms) {
  int limit = 0;
  CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
#if defined(TIME_SKINNY_TMA)
  if (G != 128 || !kSymmetric || k % 256) {
    std::printf("%-22s M=%d skipped: the TMA probe takes G = 128, symmetric, K %% 256 == 0\n", name, M);
    return;
  }
#if !defined(TMA_STAGES)
#define TMA_STAGES 6
#endif
  // TMA_STAGES stages where they fit (6: the TMA read probe's best), else 4.
  const bool fits = tma_probe::shared_bytes(TMA_STAGES, M, k) <= limit;
  auto kernel = fits ? tma_probe::tma_skinny_kernel<Tag, M, TMA_STAGES> : tma_probe::tma_skinny_kernel<Tag, M, 4>;
  const int shared = tma_probe::shared_bytes(fits ? TMA_STAGES : 4, M, k), threads = tma_probe::kThreads;
#else
  auto kernel = tensor_core::skinny_gemm_kernel<Tag, G, kSymmetric, M, false>;
  const int shared = tensor_core::shared_bytes(M, k), threads = tensor_core::kThreads;
#endif
  if (shared > limit) {
    std::printf("%-22s M=%d skipped: %d bytes of shared memory\n", name, M, shared);
    return;
  }
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  // One copy: packed weights, scales, zero points (asymmetric), each 256-byte aligned.
  const size_t weight_bytes = (size_t)n * k / 2, scale_bytes = (size_t)n * (k / G) * 2;
  const size_t zero_bytes = kSymmetric ? 0 : (size_t)n * (k / G);
  auto round_up = [](size_t b) { return (b + 255) / 256 * 256; };
  const size_t per_copy = round_up(weight_bytes) + round_up(scale_bytes) + round_up(zero_bytes);
  const int copies = (int)std::max<size_t>(2, (512ull << 20) / per_copy);
  char* weights;
  CHECK(cudaMalloc(&weights, per_copy * copies));
  auto qweight = [&](int c) { return weights + c * per_copy; };
  auto scales = [&](int c) { return qweight(c) + round_up(weight_bytes); };
  auto zeros = [&](int c) { return scales(c) + round_up(scale_bytes); };
  fill_words<<<1024, 256>>>(reinterpret_cast<uint32_t*>(weights), per_copy * copies / 4, 1234u);
  std::vector<uint8_t> zero_points;
  if constexpr (!kSymmetric)
    for (size_t i = 0; i < zero_bytes; ++i) zero_points.push_back((uint8_t)((i * 2654435761u >> 13) & 15));
  for (int c = 0; c < copies; ++c) {
    fill_floats<Tag><<<256, 256>>>(reinterpret_cast<uint16_t*>(scales(c)), scale_bytes / 2, 77u, 0.004f, 0.012f);
    if constexpr (!kSymmetric) CHECK(cudaMemcpy(zeros(c), zero_points.data(), zero_bytes, cudaMemcpyHostToDevice));
  }
  uint16_t *x, *out;
  CHECK(cudaMalloc(&x, (size_t)M * k * 2));
  CHECK(cudaMalloc(&out, (size_t)M * n * 2 * copies));
  CHECK(cudaMemset(out, 0xFF, (size_t)M * n * 2 * copies));  // NaN in fp16 and bf16
  fill_floats<Tag><<<256, 256>>>(x, (size_t)M * k, 99u, -1.f, 1.f);
  const int blocks = std::min(sms, (n + 15) / 16);
#if defined(TIME_SKINNY_TMA)
  std::vector<CUtensorMap> maps;
  for (int c = 0; c < copies; ++c) maps.push_back(weight_map(qweight(c), n, k, tma_probe::kStageSteps * 64, true));
#endif
  auto launch = [&](int c, cudaStream_t stream) {
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = shared;
    config.stream = stream;
#if defined(W4A16_PROGRAMMATIC_LAUNCH)  // a version of the kernel that waits for the kernel ahead of it
    cudaLaunchAttribute programmatic{};
    programmatic.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    programmatic.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &programmatic;
    config.numAttrs = 1;
#endif
#if defined(TIME_SKINNY_TMA)
    CHECK(cudaLaunchKernelEx(&config, kernel, maps[c], (const uint16_t*)x, reinterpret_cast<const uint16_t*>(scales(c)),
                             out + (size_t)c * M * n, n, k));
#else
    CHECK(cudaLaunchKernelEx(&config, kernel, (const uint16_t*)x, reinterpret_cast<const Words4*>(qweight(c)),
                             reinterpret_cast<const uint16_t*>(scales(c)),
                             kSymmetric ? nullptr : reinterpret_cast<const uint8_t*>(zeros(c)),
                             (const uint16_t*)nullptr, out + (size_t)c * M * n, n, k));
#endif
  };
  const float us = graph_per_call_us(launch, copies, std::max(1, 64 / copies + 1), 15);
  std::vector<uint16_t> y((size_t)M * n);
  CHECK(cudaMemcpy(y.data(), out + (size_t)(copies - 1) * M * n, y.size() * 2, cudaMemcpyDeviceToHost));
  double weighted = 0, magnitude = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const float f = host_float<Tag>(y[i]);
    weighted += f * (1 + i % 7);
    magnitude += std::fabs(f);
  }
  const char* verdict = check_rows<Tag, G, kSymmetric>(M, n, k, qweight(copies - 1), scales(copies - 1),
                                                       zeros(copies - 1), x, y);
  std::printf("%-22s M=%d %8.2f us  checksum %.6e %.6e  %s\n", name, M, us, weighted, magnitude, verdict);
  CHECK(cudaFree(weights));
  CHECK(cudaFree(x));
  CHECK(cudaFree(out));
}

int main() {
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  struct Layer {
    const char* name;
    int n, k;
  } layers[] = {{"llama_qkv", 6144, 4096}, {"llama_o", 4096, 4096}, {"llama_gate_up", 28672, 4096},
                {"llama_down", 4096, 14336}, {"qwen_qkv", 6144, 2560}, {"qwen_o", 2560, 4096},
                {"qwen_gate_up", 19456, 2560}, {"qwen_down", 2560, 9728}};
  const char* only = std::getenv("TIME_SKINNY_LAYER");
  for (const Layer& l : layers) {
    if (only && std::strcmp(only, l.name)) continue;
    time_layer<1>(l.name, l.n, l.k, sms);
    if (!only) time_layer<5>(l.name, l.n, l.k, sms);
    if (!only) time_layer<8>(l.name, l.n, l.k, sms);
  }
  if (only) return all_checks_passed ? 0 : 1;
  // TIME_SKINNY_MORE=1: also M = 1 and 5 of the other models of the bench catalogue (w4a16/bench/catalogue.py),
  // for a change whose gains and losses depend on the shape (rounds per block, k-steps per warp).
  if (std::getenv("TIME_SKINNY_MORE")) {
    const Layer more[] = {{"qwen3-8b gate_up", 24576, 4096},    {"qwen3-8b down", 4096, 12288},
                          {"qwen2.5-7b qkv", 4608, 3584},       {"qwen2.5-7b o", 3584, 3584},
                          {"qwen2.5-7b gate_up", 37888, 3584},  {"qwen2.5-7b down", 3584, 18944},
                          {"gemma3-4b qkv", 4096, 2560},        {"gemma3-4b o", 2560, 2048},
                          {"gemma3-4b gate_up", 20480, 2560},   {"gemma3-4b down", 2560, 10240},
                          {"smollm2-1.7b qkv", 6144, 2048},     {"smollm2-1.7b o", 2048, 2048},
                          {"smollm2-1.7b gate_up", 16384, 2048}, {"smollm2-1.7b down", 2048, 8192}};
    for (const Layer& l : more) {
      time_layer<1>(l.name, l.n, l.k, sms);
      time_layer<5>(l.name, l.n, l.k, sms);
    }
  }
  for (const Layer& l : {layers[0], layers[2], layers[5]}) {
    char name[48];
    std::snprintf(name, sizeof name, "%s fp16 uint4 g32", l.name);
    time_layer<1, Fp16Tag, 32, false>(name, l.n, l.k, sms);
    time_layer<5, Fp16Tag, 32, false>(name, l.n, l.k, sms);
  }
  // fp16 at G = 128 (the raw dot with fp16's magic numbers; AWQ and GPTQ checkpoints are mostly fp16)
  time_layer<1, Fp16Tag>("llama_gate_up fp16 uint4b8 g128", 28672, 4096, sms);
  time_layer<5, Fp16Tag>("llama_gate_up fp16 uint4b8 g128", 28672, 4096, sms);
  time_layer<1, Fp16Tag>("llama_down fp16 uint4b8 g128", 4096, 14336, sms);
  time_layer<1, Fp16Tag, 128, false>("qwen_o fp16 uint4 g128", 2560, 4096, sms);
  time_layer<5, Fp16Tag, 128, false>("qwen_o fp16 uint4 g128", 2560, 4096, sms);
  time_layer<1, Bf16Tag, 64, false>("llama_gate_up bf16 uint4 g64", 28672, 4096, sms);
  time_layer<5, Bf16Tag, 64, true>("llama_gate_up bf16 uint4b8 g64", 28672, 4096, sms);
  // K % 128 != 0 with G < 128: the last k-step ends inside K, and a row's groups start at any offset
  time_layer<1, Fp16Tag, 32, false>("k_tail fp16 uint4 g32", 4096, 4064, sms);
  time_layer<5, Bf16Tag, 64, false>("k_tail bf16 uint4 g64", 4096, 4032, sms);
  return all_checks_passed ? 0 : 1;
}
