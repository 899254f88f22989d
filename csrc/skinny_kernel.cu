// Instantiations of the skinny kernel and its host-side launcher. No torch here: this file compiles alone for
// sm_90 (nvcc) and gfx1151/gfx1201 (clang HIP), which is how CI checks the device code without a GPU.
// AMD runs the dot2 kernel (skinny_kernel.cuh), NVIDIA the tensor-core kernel (skinny_mma.cuh).
#include "portability.h"
#include "skinny_launch.h"
#if defined(W4A16_CUDA)
#include "skinny_mma.cuh"
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "the skinny kernel needs sm_80 or later on NVIDIA (mma.sync with bf16)"
#endif
#else
#include "skinny_kernel.cuh"
#endif

#include <algorithm>

// The probe variable the instruction checks read out of the compiled device code (portability.h). Global scope:
// the runtime registers device variables by their unqualified name.
extern "C" {
__device__ int w4a16_device_staging_elements = W4A16_DEVICE_LIMITS.staging_elements;
}

namespace w4a16 {

// The kernel is instantiated for M = 1..kInstantiatedRows; no arch may promise more.
constexpr int kInstantiatedRows = 5;
#define W4A16_ROWS_ROW(name, rows, elements, hw_bytes) \
  static_assert((rows) <= kInstantiatedRows, "max_rows of " #name " exceeds the instantiated kernels");
W4A16_ARCH_TABLE(W4A16_ROWS_ROW)
#undef W4A16_ROWS_ROW

namespace {

int multiprocessor_count() {
  static int cached[64] = {0};
  int device = 0;
  if (w4a16GetDevice(&device) != w4a16Success || device < 0 || device >= 64) return 1;
  if (!cached[device]) {
    int count = 0;
    w4a16DeviceGetAttribute(&count, w4a16AttrMultiProcessorCount, device);
    cached[device] = count > 0 ? count : 1;
  }
  return cached[device];
}

// Grid and shared memory of one launch. dot2 kernel: one block per SM / CU, waves own rows; tensor-core kernel:
// one block per SM, and no more blocks than 16-row tiles.
struct LaunchShape {
  int threads, blocks, shared_bytes;
};
template <int M>
LaunchShape launch_shape(const SkinnyArgs& a) {
#if defined(W4A16_CUDA)
  constexpr int threads = tensor_core::kThreads;
  const int blocks = std::min(multiprocessor_count(), (a.n + 15) / 16);
  return {threads, blocks, tensor_core::shared_bytes(M, a.k)};
#else
  constexpr int threads = block_threads<M>();
  const int waves_per_block = threads / kWaveSize;
  const int blocks = std::min(multiprocessor_count(), std::max(1, (a.n + waves_per_block - 1) / waves_per_block));
  return {threads, blocks, staging_bytes(M * a.k)};
#endif
}

template <typename Tag, int G, bool kSymmetric, int M>
SkinnyStatus launch_one(const SkinnyArgs& a, gpuStream_t stream, const char** error) {
#if defined(W4A16_CUDA)
  auto kernel = tensor_core::skinny_gemm_kernel<Tag, G, kSymmetric, M>;
#else
  auto kernel = skinny_gemm_kernel<Tag, G, kSymmetric, M>;
#endif
  const LaunchShape shape = launch_shape<M>(a);
  // Opt in to more than 48 KB of dynamic shared memory up to what this launch needs; the binding has already
  // checked M * K against the device's staging budget, whose bytes the hardware can hold (portability.h).
  static int opted_in = 0;
  if (shape.shared_bytes > opted_in) {
    if (w4a16FuncSetAttribute(reinterpret_cast<const void*>(kernel), w4a16FuncAttrMaxDynamicShared,
                              shape.shared_bytes) != w4a16Success) {
      *error = w4a16GetErrorString(w4a16GetLastError());
      return SkinnyStatus::launch_failed;
    }
    opted_in = shape.shared_bytes;
  }
  kernel<<<shape.blocks, shape.threads, shape.shared_bytes, stream>>>(
      a.x, reinterpret_cast<const Words4*>(a.qweight), a.scales, a.zeros, a.bias, a.out, a.n, a.k);
  const gpuError_t status = w4a16GetLastError();
  if (status != w4a16Success) {
    *error = w4a16GetErrorString(status);
    return SkinnyStatus::launch_failed;
  }
  return SkinnyStatus::ok;
}

template <typename Tag, int G, bool kSymmetric>
SkinnyStatus by_rows(const SkinnyArgs& a, gpuStream_t s, const char** e) {
  switch (a.m) {
    case 1: return launch_one<Tag, G, kSymmetric, 1>(a, s, e);
    case 2: return launch_one<Tag, G, kSymmetric, 2>(a, s, e);
    case 3: return launch_one<Tag, G, kSymmetric, 3>(a, s, e);
    case 4: return launch_one<Tag, G, kSymmetric, 4>(a, s, e);
    case 5: return launch_one<Tag, G, kSymmetric, 5>(a, s, e);
    default: return SkinnyStatus::unsupported;
  }
}

template <typename Tag, int G>
SkinnyStatus by_format(const SkinnyArgs& a, gpuStream_t s, const char** e) {
  return a.zeros ? by_rows<Tag, G, false>(a, s, e) : by_rows<Tag, G, true>(a, s, e);
}

template <typename Tag>
SkinnyStatus by_group(const SkinnyArgs& a, gpuStream_t s, const char** e) {
  switch (a.group_size) {
    case 32: return by_format<Tag, 32>(a, s, e);
    case 64: return by_format<Tag, 64>(a, s, e);
    case 128: return by_format<Tag, 128>(a, s, e);
    default: return SkinnyStatus::unsupported;
  }
}

}  // namespace

SkinnyStatus skinny_launch(const SkinnyArgs& args, void* stream, const char** error) {
  gpuStream_t s = static_cast<gpuStream_t>(stream);
  return args.bf16 ? by_group<Bf16Tag>(args, s, error) : by_group<Fp16Tag>(args, s, error);
}

bool skinny_device_limits(void* stream, int out[2]) {
  int* device_out = nullptr;
#if defined(W4A16_HIP)
  if (hipMalloc(&device_out, 2 * sizeof(int)) != hipSuccess) return false;
  skinny_limits_probe<<<1, 1, 0, static_cast<gpuStream_t>(stream)>>>(device_out);
  const bool ok = hipMemcpy(out, device_out, 2 * sizeof(int), hipMemcpyDeviceToHost) == hipSuccess;
  hipFree(device_out);
#else
  if (cudaMalloc(&device_out, 2 * sizeof(int)) != cudaSuccess) return false;
  skinny_limits_probe<<<1, 1, 0, static_cast<gpuStream_t>(stream)>>>(device_out);
  const bool ok = cudaMemcpy(out, device_out, 2 * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(device_out);
#endif
  return ok;
}

}  // namespace w4a16
