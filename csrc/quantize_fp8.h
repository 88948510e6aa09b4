// The FP8 mode's activation quantizer ("jax_nvfp4_quantize_fp8"): rows of x to e4m3 codes with
// one power-of-two float32 scale per row and 128-wide k chunk, the codes written in the order the
// FP8 kernel reads them (jax_nvfp4.ops.fp8.to_kernel_k_order), in one pass over x. x is float (bf16,
// float16, float32) or NVFP4 (packed e2m1 codes and e4m3 block scales, checkpoint layout: the
// values e2m1 * block scale are quantized, the global scale is the caller's).
//
// The per-chunk arithmetic is plain C++ shared by the CPU handler (ffi/quantize_fp8_cpu.cc) and the
// CUDA kernel (csrc/quantize_fp8.cu). It is jax_nvfp4.ops.fp8.quantize_activations_fp8 in integer
// operations: the scale exponent from the chunk amax's float32 bits, and each code as the single
// round-to-nearest-even of the exact x * 2^-p (no float arithmetic touches a subnormal, so the
// bytes do not depend on a flush-to-zero mode).
#pragma once

#include <cstdint>
#include <cstring>

#include "csrc/float_bits.h"

namespace jax_nvfp4 {

enum class Fp8InputKind : int { kBf16 = 0, kF16 = 1, kF32 = 2, kNvfp4 = 3 };

struct QuantizeFp8Params {
  const void* x = nullptr;             // [M, K] of kind, or (kNvfp4) uint8 [M, K/2] packed codes
  const uint8_t* block_scales = nullptr;  // kNvfp4: e4m3 [M, K/16] (checkpoint layout), else nullptr
  Fp8InputKind kind = Fp8InputKind::kBf16;
  int64_t M = 0, K = 0;
  uint8_t* codes = nullptr;            // e4m3 [M, K], kernel k order
  float* scales = nullptr;             // [M, K/128], or [K/128, M] with scales_transposed
  bool scales_transposed = false;
};

namespace fp8q {

constexpr int kChunk = 128;

JAX_NVFP4_HD int BitLength(uint32_t v) {  // v > 0
#if defined(__CUDA_ARCH__)
  return 32 - __clz(v);
#else
  return 32 - __builtin_clz(v);
#endif
}

// float32 bits of a bf16 / float16 value (exact conversions, subnormals kept).
JAX_NVFP4_HD uint32_t BitsFromBf16(uint16_t h) { return static_cast<uint32_t>(h) << 16; }
JAX_NVFP4_HD uint32_t BitsFromF16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1Fu, f = h & 0x3FFu;
  if (e == 0x1Fu) return sign | 0x7F800000u | (f << 13);  // Inf, NaN (payload kept)
  if (e == 0) {
    if (f == 0) return sign;
    e = 113;  // normalize the subnormal f * 2^-24: exponent field 127 - 14 for the leading bit at 10
    while (!(f & 0x400u)) {
      f <<= 1;
      --e;
    }
    f &= 0x3FFu;
    return sign | (e << 23) | (f << 13);
  }
  return sign | ((e + 112u) << 23) | (f << 13);
}

// float32 value of an e2m1 code (low nibble; code 8 is -0): as jax_nvfp4.maths.formats.decode_e2m1, the
// magnitude bits at float32 bits 24..22 plus an exponent bias of 126 (codes 0 and 1: mag * 0.5).
JAX_NVFP4_HD float E2m1Value(uint32_t code) {
  const uint32_t mag = code & 7u;
  const uint32_t bits = mag > 1u ? (mag << 22) + 0x3F000000u : mag * 0x3F000000u;
  return BitsF32(bits | (code & 8u) << 28);
}

// float32 bits of e2m1(code) * float(e4m3 scale): the product is exact and never subnormal (at most
// 6 significant bits, >= 0.5 * 2^-9), so no flush-to-zero mode changes it; a NaN scale gives NaN.
JAX_NVFP4_HD uint32_t BitsFromNvfp4(uint32_t code, float scale) { return F32Bits(E2m1Value(code) * scale); }

// The scale exponent of a chunk from its amax's float32 bits (sign clear): p = max(E - 135 +
// (F > 0x600000), -126), the smallest power of two with amax / 2^p <= 448; *nonfinite when the
// amax is Inf or NaN (p = 0 then).
JAX_NVFP4_HD int ScaleExponent(uint32_t amax, bool* nonfinite) {
  *nonfinite = amax >= 0x7F800000u;
  if (*nonfinite) return 0;
  const int p = static_cast<int>((amax + 0x1FFFFFu) >> 23) - 135;
  return p < -126 ? -126 : p;
}

// float32 2^e for e in [-126, 127].
JAX_NVFP4_HD float Pow2(int e) { return BitsF32(static_cast<uint32_t>(e + 127) << 23); }

// e4m3fn byte of x * 2^-p, rounded to nearest even from the exact value (x finite, given by its
// float32 bits; |x| * 2^-p <= 448, as the chunk's exponent guarantees).
JAX_NVFP4_HD uint8_t E4m3Scaled(uint32_t bits, int p) {
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag == 0) return static_cast<uint8_t>(sign);
  const uint32_t e = mag >> 23;
  const uint32_t m = e ? (mag & 0x7FFFFFu) | 0x800000u : mag;  // |x| = m * 2^q
  const int q = e ? static_cast<int>(e) - 150 : -149;
  const int ey = BitLength(m) - 1 + q - p;   // the exponent of |y| = m * 2^(q - p)
  const int eq = ey > -6 ? ey : -6;          // e4m3's step there is 2^(eq - 3)
  const int shift = q - p - (eq - 3);        // |y| / step = m * 2^shift
  uint32_t n;
  if (shift >= 0) {
    n = m << shift;                          // shift <= 3 here, m < 16
  } else if (shift < -31) {
    n = 0;                                   // m < 2^24: below half a step
  } else {
    const int r = -shift;
    n = m >> r;
    const uint32_t rem = m & ((1u << r) - 1u), half = 1u << (r - 1);
    n += (rem > half || (rem == half && (n & 1u))) ? 1u : 0u;
  }
  // (eq + 6) * 8 + n: n in [8, 16] above the subnormals (16 carries into the next exponent),
  // in [0, 8] among them (8: the smallest normal)
  return static_cast<uint8_t>(sign | static_cast<uint32_t>((eq + 6) * 8 + static_cast<int>(n)));
}

// Position, within a 128-wide chunk in the kernel k order, of logical k (to_kernel_k_order:
// position 32 j + 16 h + 4 t + i holds k = 32 t + 8 j + 4 h + i).
JAX_NVFP4_HD int KernelPosition(int k) {
  const int t = k >> 5, j = (k >> 3) & 3, h = (k >> 2) & 1, i = k & 3;
  return 32 * j + 16 * h + 4 * t + i;
}

// float32 bits of x[r, k] (host loop; the kernel reads words).
inline uint32_t ValueBits(const QuantizeFp8Params& p, int64_t r, int64_t k) {
  switch (p.kind) {
    case Fp8InputKind::kBf16: return BitsFromBf16(static_cast<const uint16_t*>(p.x)[r * p.K + k]);
    case Fp8InputKind::kF16: return BitsFromF16(static_cast<const uint16_t*>(p.x)[r * p.K + k]);
    case Fp8InputKind::kF32: {
      uint32_t b;
      memcpy(&b, static_cast<const float*>(p.x) + r * p.K + k, 4);
      return b;
    }
    case Fp8InputKind::kNvfp4: {
      const uint8_t byte = static_cast<const uint8_t*>(p.x)[r * (p.K / 2) + k / 2];
      return BitsFromNvfp4((k & 1) ? byte >> 4 : byte & 0xFu, E4m3Value(p.block_scales[r * (p.K / 16) + k / 16]));
    }
  }
  return 0;
}

}  // namespace fp8q

// A bad argument's message, or nullptr (shared by the handlers).
inline const char* QuantizeFp8CheckParams(const QuantizeFp8Params& p) {
  if (p.M < 0 || p.K < 0) return "negative sizes";
  if (p.K == 0 || p.K % fp8q::kChunk) return "K must be a positive multiple of 128";
  if (p.kind == Fp8InputKind::kNvfp4 && p.M > 0 && p.block_scales == nullptr) return "NVFP4 x without block_scales";
  return nullptr;
}

}  // namespace jax_nvfp4

#if defined(JAX_NVFP4_WITH_CUDA_DECLS) || defined(__CUDACC__)
#include <cuda_runtime.h>
namespace jax_nvfp4 {
// Enqueues the quantizer on stream (csrc/quantize_fp8.cu); checks the launch.
cudaError_t LaunchQuantizeFp8(const QuantizeFp8Params& p, cudaStream_t stream);
}  // namespace jax_nvfp4
#endif
