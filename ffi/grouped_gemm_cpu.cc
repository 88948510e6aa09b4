// CPU handler of the grouped NVFP4 GEMM (same contract as the CUDA handler; see
// jax_nvfp4/ops/reference.py for the semantics). Straight loops. Like the CUDA kernels, each weight
// enters the dot as e2m1 * scale * 2^-7 (exact in float32) and the epilogue multiplies by
// alpha * 2^7, so the float32 accumulator overflows exactly where theirs can (past 2^7 *
// FLT_MAX of the exact dot), not where a product with an unscaled weight would. Not fast; it
// makes the custom-call path testable and usable without a GPU.
// The sm90 load-time layout (jax_nvfp4/maths/layout.py, csrc/gemm_contract.h) is read natively: each weight
// row's codes are gathered through the layout's index mapping, then the same loops run, so the
// result is bitwise the one of the checkpoint layout.
// The SwiGLU handler ("jax_nvfp4_grouped_gemm_glu") runs the same loops over each gate row and its
// up row (csrc/gemm_contract.h) and stores silu(min(gate, L)) * clamp(up, -L, L).
// In the FP8 mode (a kernel attribute of an FP8 family) the same handler computes the arithmetic of
// docs/design.md "FP8 mode": weights rounded to e4m3 as e4m3(e2m1 * scale * 2^-3), one float32 dot
// per 128-wide chunk, promoted with fma(part, chunk scale, acc), the epilogue times alpha * 2^3.
// Weights prepared as e4m3 (rhs_layout 2: those values, in the kernel k order inside each chunk) are
// read as they lie; the products and their order are those of the NVFP4 weights' loop, so the result
// is bitwise the same.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "ffi/gemm_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jax_nvfp4::F32Buffer1;
using jax_nvfp4::S32Buffer1;
using jax_nvfp4::U8Buffer1;
using jax_nvfp4::U8Buffer3;

constexpr float kWeightPrescale = jax_nvfp4::Pow2f(-jax_nvfp4::kExactWeightShift);   // 2^-7
using jax_nvfp4::kFp8WeightPrescale;   // 2^-3
using jax_nvfp4::kFp8WeightUndo;

constexpr float kE2m1[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                             -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// float8_e4m3fn bits -> float (bias 7, no infinities, S.1111.111 is NaN).
float E4m3ToFloat(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 7;
  float v;
  if (exp == 0xF && man == 7) return NAN;
  if (exp == 0) v = std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^-6
  else v = std::ldexp(1.f + man / 8.f, exp - 7);
  return sign ? -v : v;
}

float Bf16ToFloat(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The codes of weight row n (0 <= n < N) of one expert, data u8 [N, K/2], into codes[0..K).
// Layout 0 (checkpoint): element 2j in the low nibble of byte j.
void RowCodesCheckpoint(const uint8_t* data, int64_t K, int64_t n, uint8_t* codes) {
  const uint8_t* row = data + n * (K / 2);
  for (int64_t j = 0; j < K / 2; ++j) {
    codes[2 * j] = row[j] & 0xF;
    codes[2 * j + 1] = row[j] >> 4;
  }
}

// Layout 1 (sm90; N % 128 == 0, K % 64 == 0), per jax_nvfp4/maths/layout.py: with n = 128 NB + 16 mt +
// 8 hi + g8 and k = 64 KB + 16 kb + 8 half + 2 t + parity, the code sits in the little-endian
// 32-bit word at byte 512 mt + 16 (4 g8 + t) + 4 kb of 4096-byte block KB of row stripe NB (the
// stripe's 128 rows x K/2 bytes hold its K/64 blocks one after another: block byte o is byte
// 4096 KB + o of the stripe), register slot hi + 2 half, its sign/e1/e0/m0 bits at
// kSm90SlotBits[slot] + 16 parity.
using jax_nvfp4::kSm90SlotBits;

void RowCodesSm90(const uint8_t* data, int64_t K, int64_t n, uint8_t* codes) {
  const int64_t nb = n / 128, r = n % 128;
  const int64_t mt = r / 16, hi = (r / 8) % 2, g8 = r % 8;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t kblk = k / 64, kk = k % 64;
    const int64_t kb = kk / 16, half = (kk / 8) % 2, t = (kk / 2) % 4, parity = kk % 2;
    const int64_t o = 512 * mt + 16 * (4 * g8 + t) + 4 * kb;  // a multiple of 4: one data row
    const uint8_t* b = data + 128 * nb * (K / 2) + 4096 * kblk + o;
    const uint32_t w =
        b[0] | (uint32_t{b[1]} << 8) | (uint32_t{b[2]} << 16) | (uint32_t{b[3]} << 24);
    const int* bits = kSm90SlotBits[hi + 2 * half];
    const int off = 16 * static_cast<int>(parity);
    auto bit = [&](int i) { return (w >> (bits[i] + off)) & 1u; };  // sign, e1, e0, m0
    codes[k] = static_cast<uint8_t>(bit(0) << 3 | bit(1) << 2 | bit(2) << 1 | bit(3));
  }
}

uint16_t FloatToBf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// float -> float8_e4m3fn bits, round to nearest even, subnormals kept. NaN (and magnitudes of 464
// and more, which round past the largest finite 448; e4m3fn has no infinity) -> S.1111.111.
uint8_t FloatToE4m3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (std::isnan(f)) return sign | 0x7F;
  const float a = std::fabs(f);
  if (a >= 464.f) return sign | 0x7F;
  if (a == 0.f) return sign;
  int e = 0;
  std::frexp(a, &e);                             // a = m * 2^e, m in [0.5, 1): a in [2^(e-1), 2^e)
  const int q = std::max(e - 1, -6) - 3;         // the e4m3 quantum at a: 3 mantissa bits, normals from 2^-6
  const float r = std::nearbyint(std::ldexp(a, -q));  // exact scaling; rounds half to even (default mode)
  const float v = std::ldexp(r, q);              // the rounded magnitude (may carry into the next binade)
  if (v < 0.015625f) return sign | static_cast<uint8_t>(r);  // subnormal: v = r * 2^-9, r in 0..7
  std::frexp(v, &e);
  const int exp = e - 1 + 7;                     // bias 7
  const int man = static_cast<int>(std::ldexp(v, -(e - 1)) * 8.f) - 8;
  return sign | static_cast<uint8_t>(exp << 3 | man);
}

// Calls fn(g, start, end) for each group's rows [start, end) in order (negative sizes count as 0,
// the running sum is clamped to M), then writes 0 to the rows past the last group.
template <typename Fn>
void ForEachGroup(const jax_nvfp4::GroupedGemmParams& p, Fn fn) {
  int64_t start = 0;
  for (int64_t g = 0; g < p.G; ++g) {
    const int64_t end = std::min<int64_t>(start + std::max<int32_t>(p.group_sizes[g], 0), p.M);
    fn(g, start, end);
    start = end;
  }
  const int64_t cols = jax_nvfp4::OutputColumns(p);
  const int64_t tail = (p.M - start) * cols;
  if (p.out_f32) std::fill_n(static_cast<float*>(p.out) + start * cols, tail, 0.f);
  else std::fill_n(static_cast<uint16_t*>(p.out) + start * cols, tail, uint16_t{0});
}

// silu(min(g, L)) * clamp(u, -L, L), silu(x) = x / (1 + exp(-x)), as csrc/epilogue.cuh: NaN passes.
float SwigluClamped(float g, float u, float limit) {
  g = g > limit ? limit : g;
  u = u > limit ? limit : (u < -limit ? -limit : u);
  return g / (1.0f + std::exp(-g)) * u;
}

// The exact mode's loops for a checked call (host pointers), plain or with the SwiGLU epilogue;
// `wcodes` holds the decoded codes of one weight row (two with the SwiGLU: a gate row and its up row).
void ExactGemmCpu(const jax_nvfp4::GroupedGemmParams& p, uint8_t* wcodes) {
  const int64_t N = p.N, K = p.K;
  const bool w4a4 = p.a_fp4, out_f32 = p.out_f32;
  const bool sm90 = p.rhs_layout == jax_nvfp4::RhsLayout::kSm90;

  float e4m3[256];
  for (int i = 0; i < 256; ++i) e4m3[i] = E4m3ToFloat(static_cast<uint8_t>(i));
  const uint8_t* w = p.rhs;
  const uint8_t* ws = p.rhs_scales;
  const uint8_t* a8 = static_cast<const uint8_t*>(p.lhs);
  const uint16_t* a16 = static_cast<const uint16_t*>(p.lhs);
  const uint8_t* as = p.lhs_scales;
  const float* al = p.alpha;
  float* of = static_cast<float*>(p.out);
  uint16_t* ob = static_cast<uint16_t*>(p.out);
  const int64_t KB = K / 16;
  // Scale b of weight row n sits at row_scales(g, n)[qstride (b / 4) + b % 4]: checkpoint [N, K/16]
  // rows (qstride 4); sm90 (layout.py) one 512-byte [128 rows][4] record per 128-row stripe and
  // k-tile (qstride 512, the row's 4 bytes at 4 (n % 128) of each record).
  const int64_t qstride = sm90 ? 512 : 4;
  auto row_scales = [&](int64_t g, int64_t n) {
    return sm90 ? ws + (g * N + n / 128 * 128) * KB + 4 * (n % 128) : ws + (g * N + n) * KB;
  };
  auto decode_row = [&](int64_t g, int64_t n, uint8_t* codes) {
    const uint8_t* wg = w + g * N * (K / 2);
    if (sm90) RowCodesSm90(wg, K, n, codes);
    else RowCodesCheckpoint(wg, K, n, codes);
  };
  // lhs row r . weight row (codes, scales), the weights as e2m1 * scale * 2^-7 (exact in float32)
  auto dot = [&](int64_t r, const uint8_t* codes, const uint8_t* wsrow) {
    float acc = 0.f;
    for (int64_t b = 0; b < KB; ++b) {
      const float lhs_scale = w4a4 ? e4m3[as[r * KB + b]] : 1.f;
      const float wscale = e4m3[wsrow[qstride * (b / 4) + b % 4]] * kWeightPrescale;
      for (int j = 0; j < 16; j += 2) {
        const int64_t k = b * 16 + j;
        float x0, x1;
        if (w4a4) {  // e2m1 * e4m3: exact in float32
          const uint8_t ab = a8[r * (K / 2) + k / 2];
          x0 = kE2m1[ab & 0xF] * lhs_scale;
          x1 = kE2m1[ab >> 4] * lhs_scale;
        } else {
          x0 = Bf16ToFloat(a16[r * K + k]);
          x1 = Bf16ToFloat(a16[r * K + k + 1]);
        }
        acc += x0 * (kE2m1[codes[k]] * wscale);
        acc += x1 * (kE2m1[codes[k + 1]] * wscale);
      }
    }
    return acc;
  };
  auto store = [&](int64_t idx, float v) {
    if (out_f32) of[idx] = v;
    else ob[idx] = FloatToBf16(v);
  };
  constexpr float kFix = 1.f / kWeightPrescale;
  ForEachGroup(p, [&](int64_t g, int64_t start, int64_t end) {
    if (!p.glu) {
      for (int64_t n = 0; n < N && start < end; ++n) {
        decode_row(g, n, wcodes);
        const uint8_t* wsrow = row_scales(g, n);
        const float mul = al[g] * kFix;
        for (int64_t r = start; r < end; ++r) store(r * N + n, dot(r, wcodes, wsrow) * mul);
      }
      return;
    }
    // SwiGLU: gate row n (n % 16 < 8) and its up row n + 8 give output column 8 (n / 16) + n % 8
    uint8_t* up_codes = wcodes + K;
    const float mul_gate = al[2 * g] * kFix, mul_up = al[2 * g + 1] * kFix;
    for (int64_t n = 0; n < N && start < end; n += (n % 16 == 7) ? 9 : 1) {
      decode_row(g, n, wcodes);
      decode_row(g, n + 8, up_codes);
      const uint8_t *gs = row_scales(g, n), *us = row_scales(g, n + 8);
      for (int64_t r = start; r < end; ++r) {
        float gate = dot(r, wcodes, gs) * mul_gate, up = dot(r, up_codes, us) * mul_up;
        if (p.row_scale) {
          gate *= p.row_scale[r];
          up *= p.row_scale[r];
        }
        store(r * (N / 2) + n / 16 * 8 + n % 8, SwigluClamped(gate, up, p.glu_limit));
      }
    }
  });
}

ffi::Error GroupedGemmGluCpu(ffi::AnyBuffer lhs, ffi::AnyBuffer lhs_scales, U8Buffer3 rhs_data,
                             ffi::AnyBuffer rhs_scales, F32Buffer1 alpha, S32Buffer1 group_sizes,
                             F32Buffer1 row_scale, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<U8Buffer1> workspace, jax_nvfp4::GluAttrs attrs) {
  jax_nvfp4::GroupedGemmParams p;
  if (ffi::Error err = jax_nvfp4::DecodeGroupedGemmGlu(lhs, lhs_scales, rhs_data, rhs_scales, alpha, group_sizes,
                                                       row_scale, out, workspace, attrs, &p);
      err.failure())
    return err;
  ExactGemmCpu(p, workspace->typed_data());
  return ffi::Error::Success();
}

// Logical k (0..127) of position s of a 128-wide chunk in the kernel k order (docs/design.md):
// s = 32 j + 16 h + 4 t + i holds k = 32 t + 8 j + 4 h + i.
int KernelOrderToLogical(int s) {
  const int j = s >> 5, h = (s >> 4) & 1, t = (s >> 2) & 3, i = s & 3;
  return 32 * t + 8 * j + 4 * h + i;
}

// The FP8 mode (p.fp8): wrow, the workspace (one weight row).
void Fp8GemmCpu(const jax_nvfp4::GroupedGemmParams& p, uint8_t* wrow) {
  const int64_t N = p.N, K = p.K;
  const bool out_f32 = p.out_f32;
  const bool sm90 = p.rhs_layout == jax_nvfp4::RhsLayout::kSm90;
  const bool prepared = p.rhs_layout == jax_nvfp4::RhsLayout::kFp8;

  float e4m3[256];
  for (int i = 0; i < 256; ++i) e4m3[i] = E4m3ToFloat(static_cast<uint8_t>(i));
  int logical[128];
  for (int s = 0; s < 128; ++s) logical[s] = KernelOrderToLogical(s);
  const uint8_t* w = p.rhs;
  const uint8_t* ws = p.rhs_scales;
  const uint8_t* a8 = static_cast<const uint8_t*>(p.lhs);
  const float* xs = p.lhs_chunk_scales;
  const float* al = p.alpha;
  float* of = static_cast<float*>(p.out);
  uint16_t* ob = static_cast<uint16_t*>(p.out);
  const int64_t KB = K / 16, KC = K / 128;

  // workspace: one weight row's codes, then (in place) its e4m3 weights, in logical k order; prepared
  // weights: the row itself, already in the kernel k order (position s of a chunk holds logical[s])
  int w_index[128];
  for (int s = 0; s < 128; ++s) w_index[s] = prepared ? s : logical[s];
  ForEachGroup(p, [&](int64_t g, int64_t start, int64_t end) {
    for (int64_t n = 0; n < N && start < end; ++n) {
      const uint8_t* w8 = wrow;
      if (prepared) {
        w8 = w + (g * N + n) * K;
      } else {
        const uint8_t* wg = w + g * N * (K / 2);
        if (sm90) RowCodesSm90(wg, K, n, wrow);
        else RowCodesCheckpoint(wg, K, n, wrow);
        const uint8_t* wsrow = sm90 ? ws + (g * N + n / 128 * 128) * KB + 4 * (n % 128) : ws + (g * N + n) * KB;
        const int64_t qstride = sm90 ? 512 : 4;
        for (int64_t k = 0; k < K; ++k) {  // e4m3(e2m1 * scale * 2^-3): the product is exact in float32
          const float scale = e4m3[wsrow[qstride * (k / 64) + (k / 16) % 4]];
          wrow[k] = FloatToE4m3(kE2m1[wrow[k]] * scale * kFp8WeightPrescale);
        }
      }
      const float mul = al[g] * kFp8WeightUndo;
      for (int64_t r = start; r < end; ++r) {
        float acc = 0.f;
        for (int64_t c = 0; c < KC; ++c) {
          float part = 0.f;
          for (int s = 0; s < 128; ++s)
            part += e4m3[a8[r * K + 128 * c + s]] * e4m3[w8[128 * c + w_index[s]]];
          acc = std::fma(part, xs[c * p.M + r], acc);
        }
        const float v = acc * mul;
        if (out_f32) of[r * N + n] = v;
        else ob[r * N + n] = FloatToBf16(v);
      }
    }
  });
}

ffi::Error GroupedGemmCpu(ffi::AnyBuffer lhs, ffi::AnyBuffer lhs_scales, U8Buffer3 rhs_data,
                          ffi::AnyBuffer rhs_scales, F32Buffer1 alpha, S32Buffer1 group_sizes,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<U8Buffer1> workspace,
                          jax_nvfp4::GemmAttrs attrs) {
  // The kernel configuration gets the decoder's checks (a compiled configuration; its family states
  // the mode) and then only the mode is used.
  jax_nvfp4::GroupedGemmParams p;
  if (ffi::Error err = jax_nvfp4::DecodeGroupedGemm(lhs, lhs_scales, rhs_data, rhs_scales, alpha, group_sizes, out,
                                                    workspace, attrs, &p);
      err.failure())
    return err;
  if (p.fp8) Fp8GemmCpu(p, workspace->typed_data());
  else ExactGemmCpu(p, workspace->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4GroupedGemmCpu, GroupedGemmCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // lhs
                                  .Arg<ffi::AnyBuffer>()  // lhs_scales
                                  .Arg<U8Buffer3>()       // rhs_data
                                  .Arg<ffi::AnyBuffer>()  // rhs_scales
                                  .Arg<F32Buffer1>()      // alpha
                                  .Arg<S32Buffer1>()      // group_sizes
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<U8Buffer1>()       // workspace (CPU: one row's codes)
                                  .Attrs<jax_nvfp4::GemmAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4GroupedGemmGluCpu, GroupedGemmGluCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // lhs
                                  .Arg<ffi::AnyBuffer>()  // lhs_scales
                                  .Arg<U8Buffer3>()       // rhs_data: gate/up-paired rows
                                  .Arg<ffi::AnyBuffer>()  // rhs_scales
                                  .Arg<F32Buffer1>()      // alpha [2G]
                                  .Arg<S32Buffer1>()      // group_sizes
                                  .Arg<F32Buffer1>()      // row_scale [M] or [0]
                                  .Ret<ffi::AnyBuffer>()  // out [M, N/2]
                                  .Ret<U8Buffer1>()       // workspace (CPU: a gate row's and an up row's codes)
                                  .Attrs<jax_nvfp4::GluAttrs>());

