// Host interface of the skinny kernel, free of torch and of GPU runtime headers: the binding includes this.
#pragma once

#include <stdint.h>

namespace w4a16 {

// One call y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias). All pointers are device pointers; 16-bit tensors are
// passed as raw bits. The caller (binding.cpp) has validated shapes, dtypes, alignment and the staging limit.
struct SkinnyArgs {
  const uint16_t* x;        // [M, K] activations, fp16 or bf16, row-major, 16-byte aligned
  const int32_t* qweight;   // [N, K / 8] packed int4, shuffle order, 16-byte aligned
  const uint16_t* scales;   // [N, K / G], the activation dtype
  const uint8_t* zeros;     // [N, K / G] raw zero points 0..15, or nullptr (symmetric, z = 8)
  const uint16_t* bias;     // [N] in the activation dtype, or nullptr
  uint16_t* out;            // [M, N], the activation dtype
  int m, n, k, group_size;
  bool bf16;                // activation dtype: bf16 (true) or fp16 (false)
  // Blocks of one thread-block cluster that split the k-steps of a row range (NVIDIA sm_90 and later): 1, 2 or 4,
  // or 0 to pick from the shape (skinny_kernel.cu, cluster_size_for). Elsewhere only 0 and 1 are valid.
  int cluster_blocks;
};

enum class SkinnyStatus : int { ok = 0, unsupported = 1, launch_failed = 2, no_clusters = 3 };

// Launches on `stream` (a cudaStream_t / hipStream_t). On launch_failed, `error` holds the runtime's message.
SkinnyStatus skinny_launch(const SkinnyArgs& args, void* stream, const char** error);

// What the device code was compiled with for the current device: {max_rows, staging_elements}, read by a probe
// kernel (tests compare it against the host table). Returns false when the probe could not run.
bool skinny_device_limits(void* stream, int out[2]);

}  // namespace w4a16
