// The FP8 mode's e4m3 codes of four values of a 128-wide activation chunk, as one word, for the
// CUDA kernels that write the fp8 operand (csrc/quantize_fp8.cu, csrc/dispatch_rows.cu): the same
// bytes as the host's integer route (fp8q::E4m3Scaled, csrc/quantize_fp8.h).
#pragma once

#include <cstdint>

#include <cuda_fp8.h>

#include "csrc/quantize_fp8.h"

namespace jax_nvfp4 {
namespace fp8q {

// The four codes of x * 2^-e (bits of four finite values of a chunk with scale exponent e) as one
// word, first value in the low byte. On sm_89 and later a float multiply and the hardware's
// round-to-nearest-even conversion: the same bytes as the integer route (E4m3Scaled) while
// subnormal operands are kept (nvcc's default; docs/design.md, "FP8 mode", gives the argument per
// element), in a few instructions per value; before sm_89 (no e4m3 conversion instruction) the
// integer route.
__device__ __forceinline__ uint32_t CodesWord(uint4 v, int e) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const float inv = Pow2(-e);  // e in [-126, 120]
  const float2 lo = make_float2(__uint_as_float(v.x) * inv, __uint_as_float(v.y) * inv);
  const float2 hi = make_float2(__uint_as_float(v.z) * inv, __uint_as_float(v.w) * inv);
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(lo, __NV_SATFINITE, __NV_E4M3)) |
         static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(hi, __NV_SATFINITE, __NV_E4M3)) << 16;
#else
  return static_cast<uint32_t>(E4m3Scaled(v.x, e)) | static_cast<uint32_t>(E4m3Scaled(v.y, e)) << 8 |
         static_cast<uint32_t>(E4m3Scaled(v.z, e)) << 16 | static_cast<uint32_t>(E4m3Scaled(v.w, e)) << 24;
#endif
}

// The codes word of a chunk with amax bits `amax` (sign clear, over the whole chunk): NaN codes
// (0x7F) for a chunk holding an Inf or NaN; *scale receives the chunk's scale (1 then).
__device__ __forceinline__ uint32_t ChunkCodesWord(uint4 v, uint32_t amax, float* scale) {
  bool nonfinite;
  const int e = ScaleExponent(amax, &nonfinite);
  *scale = nonfinite ? 1.0f : Pow2(e);
  return nonfinite ? 0x7F7F7F7Fu : CodesWord(v, e);
}

}  // namespace fp8q
}  // namespace jax_nvfp4
