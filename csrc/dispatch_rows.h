// Row dispatch for the MoE layer ("jax_nvfp4_dispatch_rows"): each source row of x is read once
// and written to every output row its scatter map names, either as it is (bf16, the W4A16 GEMM
// input) or as the values of its NVFP4 quantization (the W4A4 GEMM input: e2m1 x e4m3 block
// scale, exact in bf16, the row's global scale left to the caller), so the layer writes the
// grouped GEMM's bf16 input in one pass instead of quantizing, packing, gathering and decoding.
//
// The per-block arithmetic is plain C++ shared by the CPU handler (ffi/dispatch_rows_cpu.cc) and
// the CUDA kernel (csrc/dispatch_rows.cu): it reproduces jax_nvfp4.quantize followed by
// jax_nvfp4.quantization.e2m1_scaled bit for bit (IEEE divisions, e4m3 and e2m1 round to nearest
// even, NaN blocks, saturated infinities, subnormal inputs kept).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define JAX_NVFP4_HD __host__ __device__ __forceinline__
#else
#define JAX_NVFP4_HD inline
#endif

namespace jax_nvfp4 {

struct DispatchRowsParams {
  const void* x = nullptr;           // [T, K], bf16 (x_f32 false) or float32
  bool x_f32 = false;
  const float* row_scale = nullptr;  // [T] global scale per row (quantize), or nullptr (copy bf16)
  const int32_t* scatter = nullptr;  // [T, slots] output row of each copy (>= R or < 0: none), or
                                     // nullptr: row t goes to output row t (slots 1, R == T)
  int64_t T = 0, K = 0, slots = 1, R = 0;
  uint16_t* out = nullptr;           // bf16 [R, K]
};

namespace rows {

constexpr int kBlock = 16;

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
JAX_NVFP4_HD bool IsNan(float v) { return v != v; }

// float32 in [0, 448] or NaN -> e4m3fn byte, round to nearest even (NaN: 0x7F).
JAX_NVFP4_HD uint8_t E4m3FromF32(float v) {
  if (IsNan(v)) return 0x7F;
  if (v < 0.015625f)  // below 2^-6: subnormal steps of 2^-9 (8 steps reach the normal 2^-6, code 8)
    return static_cast<uint8_t>(rintf(v * 512.0f));  // exact product; rintf: nearest, ties to even
  uint32_t b = F32Bits(v);
  b += 0x7FFFFu + ((b >> 20) & 1u);  // round the mantissa to 3 bits, ties to even (carries into the exponent)
  const int e = static_cast<int>(b >> 23) - 127;
  return static_cast<uint8_t>(((e + 7) << 3) | ((b >> 20) & 7u));
}

// e4m3fn byte (sign clear) -> float32.
JAX_NVFP4_HD float F32FromE4m3(uint8_t c) {
  if (c == 0x7F) return BitsF32(0x7FC00000u);
  const int e = c >> 3, m = c & 7;
  if (e == 0) return static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  return BitsF32(static_cast<uint32_t>(e - 7 + 127) << 23 | static_cast<uint32_t>(m) << 20);
}

// q in [-6, 6] -> the nearest E2M1 value (ties to the even code), sign kept (-0 for a negative q
// that rounds to 0, as the code 8 decodes).
JAX_NVFP4_HD float RoundE2m1(float q) {
  const float a = q < 0.0f ? -q : q;
  // steps 0.5, 1, 2 below 2, 4, 6: powers of 2, so both products are exact
  const float step = a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f);
  const float inv = a < 2.0f ? 2.0f : (a < 4.0f ? 1.0f : 0.5f);
  const float m = rintf(a * inv) * step;  // rintf: nearest, ties to even (the even code)
  return BitsF32(F32Bits(m) | (F32Bits(q) & 0x80000000u));
}

// Exact bf16 bits of v (v needs at most 8 significant bits); NaN -> quiet NaN.
JAX_NVFP4_HD uint16_t Bf16Exact(float v) {
  const uint32_t b = F32Bits(v);
  if (IsNan(v)) return static_cast<uint16_t>((b >> 16) | 0x7FC0u);
  return static_cast<uint16_t>(b >> 16);
}

JAX_NVFP4_HD float F32FromBf16(uint16_t h) { return BitsF32(static_cast<uint32_t>(h) << 16); }

// The block scale (as float32) of a block whose |x / gs| has maximum amax (nan: the block holds a
// NaN), for the row's global scale gs: e4m3(min(amax / 6, 448)), NaN for a NaN block or an invalid
// gs (not a finite float32 >= 2^-126).
JAX_NVFP4_HD float BlockScale(float amax, bool nan, float gs) {
  const bool bad = !(gs >= 1.17549435e-38f && gs <= 3.40282347e+38f);  // NaN compares false
  if (bad || nan) return BitsF32(0x7FC00000u);
  float v = amax / 6.0f;
  v = v < 448.0f ? v : 448.0f;
  return F32FromE4m3(E4m3FromF32(v));
}

// The bf16 bits of e2m1(code) * s for y = x / gs in a block of scale s (BlockScale).
JAX_NVFP4_HD uint16_t QuantizedValue(float y, float s) {
  float q = 0.0f;
  if (s > 0.0f && !IsNan(y)) {  // s > 0 is false for 0 and NaN: the code is 0
    q = y / s;
    q = q < -6.0f ? -6.0f : (q > 6.0f ? 6.0f : q);
  }
  return Bf16Exact(RoundE2m1(q) * s);
}

// One block of 16 values x (float32) with the row's global scale gs -> the bf16 bits of
// e2m1(code) * float(scale) as jax_nvfp4.quantize would produce them with exact divisions.
JAX_NVFP4_HD void QuantizeBlock16(const float* x, float gs, uint16_t* out) {
  float y[kBlock];
  float amax = 0.0f;
  bool nan = false;
  for (int i = 0; i < kBlock; ++i) {
    y[i] = x[i] / gs;
    const float a = y[i] < 0.0f ? -y[i] : y[i];
    nan |= IsNan(a);
    amax = a > amax ? a : amax;
  }
  const float s = BlockScale(amax, nan, gs);
  for (int i = 0; i < kBlock; ++i) out[i] = QuantizedValue(y[i], s);
}

}  // namespace rows

// A bad argument's message, or nullptr (shared by the handlers).
inline const char* DispatchRowsCheckParams(const DispatchRowsParams& p) {
  if (p.T < 0 || p.K < 0 || p.R < 0 || p.slots < 1) return "negative sizes";
  if (p.K % rows::kBlock) return "K must be a multiple of 16";
  if (!p.scatter && p.R != p.T) return "without a scatter map the output has one row per input row";
  if (!p.row_scale && p.x_f32) return "the copy (no row_scale) takes a bf16 x";
  return nullptr;
}

}  // namespace jax_nvfp4

#if defined(JAX_NVFP4_WITH_CUDA_DECLS) || defined(__CUDACC__)
#include <cuda_runtime.h>
namespace jax_nvfp4 {
// Enqueues the dispatch on stream (csrc/dispatch_rows.cu); checks the launch.
cudaError_t LaunchDispatchRows(const DispatchRowsParams& p, cudaStream_t stream);
}  // namespace jax_nvfp4
#endif
