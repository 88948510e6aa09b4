// The weight operand of the FP8 kernel on NVFP4 weights (csrc/grouped_gemm_fp8_sm90.cu): its stage
// layout (F8Cfg), the e4m3 register-A wgmma (F8Ops, wgmma_fp8) and the consumer's Operands class
// (E2m1RegisterA, csrc/fp8_consumer_sm90.cuh), which decodes a stage's e2m1 codes and block scales
// into A fragments. The decoder is a template parameter (CheckpointDecode, the kernel's: checkpoint
// layout codes through the product table, csrc/e2m1_e4m3_decode.cuh), so that the decode-and-MMA
// microbenchmark (tools/lab/decode_mma_microbench.cu) times this very pipeline with other decoders.
// Included after csrc/wgmma_sm90_common.cuh and csrc/fp8_consumer_sm90.cuh (internal linkage).
#pragma once

#include <cstdint>
#include <utility>

#include <cuda_runtime.h>

#include <cute/arch/mma_sm90_gmma.hpp>

#include "csrc/e2m1_e4m3_decode.cuh"
#include "csrc/fp8_consumer_sm90.cuh"
#include "csrc/wgmma_sm90_common.cuh"

namespace jax_nvfp4 {
namespace {

namespace gmma = cute::SM90::GMMA;

constexpr int kE4m3TableBytes = 256 * 8;  // e4m3 product table: 8 bytes per scale byte

// A stage: the tokens' e4m3 box, the weights' codes and block scales, the tokens' chunk scales;
// after the stages the product table, the barriers and the schedule ring.
template <int BTMAX, int STAGES>
struct F8Cfg {
  static constexpr int kActOff = 0;                        // e4m3 [BTMAX][128], 128B swizzle
  static constexpr int kWOff = BTMAX * kFp8BK;                // u8 [128][64] packed e2m1 (checkpoint order)
  static constexpr int kSOff = kWOff + kRowsW * kFp8BK / 2;   // u8 [128][8] e4m3 block scales
  static constexpr int kXsOff = kSOff + kRowsW * 8;        // f32 [BTMAX] chunk scales of the tile's tokens
  static constexpr int kStage = (kXsOff + BTMAX * 4 + 1023) / 1024 * 1024;  // 128B swizzle: 1024B-aligned tiles
  static constexpr int kTableOff = STAGES * kStage;
  static constexpr int kBarOff = kTableOff + kE4m3TableBytes;  // full[], empty[]
  static constexpr int kTileOff = kBarOff + 2 * STAGES * 8;  // the schedule ring (TileRing)
  static constexpr int kSmem = kTileOff + kTileRingBytes + 1024;  // + slack for 1024B alignment
  static_assert(kSmem <= 232448, "shared memory");
  static_assert(BTMAX % kFp8BoxT == 0 && BTMAX <= 128, "token tile");
};

// A decoder: one 32-bit word of 8 e2m1 codes and its block's product-table entry -> two A-fragment
// registers of 4 e4m3 each. kTable: whether it reads the table (the stage's block scales).
struct CheckpointDecode {
  static constexpr bool kTable = true;
  static __device__ __forceinline__ void word(uint32_t w, uint2 table_entry, uint32_t& lo, uint32_t& hi) {
    e2m1x8_to_e4m3(w, table_entry, lo, hi);
  }
};

// WGMMA m64nNk32 RS, e4m3 x e4m3 -> f32, both operands K-major.
template <int NN>
struct F8Ops;
template <>
struct F8Ops<32> {
  using RS = gmma::MMA_64x32x32_F32E4M3E4M3_RS_TN<>;
};
template <>
struct F8Ops<64> {
  using RS = gmma::MMA_64x64x32_F32E4M3E4M3_RS_TN<>;
};
template <>
struct F8Ops<128> {
  using RS = gmma::MMA_64x128x32_F32E4M3E4M3_RS_TN<>;
};

template <int NN, typename Acc, size_t... I>
__device__ __forceinline__ void wgmma_fp8(const uint32_t (&a)[4], uint64_t desc, Acc& acc, gmma::ScaleOut sc,
                                          std::index_sequence<I...>) {
  F8Ops<NN>::RS::fma(a[0], a[1], a[2], a[3], desc, acc[I]..., sc);
}

// The consumer's operands (csrc/fp8_consumer_sm90.cuh, consumer_mainloop): A, the weights, from registers
// decoded from the stage's e2m1 codes and block scales (rows r0 and r0 + 8, k 32 t4 .. 32 t4 + 31 of the
// chunk, t4 = lane % 4); B, the tokens, by descriptor.
template <int BTMAX, int STAGES, typename Decode = CheckpointDecode>
struct E2m1RegisterA {
  using C = F8Cfg<BTMAX, STAGES>;
  static constexpr bool kRegisterA = true;
  struct Frag {
    uint32_t r[4][4];  // [k32 step][A fragment register]
  };
  struct Desc {
    uint64_t b[4];
  };
  int r0, t4;
  uint32_t base, table;
  uint32_t desc_lo0;  // the token descriptor's low word at stage 0

  __device__ __forceinline__ E2m1RegisterA(uint8_t* smem, int r0_, int /*wg*/)
      : r0(r0_),
        t4(threadIdx.x & 3),
        base(smem_u32(smem)),
        table(base + C::kTableOff),
        desc_lo0(static_cast<uint32_t>(smem_desc_sw128(base + C::kActOff))) {}

  __device__ __forceinline__ void load(int st, Frag& f) const {
    const uint32_t sb = base + st * C::kStage;
    const uint4 wa = lds128(sb + C::kWOff + r0 * 64 + t4 * 16);
    const uint4 wb = lds128(sb + C::kWOff + (r0 + 8) * 64 + t4 * 16);
    uint2 ta[2] = {}, tb[2] = {};
    if constexpr (Decode::kTable) {
      const uint32_t sa = lds_u16(sb + C::kSOff + r0 * 8 + 2 * t4);        // blocks 2 t4, 2 t4 + 1
      const uint32_t sc = lds_u16(sb + C::kSOff + (r0 + 8) * 8 + 2 * t4);
      ta[0] = lds64(table + (sa & 0xFFu) * 8);
      ta[1] = lds64(table + (sa >> 8) * 8);
      tb[0] = lds64(table + (sc & 0xFFu) * 8);
      tb[1] = lds64(table + (sc >> 8) * 8);
    }
    const uint32_t wva[4] = {wa.x, wa.y, wa.z, wa.w};
    const uint32_t wvb[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // word j: k 32 t4 + 8 j .. + 7, block 2 t4 + j / 2
      Decode::word(wva[j], ta[j >> 1], f.r[j][0], f.r[j][2]);
      Decode::word(wvb[j], tb[j >> 1], f.r[j][1], f.r[j][3]);
    }
  }
  __device__ __forceinline__ Desc descriptors(int s, Frag& f) const {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) cute::warpgroup_fence_operand(f.r[j][i]);
    Desc d;
    const uint32_t dlo = desc_lo0 + static_cast<uint32_t>(s) * (C::kStage >> 4);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      d.b[j] = (smem_desc_sw128(0) & 0xFFFFFFFF00000000ull) | (dlo + j * 2);  // + 32 bytes per k32 step
      fence_operand(d.b[j]);
    }
    return d;
  }
  template <int NN, typename Acc>
  __device__ __forceinline__ void mma(const Frag& f, const Desc& d, int j, Acc& part, gmma::ScaleOut sc) const {
    wgmma_fp8<NN>(f.r[j], d.b[j], part, sc, std::make_index_sequence<NN / 2>{});
  }
  // the tokens' chunk scales, in the stage
  __device__ __forceinline__ uint32_t scales(int s) const { return base + s * C::kStage + C::kXsOff + 8 * t4; }
};

}  // namespace
}  // namespace jax_nvfp4
