// XLA FFI CUDA handler of "jax_nvfp4_dispatch_rows" (ffi/dispatch_rows_ffi.h): checks the call and
// enqueues csrc/dispatch_rows.cu. No allocation, no host sync.
#include <cstdint>

#include <cuda_runtime.h>

#define JAX_NVFP4_WITH_CUDA_DECLS 1
#include "ffi/cuda_status.h"
#include "ffi/dispatch_rows_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using CudaStream = ffi::PlatformStream<cudaStream_t>;

ffi::Error DispatchRowsCuda(cudaStream_t stream, ffi::AnyBuffer x, jax_nvfp4::RowScaleBuffer row_scale,
                            ffi::AnyBuffer scatter, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<jax_nvfp4::RowScaleBuffer> row_scale_out,
                            ffi::Result<ffi::AnyBuffer> chunk_scales) {
  jax_nvfp4::DispatchRowsParams p;
  if (ffi::Error err = jax_nvfp4::DecodeDispatchRows(x, row_scale, scatter, out, row_scale_out, chunk_scales, &p);
      err.failure())
    return err;
  return jax_nvfp4::LaunchStatus("jax_nvfp4_dispatch_rows", jax_nvfp4::LaunchDispatchRows(p, stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4DispatchRowsCuda, DispatchRowsCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<CudaStream>()
                                  .Arg<ffi::AnyBuffer>()               // x [T, K]
                                  .Arg<jax_nvfp4::RowScaleBuffer>()    // row_scale [T] or [0]
                                  .Arg<ffi::AnyBuffer>()               // scatter [T, slots] or [0]
                                  .Ret<ffi::AnyBuffer>()               // out bf16 or e4m3 [R, K]
                                  .Ret<jax_nvfp4::RowScaleBuffer>()    // row_scale_out [R] or [0]
                                  .Ret<ffi::AnyBuffer>(),              // chunk_scales [R, K/128] or [0, 0]
                              {xla::ffi::Traits::kCmdBufferCompatible});
