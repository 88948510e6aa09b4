// float32 <-> bit-pattern helpers for the arithmetic that the custom calls' CPU handlers and CUDA
// kernels share (csrc/dispatch_rows.h, csrc/quantize_fp8.h): plain C++ on the host, inlined device
// functions under nvcc.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define JAX_NVFP4_HD __host__ __device__ __forceinline__
#else
#define JAX_NVFP4_HD inline
#endif

namespace jax_nvfp4 {

JAX_NVFP4_HD uint32_t F32Bits(float v) {
  uint32_t b;
  memcpy(&b, &v, 4);
  return b;
}

JAX_NVFP4_HD float BitsF32(uint32_t b) {
  float v;
  memcpy(&v, &b, 4);
  return v;
}

}  // namespace jax_nvfp4
