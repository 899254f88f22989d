// Inline definitions of the five ROCm device-library functions that HIP's headers call from the skinny kernel
// (threadIdx, blockIdx, blockDim, gridDim, __syncthreads), for the device-only compile checks only: those compile
// with -nogpulib (Debian ships HIP's headers but no device libraries for gfx1151/gfx1201), which leaves each of
// them an external call. A kernel with calls is not the kernel a ROCm build makes: the callee may clobber
// registers, so register counts, conversions and the "no scratch" check would all read a different kernel.
// Force-included by w4a16/skinny_build.py (compile_device) for the AMD targets; the extension never includes it.
// Each follows the device library's own definition for code object v5 (clang 19's default).
#pragma once

#if defined(__HIP_DEVICE_COMPILE__)
#include <hip/hip_runtime.h>

namespace w4a16_device_lib {
// Code object v5's implicit kernel arguments: hidden_block_count_{x,y,z} (uint32 at 0, 4, 8), then
// hidden_group_size_{x,y,z} (uint16 at 12, 14, 16) and hidden_remainder_{x,y,z} (uint16 at 18, 20, 22).
__device__ __attribute__((always_inline)) inline const uint8_t* implicit_args() {
  return reinterpret_cast<const uint8_t*>(__builtin_amdgcn_implicitarg_ptr());
}
}  // namespace w4a16_device_lib

extern "C" {
__device__ __attribute__((always_inline, const)) size_t __ockl_get_local_id(uint dim) {
  return dim == 0 ? __builtin_amdgcn_workitem_id_x()
                  : dim == 1 ? __builtin_amdgcn_workitem_id_y() : dim == 2 ? __builtin_amdgcn_workitem_id_z() : 0;
}

__device__ __attribute__((always_inline, const)) size_t __ockl_get_group_id(uint dim) {
  return dim == 0 ? __builtin_amdgcn_workgroup_id_x()
                  : dim == 1 ? __builtin_amdgcn_workgroup_id_y() : dim == 2 ? __builtin_amdgcn_workgroup_id_z() : 0;
}

__device__ __attribute__((always_inline, const)) size_t __ockl_get_num_groups(uint dim) {
  if (dim > 2) return 1;
  const uint32_t full = reinterpret_cast<const uint32_t*>(w4a16_device_lib::implicit_args())[dim];
  const uint16_t remainder = reinterpret_cast<const uint16_t*>(w4a16_device_lib::implicit_args() + 18)[dim];
  return full + (remainder != 0);
}

__device__ __attribute__((always_inline, const)) size_t __ockl_get_local_size(uint dim) {
  if (dim > 2) return 1;
  const uint32_t full = reinterpret_cast<const uint32_t*>(w4a16_device_lib::implicit_args())[dim];
  const uint16_t size = reinterpret_cast<const uint16_t*>(w4a16_device_lib::implicit_args() + 12)[dim];
  const uint16_t remainder = reinterpret_cast<const uint16_t*>(w4a16_device_lib::implicit_args() + 18)[dim];
  return __ockl_get_group_id(dim) < full ? size : remainder;
}

// The fence's order and scope reach the builtin as constants: every caller passes literals and this is inlined.
__device__ __attribute__((always_inline)) void __atomic_work_item_fence(__cl_mem_fence_flags, __memory_order order,
                                                                        __memory_scope scope) {
#define W4A16_FENCE(ORDER)                                                                         \
  switch (scope) {                                                                                 \
    case __memory_scope_work_item: break;                                                          \
    case __memory_scope_sub_group: __builtin_amdgcn_fence(ORDER, "wavefront"); break;              \
    case __memory_scope_work_group: __builtin_amdgcn_fence(ORDER, "workgroup"); break;             \
    case __memory_scope_device: __builtin_amdgcn_fence(ORDER, "agent"); break;                     \
    default: __builtin_amdgcn_fence(ORDER, ""); break;                                             \
  }
  switch (order) {
    case __memory_order_relaxed: break;
    case __memory_order_acquire: W4A16_FENCE(__ATOMIC_ACQUIRE) break;
    case __memory_order_release: W4A16_FENCE(__ATOMIC_RELEASE) break;
    case __memory_order_acq_rel: W4A16_FENCE(__ATOMIC_ACQ_REL) break;
    default: W4A16_FENCE(__ATOMIC_SEQ_CST) break;
  }
#undef W4A16_FENCE
}
}  // extern "C"
#endif
