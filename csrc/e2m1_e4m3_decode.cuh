// The FP8 mode's weight decode (csrc/grouped_gemm_fp8_sm90.cu; the decode microbenchmark
// tools/lab/decode_mma_microbench.cu): an e2m1 code times its block scale, rounded to e4m3, by byte
// permutes of a per-scale product table (the kernel file's header comment gives the scheme).
#pragma once

#include <cstdint>

#include <cuda_fp8.h>

#include "csrc/e2m1_sm90_layout.cuh"  // prmt
#include "csrc/float_bits.h"          // E4m3Value
#include "csrc/gemm_attributes.h"      // kFp8WeightPrescale

namespace jax_nvfp4 {

// The 8-byte product table of scale byte b: byte m = e4m3_rn(e2m1(m) * s * 2^-3), m = 0..7 (a NaN
// scale gives NaN bytes, as e2m1 * NaN does in the exact kernels).
__device__ __forceinline__ uint2 product_table(uint32_t b) {
  const float s = E4m3Value(b) * kFp8WeightPrescale;  // exact
  const float mags[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  uint32_t h[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = make_float2(mags[2 * i] * s, mags[2 * i + 1] * s);  // exact products
    h[i] = __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3);      // .x -> low byte
  }
  return make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
}

// 8 codes (one 32-bit word, element i in nibble i) -> two A-fragment registers of e4m3: lo = codes
// 0..3, hi = codes 4..7, with tbl the block's product table. The magnitudes index the table (the
// selector's high nibble bit is 0: plain byte select); the signs come from a permute of w and w << 4
// in sign-replicate mode (bit 3 of each selector nibble: the byte becomes 0x00 or 0xFF by the msb of
// the selected byte, which is the code's sign bit) and flip the e4m3 sign bit.
__device__ __forceinline__ void e2m1x8_to_e4m3(uint32_t w, uint2 tbl, uint32_t& lo, uint32_t& hi) {
  const uint32_t m = w & 0x77777777u;
  const uint32_t w4 = w << 4;
  const uint32_t mlo = prmt(tbl.x, tbl.y, m);
  const uint32_t mhi = prmt(tbl.x, tbl.y, m >> 16);
  // byte i of the result replicates the sign of code i: codes 0, 2 are bit 7 of bytes 0, 1 of w << 4
  // (selector 4, 5), codes 1, 3 bit 7 of bytes 0, 1 of w (0, 1); codes 4..7 likewise from bytes 2, 3
  const uint32_t slo = prmt(w, w4, 0x9D8Cu);
  const uint32_t shi = prmt(w, w4, 0xBFAEu);
  lo = mlo ^ (slo & 0x80808080u);
  hi = mhi ^ (shi & 0x80808080u);
}

}  // namespace jax_nvfp4
