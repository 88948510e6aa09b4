// XLA FFI CUDA handler of "jax_nvfp4_quantize_fp8" (ffi/quantize_fp8_ffi.h): checks the call and
// enqueues csrc/quantize_fp8.cu. No allocation, no host sync.
#include <cuda_runtime.h>

#define JAX_NVFP4_WITH_CUDA_DECLS 1
#include "ffi/cuda_status.h"
#include "ffi/quantize_fp8_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using CudaStream = ffi::PlatformStream<cudaStream_t>;

ffi::Error QuantizeFp8Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer block_scales,
                           ffi::Result<ffi::AnyBuffer> codes, ffi::Result<ffi::AnyBuffer> scales,
                           bool scales_transposed) {
  jax_nvfp4::QuantizeFp8Params p;
  if (ffi::Error err = jax_nvfp4::DecodeQuantizeFp8(x, block_scales, codes, scales, scales_transposed, &p);
      err.failure())
    return err;
  return jax_nvfp4::LaunchStatus("jax_nvfp4_quantize_fp8", jax_nvfp4::LaunchQuantizeFp8(p, stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4QuantizeFp8Cuda, QuantizeFp8Cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<CudaStream>()
                                  .Arg<ffi::AnyBuffer>()   // x [M, K] float, or uint8 [M, K/2]
                                  .Arg<ffi::AnyBuffer>()   // block_scales e4m3 [M, K/16] or [0]
                                  .Ret<ffi::AnyBuffer>()   // codes e4m3 [M, K], kernel k order
                                  .Ret<ffi::AnyBuffer>()   // scales float32 [M, K/128] or [K/128, M]
                                  .Attr<bool>("scales_transposed"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
