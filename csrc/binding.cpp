// torch binding of the skinny kernel: torch.ops.w4a16.skinny_gemm and the limit queries.
//
// Every argument is checked here, before any launch, with an error that names the argument, what was expected
// and what came (TypeError for dtypes, ValueError for everything else). The device code (skinny_kernel.cu) trusts
// these checks and has no torch dependency.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "portability.h"
#include "skinny_launch.h"

namespace {

using w4a16::ArchLimits;

// Error messages are assembled with std::to_string and string appends and handed to TORCH_CHECK as one
// std::string (which c10::str passes through untouched). On the H200 build, streaming an integer into the
// message (c10::str's ostringstream path) crashed inside this library's error path; this avoids that path.
void append(std::string& s, const char* v) { s += v; }
void append(std::string& s, const std::string& v) { s += v; }
void append(std::string& s, int v) { s += std::to_string(v); }
void append(std::string& s, long v) { s += std::to_string(v); }
void append(std::string& s, long long v) { s += std::to_string(v); }
void append(std::string& s, uintptr_t v) { s += std::to_string(v); }
void append(std::string& s, at::ScalarType v) { s += c10::toString(v); }
void append(std::string& s, const c10::Device& v) { s += v.str(); }
void append(std::string& s, c10::IntArrayRef v) {
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  s += "]";
}
template <typename... Args>
std::string cat(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

// The normalised architecture name of a device, spelled as in portability.h's table ("sm_90", "gfx1151").
std::string arch_name(int device) {
#if defined(USE_ROCM)
  cudaDeviceProp props;
  TORCH_CHECK(cudaGetDeviceProperties(&props, device) == cudaSuccess, cat("cannot query GPU ", device));
  std::string name = props.gcnArchName;
  return name.substr(0, name.find(':'));
#else
  int major = 0, minor = 0;
  TORCH_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
                  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess, cat("cannot query GPU ", device));
  return "sm_" + std::to_string(major) + std::to_string(minor);
#endif
}

// The host's row of the one staging table; the same row the device pass compiled in (portability.h).
ArchLimits host_limits(int device) {
  return w4a16::arch_limits(w4a16::arch_id_from_name(arch_name(device).c_str()));
}

bool is_16bit_float(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

void check_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, cat(name,
                    " must start on a 16-byte boundary (the kernel reads it in 16-byte pieces); got a tensor at offset ",
                    reinterpret_cast<uintptr_t>(t.data_ptr()) % 16, " bytes: pass a fresh contiguous tensor"));
}

// Shape/dtype checks shared by the real and the meta implementation. Returns (M, N, K).
std::vector<int64_t> check_args(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias,
                                int64_t group_size, int64_t cluster_blocks) {
  TORCH_CHECK_VALUE(cluster_blocks == 0 || cluster_blocks == 1 || cluster_blocks == 2 || cluster_blocks == 4,
                    cat("cluster_blocks must be 0 (chosen from the shape), 1, 2 or 4, got ", cluster_blocks));
  TORCH_CHECK_TYPE(is_16bit_float(x.scalar_type()), cat("x must be float16 or bfloat16, got ", x.scalar_type()));
  TORCH_CHECK_VALUE(x.dim() == 2, cat("x must be 2-D [M, K], got shape ", x.sizes()));
  TORCH_CHECK_VALUE(x.is_contiguous(), cat("x must be contiguous (row-major [M, K]), got strides ", x.strides()));
  TORCH_CHECK_TYPE(qweight.scalar_type() == at::kInt, cat("qweight must be int32 [N, K // 8], got ", qweight.scalar_type()));
  TORCH_CHECK_VALUE(qweight.dim() == 2 && qweight.size(0) > 0, cat("qweight must be 2-D [N, K // 8] with N > 0, got shape ",
                    qweight.sizes()));
  TORCH_CHECK_VALUE(qweight.is_contiguous(), cat("qweight must be contiguous, got strides ", qweight.strides()));
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  // M's upper bound depends on the device (its table row), so the CUDA implementation checks that; M >= 1 holds
  // everywhere, and the meta implementation must refuse what the real one refuses.
  TORCH_CHECK_VALUE(m >= 1, cat("x must have at least one row, got shape ", x.sizes()));
  TORCH_CHECK_VALUE(k > 0 && k % 16 == 0, cat("K=", k, " (x's last dim) must be a positive multiple of 16"));
  TORCH_CHECK_VALUE(qweight.size(1) * 8 == k, cat("qweight must be [N, K // 8] = [", n, ", ", k / 8, "] for x with K=", k,
                    ", got shape ", qweight.sizes()));
  TORCH_CHECK_VALUE(group_size == 32 || group_size == 64 || group_size == 128, cat("group_size must be one of (32, 64, 128), got ", group_size));
  TORCH_CHECK_VALUE(k % group_size == 0, cat("K=", k, " must be a multiple of group_size=", group_size));
  const int64_t groups = k / group_size;
  TORCH_CHECK_TYPE(scales.scalar_type() == x.scalar_type(), cat("scales must have the activation dtype ",
                   x.scalar_type(), ", got ", scales.scalar_type()));
  TORCH_CHECK_VALUE(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == groups, cat("scales must have shape [N, K // G] = [", n, ", ", groups, "], got ", scales.sizes()));
  TORCH_CHECK_VALUE(scales.is_contiguous(), cat("scales must be contiguous, got strides ", scales.strides()));
  if (zeros) {
    TORCH_CHECK_TYPE(zeros->scalar_type() == at::kByte, cat("zeros must be uint8 raw zero points 0..15, got ",
                     zeros->scalar_type()));
    TORCH_CHECK_VALUE(zeros->dim() == 2 && zeros->size(0) == n && zeros->size(1) == groups, cat("zeros must have shape [N, K // G] = [", n, ", ", groups, "], got ", zeros->sizes()));
    TORCH_CHECK_VALUE(zeros->is_contiguous(), cat("zeros must be contiguous, got strides ", zeros->strides()));
  }
  if (bias) {
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), cat("bias must have the activation dtype ", x.scalar_type(),
                     ", got ", bias->scalar_type()));
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, cat("bias must have shape [N] = [", n, "], got ",
                      bias->sizes()));
    TORCH_CHECK_VALUE(bias->is_contiguous(), cat("bias must be contiguous, got strides ", bias->strides()));
  }
  return {m, n, k};
}

at::Tensor skinny_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias,
                       int64_t group_size, int64_t cluster_blocks) {
  const auto mnk = check_args(x, qweight, scales, zeros, bias, group_size, cluster_blocks);
  const int64_t m = mnk[0], n = mnk[1], k = mnk[2];
  TORCH_CHECK_VALUE(x.is_cuda(), cat("x must be on a GPU, got ", x.device()));
  for (const at::Tensor* t : {&qweight, &scales}) {
    TORCH_CHECK_VALUE(t->device() == x.device(), cat("all operands must be on x's device ", x.device(), ", got ",
                      t->device()));
  }
  if (zeros) TORCH_CHECK_VALUE(zeros->device() == x.device(), cat("zeros are on ", zeros->device(), " but x is on ", x.device()));
  if (bias) TORCH_CHECK_VALUE(bias->device() == x.device(), cat("bias is on ", bias->device(), " but x is on ", x.device()));
  const std::string arch = arch_name(x.get_device());
  const ArchLimits limits = w4a16::arch_limits(w4a16::arch_id_from_name(arch.c_str()));
  TORCH_CHECK_VALUE(m >= 1 && m <= limits.max_rows, cat("the skinny kernel takes 1..", limits.max_rows,
                    " activation rows on ", arch, ", got M=", m));
  TORCH_CHECK_VALUE(m * k <= limits.staging_elements, cat("K * M = ", k, " * ", m, " = ", k * m,
                    " activation elements exceed the staging budget of ", limits.staging_elements, " on ", arch,
                    " (use the Triton path for this shape)"));
  // The kernels index weight chunks (16 bytes) with 32-bit offsets, and the launchers round N up to whole tiles
  // and waves in int (N + 63 at most).
  TORCH_CHECK_VALUE(n <= INT32_MAX - 63 && n * (k / 32) <= INT32_MAX, cat("N * K / 32 = ", n * (k / 32),
                    " weight chunks (N=", n, ", K=", k, ") exceed the kernel's 32-bit offsets"));
  check_aligned(x, "x");
  check_aligned(qweight, "qweight");

  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({m, n}, x.options());
  w4a16::SkinnyArgs args;
  args.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
  args.qweight = qweight.data_ptr<int32_t>();
  args.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  args.zeros = zeros ? zeros->data_ptr<uint8_t>() : nullptr;
  args.bias = bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
  args.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  args.m = static_cast<int>(m);
  args.n = static_cast<int>(n);
  args.k = static_cast<int>(k);
  args.group_size = static_cast<int>(group_size);
  args.bf16 = x.scalar_type() == at::kBFloat16;
  args.cluster_blocks = static_cast<int>(cluster_blocks);
  const char* error = "";
  const auto status = w4a16::skinny_launch(args, c10::cuda::getCurrentCUDAStream().stream(), &error);
  TORCH_CHECK_VALUE(status != w4a16::SkinnyStatus::no_clusters, cat("cluster_blocks=", cluster_blocks,
                    " needs thread-block clusters of that size (NVIDIA sm_90 or later), which ", arch,
                    " cannot run; pass 0 or 1"));
  TORCH_CHECK(status != w4a16::SkinnyStatus::unsupported, cat("skinny kernel: no instantiation for M=", m,
              ", group_size=", group_size));
  TORCH_CHECK(status == w4a16::SkinnyStatus::ok, cat("skinny kernel launch failed (M=", m, ", N=", n, ", K=", k,
              "): ", error));
  return out;
}

at::Tensor skinny_gemm_meta(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias,
                            int64_t group_size, int64_t cluster_blocks) {
  const auto mnk = check_args(x, qweight, scales, zeros, bias, group_size, cluster_blocks);
  return at::empty({mnk[0], mnk[1]}, x.options());
}

// {max_rows, staging_elements} of the host table for a device.
std::vector<int64_t> skinny_limits(int64_t device) {
  const ArchLimits l = host_limits(static_cast<int>(device));
  return {l.max_rows, l.staging_elements};
}

// {max_rows, staging_elements} as compiled into the device code, read back by a probe kernel.
std::vector<int64_t> skinny_device_limits(int64_t device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  int out[2] = {0, 0};
  TORCH_CHECK(w4a16::skinny_device_limits(c10::cuda::getCurrentCUDAStream().stream(), out), cat("the staging-limit probe kernel failed on device ", device));
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(w4a16, m) {
  m.def("skinny_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int group_size, int cluster_blocks=0) -> Tensor");
  m.def("skinny_limits(int device) -> int[]", &skinny_limits);
  m.def("skinny_device_limits(int device) -> int[]", &skinny_device_limits);
}

TORCH_LIBRARY_IMPL(w4a16, CUDA, m) { m.impl("skinny_gemm", &skinny_gemm); }
TORCH_LIBRARY_IMPL(w4a16, Meta, m) { m.impl("skinny_gemm", &skinny_gemm_meta); }
