// The epilogue every kernel family shares: one thread's accumulators of weight rows n and n + 8 for
// one token row (the mma.sync and wgmma D fragments both give a thread that pair, n % 16 < 8), scaled
// by alpha and stored, either as they are or through the SwiGLU of the gate/up-paired weight rows
// (csrc/gemm_contract.h). Included by the kernel files (internal linkage).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace jax_nvfp4 {
namespace {

// silu(min(g, L)) * clamp(u, -L, L), silu(x) = x / (1 + exp(-x)). The comparisons are written so that
// a NaN passes through (fminf would replace it by L and hide a NaN row). The exponential and the
// division are the hardware approximations (relative error ~1e-6 against the IEEE ones): the tensor
// cores idle while a tile's epilogue runs, so its cost shows in the GEMM's time.
__device__ __forceinline__ float swiglu_clamped(float g, float u, float limit) {
  g = g > limit ? limit : g;
  u = u > limit ? limit : (u < -limit ? -limit : u);
  return __fdividef(g, 1.0f + __expf(-g)) * u;
}

// The factors of group g's rows n (mul_lo, n % 16 < 8) and n + 8 (mul_hi): alpha[g] for both, or the
// gate and up factors alpha[2g], alpha[2g + 1] with the SwiGLU epilogue; times `fix`, the power of two
// the kernel's weight scaling needs undone.
template <typename KP>
__device__ __forceinline__ void epilogue_factors(const KP& p, int64_t g, float fix, float& mul_lo, float& mul_hi) {
  if (p.glu) {
    mul_lo = __ldg(p.alpha + 2 * g) * fix;
    mul_hi = __ldg(p.alpha + 2 * g + 1) * fix;
  } else {
    mul_lo = mul_hi = __ldg(p.alpha + g) * fix;
  }
}

template <typename KP>
__device__ __forceinline__ void store_value(const KP& p, int64_t idx, float v) {
  if (p.out_f32)
    static_cast<float*>(p.out)[idx] = v;
  else
    static_cast<__nv_bfloat16*>(p.out)[idx] = __float2bfloat16_rn(v);
}

// Stores token row r's accumulators lo (weight row n, n % 16 < 8) and hi (row n + 8): out[r, n] and
// out[r, n + 8] (columns below N), or with the SwiGLU epilogue (N % 16 == 0) the one value
// out[r, 8 (n / 16) + n % 8] of the output's N / 2 columns, gate and up times row_scale (row r's
// entry of p.row_scale, or 1: the caller loads it, ahead of its store loop). The caller checks that r
// is in its group.
template <typename KP>
__device__ __forceinline__ void store_pair(const KP& p, int64_t r, int64_t n, float lo, float hi, float mul_lo,
                                           float mul_hi, float row_scale) {
  if (n >= p.N) return;
  if (!p.glu) {
    store_value(p, r * p.N + n, lo * mul_lo);
    if (n + 8 < p.N) store_value(p, r * p.N + n + 8, hi * mul_hi);
    return;
  }
  const float g = lo * mul_lo * row_scale, u = hi * mul_hi * row_scale;
  store_value(p, r * (p.N / 2) + (n >> 4) * 8 + (n & 7), swiglu_clamped(g, u, p.glu_limit));
}

}  // namespace
}  // namespace jax_nvfp4
