// Fragment extraction from the sm90 load-time weight layout (jax_nvfp4/layout.py), shared by the
// v1 (mma.sync) and v2 (wgmma) kernels: both use the same m16k16 A-fragment register mapping; and
// the bf16x2 multiply and byte permute both kernels use.
#pragma once

#include <cstdint>

namespace jax_nvfp4 {

// The four A-fragment registers of one k16 block from one 32-bit word of the sm90 layout (bits
// pre-placed at load time), each a bf16x2 of (e2m1 * 2^-126), sign kept: 11 integer ops for 4
// registers, against ~21 from the checkpoint layout.
//   a0 = (row g, k 2t..2t+1), a1 = (row g+8, same k), a2 = (row g, k 2t+8..), a3 = (row g+8, k 2t+8..)
//
// JAX_NVFP4_DIAG_CONV (diagnostic builds only; wrong results, for timing): >= 1 replaces the
// unpacking by one LOP3 per register (-7 integer ops per word) to measure its marginal cost; 2 also
// drops the block-scale multiplies in the kernels (docs/perf-notes.md, session 8, next steps).
#ifndef JAX_NVFP4_DIAG_CONV
#define JAX_NVFP4_DIAG_CONV 0
#endif
__device__ __forceinline__ void e2m1_sm90_word(uint32_t w, uint32_t& a0, uint32_t& a1, uint32_t& a2, uint32_t& a3) {
  constexpr uint32_t M = 0x81C081C0u;
#if JAX_NVFP4_DIAG_CONV == 0
  a0 = w & M;
  a1 = (w << 3) & M;
  a2 = (w << 6) & M;
  a3 = ((w << 1) & 0x80008000u) | ((w >> 5) & 0x01000100u) | ((w >> 4) & 0x00C000C0u);
#else
  a0 = w & M;
  a1 = w & 0x40384038u;
  a2 = w & 0x06070607u;
  a3 = w & 0x38003800u;
#endif
}

// Byte permute (PTX prmt.b32): byte i of the result is byte (sel >> 4i) & 7 of the eight bytes
// {a (bytes 0-3), b (bytes 4-7)}.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// The block-scale multiply of one fragment register (JAX_NVFP4_DIAG_CONV == 2: a stand-in LOP3).
__device__ __forceinline__ uint32_t e2m1_scale_mul(uint32_t a, uint32_t scale) {
#if JAX_NVFP4_DIAG_CONV < 2
  return bf16x2_mul(a, scale);
#else
  return a ^ scale;
#endif
}

}  // namespace jax_nvfp4
