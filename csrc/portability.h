// Portability layer of the skinny kernel: one source for CUDA (nvcc, sm_90) and HIP (clang, gfx1151/gfx1201).
//
// Everything that differs between the two toolchains or between GPU generations lives here: the wave size,
// lane shuffles, the 2-element dot product ("dot2"), streaming loads, the runtime API spelling, and the
// per-architecture staging budget (how many activation elements one block may hold in shared memory / LDS).
//
// The staging budget has ONE home, W4A16_ARCH_TABLE below. The device pass picks its row with the compiler's
// target macros, and the host picks its row from the device's reported architecture and refuses M * K past it.
// A static_assert proves that staging_bytes of every row's budget, plus what the NVIDIA kernel reserves besides
// x, fits its hardware; each kernel's own byte count at the budget stays within that (skinny_kernel.cuh launches
// staging_bytes, skinny_mma.cuh the x it stages plus its split-K partials). A probe
// variable (w4a16_device_staging_elements) exposes what the device pass compiled in, and the tests compare that
// value, the host value and the Python parser of this file. (A public version of this kernel once sized its LDS
// array at 64 KB while the host assumed 160 KB on some chips and launched a variant the device could not hold.)
//
// This header is also included by host-only code (the torch binding and the host test of the dequant helpers):
// the device parts are guarded by W4A16_DEVICE_COMPILER.
#pragma once

#include <stdint.h>

#if defined(__HIPCC__) || defined(__HIP__)
#define W4A16_HIP 1
#elif defined(__CUDACC__)
#define W4A16_CUDA 1
#endif
#if defined(W4A16_HIP)
#include <hip/hip_runtime.h>
#elif defined(W4A16_CUDA)
#include <cuda_runtime.h>
#endif
// The dot2 kernel's device functions: on HIP, and in the CPU emulation that runs that kernel in the tests
// (tests/csrc/emulate_dot2.cpp defines W4A16_EMULATION, the thread indices, __syncthreads and __shfl_xor).
#if defined(W4A16_HIP) || defined(W4A16_EMULATION)
#define W4A16_DOT2_PATH 1
#endif
#if defined(W4A16_HIP) || defined(W4A16_CUDA) || defined(W4A16_EMULATION)
#define W4A16_DEVICE_COMPILER 1
#define W4A16_HD __host__ __device__ __forceinline__
#else
#define W4A16_HD inline
#endif

namespace w4a16 {

// ---------------------------------------------------------------------------------------------------------------
// Per-architecture limits: the one table. Columns: name, max activation rows M, staging budget in activation
// elements (K * M), hardware shared memory / LDS bytes one block may use (the bound the budget must respect).
//   sm_90:   227 KB of dynamic shared memory per block (after cudaFuncSetAttribute); 8 rows, the mma's columns.
//   gfx1151, gfx1201 (RDNA 3.5 / RDNA 4): 64 KB of LDS per workgroup.
//   generic: any other target; the 48 KB every CUDA/HIP device grants without opting in. (The AMD kernel needs
//            the packed bf16 dot of gfx11/gfx12, clang's dot9-insts: CDNA targets such as gfx90a and gfx942 do not
//            compile it.)
// On NVIDIA (sm_90, and generic, which may be NVIDIA) the block also holds the tensor-core kernel's split-K
// partials (reserved_bytes below), so those budgets leave room for them.
// Python reads this table by parsing this file (w4a16/skinny.py: limits); keep one row per line.
// ---------------------------------------------------------------------------------------------------------------
#define W4A16_ARCH_TABLE(ROW)       \
  ROW(sm_90, 8, 100928, 232448)     \
  ROW(gfx1151, 5, 30720, 65536)     \
  ROW(gfx1201, 5, 30720, 65536)     \
  ROW(generic, 5, 17408, 49152)

enum class ArchId : int {
#define W4A16_ENUM_ROW(name, rows, elements, hw_bytes) name,
  W4A16_ARCH_TABLE(W4A16_ENUM_ROW)
#undef W4A16_ENUM_ROW
};

struct ArchLimits {
  int max_rows;          // largest M the kernel is instantiated for
  int staging_elements;  // largest K * M one block stages
  int hw_shared_bytes;   // what one block may hold on this architecture
};

// Bytes a block stages for `elements` activation values: the 2-byte values themselves plus one fp32 sum per
// 32-element chunk (the kernel's raw-dot correction term, see skinny_kernel.cuh).
W4A16_HD constexpr int staging_bytes(int elements) { return elements * 2 + (elements / 32) * 4; }

W4A16_HD constexpr ArchLimits arch_limits(ArchId id) {
#define W4A16_LIMITS_ROW(name, rows, elements, hw_bytes) \
  id == ArchId::name ? ArchLimits{rows, elements, hw_bytes} :
  return W4A16_ARCH_TABLE(W4A16_LIMITS_ROW) ArchLimits{0, 0, 0};
#undef W4A16_LIMITS_ROW
}

// The tensor-core kernel (skinny_mma.cuh, NVIDIA): kSplitKWarps warps split the k-steps of kSplitKTileRows
// weight rows and add their fp32 partials in shared memory, one [M][kSplitKPartialStride] slice per warp (the
// stride's 4 floats of padding keep the fragment writes free of bank conflicts).
// When the blocks of a thread-block cluster split the k-steps too, each block keeps its sums of up to
// kClusterRoundSlots rounds, [slots][rows][kSplitKTileRows] fp32, until the cluster adds them up.
constexpr int kSplitKWarps = 12;  // with skinny_mma.cuh's kPipelineDepth: the measured best (csrc/PERF.md)
constexpr int kSplitKTileRows = 32;
constexpr int kSplitKPartialStride = kSplitKTileRows + 4;
constexpr int kClusterRoundSlots = 4;
W4A16_HD constexpr int split_k_partial_bytes(int rows) {
  return kSplitKWarps * rows * kSplitKPartialStride * 4 + kClusterRoundSlots * rows * kSplitKTileRows * 4;
}

// Shared memory a block holds besides the staged activations, at the arch's max_rows: the split-K partials and
// round sums on the architectures that may be NVIDIA (the AMD kernel, skinny_kernel.cuh, holds none).
W4A16_HD constexpr int reserved_bytes(ArchId id) {
  return id == ArchId::sm_90 || id == ArchId::generic ? split_k_partial_bytes(arch_limits(id).max_rows) : 0;
}

#define W4A16_CHECK_ROW(name, rows, elements, hw_bytes)                                              \
  static_assert(staging_bytes(elements) + reserved_bytes(ArchId::name) <= (hw_bytes),                  \
                "staging budget of " #name " exceeds its hardware");                                   \
  static_assert((elements) % 32 == 0 && (rows) >= 1, "staging budget of " #name " must be whole chunks");
W4A16_ARCH_TABLE(W4A16_CHECK_ROW)
#undef W4A16_CHECK_ROW

// Activation dtype tags (the kernel never needs the value types on the host side).
struct Fp16Tag {};
struct Bf16Tag {};

// Host side: the table row for a device, from its normalised name ("sm_90", "gfx1151"; anything else: generic).
inline ArchId arch_id_from_name(const char* arch_name) {
  auto same = [](const char* a, const char* b) {
    while (*a && *a == *b) ++a, ++b;
    return *a == *b;
  };
#define W4A16_NAME_ROW(name, rows, elements, hw_bytes) \
  if (same(arch_name, #name)) return ArchId::name;
  W4A16_ARCH_TABLE(W4A16_NAME_ROW)
#undef W4A16_NAME_ROW
  return ArchId::generic;
}

}  // namespace w4a16

#if defined(W4A16_DEVICE_COMPILER)

namespace w4a16 {

// The row the device pass compiles in. The host never sees these macros (they are defined in device passes only),
// so on the host side kDeviceArch is `generic` and must not be used: host code calls arch_limits(arch_id_from_name).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
constexpr ArchId kDeviceArch = ArchId::sm_90;
#elif defined(__gfx1151__)
constexpr ArchId kDeviceArch = ArchId::gfx1151;
#elif defined(__gfx1201__)
constexpr ArchId kDeviceArch = ArchId::gfx1201;
#elif defined(W4A16_EMULATION)
constexpr ArchId kDeviceArch = ArchId::gfx1151;  // the RDNA budget: the emulation stands in for those targets
#else
constexpr ArchId kDeviceArch = ArchId::generic;
#endif
#define W4A16_DEVICE_LIMITS (::w4a16::arch_limits(::w4a16::kDeviceArch))

// Wave size: 32 on NVIDIA and on RDNA (HIP compiles RDNA in wave32 by default), 64 on CDNA.
#if defined(W4A16_HIP) && defined(__AMDGCN_WAVEFRONT_SIZE)
constexpr int kWaveSize = __AMDGCN_WAVEFRONT_SIZE;
#else
constexpr int kWaveSize = 32;
#endif

#if defined(W4A16_DOT2_PATH)
// Butterfly reduction step across lanes (the dot2 kernel). HIP lowers __shfl_xor to ds_swizzle / DPP or
// ds_bpermute. The NVIDIA kernel reduces through the mma and shared memory instead.
__device__ __forceinline__ float lane_xor(float v, int mask) { return __shfl_xor(v, mask, kWaveSize); }
#endif

struct alignas(16) Words4 {
  uint32_t w[4];
};

// 16-byte load of weight data that is read exactly once (marked non-temporal on AMD). On NVIDIA it stays out of L1
// unless kAllocateL1, and L2 fetches its 128-byte line (L2::128B). Both timed on an H100 (csrc/PERF.md, "The
// weight loads' cache hints"): against L2::256B the 128-byte hint was up to 5% faster (Llama gate_up at M = 1:
// 2%); letting the weights into L1 was 8-20% faster with G < 128, whose lanes load scattered scales and zero
// points, and from 5% faster to 2% slower with G = 128 (Llama down, Llama gate_up), so only G < 128 does it.
template <bool kAllocateL1 = false>
__device__ __forceinline__ Words4 load_stream(const Words4* p) {
  Words4 r;
#if defined(W4A16_DOT2_PATH)
  typedef uint32_t v4u __attribute__((ext_vector_type(4)));
  v4u v = __builtin_nontemporal_load(reinterpret_cast<const v4u*>(p));
  r.w[0] = v.x, r.w[1] = v.y, r.w[2] = v.z, r.w[3] = v.w;
#else
  if constexpr (kAllocateL1)
    asm volatile("ld.global.nc.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3])
                 : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3])
                 : "l"(p));
#endif
  return r;
}

// Read-only, cached load for the small per-group metadata (scales, zeros), reused by neighbouring lanes.
template <typename U>
__device__ __forceinline__ U load_cached(const U* p) {
#if defined(W4A16_DOT2_PATH)
  return *p;
#else
  return __ldg(p);
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// The inner product. AMD (skinny_kernel.cuh): dot2, acc + a.lo * b.lo + a.hi * b.hi for two packed 16-bit values
// (fp16 or bf16, selected by Tag) with an fp32 accumulator, one instruction (v_dot2_f32_f16, v_dot2_f32_bf16 on
// gfx11/gfx12). NVIDIA has no fp32-accumulating packed dot outside the tensor cores, so its kernel
// (skinny_mma.cuh) uses mma.sync m16n8k16 with fp32 accumulators, and packed 16-bit FMAs for the dequantization.
// ---------------------------------------------------------------------------------------------------------------
#if defined(W4A16_DOT2_PATH)
typedef _Float16 w4a16_half2 __attribute__((ext_vector_type(2)));
typedef __bf16 w4a16_bf162 __attribute__((ext_vector_type(2)));

template <typename Tag>
struct XOperand {
  uint32_t bits;
};
template <typename Tag>
__device__ __forceinline__ XOperand<Tag> x_operand(uint32_t bits) {
  return {bits};
}
#if defined(W4A16_EMULATION)
// The two products and their sum with acc in double, rounded to fp32 once.
template <typename Pair>
__device__ __forceinline__ float dot2_in_double(Pair a, Pair b, float acc) {
  return static_cast<float>(double(a.x) * double(b.x) + double(a.y) * double(b.y) + double(acc));
}
__device__ __forceinline__ float dot2(uint32_t w, XOperand<Fp16Tag> x, float acc) {
  return dot2_in_double(__builtin_bit_cast(w4a16_half2, w), __builtin_bit_cast(w4a16_half2, x.bits), acc);
}
__device__ __forceinline__ float dot2(uint32_t w, XOperand<Bf16Tag> x, float acc) {
  return dot2_in_double(__builtin_bit_cast(w4a16_bf162, w), __builtin_bit_cast(w4a16_bf162, x.bits), acc);
}
#else
__device__ __forceinline__ float dot2(uint32_t w, XOperand<Fp16Tag> x, float acc) {
  return __builtin_amdgcn_fdot2(__builtin_bit_cast(w4a16_half2, w), __builtin_bit_cast(w4a16_half2, x.bits), acc,
                                false);
}
__device__ __forceinline__ float dot2(uint32_t w, XOperand<Bf16Tag> x, float acc) {
  return __builtin_amdgcn_fdot2_f32_bf16(__builtin_bit_cast(w4a16_bf162, w), __builtin_bit_cast(w4a16_bf162, x.bits),
                                         acc, false);
}
#endif
#else
// a * b + c on two packed 16-bit floats, rounded once.
__device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c, Fp16Tag) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c, Bf16Tag) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// d += A (16 x 16, row-major) * B (16 x 8, column-major) with fp32 accumulators. The lane with g = lane / 4 and
// t = lane % 4 holds A rows g, g + 8 at k {2t, 2t+1} (a[0], a[1]) and {2t+8, 2t+9} (a[2], a[3]), B column g at
// k {2t, 2t+1} (b0) and {2t+8, 2t+9} (b1), and D rows g (d[0], d[1]) and g + 8 (d[2], d[3]) at columns 2t, 2t+1.
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                            Fp16Tag) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                            Bf16Tag) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

// 16-bit float bits <-> fp32, round to nearest even. The kernel keeps activations as raw 16-bit patterns so the
// same code serves both dtypes and both toolchains.
__device__ __forceinline__ float to_float(uint16_t bits, Fp16Tag) {
#if defined(W4A16_DOT2_PATH)
  return static_cast<float>(__builtin_bit_cast(_Float16, bits));
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
  return f;
#endif
}
__device__ __forceinline__ float to_float(uint16_t bits, Bf16Tag) { return __uint_as_float(uint32_t(bits) << 16); }
__device__ __forceinline__ uint16_t from_float(float f, Fp16Tag) {
#if defined(W4A16_DOT2_PATH)
  return __builtin_bit_cast(uint16_t, static_cast<_Float16>(f));
#else
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#endif
}
__device__ __forceinline__ uint16_t from_float(float f, Bf16Tag) {
#if defined(W4A16_CUDA)
  uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN stays NaN
  u += 0x7FFFu + ((u >> 16) & 1u);                     // round to nearest even
  return static_cast<uint16_t>(u >> 16);
#endif
}

// Runtime API spelling.
#if defined(W4A16_HIP)
using gpuStream_t = hipStream_t;
using gpuError_t = hipError_t;
#define w4a16GetLastError hipGetLastError
#define w4a16Success hipSuccess
#define w4a16GetErrorString hipGetErrorString
#define w4a16GetDevice hipGetDevice
#define w4a16DeviceGetAttribute hipDeviceGetAttribute
#define w4a16AttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define w4a16FuncSetAttribute hipFuncSetAttribute
#define w4a16FuncAttrMaxDynamicShared hipFuncAttributeMaxDynamicSharedMemorySize
#elif defined(W4A16_CUDA)
using gpuStream_t = cudaStream_t;
using gpuError_t = cudaError_t;
#define w4a16GetLastError cudaGetLastError
#define w4a16Success cudaSuccess
#define w4a16GetErrorString cudaGetErrorString
#define w4a16GetDevice cudaGetDevice
#define w4a16DeviceGetAttribute cudaDeviceGetAttribute
#define w4a16AttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#define w4a16FuncSetAttribute cudaFuncSetAttribute
#define w4a16FuncAttrMaxDynamicShared cudaFuncAttributeMaxDynamicSharedMemorySize
#endif

}  // namespace w4a16

#endif  // W4A16_DEVICE_COMPILER
