// XLA FFI CUDA handlers for "jax_nvfp4_grouped_gemm" (exact or FP8 mode, by the kernel attribute's
// family) and "jax_nvfp4_grouped_gemm_glu" (the exact kernels with the SwiGLU epilogue): each checks
// the call (ffi/gemm_ffi.h),
// checks that the kernel configuration it was lowered with runs on this device with this build,
// computes this problem and can read these buffers, and enqueues exactly that configuration
// (csrc/grouped_gemm.h): what the lowered attributes name is what runs, or the call fails. No
// allocation, no host sync. The configuration comes from jax_nvfp4.grouped_gemm (ChooseKernelConfig
// at trace time, or the caller's explicit choice).
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "csrc/grouped_gemm.h"
#include "ffi/cuda_status.h"
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

ffi::Error CudaError(const char* what, cudaError_t e) { return jax_nvfp4::CudaCallError("jax_nvfp4_grouped_gemm", what, e); }

std::string DeviceDescription(int dev, int arch) {
  cudaDeviceProp prop;
  std::string name = cudaGetDeviceProperties(&prop, dev) == cudaSuccess ? prop.name : "unknown device";
  return name + " (device " + std::to_string(dev) + ", compute capability " + std::to_string(arch / 10) + "." +
         std::to_string(arch % 10) + ")";
}

// Checks that configuration cfg runs on this device with this build, and enqueues the GEMM.
ffi::Error CheckAndLaunch(const jax_nvfp4::GroupedGemmParams& p, const jax_nvfp4::KernelConfig& cfg,
                          cudaStream_t stream) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return CudaError("cudaGetDevice", e);
  const int arch = jax_nvfp4::DeviceArch(dev);
  if (const char* why = jax_nvfp4::ConfigUnsupportedReason(cfg, arch)) {
    const std::string device = DeviceDescription(dev, arch);
    if (!jax_nvfp4::ArchSupported(arch))
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        "jax_nvfp4_grouped_gemm: " + device +
                            " is not supported: the CUDA kernels need compute capability 8.0 or newer "
                            "(Ampere, Ada, Hopper, Blackwell); use backend='reference' on this device");
    return BadArgument(jax_nvfp4::ConfigToString(cfg) + " cannot run on " + device + ": " + why);
  }
  if (!jax_nvfp4::FamilyHandles(cfg.family, jax_nvfp4::ProblemOf(p)))
    return BadArgument(jax_nvfp4::ConfigToString(cfg) + " does not compute this problem (M = " + std::to_string(p.M) +
                       ", N = " + std::to_string(p.N) + ", K = " + std::to_string(p.K) + ", G = " +
                       std::to_string(p.G) + (p.a_fp4 ? ", packed e2m1 lhs" : "") +
                       (p.rhs_layout == jax_nvfp4::RhsLayout::kSm90 ? ", sm90 weights" : "") +
                       "); jax_nvfp4.config.kernel_config.choose picks one that does");
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  // XLA's buffers meet every kernel's alignment (csrc/gemm_contract.h, kXlaBufferAlignBytes)
  if (const char* why = jax_nvfp4::BufferAlignmentError(p, cfg)) return BadArgument(why);

  e = jax_nvfp4::LaunchGroupedGemm(p, cfg, arch, stream);
  if (e != cudaSuccess) return CudaError("kernel launch failed", e);
  e = cudaGetLastError();
  if (e != cudaSuccess) return CudaError("CUDA error after launch", e);
  return ffi::Error::Success();
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
  // The FP8 mode: the wgmma_fp8 kernel on checkpoint-layout weights, wgmma_fp8_prepared and cutlass_fp8 on
  // fp8-prepared weights (rhs_layout 2; the decoder checked that the configuration's family reads the layout).
  if (p.fp8 && p.rhs_layout == jax_nvfp4::RhsLayout::kSm90)
    return BadArgument("(FP8 mode) the CUDA kernels read checkpoint-layout weights only (rhs_layout 0), got "
                       "rhs_layout 1 (sm90); use jax_nvfp4.prepare_weights(w, 'checkpoint') for the FP8 mode");
  if (p.rhs_layout == jax_nvfp4::RhsLayout::kSm90 && p.a_fp4)
    return BadArgument("rhs_layout 1 (sm90 weights) takes a bf16 lhs only on the GPU, got packed e2m1 "
                       "(jax_nvfp4.grouped_gemm dequantizes W4A4 activations to bf16 first for such weights)");
  return CheckAndLaunch(p, attrs.config(), stream);
}

// The SwiGLU call ("jax_nvfp4_grouped_gemm_glu"): the exact kernels with the SwiGLU epilogue.
ffi::Error GroupedGemmGluCudaImpl(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer lhs_scales, U8Buffer3 rhs,
                                  ffi::AnyBuffer rhs_scales, F32Buffer1 alpha, S32Buffer1 group_sizes,
                                  F32Buffer1 row_scale, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<U8Buffer1> workspace, jax_nvfp4::GluAttrs attrs) {
  jax_nvfp4::GroupedGemmParams p;
  if (ffi::Error err = jax_nvfp4::DecodeGroupedGemmGlu(lhs, lhs_scales, rhs, rhs_scales, alpha, group_sizes, row_scale,
                                                       out, workspace, attrs, &p);
      err.failure())
    return err;
  if (p.rhs_layout == jax_nvfp4::RhsLayout::kSm90 && p.a_fp4)
    return ffi::Error::InvalidArgument(
        "jax_nvfp4_grouped_gemm_glu: rhs_layout 1 (sm90 weights) takes a bf16 lhs only on the GPU, got packed e2m1 "
        "(jax_nvfp4.grouped_gemm_swiglu dequantizes W4A4 activations to bf16 first for such weights)");
  return CheckAndLaunch(p, attrs.gemm().config(), stream);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4GroupedGemmGluCuda, GroupedGemmGluCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<CudaStream>()
                                  .Arg<ffi::AnyBuffer>()  // lhs
                                  .Arg<ffi::AnyBuffer>()  // lhs_scales
                                  .Arg<U8Buffer3>()       // rhs_data: gate/up-paired rows
                                  .Arg<ffi::AnyBuffer>()  // rhs_scales
                                  .Arg<F32Buffer1>()      // alpha [2G]
                                  .Arg<S32Buffer1>()      // group_sizes
                                  .Arg<F32Buffer1>()      // row_scale [M] or [0]
                                  .Ret<ffi::AnyBuffer>()  // out [M, N/2]
                                  .Ret<U8Buffer1>()       // workspace
                                  .Attrs<jax_nvfp4::GluAttrs>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

