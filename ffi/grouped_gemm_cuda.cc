// XLA FFI CUDA handler for "jax_nvfp4_grouped_gemm": checks the call (ffi/gemm_ffi.h), checks that
// the kernel configuration it was lowered with runs on this device with this build, and enqueues
// it (csrc/grouped_gemm.h). No allocation, no host sync. The configuration comes from
// jax_nvfp4.grouped_gemm (ChooseKernelConfig at trace time, or the caller's explicit choice).
#include <string>

#include <cuda_runtime.h>

#include "csrc/grouped_gemm.h"
#include "ffi/gemm_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jax_nvfp4::BadArgument;
using jax_nvfp4::F32Buffer1;
using jax_nvfp4::S32Buffer1;
using jax_nvfp4::U8Buffer1;
using jax_nvfp4::U8Buffer3;
using CudaStream = ffi::PlatformStream<cudaStream_t>;

ffi::Error CudaError(const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string("jax_nvfp4_grouped_gemm: ") + what + ": " + cudaGetErrorName(e) + ": " +
                              cudaGetErrorString(e));
}

std::string DeviceDescription(int dev, int arch) {
  cudaDeviceProp prop;
  std::string name = cudaGetDeviceProperties(&prop, dev) == cudaSuccess ? prop.name : "unknown device";
  return name + " (device " + std::to_string(dev) + ", compute capability " + std::to_string(arch / 10) + "." +
         std::to_string(arch % 10) + ")";
}

ffi::Error GroupedGemmCudaImpl(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer lhs_scales, U8Buffer3 rhs,
                               ffi::AnyBuffer rhs_scales, F32Buffer1 alpha, S32Buffer1 group_sizes,
                               ffi::Result<ffi::AnyBuffer> out, ffi::Result<U8Buffer1> workspace,
                               jax_nvfp4::GemmAttrs attrs) {
  jax_nvfp4::GroupedGemmParams p;
  if (ffi::Error err = jax_nvfp4::DecodeGroupedGemm(lhs, lhs_scales, rhs, rhs_scales, alpha, group_sizes, out,
                                                    workspace, attrs, &p);
      err.failure())
    return err;
  if (p.rhs_layout == jax_nvfp4::RhsLayout::kSm90 && p.a_fp4)
    return BadArgument("rhs_layout 1 (sm90 weights) takes a bf16 lhs only on the GPU, got packed e2m1 "
                       "(jax_nvfp4.grouped_gemm dequantizes W4A4 activations to bf16 first for such weights)");

  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return CudaError("cudaGetDevice", e);
  const int arch = jax_nvfp4::DeviceArch(dev);
  const jax_nvfp4::KernelConfig cfg = attrs.config();
  if (const char* why = jax_nvfp4::ConfigUnsupportedReason(cfg, arch)) {
    const std::string device = DeviceDescription(dev, arch);
    if (!jax_nvfp4::ArchSupported(arch))
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        "jax_nvfp4_grouped_gemm: " + device +
                            " is not supported: the CUDA kernels need compute capability 8.0 or newer "
                            "(Ampere, Ada, Hopper, Blackwell); use backend='reference' on this device");
    return BadArgument(jax_nvfp4::ConfigToString(cfg) + " cannot run on " + device + ": " + why);
  }
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();

  e = jax_nvfp4::LaunchGroupedGemm(p, cfg, arch, stream);
  if (e != cudaSuccess) return CudaError("kernel launch failed", e);
  e = cudaGetLastError();
  if (e != cudaSuccess) return CudaError("CUDA error after launch", e);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4GroupedGemmCuda, GroupedGemmCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<CudaStream>()
                                  .Arg<ffi::AnyBuffer>()  // lhs
                                  .Arg<ffi::AnyBuffer>()  // lhs_scales
                                  .Arg<U8Buffer3>()       // rhs_data
                                  .Arg<ffi::AnyBuffer>()  // rhs_scales
                                  .Arg<F32Buffer1>()      // alpha
                                  .Arg<S32Buffer1>()      // group_sizes
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<U8Buffer1>()       // workspace
                                  .Attrs<jax_nvfp4::GemmAttrs>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
