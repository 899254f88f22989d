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

// The kernel is instantiated for M = 1..kInstantiatedRows: the tensor-core kernel up to the mma's 8 columns, the
// AMD dot2 kernel up to 5. No arch this backend serves may promise more.
#if defined(W4A16_CUDA)
constexpr int kInstantiatedRows = 8;
constexpr bool serves(ArchId id) { return id == ArchId::sm_90 || id == ArchId::generic; }
#else
constexpr int kInstantiatedRows = 5;
constexpr bool serves(ArchId id) { return id != ArchId::sm_90; }
#endif
#define W4A16_ROWS_ROW(name, rows, elements, hw_bytes)                   \
  static_assert(!serves(ArchId::name) || (rows) <= kInstantiatedRows, \
                "max_rows of " #name " exceeds the instantiated kernels");
W4A16_ARCH_TABLE(W4A16_ROWS_ROW)
#undef W4A16_ROWS_ROW

namespace {

// What the launcher remembers is per device (a process may drive several GPUs): caches are indexed by this.
constexpr int kMaxDevices = 64;
// The current device, or -1 where it cannot be told or indexed (then nothing is cached).
int current_device() {
  int device = 0;
  return w4a16GetDevice(&device) == w4a16Success && device >= 0 && device < kMaxDevices ? device : -1;
}

int multiprocessor_count() {
  static int cached[kMaxDevices] = {0};
  const int device = current_device();
  if (device < 0) return 1;
  if (!cached[device]) {
    int count = 0;
    if (w4a16DeviceGetAttribute(&count, w4a16AttrMultiProcessorCount, device) != w4a16Success || count < 1) count = 1;
    cached[device] = count;
  }
  return cached[device];
}

// Grid and shared memory of one launch. dot2 kernel: one block per SM / CU, waves own rows; tensor-core kernel:
// one block per SM, in clusters of `cluster` blocks (cluster_size_for), and no more clusters than 16-row tiles.
struct LaunchShape {
  int threads, blocks, shared_bytes, cluster;
};

#if defined(W4A16_CUDA)
// A launch configuration, in clusters of `cluster` blocks; a cluster of 1 carries no cluster attribute, so it
// launches exactly as without clusters. `programmatic`: the kernel may start before the one ahead of it on the
// stream has finished (it waits for it itself: skinny_mma.cuh, wait_for_preceding_grid). Not copyable: the
// configuration points at its own attributes.
struct KernelLaunch {
  cudaLaunchAttribute attributes[2];
  cudaLaunchConfig_t config;
  KernelLaunch(int blocks, int cluster, int threads, int shared_bytes, cudaStream_t stream, bool programmatic = false)
      : attributes{}, config{} {
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = shared_bytes;
    config.stream = stream;
    config.attrs = attributes;
    if (cluster > 1) {
      cudaLaunchAttribute& a = attributes[config.numAttrs++];
      a.id = cudaLaunchAttributeClusterDimension;
      a.val.clusterDim.x = cluster;
      a.val.clusterDim.y = 1;
      a.val.clusterDim.z = 1;
    }
    if (programmatic) {
      cudaLaunchAttribute& a = attributes[config.numAttrs++];
      a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      a.val.programmaticStreamSerializationAllowed = 1;
    }
  }
  KernelLaunch(const KernelLaunch&) = delete;
};

// How many clusters of `size` blocks the device runs at once. A cluster's blocks share a GPC, so this is below
// SMs / size where the size does not divide a GPC's SM count. The kernel holds one block per SM whatever its
// shared memory (its registers fill the SM), so the answer depends on the device and the size only. 0 before
// sm_90, which has no clusters.
int max_active_clusters(const void* kernel, int size, int threads, int shared_bytes) {
  static int cached[kMaxDevices][5] = {};
  const int device = current_device();
  int major = 0;
  if (device < 0 || size > 4) return 0;
  if (!cached[device][size]) {
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    const KernelLaunch launch(size, size, threads, shared_bytes, nullptr);
    int count = 0;
    if (major < 9 || cudaOccupancyMaxActiveClusters(&count, kernel, &launch.config) != cudaSuccess) {
      cudaGetLastError();  // clear it: the launcher then falls back to single blocks
      count = 0;
    }
    cached[device][size] = count > 0 ? count : -1;
  }
  return std::max(cached[device][size], 0);
}

// Blocks per cluster for a shape, when the caller leaves it open. Measured on the H200 (csrc/PERF.md), not modelled:
// - Splitting K over a cluster splits the staging of x too (M * K * 2 bytes from L2 per lone block). Since x is
//   staged by cp.async (all of a warp's pieces in flight at once), that no longer pays for a cluster's overheads:
//   up to M * K = 86016 single blocks were faster on every bench layer, by up to 25% (Llama-3.1-8B o at M = 8:
//   8.42 -> 6.76 µs; Llama down at M = 2: 15.48 -> 13.38), except Qwen3-4B down at M = 7 and 8 (4 blocks 3.4% and
//   1.5% faster). Above it, the one bench case (Llama down at M = 7) ran the same in 1 and 2 blocks.
// - Clusters that walk many rounds lose (Llama gate_up, 14 rounds at 2 blocks: 26.8 -> 35.4 µs): so the largest
//   size whose clusters walk at most kClusterMaxRounds rounds.
constexpr long long kClusterMinStaged = 86016;
constexpr int kClusterMaxRounds = 3;
static_assert(kClusterMaxRounds <= kClusterRoundSlots, "one cluster reduction at the end of the walk");
int cluster_size_for(int m, int n, int k, const int (&clusters)[3]) {
  if ((long long)m * k <= kClusterMinStaged) return 1;
  const int tiles = (n + 15) / 16;
  for (const int i : {2, 1}) {  // clusters of 4, then 2 blocks
    if (clusters[i] <= 0) continue;
    const int cluster_rows = (tiles + clusters[i] - 1) / clusters[i] * 16;
    if ((cluster_rows + kSplitKTileRows - 1) / kSplitKTileRows <= kClusterMaxRounds) return 1 << i;
  }
  return 1;
}
#endif

// Dynamic shared memory of one launch.
template <int M>
int launch_shared_bytes(const SkinnyArgs& a) {
#if defined(W4A16_CUDA)
  return tensor_core::shared_bytes(M, a.k);
#else
  return staging_bytes(M * a.k);
#endif
}

// blocks == 0: the requested cluster size cannot run on this device.
template <int M>
LaunchShape launch_shape(const SkinnyArgs& a, const void* kernel) {
  const int shared = launch_shared_bytes<M>(a);
#if defined(W4A16_CUDA)
  constexpr int threads = tensor_core::kThreads;
  const int tiles = (a.n + 15) / 16;
  // clusters[i]: how many clusters of 1, 2, 4 blocks can run at once (0: not on this device).
  const int clusters[3] = {multiprocessor_count(), max_active_clusters(kernel, 2, threads, shared),
                           max_active_clusters(kernel, 4, threads, shared)};
  const int size = a.cluster_blocks ? a.cluster_blocks : cluster_size_for(M, a.n, a.k, clusters);
  const int index = size == 1 ? 0 : size == 2 ? 1 : size == 4 ? 2 : -1;
  if (index < 0 || clusters[index] <= 0) return {threads, 0, shared, size};
  return {threads, std::min(clusters[index], tiles) * size, shared, size};
#else
  (void)kernel;
  constexpr int threads = block_threads<M>();
  if (a.cluster_blocks > 1) return {threads, 0, shared, a.cluster_blocks};
  const int waves_per_block = threads / kWaveSize;
  const int blocks = std::min(multiprocessor_count(), std::max(1, (a.n + waves_per_block - 1) / waves_per_block));
  return {threads, blocks, shared, 1};
#endif
}

// Opts `kernel` in to `bytes` of dynamic shared memory (beyond the default 48 KB) once per size increase and
// device (the attribute is set on the current device only; opted_in holds the bytes per device). The binding has
// already checked M * K against the device's staging budget, whose bytes the hardware can hold (portability.h).
template <typename Kernel>
bool allow_shared_bytes(Kernel kernel, int bytes, int (&opted_in)[kMaxDevices], const char** error) {
  const int device = current_device();
  if (device >= 0 && bytes <= opted_in[device]) return true;
  if (w4a16FuncSetAttribute(reinterpret_cast<const void*>(kernel), w4a16FuncAttrMaxDynamicShared, bytes) !=
      w4a16Success) {
    *error = w4a16GetErrorString(w4a16GetLastError());
    return false;
  }
  if (device >= 0) opted_in[device] = bytes;
  return true;
}

#if defined(W4A16_CUDA)
// Whether `kernel`, as loaded on the current device, waits for the kernel ahead of it on the stream, so that it may
// be launched programmatically: skinny_mma.cuh compiles the wait for sm_90 and later, that is PTX version >= 90
// (a build for an older arch JIT-compiled for this device has none). Cached per device in `cached` (1 yes, -1 no).
template <typename Kernel>
bool kernel_waits_for_preceding_grid(Kernel kernel, signed char (&cached)[kMaxDevices]) {
  const int device = current_device();
  if (device >= 0 && cached[device]) return cached[device] > 0;
  cudaFuncAttributes attributes{};
  const bool waits = cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel)) == cudaSuccess &&
                     attributes.ptxVersion >= 90;
  if (!waits) cudaGetLastError();  // clear a failed query: the launch then runs in stream order, as any other
  if (device >= 0) cached[device] = waits ? 1 : -1;
  return waits;
}
#endif

template <typename Kernel>
SkinnyStatus launch_kernel(Kernel kernel, const LaunchShape& shape, const SkinnyArgs& a, gpuStream_t stream,
                           bool programmatic, const char** error) {
#if defined(W4A16_CUDA)
  const KernelLaunch launch(shape.blocks, shape.cluster, shape.threads, shape.shared_bytes, stream, programmatic);
  cudaLaunchKernelEx(&launch.config, kernel, a.x, reinterpret_cast<const Words4*>(a.qweight), a.scales, a.zeros,
                     a.bias, a.out, a.n, a.k);
#else
  (void)programmatic;
  kernel<<<shape.blocks, shape.threads, shape.shared_bytes, stream>>>(
      a.x, reinterpret_cast<const Words4*>(a.qweight), a.scales, a.zeros, a.bias, a.out, a.n, a.k);
#endif
  const gpuError_t status = w4a16GetLastError();
  if (status != w4a16Success) {
    *error = w4a16GetErrorString(status);
    return SkinnyStatus::launch_failed;
  }
  return SkinnyStatus::ok;
}

template <typename Tag, int G, bool kSymmetric, int M>
SkinnyStatus launch_one(const SkinnyArgs& a, gpuStream_t stream, const char** error) {
  const int shared_bytes = launch_shared_bytes<M>(a);
#if defined(W4A16_CUDA)
  auto single = tensor_core::skinny_gemm_kernel<Tag, G, kSymmetric, M, false>;
  auto clustered = tensor_core::skinny_gemm_kernel<Tag, G, kSymmetric, M, true>;
  static int single_opted_in[kMaxDevices] = {}, clustered_opted_in[kMaxDevices] = {};
  static signed char waits[kMaxDevices] = {};  // both forms are compiled alike
  if (!allow_shared_bytes(single, shared_bytes, single_opted_in, error) ||
      !allow_shared_bytes(clustered, shared_bytes, clustered_opted_in, error))
    return SkinnyStatus::launch_failed;
  const LaunchShape shape = launch_shape<M>(a, reinterpret_cast<const void*>(clustered));
  if (shape.blocks == 0) return SkinnyStatus::no_clusters;
  const bool programmatic = kernel_waits_for_preceding_grid(single, waits);
  return shape.cluster > 1 ? launch_kernel(clustered, shape, a, stream, programmatic, error)
                           : launch_kernel(single, shape, a, stream, programmatic, error);
#else
  auto kernel = skinny_gemm_kernel<Tag, G, kSymmetric, M>;
  static int opted_in[kMaxDevices] = {};
  if (!allow_shared_bytes(kernel, shared_bytes, opted_in, error)) return SkinnyStatus::launch_failed;
  const LaunchShape shape = launch_shape<M>(a, nullptr);
  if (shape.blocks == 0) return SkinnyStatus::no_clusters;
  return launch_kernel(kernel, shape, a, stream, false, error);
#endif
}

template <typename Tag, int G, bool kSymmetric>
SkinnyStatus by_rows(const SkinnyArgs& a, gpuStream_t s, const char** e) {
  switch (a.m) {
    case 1: return launch_one<Tag, G, kSymmetric, 1>(a, s, e);
    case 2: return launch_one<Tag, G, kSymmetric, 2>(a, s, e);
    case 3: return launch_one<Tag, G, kSymmetric, 3>(a, s, e);
    case 4: return launch_one<Tag, G, kSymmetric, 4>(a, s, e);
    case 5: return launch_one<Tag, G, kSymmetric, 5>(a, s, e);
    default: break;
  }
  if constexpr (kInstantiatedRows == 8) {
    switch (a.m) {
      case 6: return launch_one<Tag, G, kSymmetric, 6>(a, s, e);
      case 7: return launch_one<Tag, G, kSymmetric, 7>(a, s, e);
      case 8: return launch_one<Tag, G, kSymmetric, 8>(a, s, e);
      default: break;
    }
  }
  return SkinnyStatus::unsupported;
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

// The probe runs on the caller's stream (torch's current one, which need not synchronise with the legacy
// stream), so the copy back goes on that stream too, and the launch itself is checked.
bool skinny_device_limits(void* stream, int out[2]) {
  const gpuStream_t s = static_cast<gpuStream_t>(stream);
  int* device_out = nullptr;
#if defined(W4A16_HIP)
  if (hipMalloc(&device_out, 2 * sizeof(int)) != hipSuccess) return false;
  skinny_limits_probe<<<1, 1, 0, s>>>(device_out);
  const bool ok = hipGetLastError() == hipSuccess &&
                  hipMemcpyAsync(out, device_out, 2 * sizeof(int), hipMemcpyDeviceToHost, s) == hipSuccess &&
                  hipStreamSynchronize(s) == hipSuccess;
  (void)hipFree(device_out);  // its result changes nothing: the probe's answer is already copied, or not
#else
  if (cudaMalloc(&device_out, 2 * sizeof(int)) != cudaSuccess) return false;
  skinny_limits_probe<<<1, 1, 0, s>>>(device_out);
  const bool ok = cudaGetLastError() == cudaSuccess &&
                  cudaMemcpyAsync(out, device_out, 2 * sizeof(int), cudaMemcpyDeviceToHost, s) == cudaSuccess &&
                  cudaStreamSynchronize(s) == cudaSuccess;
  (void)cudaFree(device_out);
#endif
  return ok;
}

}  // namespace w4a16
