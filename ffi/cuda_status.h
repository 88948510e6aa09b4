// The CUDA handlers' error for a failed CUDA call, and the check after a kernel launch (its returned
// status, then cudaGetLastError), shared by ffi/*_cuda.cc.
#pragma once

#include <string>

#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {

// "<target>: <what>: <error name>: <error string>" as an internal FFI error.
inline ::xla::ffi::Error CudaCallError(const char* target, const char* what, cudaError_t e) {
  return ::xla::ffi::Error::Internal(std::string(target) + ": " + what + ": " + cudaGetErrorName(e) + ": " +
                                     cudaGetErrorString(e));
}

// The status of a launch just enqueued: e (the launcher's own checks), then the runtime's last error.
inline ::xla::ffi::Error LaunchStatus(const char* target, cudaError_t e) {
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) return CudaCallError(target, "kernel launch failed", e);
  return ::xla::ffi::Error::Success();
}

}  // namespace jax_nvfp4
