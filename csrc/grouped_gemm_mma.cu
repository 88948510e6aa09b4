// Grouped NVFP4 GEMM with mma.sync: the portable kernel (sm_80 and newer), and on sm_90 its
// warp-specialized variant for decode with sm90 weights.
//
// No tensor core before Blackwell multiplies FP4, but every e2m1 x e4m3 product is exact in bf16,
// so the kernel dequantises in registers and runs bf16 mma.sync (CuTe atom
// SM80_16x8x16_F32BF16BF16F32_TN) with f32 accumulation. The operands are swapped (D^T = W X^T):
// weight rows are the MMA "M" side (128 per CTA) and tokens the "N" side (16/32/64/128 per CTA), so
// that a decode tile of a few tokens still fills the MMA's large side.
//
// k permutation. A k-tile is 64 wide. Quad thread t (lane % 4) owns physical k 16t..16t+15, i.e.
// exactly one 16-element scale group, for every row it touches: 8 packed bytes (two u32 words
// q0, q1) of a weight row. The MMA sums over k, so any bijection between the logical k of the
// mma fragment and the physical k works as long as A and B use the same one. We use
//   k-block kb = 2h + j (h = 0/1 picks q_h, j = 0/1):
//     logical (2t, 2t+1)   <- physical nibbles (3 - 2j, 7 - 2j) of q_h  (shift s = 2j)
//     logical (2t+8, 2t+9) <- physical nibbles (2 - 2j, 6 - 2j) of q_h  (shift s = 2j + 1)
// so that a pair of nibbles (i, i+4) of one u32 turns into one bf16x2 with three integer ops:
//   v = q << 4s;  bits = (v & 0x80008000) | ((v >> 6) & 0x01C001C0)
// which is the bf16 value e2m1 * 2^-126 (sign kept; the e=0 case is a bf16 subnormal, which the
// bf16 multiply handles), and then one bf16x2 multiply by bf16(scale * 2^119) gives the exact
// value e2m1 * scale * 2^-7 (range [2^-17, 21]: always a normal bf16, so exact). The 2^-7 is
// undone in the epilogue (x 2^7 per fp4 operand, exact power of two).
// bf16 activations (W4A16) pick the same physical k with one prmt per pair.
//
// Weights in the sm90 load-time layout (jax_nvfp4/maths/layout.py; W4A16 only, template SM90L) keep the
// natural k order instead: each thread reads its m16 tile's four fragment words with one 16-byte
// shared load, extracts them with e2m1_sm90_word (csrc/e2m1_sm90_layout.cuh), gets the other
// three k-blocks' scales from its quad by shuffles, and reads the activation pairs directly. The
// layout's scales come as one contiguous 512-byte [128 rows][4] record per k-tile.
//
// Schedule (no host sync): a setup kernel turns the device group sizes into clamped row offsets
// and per-group token-tile prefix sums in the workspace; the GEMM grid is
// (ceil(N/128), min(ceil(M/BT) + G, 65535)) and each CTA maps its tile index to (group, tile)
// with a block-wide count over the prefix sums, looping by gridDim.y; the setup kernel's other
// blocks zero the rows past the last group.
//
// Configurations: the KernelFamily::kMma and kMmaWs entries of kKernelConfigs
// (csrc/gemm_contract.h); the launcher instantiates each of them for each activation type and
// weight layout.

#include "csrc/grouped_gemm.h"
#include "csrc/grouped_gemm_schedule.cuh"
#include "csrc/e2m1_sm90_layout.cuh"
#include "csrc/epilogue.cuh"
#include "csrc/mbarrier_sm90.cuh"

#include <atomic>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>

namespace jax_nvfp4 {
namespace {

constexpr int kBW = 128;          // weight rows (output columns) per CTA
constexpr int kBK = 64;           // k per pipeline stage
constexpr int kWarpsW = 4;        // warps along the weight rows (32 rows each)
constexpr int kWM = kBW / kWarpsW;
constexpr int kMT = kWM / 16;     // m16 tiles per warp
constexpr int kActPitchBf16 = 144;  // bytes per token row of a bf16 activation stage (128 + 16 pad)

// Workspace layout: csrc/grouped_gemm_schedule.cuh.

template <int BT, int WARPS_T, bool A_FP4>
struct Cfg {
  static constexpr int kThreads = 32 * kWarpsW * WARPS_T;
  static constexpr int kWT = BT / WARPS_T;  // tokens per warp
  static constexpr int kNT = kWT / 8;       // n8 tiles per warp
  static constexpr int kWOff = 0;
  static constexpr int kWSOff = kBW * 32;
  static constexpr int kAOff = kWSOff + kBW * 4;
  static constexpr int kABytes = A_FP4 ? BT * 32 : BT * kActPitchBf16;
  static constexpr int kASOff = kAOff + kABytes;
  static constexpr int kStageRaw = kASOff + (A_FP4 ? BT * 4 : 0);
  static constexpr int kStage = (kStageRaw + 127) / 128 * 128;
  static_assert(kNT >= 1 && kWT % 8 == 0, "token tile per warp must be a multiple of 8");
};

struct KParams {
  const uint8_t* lhs;
  const uint8_t* lhs_scales;
  const uint8_t* rhs;
  const uint8_t* rhs_scales;
  const float* alpha;
  void* out;
  const int* ws;
  int64_t M, N, K, G;
  bool scales_vec;  // K/16 % 4 == 0 and scale pointers 4-byte aligned: 4-byte cp.async for scales
  bool out_f32;
  bool glu;  // SwiGLU epilogue (alpha [G, 2], out [M, N/2], optional row_scale)
  float glu_limit;
  const float* row_scale;
};

using CpAsync16 = cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>;
using CpAsync4 = cute::SM80_CP_ASYNC_CACHEALWAYS_ZFILL<uint32_t>;
using Mma = cute::SM80_16x8x16_F32BF16BF16F32_TN;

__device__ __forceinline__ void cp16(uint8_t* dst, const uint8_t* src, bool pred) {
  CpAsync16::copy(*reinterpret_cast<const cute::uint128_t*>(src), *reinterpret_cast<cute::uint128_t*>(dst), pred);
}
__device__ __forceinline__ void cp4(uint8_t* dst, const uint8_t* src, bool pred) {
  CpAsync4::copy(*reinterpret_cast<const uint32_t*>(src), *reinterpret_cast<uint32_t*>(dst), pred);
}

// bf16x2 of e2m1 nibbles (3-s, 7-s) of q, as value * 2^-126.
template <int S>
__device__ __forceinline__ uint32_t e2m1_pair(uint32_t q) {
  const uint32_t v = q << (4 * S);
  return (v & 0x80008000u) | ((v >> 6) & 0x01C001C0u);
}

// e4m3 byte -> bf16x2 (duplicated) of scale * 2^119 (exact; 448 * 2^119 < bf16 max).
__device__ __forceinline__ uint32_t scale_pair(uint8_t b) {
  __half_raw hr = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
  const float f = __half2float(__half(hr)) * Pow2f(kExactScaleExponent);
  const __nv_bfloat16 bf = __float2bfloat16_rn(f);
  const uint32_t bits = static_cast<uint32_t>(__bfloat16_as_ushort(bf));
  return bits | (bits << 16);
}

// ---------------------------------------------------------------------------------------------
// The pieces every variant is built from. The variants (template flags of grouped_gemm_kernel):
//   checkpoint weights, bf16 activations (W4A16)      run_multistage<A_FP4 = false, SM90L = false>
//   checkpoint weights, packed e2m1 activations (W4A4) run_multistage<A_FP4 = true,  SM90L = false>
//   sm90 weights, bf16 activations                    run_multistage<A_FP4 = false, SM90L = true>
//   sm90 weights, bf16 activations, warp-specialized  run_warp_specialized (the mma_ws family)

// This thread's place in the CTA: weight-row warp wi (32 rows each), token warp wj, and its mma
// fragment coordinates g8 (groupID) and t4 (thread in group).
struct Lanes {
  int tid, lane, warp, wi, wj, g8, t4;
};
__device__ __forceinline__ Lanes this_thread_lanes() {
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  return Lanes{tid, lane, warp, warp % kWarpsW, warp / kWarpsW, lane >> 2, lane & 3};
}

// The schedule the setup kernel wrote into the workspace (csrc/grouped_gemm_schedule.cuh), read
// after waiting for it.
struct Schedule {
  const int* prefix;  // per-group token-tile prefix sums [G + 1]
  const int* starts;  // group row starts [G]
  const int* ends;    // group row ends [G]
  int total_tiles;
};
__device__ __forceinline__ Schedule wait_for_schedule(const KParams& p) {
  Schedule s{p.ws + kWsPrefix, p.ws + ws_start_off(p.G), p.ws + ws_end_off(p.G), 0};
  pdl_wait();  // the setup kernel's workspace (a no-op unless launched as its programmatic dependent)
  s.total_tiles = p.ws[kWsTotalTiles];
  return s;
}

// The group of token tile `tile`: g = #{j in 1..G : prefix[j] <= tile}. prefix is nondecreasing, so a
// round that is not full ends the count. Block-wide: __syncthreads_count counts threads, so each
// thread tests one entry per round (the count is block-uniform).
template <int NTH>
__device__ __forceinline__ int tile_group_block(const int* prefix, int64_t G, int tile, int tid) {
  int g = 0;
  for (int64_t j0 = 1; j0 <= G; j0 += NTH) {
    const int64_t j = j0 + tid;
    const int c = __syncthreads_count(j <= G && prefix[j] <= tile);
    g += c;
    if (c < NTH) break;
  }
  return g;
}
// The same count per warp, by ballots: no barrier ties the warp-specialized producer to the math
// warps, so it runs ahead into the next tile's stages.
__device__ __forceinline__ int tile_group_warp(const int* prefix, int64_t G, int tile, int lane) {
  int g = 0;
  for (int64_t j0 = 1; j0 <= G; j0 += 32) {
    const int64_t j = j0 + lane;
    const int c = __popc(__ballot_sync(0xffffffffu, j <= G && prefix[j] <= tile));
    g += c;
    if (c < 32) break;
  }
  return g;
}

// The rows [row0, rend) of token tile `tile` of group g (rend is the group's end: rows at or past
// it are outside the tile's group).
struct TileRows {
  int64_t row0, rend;
};
// The problem's sizes, read once per kernel: N, K, K/2 (packed bytes per row), K/16 (scales per row)
// and the k-tiles.
struct Dims {
  int64_t N, K, KH, KS;
  int KT;
};
__device__ __forceinline__ Dims problem_dims(const KParams& p) {
  return Dims{p.N, p.K, p.K / 2, p.K / 16, static_cast<int>((p.K + kBK - 1) / kBK)};
}

template <int BT>
__device__ __forceinline__ TileRows tile_rows(const Schedule& sch, int g, int tile) {
  return TileRows{sch.starts[g] + static_cast<int64_t>(tile - sch.prefix[g]) * BT, sch.ends[g]};
}

template <int MT, int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mt][nt][c] = 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Stage copies of the multistage variants (cp.async by every thread).

// One copy chunk of a thread: src is a valid address for every k-tile (past lim the copy zero-fills
// from src itself, offset 0, so the k loop needs no pointer select); lim: the k-tiles for which the
// chunk is in bounds (0: zero-fill; -1: this thread has no such chunk); dst: its stage offset.
struct Cp {
  const uint8_t* src;
  int lim;
  int dst;
};
__device__ __forceinline__ int k_tiles_in_bounds(int64_t rem) {
  return rem > 0 ? static_cast<int>((rem + kBK - 1) / kBK) : 0;
}

// A thread's copies of one tile's stages: the weight rows, their scales, the activation rows and
// (W4A4) their scales. The assignments are fixed for the whole tile and only the k offset moves, so
// the address and predicate arithmetic is done once per tile, not once per k-tile. Chunk counts that
// divide the thread count give every thread its chunks: the "no chunk" test is then compiled out.
template <int BT, int WARPS_T, bool A_FP4, bool SM90L>
struct StageLoader {
  using C = Cfg<BT, WARPS_T, A_FP4>;
  static constexpr int NTH = C::kThreads;
  static constexpr int kWCh = (kBW * 2 + NTH - 1) / NTH;
  static constexpr int kWSr = (kBW + NTH - 1) / NTH;
  static constexpr int kACh = A_FP4 ? (BT * 2 + NTH - 1) / NTH : (BT * 8 + NTH - 1) / NTH;
  static constexpr int kASr = A_FP4 ? (BT + NTH - 1) / NTH : 1;
  static constexpr bool kWAll = (kBW * 2) % NTH == 0, kWSAll = kBW % NTH == 0;
  static constexpr bool kAAll = (A_FP4 ? BT * 2 : BT * 8) % NTH == 0, kASAll = BT % NTH == 0;
  static constexpr int kWStep = SM90L ? 4096 : 32;  // global bytes per k-tile of one weight chunk
  static constexpr int kAStep = A_FP4 ? 32 : 128;   // global bytes per k-tile of one activation row

  Cp wcp[kWCh], wscp[kWSr], acp[kACh], ascp[kASr];
  int64_t KS;
  int kt_vec;  // k-tiles whose 4 scale bytes are fetched with one 4-byte cp.async

  __device__ __forceinline__ StageLoader(const KParams& p, const Dims& d, int tid, int g, int64_t n0,
                                         const TileRows& tr) {
    const int64_t N = d.N, K = d.K, KH = d.KH;
    KS = d.KS;
    const uint8_t* rhs_g = p.rhs + static_cast<int64_t>(g) * N * KH;
    const uint8_t* rhs_s_g = p.rhs_scales + static_cast<int64_t>(g) * N * KS;
#pragma unroll
    for (int j = 0; j < kWCh; ++j) {
      const int i = tid + j * NTH;
      const int row = i >> 1, c = i & 1;
      const int64_t n = n0 + row;
      const bool rv = n < N;
      // sm90 layout: the tile's 128 x 64 blocks are 4096 contiguous bytes each, one after another
      // (N % 128 == 0, so every row of the tile is valid); chunk i is bytes 16i.. of the block.
      if constexpr (SM90L) wcp[j].src = rhs_g + n0 * KH + i * 16;
      else wcp[j].src = rv ? rhs_g + n * KH + c * 16 : p.rhs;
      wcp[j].lim = i < kBW * 2 ? (rv ? k_tiles_in_bounds(K - c * 32) : 0) : -1;
      wcp[j].dst = C::kWOff + row * 32 + c * 16;
    }
#pragma unroll
    for (int j = 0; j < kWSr; ++j) {
      const int i = tid + j * NTH;
      const int64_t n = n0 + i;
      const bool rv = n < N;
      // sm90 layout: the stripe's k-tile kt scales are one 512-byte [128 rows][4] record at 512 kt
      if constexpr (SM90L) wscp[j].src = rhs_s_g + n0 * KS + i * 4;
      else wscp[j].src = rv ? rhs_s_g + n * KS : p.rhs_scales;
      wscp[j].lim = i < kBW ? (rv ? 1 : 0) : -1;
      wscp[j].dst = C::kWSOff + i * 4;
    }
#pragma unroll
    for (int j = 0; j < kACh; ++j) {
      const int i = tid + j * NTH;
      if constexpr (A_FP4) {
        const int row = i >> 1, c = i & 1;
        const int64_t r = tr.row0 + row;
        const bool rv = r < tr.rend;
        acp[j].src = rv ? p.lhs + r * KH + c * 16 : p.lhs;
        acp[j].lim = i < BT * 2 ? (rv ? k_tiles_in_bounds(K - c * 32) : 0) : -1;
        acp[j].dst = C::kAOff + row * 32 + c * 16;
      } else {
        const int row = i >> 3, c = i & 7;
        const int64_t r = tr.row0 + row;
        const bool rv = r < tr.rend;
        acp[j].src = rv ? p.lhs + (r * K + c * 8) * 2 : p.lhs;
        acp[j].lim = i < BT * 8 ? (rv ? k_tiles_in_bounds(K - c * 8) : 0) : -1;
        acp[j].dst = C::kAOff + row * kActPitchBf16 + c * 16;
      }
    }
#pragma unroll
    for (int j = 0; j < kASr; ++j) {
      const int i = tid + j * NTH;
      const int64_t r = tr.row0 + i;
      const bool rv = r < tr.rend;
      ascp[j].src = (A_FP4 && rv) ? p.lhs_scales + r * KS : p.lhs_scales;
      ascp[j].lim = (A_FP4 && i < BT) ? (rv ? 1 : 0) : -1;
      ascp[j].dst = C::kASOff + i * 4;
    }
    kt_vec = p.scales_vec ? static_cast<int>(KS / 4) : 0;
  }

  // A row's 4 scales of k-tile kt: at 4 kt (checkpoint), or in the 512-byte record kt of the stripe
  // (sm90 weight scales; SM90L kernels have no activation scales).
  __device__ __forceinline__ void load_scales(uint8_t* st, const Cp& cp, int kt, bool all) const {
    if (!all && cp.lim < 0) return;
    uint8_t* dst = st + cp.dst;
    if (kt < kt_vec) {
      const bool v = cp.lim > 0;
      cp4(dst, cp.src + (v ? (SM90L ? static_cast<int64_t>(kt) * 512 : kt * 4) : 0), v);
    } else {
      const int64_t kg0 = static_cast<int64_t>(kt) * 4;
      uint32_t v = 0;
      if (cp.lim > 0) {
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (kg0 + q < KS)
            v |= static_cast<uint32_t>(__ldg(cp.src + (SM90L ? static_cast<int64_t>(kt) * 512 : kg0) + q)) << (8 * q);
      }
      *reinterpret_cast<uint32_t*>(dst) = v;
    }
  }

  // Issues this thread's copies of k-tile kt into stage buffer st.
  __device__ __forceinline__ void load(uint8_t* st, int kt) const {
#pragma unroll
    for (int j = 0; j < kWCh; ++j) {
      if (!kWAll && wcp[j].lim < 0) continue;
      const bool v = kt < wcp[j].lim;
      cp16(st + wcp[j].dst, wcp[j].src + (v ? static_cast<int64_t>(kt) * kWStep : 0), v);
    }
#pragma unroll
    for (int j = 0; j < kWSr; ++j) load_scales(st, wscp[j], kt, kWSAll);
#pragma unroll
    for (int j = 0; j < kACh; ++j) {
      if (!kAAll && acp[j].lim < 0) continue;
      const bool v = kt < acp[j].lim;
      cp16(st + acp[j].dst, acp[j].src + (v ? static_cast<int64_t>(kt) * kAStep : 0), v);
    }
    if constexpr (A_FP4) {
#pragma unroll
      for (int j = 0; j < kASr; ++j) load_scales(st, ascp[j], kt, kASAll);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// The k-tile math: one stage in shared memory into the accumulators.

// The weight scales of this thread's rows rA and rA + 8 of each m16 tile, as bf16x2 factors.
__device__ __forceinline__ void weight_scale_pairs(const uint8_t* sWS, const Lanes& ln, uint32_t (&scA)[kMT],
                                                   uint32_t (&scB)[kMT]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    const int rA = ln.wi * kWM + mt * 16 + ln.g8;
    scA[mt] = scale_pair(sWS[rA * 4 + ln.t4]);
    scB[mt] = scale_pair(sWS[(rA + 8) * 4 + ln.t4]);
  }
}

// Checkpoint-layout weights in the permuted k order (top of this file): per half h of the thread's
// 8 weight bytes, the activation fragments of every n8 token tile (decoded e2m1 times its scale for
// W4A4, one prmt per pair for bf16), then per k-block j the weight fragments and their mma.sync.
template <int NT, int WT, bool A_FP4>
__device__ __forceinline__ void ktile_checkpoint(float (&acc)[kMT][NT][4], const uint8_t* sW, const uint8_t* sA,
                                                 const uint8_t* sAS, const uint32_t (&scA)[kMT],
                                                 const uint32_t (&scB)[kMT], const Lanes& ln) {
  uint32_t scT[NT];
  if constexpr (A_FP4) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) scT[nt] = scale_pair(sAS[(ln.wj * WT + nt * 8 + ln.g8) * 4 + ln.t4]);
  }
  uint2 wa[kMT], wb[kMT];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    const int rA = ln.wi * kWM + mt * 16 + ln.g8;
    wa[mt] = *reinterpret_cast<const uint2*>(sW + rA * 32 + 8 * ln.t4);
    wb[mt] = *reinterpret_cast<const uint2*>(sW + (rA + 8) * 32 + 8 * ln.t4);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t qa[kMT], qb[kMT];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      qa[mt] = h ? wa[mt].y : wa[mt].x;
      qb[mt] = h ? wb[mt].y : wb[mt].x;
    }
    uint32_t b0[NT][2], b1[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int c = ln.wj * WT + nt * 8 + ln.g8;
      if constexpr (A_FP4) {
        const uint32_t q = *reinterpret_cast<const uint32_t*>(sA + c * 32 + 8 * ln.t4 + 4 * h);
        b0[nt][0] = bf16x2_mul(e2m1_pair<0>(q), scT[nt]);
        b1[nt][0] = bf16x2_mul(e2m1_pair<1>(q), scT[nt]);
        b0[nt][1] = bf16x2_mul(e2m1_pair<2>(q), scT[nt]);
        b1[nt][1] = bf16x2_mul(e2m1_pair<3>(q), scT[nt]);
      } else {
        const uint4 w = *reinterpret_cast<const uint4*>(sA + c * kActPitchBf16 + 32 * ln.t4 + 16 * h);
        b0[nt][0] = prmt(w.y, w.w, 0x7632);
        b1[nt][0] = prmt(w.y, w.w, 0x5410);
        b0[nt][1] = prmt(w.x, w.z, 0x7632);
        b1[nt][1] = prmt(w.x, w.z, 0x5410);
      }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        uint32_t a0, a1, a2, a3;
        if (j == 0) {
          a0 = bf16x2_mul(e2m1_pair<0>(qa[mt]), scA[mt]);
          a1 = bf16x2_mul(e2m1_pair<0>(qb[mt]), scB[mt]);
          a2 = bf16x2_mul(e2m1_pair<1>(qa[mt]), scA[mt]);
          a3 = bf16x2_mul(e2m1_pair<1>(qb[mt]), scB[mt]);
        } else {
          a0 = bf16x2_mul(e2m1_pair<2>(qa[mt]), scA[mt]);
          a1 = bf16x2_mul(e2m1_pair<2>(qb[mt]), scB[mt]);
          a2 = bf16x2_mul(e2m1_pair<3>(qa[mt]), scA[mt]);
          a3 = bf16x2_mul(e2m1_pair<3>(qb[mt]), scB[mt]);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          float* d = acc[mt][nt];
          Mma::fma(d[0], d[1], d[2], d[3], a0, a1, a2, a3, b0[nt][j], b1[nt][j], d[0], d[1], d[2], d[3]);
        }
      }
    }
  }
}

// sm90-layout weights (jax_nvfp4/maths/layout.py) in the natural k order, k-block kb = physical k
// 16kb..16kb+15. The stage holds the 4096-byte layout block in its global byte order; m16 tile
// (2 wi + mt) of the block is 512 bytes, this lane's 4 words (k-blocks 0..3) 16 of them. Thread t4
// converted the scale of k-block t4 (weight_scale_pairs); the quad shares them by shuffles. NTL: the
// n8 token tiles that hold rows of the group (the rest of the NT accumulator tiles stay untouched).
template <int NT, int NTL, int WT>
__device__ __forceinline__ void ktile_sm90(float (&acc)[kMT][NT][4], const uint8_t* sW, const uint8_t* sA,
                                           const uint32_t (&scA)[kMT], const uint32_t (&scB)[kMT], const Lanes& ln) {
  uint4 q[kMT];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
    q[mt] = *reinterpret_cast<const uint4*>(sW + (ln.wi * (kWM / 16) + mt) * 512 + ln.lane * 16);
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    uint32_t b0[NTL], b1[NTL];  // natural k: (16kb + 2t, +1) and (16kb + 2t + 8, +9) of token g8
#pragma unroll
    for (int nt = 0; nt < NTL; ++nt) {
      const uint8_t* a = sA + (ln.wj * WT + nt * 8 + ln.g8) * kActPitchBf16 + kb * 32 + 4 * ln.t4;
      b0[nt] = *reinterpret_cast<const uint32_t*>(a);
      b1[nt] = *reinterpret_cast<const uint32_t*>(a + 16);
    }
    const int src = (ln.lane & ~3) | kb;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const uint32_t sa = __shfl_sync(0xffffffffu, scA[mt], src);
      const uint32_t sb = __shfl_sync(0xffffffffu, scB[mt], src);
      const uint32_t w = kb == 0 ? q[mt].x : kb == 1 ? q[mt].y : kb == 2 ? q[mt].z : q[mt].w;
      uint32_t a0, a1, a2, a3;
      e2m1_sm90_word(w, a0, a1, a2, a3);
      a0 = e2m1_scale_mul(a0, sa);
      a1 = e2m1_scale_mul(a1, sb);
      a2 = e2m1_scale_mul(a2, sa);
      a3 = e2m1_scale_mul(a3, sb);
#pragma unroll
      for (int nt = 0; nt < NTL; ++nt) {
        float* d = acc[mt][nt];
        Mma::fma(d[0], d[1], d[2], d[3], a0, a1, a2, a3, b0[nt], b1[nt], d[0], d[1], d[2], d[3]);
      }
    }
  }
}

// One k-tile of stage st for the weight layout and activation type of the variant.
template <int BT, int WARPS_T, bool A_FP4, bool SM90L>
__device__ __forceinline__ void ktile_mma(float (&acc)[kMT][Cfg<BT, WARPS_T, A_FP4>::kNT][4], const uint8_t* st,
                                          const Lanes& ln) {
  using C = Cfg<BT, WARPS_T, A_FP4>;
  uint32_t scA[kMT], scB[kMT];
  weight_scale_pairs(st + C::kWSOff, ln, scA, scB);
  if constexpr (SM90L) ktile_sm90<C::kNT, C::kNT, C::kWT>(acc, st + C::kWOff, st + C::kAOff, scA, scB, ln);
  else ktile_checkpoint<C::kNT, C::kWT, A_FP4>(acc, st + C::kWOff, st + C::kAOff, st + C::kASOff, scA, scB, ln);
}

// ---------------------------------------------------------------------------------------------
// Epilogue: acc[mt][nt] = {(n, r), (n, r+1), (n+8, r), (n+8, r+1)}, n % 16 < 8 (csrc/epilogue.cuh).
// Row scales (SwiGLU epilogue with p.row_scale) are loaded ahead of the store loop: 2 NT per thread.
// fp4_fix undoes the 2^-7 of each fp4 operand.
template <int NT, int WT>
__device__ __forceinline__ void store_tile(const KParams& p, const float (&acc)[kMT][NT][4], int g, int64_t n0,
                                           const TileRows& tr, const Lanes& ln, float fp4_fix) {
  float mul_lo, mul_hi;
  epilogue_factors(p, g, fp4_fix, mul_lo, mul_hi);
  const bool scaled = p.glu && p.row_scale != nullptr;
  float rs[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int64_t r = tr.row0 + ln.wj * WT + nt * 8 + 2 * ln.t4 + c;
      rs[nt][c] = scaled && r < tr.rend ? __ldg(p.row_scale + r) : 1.0f;
    }
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    const int64_t n = n0 + ln.wi * kWM + mt * 16 + ln.g8;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int64_t r = tr.row0 + ln.wj * WT + nt * 8 + 2 * ln.t4;
#pragma unroll
      for (int c = 0; c < 2; ++c)
        if (r + c < tr.rend)
          store_pair(p, r + c, n, acc[mt][nt][c], acc[mt][nt][2 + c], mul_lo, mul_hi, rs[nt][c]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The multistage variants (mma family): every thread issues its share of each stage's copies
// STAGES - 1 k-tiles ahead (cp.async groups), then all run the k-tile math on the oldest stage.
template <int BT, int WARPS_T, int STAGES, bool A_FP4, bool SM90L>
__device__ __forceinline__ void run_multistage(const KParams& p, uint8_t* smem) {
  using C = Cfg<BT, WARPS_T, A_FP4>;
  const Lanes ln = this_thread_lanes();
  const Dims d = problem_dims(p);
  const int KT = d.KT;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kBW;
  const Schedule sch = wait_for_schedule(p);
  const float fp4_fix = A_FP4 ? kExactWeightUndo * kExactWeightUndo : kExactWeightUndo;

  for (int tile = blockIdx.y; tile < sch.total_tiles; tile += gridDim.y) {
    const int g = tile_group_block<C::kThreads>(sch.prefix, p.G, tile, ln.tid);
    const TileRows tr = tile_rows<BT>(sch, g, tile);
    const StageLoader<BT, WARPS_T, A_FP4, SM90L> loader(p, d, ln.tid, g, n0, tr);
    float acc[kMT][C::kNT][4];
    zero_acc(acc);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < KT) loader.load(smem + s * C::kStage, s);
      cute::cp_async_fence();
    }
    for (int kt = 0; kt < KT; ++kt) {
      cute::cp_async_wait<STAGES - 2>();
      __syncthreads();
      const int nk = kt + STAGES - 1;
      if (nk < KT) loader.load(smem + (nk % STAGES) * C::kStage, nk);
      cute::cp_async_fence();
      ktile_mma<BT, WARPS_T, A_FP4, SM90L>(acc, smem + (kt % STAGES) * C::kStage, ln);
    }
    cute::cp_async_wait<0>();
    store_tile<C::kNT, C::kWT>(p, acc, g, n0, tr, ln, fp4_fix);
    __syncthreads();  // the next tile's prologue overwrites the stages
  }
}

// ---------------------------------------------------------------------------------------------
// The warp-specialized variant (mma_ws family; sm90 weights, bf16 activations, one token warp): one
// extra producer warp per CTA copies each stage (the weight block and the scale record by two bulk
// copies from one lane, the activation rows by 16-byte cp.async) and signals full[s]; the math warps
// wait on full[s], run the same k-tile math, and release the stage on empty[s]. The math warps then
// issue no copies, copy address arithmetic or block-wide barriers, which is what decode is bound by.
// Each warp finds its tile's group by itself, so the producer runs ahead into the next tile. A tile
// with at most 8 rows (most decode tiles) skips the second n8 token tile's activation loads and
// mma.sync, through a second copy of the k-tile math chosen per tile.

// The stage ring: barriers full[s] (after the stages) and empty[s]; stage s and phase ph persist
// across tiles.
struct StageRing {
  uint32_t full0, empty0;
  int s;
  uint32_t ph;
  __device__ __forceinline__ uint32_t full() const { return full0 + 8 * s; }
  __device__ __forceinline__ uint32_t empty() const { return empty0 + 8 * s; }
};

// The producer warp's copies of one tile. sm90 layout: K % 64 == 0 and N % 128 == 0, so every weight
// k-tile is a whole 4096-byte block and every scale k-tile a whole 512-byte record; activation rows
// past the group are zero-filled (never read past the lhs buffer).
template <int BT, int STAGES>
__device__ __forceinline__ void ws_produce_tile(const KParams& p, const Dims& d, uint8_t* smem, StageRing& ring, int g,
                                                int64_t n0, const TileRows& tr, int lane) {
  using C = Cfg<BT, 1, false>;
  const int64_t N = d.N, K = d.K, KH = d.KH, KS = d.KS;
  const int KT = d.KT;
  const uint8_t* wsrc = p.rhs + static_cast<int64_t>(g) * N * KH + n0 * KH;
  const uint8_t* ssrc = p.rhs_scales + static_cast<int64_t>(g) * N * KS + n0 * KS;
  constexpr int kAPerLane = BT * 8 / 32;  // BT rows x 8 chunks of 16 bytes over 32 lanes
  const uint8_t* asrc[kAPerLane];
  uint32_t abytes[kAPerLane];
#pragma unroll
  for (int i = 0; i < kAPerLane; ++i) {
    const int chunk = lane + 32 * i, row = chunk >> 3, c = chunk & 7;
    const int64_t r = tr.row0 + row;
    asrc[i] = r < tr.rend ? p.lhs + (r * K + c * 8) * 2 : p.lhs;
    abytes[i] = r < tr.rend ? 16u : 0u;
  }
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt) {
    mbar_wait(ring.empty(), ring.ph ^ 1);
    const uint32_t full = ring.full();
    const uint32_t st = smem_u32(smem + ring.s * C::kStage);
    if (lane == 0) {
      mbar_arrive_expect_tx(full, 4096 + 512);
      bulk_load(st + C::kWOff, wsrc + static_cast<int64_t>(kt) * 4096, 4096, full);
      bulk_load(st + C::kWSOff, ssrc + static_cast<int64_t>(kt) * 512, 512, full);
    }
#pragma unroll
    for (int i = 0; i < kAPerLane; ++i) {
      const int chunk = lane + 32 * i;
      cp_async16(st + C::kAOff + (chunk >> 3) * kActPitchBf16 + (chunk & 7) * 16,
                 abytes[i] ? asrc[i] + kt * 128 : asrc[i], abytes[i]);
    }
    cp_async_mbar_arrive(full);
    advance_stage<STAGES>(ring.s, ring.ph);
  }
}

// A math warp's k-tiles of one tile: wait for each stage, run its math (NTL n8 token tiles), release it.
template <int BT, int STAGES, int NTL>
__device__ __forceinline__ void ws_consume_tile(float (&acc)[kMT][Cfg<BT, 1, false>::kNT][4], uint8_t* smem,
                                                StageRing& ring, int KT, const Lanes& ln) {
  using C = Cfg<BT, 1, false>;
  for (int kt = 0; kt < KT; ++kt) {
    mbar_wait(ring.full(), ring.ph);
    const uint8_t* st = smem + ring.s * C::kStage;
    uint32_t scA[kMT], scB[kMT];
    weight_scale_pairs(st + C::kWSOff, ln, scA, scB);
    ktile_sm90<C::kNT, NTL, C::kWT>(acc, st + C::kWOff, st + C::kAOff, scA, scB, ln);
    __syncwarp();  // every lane's reads of the stage are done: release it to the producer
    if (ln.lane == 0) mbar_arrive(ring.empty());
    advance_stage<STAGES>(ring.s, ring.ph);
  }
}

template <int BT, int STAGES>
__device__ __forceinline__ void run_warp_specialized(const KParams& p, uint8_t* smem) {
  using C = Cfg<BT, 1, false>;
  const Lanes ln = this_thread_lanes();
  const Dims d = problem_dims(p);
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kBW;
  const Schedule sch = wait_for_schedule(p);
  StageRing ring{smem_u32(smem + STAGES * C::kStage), smem_u32(smem + STAGES * C::kStage) + STAGES * 8, 0, 0};
  if (ln.tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(ring.full0 + 8 * s, 1 + 32);  // expect_tx arrival + the producer lanes' cp.async arrivals
      mbar_init(ring.empty0 + 8 * s, kWarpsW);  // one per math warp
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  for (int tile = blockIdx.y; tile < sch.total_tiles; tile += gridDim.y) {
    const int g = tile_group_warp(sch.prefix, p.G, tile, ln.lane);
    const TileRows tr = tile_rows<BT>(sch, g, tile);
    if (ln.warp == kWarpsW) {
      ws_produce_tile<BT, STAGES>(p, d, smem, ring, g, n0, tr, ln.lane);
      continue;
    }
    float acc[kMT][C::kNT][4];
    zero_acc(acc);
    // the second n8 token tile holds rows only when the tile has more than 8
    if (C::kNT == 2 && tr.rend - tr.row0 <= 8) ws_consume_tile<BT, STAGES, 1>(acc, smem, ring, d.KT, ln);
    else ws_consume_tile<BT, STAGES, C::kNT>(acc, smem, ring, d.KT, ln);
    store_tile<C::kNT, C::kWT>(p, acc, g, n0, tr, ln, kExactWeightUndo);
  }
}

// ---------------------------------------------------------------------------------------------
// The kernel: one instantiation per configuration, activation type and weight layout (launch_entry).
// WS uses sm_90 instructions (bulk copies, mbarrier transaction counts): on older architectures its
// instantiation compiles to a trap, and the launcher never picks it there.
template <int BT, int WARPS_T, int STAGES, bool A_FP4, int MIN_BLOCKS, bool SM90L, bool WS = false>
__global__ void __launch_bounds__(Cfg<BT, WARPS_T, A_FP4>::kThreads + (WS ? 32 : 0), MIN_BLOCKS)
    grouped_gemm_kernel(const KParams p) {
  static_assert(!(SM90L && A_FP4), "the sm90 weight layout is read by the bf16-activation path only");
  static_assert(!WS || (SM90L && WARPS_T == 1 && !A_FP4),
                "the warp-specialized variant is for sm90 weights, bf16 activations, one token warp");
  extern __shared__ __align__(128) uint8_t smem[];
  if constexpr (WS) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    __trap();
#else
    run_warp_specialized<BT, STAGES>(p, smem);
#endif
  } else {
    run_multistage<BT, WARPS_T, STAGES, A_FP4, SM90L>(p, smem);
  }
}

// ---------------------------------------------------------------------------------------------
template <int BT, int WARPS_T, int STAGES, bool A_FP4, int MIN_BLOCKS, bool SM90L = false, bool WS = false>
cudaError_t launch_gemm(const KParams& kp, int64_t M, int64_t G, bool pdl, cudaStream_t stream) {
  using C = Cfg<BT, WARPS_T, A_FP4>;
  auto kernel = grouped_gemm_kernel<BT, WARPS_T, STAGES, A_FP4, MIN_BLOCKS, SM90L, WS>;
  const int smem = STAGES * C::kStage + (WS ? 2 * STAGES * 8 : 0);  // WS: + full[], empty[] barriers
  // Raise the dynamic shared-memory limit once per device (a host-side call, not a stream op).
  static std::atomic<uint64_t> done_mask{0};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const uint64_t bit = dev < 64 ? (uint64_t(1) << dev) : 0;
  if (bit == 0 || !(done_mask.load(std::memory_order_acquire) & bit)) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    done_mask.fetch_or(bit, std::memory_order_acq_rel);
  }
  const int64_t max_tiles = (M + BT - 1) / BT + G;
  dim3 grid(static_cast<unsigned>((kp.N + kBW - 1) / kBW), static_cast<unsigned>(max_tiles < 65535 ? max_tiles : 65535));
  return launch_maybe_pdl(pdl, kernel, grid, dim3(C::kThreads + (WS ? 32 : 0)), smem, stream, kp);
}

// Per token tile: warps along the tokens (the 128-token tile splits its tokens over two warp rows)
// and CTAs per SM for the register budget (4 at 16 tokens: ~3 k-tiles of weights in flight per SM).
constexpr int warps_t_for(int bt) { return bt == 128 ? 2 : 1; }
constexpr int min_blocks_for(int bt) { return bt == 16 ? 4 : bt == 32 ? 3 : bt == 64 ? 2 : 1; }

// The instantiation of table entry I for the activation type and weight layout.
template <int I>
cudaError_t launch_entry(const GroupedGemmParams& p, const KParams& kp, bool pdl, cudaStream_t stream) {
  constexpr KernelConfig c = kKernelConfigs[I];
  constexpr int BT = c.token_tile, ST = c.stages, WT = warps_t_for(BT), MB = min_blocks_for(BT);
  if constexpr (c.family != KernelFamily::kMma && c.family != KernelFamily::kMmaWs) {
    return cudaErrorInvalidValue;  // csrc/grouped_gemm_wgmma_sm90.cu, csrc/grouped_gemm_fp8_sm90.cu
  } else if constexpr (c.family == KernelFamily::kMmaWs) {
    return launch_gemm<BT, WT, ST, false, MB, true, true>(kp, p.M, p.G, pdl, stream);
  } else {
    if (p.a_fp4) return launch_gemm<BT, WT, ST, true, MB>(kp, p.M, p.G, pdl, stream);
    if (p.rhs_layout == RhsLayout::kSm90) return launch_gemm<BT, WT, ST, false, MB, true>(kp, p.M, p.G, pdl, stream);
    return launch_gemm<BT, WT, ST, false, MB>(kp, p.M, p.G, pdl, stream);
  }
}

// Launches the table entry equal to c (launch_entry refuses the wgmma families' entries).
cudaError_t launch_config(const GroupedGemmParams& p, const KernelConfig& c, const KParams& kp, bool pdl,
                          cudaStream_t stream) {
  return WithConfigEntry(c, cudaErrorInvalidValue,
                         [&](auto i) { return launch_entry<decltype(i)::value>(p, kp, pdl, stream); });
}

}  // namespace

// Preconditions: LaunchGroupedGemm's (csrc/grouped_gemm.h), c of family mma or mma_ws.
cudaError_t LaunchGroupedGemmMma(const GroupedGemmParams& p, const KernelConfig& c, bool sm90_image,
                                 cudaStream_t stream) {
  if (p.M == 0 || p.N == 0) return cudaSuccess;

  int* ws = static_cast<int*>(p.workspace);
  cudaError_t e = launch_setup(p, c.token_tile, ws, stream);
  if (e != cudaSuccess) return e;

  KParams kp;
  fill_common_params(kp, p, ws);
  kp.lhs = static_cast<const uint8_t*>(p.lhs);
  kp.lhs_scales = p.lhs_scales;
  const uintptr_t sp = reinterpret_cast<uintptr_t>(p.rhs_scales) |
                       (p.a_fp4 ? reinterpret_cast<uintptr_t>(p.lhs_scales) : uintptr_t(0));
  kp.scales_vec = ((p.K / 16) % 4 == 0) && ((sp & 3) == 0);

  // programmatic dependent launch only where the kernels wait for it (their sm_90 image)
  return launch_config(p, c, kp, sm90_image, stream);
}

}  // namespace jax_nvfp4
