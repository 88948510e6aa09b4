// e2m1 decoding shared by the mma.sync and wgmma kernels: fragment extraction from the sm90
// load-time weight layout (jax_nvfp4/maths/layout.py, constants in csrc/gemm_contract.h; both kernels use
// the same m16k16 A-fragment register mapping), the bf16x2 multiply and the byte permute.
#pragma once

#include <cstdint>

namespace jax_nvfp4 {

// The four A-fragment registers of one k16 block from one 32-bit word of the sm90 layout (bits
// pre-placed at load time), each a bf16x2 of (e2m1 * 2^-126), sign kept: 11 integer ops for 4
// registers, against ~21 from the checkpoint layout.
//   a0 = (row g, k 2t..2t+1), a1 = (row g+8, same k), a2 = (row g, k 2t+8..), a3 = (row g+8, k 2t+8..)

__device__ __forceinline__ void e2m1_sm90_word(uint32_t w, uint32_t& a0, uint32_t& a1, uint32_t& a2, uint32_t& a3) {
  constexpr uint32_t M = 0x81C081C0u;
  a0 = w & M;
  a1 = (w << 3) & M;
  a2 = (w << 6) & M;
  a3 = ((w << 1) & 0x80008000u) | ((w >> 5) & 0x01000100u) | ((w >> 4) & 0x00C000C0u);
}

// Byte permute (PTX prmt.b32): byte i of the result is byte (sel >> 4i) & 7 of the eight bytes
// {a (bytes 0-3), b (bytes 4-7)}.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// a * b per bf16 half, rounded to nearest even, subnormals kept. sm_80 has no bf16 multiply;
// fma with a -0 addend rounds once and keeps the sign of zero products, so it is the same
// operation (cuda_bf16.h's __hmul2 does the same there).
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
#else
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
#endif
  return d;
}

// The block-scale multiply of one fragment register.
__device__ __forceinline__ uint32_t e2m1_scale_mul(uint32_t a, uint32_t scale) { return bf16x2_mul(a, scale); }

}  // namespace jax_nvfp4
