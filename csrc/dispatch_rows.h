// Row dispatch for the MoE layer ("jax_nvfp4_dispatch_rows"): each source row of x is read once
// and written to every output row its scatter map names, either as it is (bf16, the W4A16 GEMM
// input) or as the values of its NVFP4 quantization (the W4A4 GEMM input: e2m1 x e4m3 block
// scale, exact in bf16, the row's global scale left to the caller), so the layer writes the
// grouped GEMM's bf16 input in one pass instead of quantizing, packing, gathering and decoding.
// The row's global scale is given, or (dynamic) made from the row's finite amax on the way and
// written beside each output row, so no separate reduction pass reads x first. For the FP8 mode
// the rows are written as its operand instead (e4m3 codes in the FP8 kernel's k order and one
// power-of-two scale per 128-wide chunk, the bytes csrc/quantize_fp8.h makes of those bf16 rows),
// so the layer's fp8 GEMM inputs take one pass too.
//
// The per-block arithmetic is plain C++ shared by the CPU handler (ffi/dispatch_rows_cpu.cc) and
// the CUDA kernel (csrc/dispatch_rows.cu): it reproduces jax_nvfp4.quantize followed by
// jax_nvfp4.maths.quantization.e2m1_scaled bit for bit (IEEE divisions, e4m3 and e2m1 round to nearest
// even, NaN blocks, saturated infinities, subnormal inputs kept).
#pragma once

#include <cmath>
#include <cstdint>

#include "csrc/float_bits.h"
#include "csrc/quantize_fp8.h"

namespace jax_nvfp4 {

struct DispatchRowsParams {
  const void* x = nullptr;           // [T, K], bf16 (x_f32 false) or float32
  bool x_f32 = false;
  const float* row_scale = nullptr;  // [T] global scale per row (quantize), or nullptr
  float* row_scale_out = nullptr;    // [R] dynamic: the global scale made from each row's finite
                                     // amax, stored for each of its output rows; or nullptr.
                                     // Neither scale: the bf16 rows are copied.
  const int32_t* scatter = nullptr;  // [T, slots] output row of each copy (>= R or < 0: none), or
                                     // nullptr: row t goes to output row t (slots 1, R == T)
  int64_t T = 0, K = 0, slots = 1, R = 0;
  bool e4m3 = false;                 // the output: bf16 rows (out), or the fp8 mode's operand
  uint16_t* out = nullptr;           // bf16 [R, K]
  uint8_t* codes = nullptr;          // e4m3 [R, K] in the FP8 kernel's k order: the output rows
                                     // (bf16 as `out` would hold them) quantized per 128-wide k
                                     // chunk as csrc/quantize_fp8.h does; or nullptr
  float* chunk_scales = nullptr;     // with codes: float32 [R, K/128], each chunk's scale
};

namespace rows {

constexpr int kBlock = 16;

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

// |v| folded into a running amax over finite values (Inf and NaN skipped).
JAX_NVFP4_HD float FiniteAbsMax(float amax, float v) {
  const float a = v < 0.0f ? -v : v;
  return a <= 3.40282347e+38f && a > amax ? a : amax;  // NaN compares false
}

// The dynamic global scale of a row (jax_nvfp4.maths.quantization.dynamic_global_scale) from its amax
// over finite values: amax / (6 * 448) rounded to nearest even, at least 2^-126; 1 for amax 0.
JAX_NVFP4_HD float DynamicGlobalScale(float amax) {
  if (!(amax > 0.0f)) return 1.0f;
  const float gs = amax / 2688.0f;  // an IEEE division on both sides (nvcc: div.rn; host: SSE)
  return gs < 1.17549435e-38f ? 1.17549435e-38f : gs;
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
  return E4m3Value(E4m3FromF32(v));
}

// e2m1(RN(y / s)) * s, the quotient rounded to E2M1 with ties to the even code, without a
// division: for a block scale s with at most 4 significant bits (an e4m3 value, >= 2^-9) and an
// E2M1 midpoint mu with at most 3, mu * s is an exact float32, and a float32 y != mu * s lies at
// least one float32 step from it, which is more than half a quotient step near mu because s's
// significand is below 2: so RN(y / s) lies on the same side of mu as y of mu * s, and the
// rounding is counted from |y|'s comparisons with the seven mu * s (docs/design.md, "Routing and dispatch").
struct E2m1Grid {
  float t[7];  // mu * s for mu = 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
  float half;  // s / 2, the grid's step below 2 s

  JAX_NVFP4_HD explicit E2m1Grid(float s) : half(0.5f * s) {
    const float mu[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    for (int i = 0; i < 7; ++i) t[i] = mu[i] * s;
  }

  // The bf16 bits of e2m1(RN(y / s)) * s with y's sign (y not NaN; the quotient saturates at 6).
  JAX_NVFP4_HD uint16_t Value(float y) const {
    const float a = y < 0.0f ? -y : y;
    // steps of s/2 up to 2s, s up to 4s, then 2s; a tie goes to the even code: down at 0.25,
    // 1.25, 2.5 and 5, up at 0.75, 1.75 and 3.5
    // (counted in float: the GPU has no full-rate int-to-float conversion, and each 0/1 is a select)
    const float n = (a > t[0] ? 1.0f : 0.0f) + (a >= t[1] ? 1.0f : 0.0f) + (a > t[2] ? 1.0f : 0.0f) +
                    (a >= t[3] ? 1.0f : 0.0f) + 2.0f * ((a > t[4] ? 1.0f : 0.0f) + (a >= t[5] ? 1.0f : 0.0f)) +
                    (a > t[6] ? 4.0f : 0.0f);
    const float v = n * half;  // exact: n is an integer <= 12, s has at most 4 bits
    return static_cast<uint16_t>((F32Bits(v) | (F32Bits(y) & 0x80000000u)) >> 16);
  }
};

// The bf16 bits of e2m1(RN(y / s)) * s for y = x / gs in a block of scale s (BlockScale): NaN for
// a NaN s (a NaN block or an invalid gs), +0 for s = 0 (every code 0).
JAX_NVFP4_HD uint16_t QuantizedValue(float y, float s) {
  if (IsNan(s)) return 0x7FC0u;
  if (!(s > 0.0f)) return 0;
  return E2m1Grid(s).Value(y);
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
  if (p.row_scale && p.row_scale_out) return "row_scale (given) and row_scale_out (dynamic) exclude each other";
  if (!p.row_scale && !p.row_scale_out && p.x_f32) return "the copy (no row scale) takes a bf16 x";
  if (p.e4m3 && p.K % 128) return "the e4m3 output needs K to be a multiple of 128";
  return nullptr;
}

// Threads per CTA (one CTA per source row) of the CUDA kernel for T rows on a GPU of `sms` SMs.
// Quantizing: 128, or the widest of 512 / 256 with which the T CTAs still fit the GPU's resident
// threads (2048 per SM), since at decode sizes few rows of 128 threads leave most SMs idle and
// step through each row's arithmetic serially. The copy stays at 128: it is bound by its stores.
inline int DispatchThreads(int64_t T, int sms, bool quantize) {
  if (quantize)
    for (const int t : {512, 256})
      if (T * t <= static_cast<int64_t>(sms) * 2048) return t;
  return 128;
}

}  // namespace jax_nvfp4

#if defined(JAX_NVFP4_WITH_CUDA_DECLS) || defined(__CUDACC__)
#include <cuda_runtime.h>
namespace jax_nvfp4 {
// Enqueues the dispatch on stream (csrc/dispatch_rows.cu); checks the launch.
cudaError_t LaunchDispatchRows(const DispatchRowsParams& p, cudaStream_t stream);
}  // namespace jax_nvfp4
#endif
