// What both skinny kernels share: the chunk size, the shared-memory layout of the staged activations, and the
// probe of the limits the device pass compiled in. AMD runs the dot2 kernel (skinny_kernel.cuh), NVIDIA the
// tensor-core kernel (skinny_mma.cuh); both read the packed weights as [N, K/32] 16-byte chunks.
#pragma once

#include "dequant.h"
#include "portability.h"

namespace w4a16 {

constexpr int kChunkK = 32;  // k per 16-byte weight chunk (4 words); a chunk never crosses a group (G >= 32)

// Which 16-byte slot of row m's chunk c holds piece j (the chunk's 64 bytes are four 16-byte pieces). Readers
// take one piece of several chunks at once; without a rotation the 8 lanes of a 128-byte shared-memory wavefront
// would hit the same 4 banks. Here (dot2 kernel) 8 lanes read 8 consecutive chunks of one row; in the tensor-core
// kernel (skinny_mma.cuh) they read chunks 4s..4s+3 of two neighbouring rows. Rotating by c / 2 + 2m spreads
// both patterns over all 32 banks (for an even number of chunks per row; otherwise correct, a little slower).
__device__ __forceinline__ int xs_piece(int m, int c, int j) { return c * 4 + ((j + (c >> 1) + 2 * m) & 3); }

// Reports what the device pass compiled in (see portability.h); the tests compare it with the host table.
__global__ void skinny_limits_probe(int* out) {
  out[0] = W4A16_DEVICE_LIMITS.max_rows;
  out[1] = W4A16_DEVICE_LIMITS.staging_elements;
}

}  // namespace w4a16
