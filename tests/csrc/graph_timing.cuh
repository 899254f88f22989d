// What the standalone timing programs (read_patterns.cu, time_skinny.cu) share: error checks, the timing protocol
// of bench_skinny.py (a CUDA graph replaying many calls over a rotation of weight copies), and the tensor maps of
// the TMA weight streams.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e = (x);                                                             \
    if (e != cudaSuccess) {                                                          \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

// Median µs per call of a graph that calls launch(copy, stream) for copy = 0 .. copies - 1, `repeats` times over,
// after three warm-up replays.
template <typename F>
float graph_per_call_us(F launch, int copies, int repeats, int replays) {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int r = 0; r < repeats; ++r)
    for (int c = 0; c < copies; ++c) launch(c, stream);
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(exec, stream));
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  std::vector<float> us;
  for (int rep = 0; rep < replays; ++rep) {
    CHECK(cudaEventRecord(start, stream));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(end, stream));
    CHECK(cudaEventSynchronize(end));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, start, end));
    us.push_back(ms * 1000.f / (repeats * copies));
  }
  std::sort(us.begin(), us.end());
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(end));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaStreamDestroy(stream));
  return us[us.size() / 2];
}

// The TMA streams' device side (read_patterns.cu, tma_skinny.cuh): a shared-memory address, and a wait for an
// mbarrier's phase of the given parity.
__device__ __forceinline__ unsigned smem_address(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n .reg .pred done;\n wait:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra wait;\n}" ::"r"(smem_address(bar)),
      "r"(parity)
      : "memory");
}

// A tensor map over one weight copy. 2-D: [n rows, k / 8 words], boxes of 16 rows x box_bytes, no swizzle. 3-D
// (swizzled): [n rows, k / 256 lines of 128 bytes, 32 words], boxes of 16 rows x box_bytes / 128 lines, with the
// 128-byte swizzle (16-byte unit u of line l lands at u ^ (l % 8)).
inline CUtensorMap weight_map(const void* base, int n, int k, int box_bytes, bool swizzled) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess) {
      std::printf("cuTensorMapEncodeTiled not found\n");
      std::exit(1);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map;
  const cuuint64_t flat_dims[2] = {(cuuint64_t)k / 8, (cuuint64_t)n}, flat_strides[1] = {(cuuint64_t)k / 2};
  const cuuint32_t flat_box[2] = {(cuuint32_t)box_bytes / 4, 16};
  const cuuint64_t line_dims[3] = {32, (cuuint64_t)k / 256, (cuuint64_t)n}, line_strides[2] = {128, (cuuint64_t)k / 2};
  const cuuint32_t line_box[3] = {32, (cuuint32_t)box_bytes / 128, 16}, element_strides[3] = {1, 1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT32, swizzled ? 3 : 2, const_cast<void*>(base),
                            swizzled ? line_dims : flat_dims, swizzled ? line_strides : flat_strides,
                            swizzled ? line_box : flat_box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            swizzled ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::printf("cuTensorMapEncodeTiled failed (%d) for n=%d k=%d box=%d\n", (int)r, n, k, box_bytes);
    std::exit(1);
  }
  return map;
}
