// float32 <-> bit-pattern helpers and the e4m3 byte decode, for the arithmetic that the custom
// calls' CPU handlers and CUDA kernels share (csrc/dispatch_rows.h, csrc/quantize_fp8.h,
// csrc/grouped_gemm_fp8_sm90.cu): plain C++ on the host, inlined device functions under nvcc.
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

// float32 value of a float8_e4m3fn byte: bias 7, sign, subnormals m * 2^-9 (a normal float32, so
// the product is exact with or without flushing), S.1111.111 NaN.
JAX_NVFP4_HD float E4m3Value(uint32_t byte) {
  const uint32_t e = (byte >> 3) & 0xFu, m = byte & 7u;
  if (e == 0xFu && m == 7u) return BitsF32(0x7FC00000u);
  const float v = e == 0 ? static_cast<float>(m) * 0.001953125f : BitsF32((e + 120u) << 23 | m << 20);
  return (byte & 0x80u) ? -v : v;
}

}  // namespace jax_nvfp4
