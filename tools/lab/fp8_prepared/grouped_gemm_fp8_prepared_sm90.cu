// LAB PROTOTYPE (issue 48; not in the package build, CMakeLists.txt lists its sources): the FP8 mode's
// grouped GEMM for weights prepared once as e4m3, sm_90a. Harness and build command:
// tools/lab/fp8_prepared/fp8_prepared_check.cu; design and predicted times: docs/archive/fp8-prepared-lab.md.
//
// Math: the FP8 mode's (docs/design.md "FP8 mode"), with the weight rounding done ahead of time:
//     w8[g, n, k] = e4m3(e2m1 * block scale * 2^-3)                  (u8 [G, N, K], K contiguous)
//     part_c      = sum_{k in chunk c} q[r, k] * w8[g, n, k]         (128-wide chunks, e4m3 WGMMA)
//     acc         = fma(part_c, xs[c, r], acc), c = 0 .. K/128 - 1   (float32 promotion)
//     out[r, n]   = acc * (alpha[g] * 8)                             (bf16 or float32)
// Activations: e4m3 codes [M, K] and float32 chunk scales [K/128, M], exactly the current FP8 mode's
// operands. The kernel is indifferent to the order of k inside a 128-chunk as long as both operands
// use the same one: a chunk's dot product is one sum. The weights are therefore prepared in the
// activations' kernel k order (docs/design.md: chunk position 32j + 16h + 4t + i holds logical k
// 32t + 8j + 4h + i), so that the existing quantizer and dispatch outputs feed this kernel as they are.
//
// Structure (D^T = W X^T, as csrc/grouped_gemm_fp8_sm90.cu; the persistent schedule, tile walk, tile
// ring and epilogue are shared through csrc/wgmma_sm90_common.cuh / csrc/grouped_gemm_schedule.cuh):
// a CTA tile is 128 weight rows x up to BTMAX tokens of one group; one pipeline stage is one 128-k
// chunk: the weight box (128 rows x 128 bytes) and the activation boxes (32 tokens x 128 bytes each,
// only those holding the tile's rows), both 128-byte swizzled by TMA, plus the tile's BTMAX chunk
// scales (cp.async, a slot with its own empty barrier). Both WGMMA operands come from shared memory
// (SS): A = 64 weight rows per consumer warpgroup, B = the tokens (WGMMA N = 32/64/128/192 by the
// tile's rows).
//
// Warp specialization (384 threads, 1 CTA per SM, persistent):
//   warp 0: walks the schedule, publishes tiles to the consumers' ring, issues the TMA loads;
//   warp 1: cp.asyncs the stage's chunk scales (zero-filled past M);
//   warpgroups 1, 2: per stage, wait full[s], issue four m64nNNk32 SS wgmmas into a chunk accumulator,
//     wait, release the operand tiles (empty[s]), promote, release the scale slot (xs_empty[s]).
// Lab configurations (LaunchGroupedGemmFp8Prepared): token tile 32/64/128/192; 2-CTA clusters sharing
// the activation boxes by TMA multicast; the walk order inside a group; an overlapped consumer (two
// chunk accumulators). Measurements and what bounds them: docs/archive/fp8-prepared-lab.md.
// OOB: every TMA box starts inside its tensor; the parts past M (tokens) or past G*N (weight rows)
// are zero-filled by TMA. Token columns past the group end and weight rows past N (the next group's)
// are computed and dropped by the epilogue.

#include "csrc/grouped_gemm.h"
#include "csrc/grouped_gemm_schedule.cuh"
#include "csrc/mbarrier_sm90.cuh"
#include "csrc/wgmma_sm90_common.cuh"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cute/arch/mma_sm90_gmma.hpp>

namespace jax_nvfp4 {
namespace {

namespace gmma = cute::SM90::GMMA;

constexpr int kBK = 128;       // k per stage = one promotion chunk = one 128-byte swizzle row of e4m3
constexpr int kBoxT = 32;      // tokens per activation TMA box
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kConsumerWarps = 8;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
#ifndef P8_ST128
#define P8_ST128 6  // stages of the 128-token tile (lab builds vary it: -DP8_ST128=N)
#endif
// Lab probes (wrong results, timing only; configurations 128x1, 128x2, 192x1, 128x1r, 192x1r only): 1 no wgmmas, 2 promotion only
// at the last chunk, 3 no TMA loads (the consumers compute on whatever the stages hold).
#ifndef P8_PROBE
#define P8_PROBE 0
#endif
// P8_WALIAS=1: every weight load reads one of 8 n-tiles of group 0 (8 x 128 rows x K bytes, 3-7 MiB at
// the bench shapes, L2-resident; results wrong by design): the kernel without the weights' HBM misses.
#ifndef P8_WALIAS
#define P8_WALIAS 0
#endif

template <int BTMAX, int STAGES>
struct P8Cfg {
  static constexpr int kActOff = 0;                        // e4m3 [BTMAX][128], 128B swizzle
  static constexpr int kWOff = BTMAX * kBK;                // e4m3 [128][128], 128B swizzle
  static constexpr int kStage = kWOff + kRowsW * kBK;      // a multiple of 1024 (swizzle atoms)
  static constexpr int kXsOff = STAGES * kStage;           // f32 [STAGES][BTMAX] chunk scales
  static constexpr int kBarOff = kXsOff + STAGES * BTMAX * 4;  // full[], empty[], xs_empty[]
  static constexpr int kTileOff = kBarOff + 3 * STAGES * 8;    // Tile [kTileSlots]
  static constexpr int kTileBarOff = kTileOff + kTileSlots * 32;
  static constexpr int kSmem = kTileBarOff + 2 * kTileSlots * 8 + 1024;  // + slack for 1024B alignment
  static_assert(kStage % 1024 == 0, "stage alignment");
  static_assert(kSmem <= 232448, "shared memory");
  static_assert(BTMAX % kBoxT == 0 && BTMAX <= 192, "token tile");
  static_assert(sizeof(Tile) <= 32, "tile slot");
};

struct P8Params {
  const float* xs;  // [K/128, M]
  const float* alpha;
  void* out;
  const int* ws;
  int64_t M, N, K, G;
  int NT;  // n-tiles per group
  int KT;  // stages (k chunks)
  bool out_f32;
  int walk;  // walk order inside a group (find_tile_ordered)
  bool glu;  // always false (the shared epilogue reads it)
  float glu_limit;
  const float* row_scale;
};

__device__ __forceinline__ float2 lds64f(uint32_t a) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(a));
  return v;
}

template <int NN>
struct P8Ops;
template <>
struct P8Ops<32> {
  using SS = gmma::MMA_64x32x32_F32E4M3E4M3_SS_TN<>;
};
template <>
struct P8Ops<64> {
  using SS = gmma::MMA_64x64x32_F32E4M3E4M3_SS_TN<>;
};
template <>
struct P8Ops<128> {
  using SS = gmma::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;
};
template <>
struct P8Ops<192> {
  using SS = gmma::MMA_64x192x32_F32E4M3E4M3_SS_TN<>;
};

// Runs STMT with constexpr NN = the smallest WGMMA N of 32/64/128/192 (up to BTMAX) covering `rows`
// (warpgroup-uniform branches; a macro so that ptxas sees one straight-line mainloop per branch, as
// with_tile_n in csrc/wgmma_sm90_common.cuh).
#define P8_WITH_TILE_N(BTMAX, rows, STMT)          \
  do {                                              \
    if (BTMAX >= 192 && (rows) > 128) {             \
      constexpr int NN = BTMAX >= 192 ? 192 : 32;   \
      STMT;                                         \
    } else if (BTMAX >= 128 && (rows) > 64) {       \
      constexpr int NN = BTMAX >= 128 ? 128 : 32;   \
      STMT;                                         \
    } else if (BTMAX >= 64 && (rows) > 32) {        \
      constexpr int NN = BTMAX >= 64 ? 64 : 32;     \
      STMT;                                         \
    } else {                                        \
      constexpr int NN = 32;                        \
      STMT;                                         \
    }                                               \
  } while (0)

template <int NN, typename Acc, size_t... I>
__device__ __forceinline__ void wgmma_ss(uint64_t da, uint64_t db, Acc& acc, gmma::ScaleOut sc,
                                         std::index_sequence<I...>) {
  P8Ops<NN>::SS::fma(da, db, acc[I]..., sc);
}

// Consumer: one tile's mainloop with WGMMA N = NN over KT stages starting at (s, ph); wg = 0, 1 is the
// consumer warpgroup (weight rows 64 wg .. 64 wg + 63 of the tile).
// Releases stage slot `bar` (an empty[] barrier): in a 2-CTA cluster on both CTAs, since the peer's
// multicast writes this CTA's copy of the stage and ours the peer's.
template <int CLUSTER>
__device__ __forceinline__ void release_stage(uint32_t bar) {
  if constexpr (CLUSTER == 1) {
    mbar_arrive(bar);
  } else {
    mbar_arrive_cluster(bar, 0);
    mbar_arrive_cluster(bar, 1);
  }
}

// Named barriers of the ordered consumer: kTurnBar + wg is "warpgroup wg may issue its next stage".
constexpr int kTurnBar = 1;
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ORDERED (the "ordered" consumer, configuration digit 2): the two warpgroups take turns issuing their
// stage's wgmmas (warpgroup 0 stage k, warpgroup 1 stage k, warpgroup 0 stage k + 1, ...), so that one
// promotes while the other's wgmmas run. In the plain consumer both issue at once, wait for the tensor
// pipe to finish both, and promote at once: the pipe idles for the promotion (~100+ clocks of 512 per
// stage). Warpgroup 1 grants the first turn before its first tile; warpgroup 0 takes the last grant
// after its last tile (grouped_gemm_fp8_prepared_kernel).
template <int NN, int BTMAX, int STAGES, int CLUSTER, bool ORDERED = false>
__device__ __forceinline__ void consumer_mainloop(float (&acc)[BTMAX / 2], uint8_t* smem, uint32_t bar_base, int KT,
                                                  int wg, int& s, uint32_t& ph) {
  using C = P8Cfg<BTMAX, STAGES>;
  const uint32_t full0 = bar_base;
  const uint32_t empty0 = bar_base + STAGES * 8;
  const uint32_t xs_empty0 = bar_base + 2 * STAGES * 8;
  const int lane = threadIdx.x & 31;
  const int t4 = lane & 3;
  const uint32_t base = smem_u32(smem);
  float part[NN / 2];
  // descriptor low words of stage 0; a stage is kStage bytes further, a k32 step 32 bytes (+2)
  const uint64_t desc_hi = smem_desc_sw128(0) & 0xFFFFFFFF00000000ull;
  const uint32_t a_lo0 = static_cast<uint32_t>(smem_desc_sw128(base + C::kWOff + wg * 64 * kBK));
  const uint32_t b_lo0 = static_cast<uint32_t>(smem_desc_sw128(base + C::kActOff));

#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt) {
    mbar_wait(full0 + s * 8, ph);
    // this thread's token scales (columns 8 j8 + 2 t4 + {0, 1}): with N <= 128 read now; at N = 192 the
    // registers hold the two accumulators only, and the scales are read during the promotion (their
    // slot has its own barrier, xs_empty, so the operand tiles are released before the promotion)
    constexpr bool kEarly = NN <= 128;
    float2 xsc[kEarly ? NN / 8 : 1];
    const uint32_t xs = base + C::kXsOff + s * (BTMAX * 4) + 8 * t4;
    if constexpr (kEarly) {
#pragma unroll
      for (int j8 = 0; j8 < NN / 8; ++j8) xsc[j8] = lds64f(xs + 32 * j8);
    }
    const uint32_t soff = static_cast<uint32_t>(s) * (C::kStage >> 4);
    uint64_t da[4], db[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      da[j] = desc_hi | (a_lo0 + soff + j * 2);
      db[j] = desc_hi | (b_lo0 + soff + j * 2);
    }
    uint32_t zero = 0u, one = 1u;
    asm volatile("" : "+r"(zero), "+r"(one)::"memory");
    fence_acc(part);
#if P8_PROBE == 1
#pragma unroll
    for (int i = 0; i < NN / 2; ++i) part[i] = static_cast<float>(zero);
#else
    if constexpr (ORDERED) named_bar_sync(kTurnBar + wg, 256);
    cute::warpgroup_arrive();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const gmma::ScaleOut sc = static_cast<gmma::ScaleOut>(j == 0 ? zero : one);
      wgmma_ss<NN>(da[j], db[j], part, sc, std::make_index_sequence<NN / 2>{});
    }
    cute::warpgroup_commit_batch();
    if constexpr (ORDERED) named_bar_arrive(kTurnBar + (wg ^ 1), 256);
    cute::warpgroup_wait<0>();
#endif
    fence_acc(part);
    // the operand tiles are free once the wgmmas are done; the scale slot once they are read
    __syncwarp();
    if (lane == 0) {
      release_stage<CLUSTER>(empty0 + s * 8);
      if (kEarly) mbar_arrive(xs_empty0 + s * 8);
    }
    if (P8_PROBE != 2 || kt + 1 == KT)
#pragma unroll
    for (int j8 = 0; j8 < NN / 8; ++j8) {
      const float2 sc = kEarly ? xsc[kEarly ? j8 : 0] : lds64f(xs + 32 * j8);
      acc[4 * j8 + 0] = fmaf(part[4 * j8 + 0], sc.x, acc[4 * j8 + 0]);
      acc[4 * j8 + 1] = fmaf(part[4 * j8 + 1], sc.y, acc[4 * j8 + 1]);
      acc[4 * j8 + 2] = fmaf(part[4 * j8 + 2], sc.x, acc[4 * j8 + 2]);
      acc[4 * j8 + 3] = fmaf(part[4 * j8 + 3], sc.y, acc[4 * j8 + 3]);
    }
    if constexpr (!kEarly) {
      __syncwarp();
      if (lane == 0) mbar_arrive(xs_empty0 + s * 8);
    }
    advance_stage<STAGES>(s, ph);
  }
}

// Consumer, overlapped (ptxas serializes its wgmmas, C7514/C7517: not yet a valid test of the idea;
// docs/archive/fp8-prepared-lab.md): two chunk accumulators; stage kt + 1's wgmmas are issued before stage kt is
// promoted, so that the tensor pipe has this warpgroup's next work queued while it promotes (the
// simple mainloop above waits for its wgmmas and then promotes, leaving the overlap to the other
// warpgroup). Registers: acc + 2 chunk accumulators = 3 NN / 2 floats, hence N <= 128; the token
// scales are read during the promotion and the stage is released after it.
template <int NN, int BTMAX, int STAGES, int CLUSTER>
__device__ __forceinline__ void consumer_mainloop_overlap(float (&acc)[BTMAX / 2], uint8_t* smem, uint32_t bar_base,
                                                          int KT, int wg, int& s, uint32_t& ph) {
  static_assert(NN <= 128, "registers");
  using C = P8Cfg<BTMAX, STAGES>;
  const uint32_t full0 = bar_base;
  const uint32_t empty0 = bar_base + STAGES * 8;
  const uint32_t xs_empty0 = bar_base + 2 * STAGES * 8;
  const int lane = threadIdx.x & 31;
  const int t4 = lane & 3;
  const uint32_t base = smem_u32(smem);
  float part[2][NN / 2];
  const uint64_t desc_hi = smem_desc_sw128(0) & 0xFFFFFFFF00000000ull;
  const uint32_t a_lo0 = static_cast<uint32_t>(smem_desc_sw128(base + C::kWOff + wg * 64 * kBK));
  const uint32_t b_lo0 = static_cast<uint32_t>(smem_desc_sw128(base + C::kActOff));

  // wait for stage st and issue its four wgmmas into part[buf] (one commit group)
  auto issue = [&](int st, uint32_t sph, auto buf_c) {
    constexpr int buf = decltype(buf_c)::value;
    mbar_wait(full0 + st * 8, sph);
    const uint32_t soff = static_cast<uint32_t>(st) * (C::kStage >> 4);
    uint32_t zero = 0u, one = 1u;
    asm volatile("" : "+r"(zero), "+r"(one)::"memory");
    fence_acc(part[buf]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const gmma::ScaleOut sc = static_cast<gmma::ScaleOut>(j == 0 ? zero : one);
      wgmma_ss<NN>(desc_hi | (a_lo0 + soff + j * 2), desc_hi | (b_lo0 + soff + j * 2), part[buf], sc,
                   std::make_index_sequence<NN / 2>{});
    }
    cute::warpgroup_commit_batch();
    fence_acc(part[buf]);
  };
  // promote part[buf] (stage st) and release the stage
  auto promote = [&](int st, auto buf_c) {
    constexpr int buf = decltype(buf_c)::value;
    fence_acc(part[buf]);
    __syncwarp();
    if (lane == 0) release_stage<CLUSTER>(empty0 + st * 8);
    const uint32_t xs = base + C::kXsOff + st * (BTMAX * 4) + 8 * t4;
#pragma unroll
    for (int j8 = 0; j8 < NN / 8; ++j8) {
      const float2 sc = lds64f(xs + 32 * j8);
      acc[4 * j8 + 0] = fmaf(part[buf][4 * j8 + 0], sc.x, acc[4 * j8 + 0]);
      acc[4 * j8 + 1] = fmaf(part[buf][4 * j8 + 1], sc.y, acc[4 * j8 + 1]);
      acc[4 * j8 + 2] = fmaf(part[buf][4 * j8 + 2], sc.x, acc[4 * j8 + 2]);
      acc[4 * j8 + 3] = fmaf(part[buf][4 * j8 + 3], sc.y, acc[4 * j8 + 3]);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(xs_empty0 + st * 8);
  };
  // one step: stage (s, ph) was issued into part[buf]; issue the next into part[buf ^ 1], then promote
  auto step = [&](int kt, auto buf_c) {
    constexpr int buf = decltype(buf_c)::value;
    int s_next = s;
    uint32_t ph_next = ph;
    advance_stage<STAGES>(s_next, ph_next);
    if (kt + 1 < KT) {
      issue(s_next, ph_next, std::integral_constant<int, buf ^ 1>{});
      cute::warpgroup_wait<1>();
    } else {
      cute::warpgroup_wait<0>();
    }
    promote(s, buf_c);
    s = s_next;
    ph = ph_next;
  };

  issue(s, ph, std::integral_constant<int, 0>{});
  int kt = 0;
#pragma unroll 1
  for (; kt + 1 < KT; kt += 2) {
    step(kt, std::integral_constant<int, 0>{});
    step(kt + 1, std::integral_constant<int, 1>{});
  }
  if (kt < KT) step(kt, std::integral_constant<int, 0>{});
}

// find_tile (csrc/wgmma_sm90_common.cuh) with the walk order inside a group chosen by the caller (walk):
// 0 token-tile-major (consecutive schedule indices take the n-tiles of one token tile: the token tile is
// re-read from L2 by concurrent CTAs, and a group's weights stream through L2 once per ~132 / NT token
// tiles), 1 n-tile-major (they take the token tiles of one weight n-tile: the weight tile is shared by
// concurrent CTAs, so each weight byte comes from HBM about once, but with the grid's even stride a CTA
// keeps its token-tile parity), S >= 2 blocks of S n-tiles: the block's token tiles in turn, its n-tiles
// innermost (concurrent CTAs share weight tiles as in n-tile-major; consecutive indices, hence the
// grid's parity, alternate n-tiles, not token tiles).
__device__ __forceinline__ bool find_tile_ordered(int L, int total, const int* __restrict__ prefix,
                                                  const int* __restrict__ starts, const int* __restrict__ ends, int G,
                                                  int NT, int BT, int walk, int& gcur, Tile& t) {
  if (L >= total) return false;
  const int q = L / NT;
  const int lane = threadIdx.x & 31;
  while (true) {
    const int j = gcur + 1 + lane;
    const int v = j <= G ? __ldcg(prefix + j) : 0x7fffffff;
    const unsigned m = __ballot_sync(0xffffffffu, v <= q);
    const int c = __popc(m);
    gcur += c;
    if (c < 32) break;
  }
  const int g = gcur;
  const int p0 = __ldcg(prefix + g);
  const int tg = __ldcg(prefix + g + 1) - p0;
  const int local = L - p0 * NT;
  int nt, tt;
  if (walk == 0) {
    nt = local % NT;
    tt = local / NT;
  } else if (walk == 1) {
    nt = local / tg;
    tt = local - nt * tg;
  } else {
    const int nb0 = local / (walk * tg) * walk;          // the block's first n-tile
    const int sw = NT - nb0 < walk ? NT - nb0 : walk;    // n-tiles in the block (the last may be short)
    const int rem = local - nb0 * tg;
    tt = rem / sw;
    nt = nb0 + rem - tt * sw;
  }
  const int64_t st = __ldcg(starts + g);
  const int64_t en = __ldcg(ends + g);
  t.g = g;
  t.n0 = nt * kRowsW;
  t.row0 = st + static_cast<int64_t>(tt) * BT;
  const int64_t r = en - t.row0;
  t.rows = static_cast<int>(r < BT ? r : BT);
  return true;
}

// TMA load multicast to the CTAs of `mask` in the cluster (same shared-memory offsets, each completing
// its own mbarrier at offset `bar`).
__device__ __forceinline__ void tma_load_2d_mc(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                               uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// CLUSTER = 1: one CTA per tile. CLUSTER = 2: a cluster of two CTAs takes the two adjacent weight n-tiles
// 2u, 2u + 1 of one token tile (schedule unit u; the n-tile past N of an odd count computes rows it
// drops); each CTA loads its own weight box and half of the token tile's activation boxes, multicast
// to both, so each CTA reads 16 + BT * 64 bytes per stage from L2 instead of 16 + BT * 128 (KiB,
// BT = tokens). A stage slot is free when the consumers of both CTAs have released it (empty[]
// counts both CTAs' consumer warps).
template <int BTMAX, int STAGES, int CLUSTER, int CONSUMER>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_fp8_prepared_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_w,
                                     const P8Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(CLUSTER == 1 || CLUSTER == 2, "cluster");
  using C = P8Cfg<BTMAX, STAGES>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t bar_base = smem_u32(smem + C::kBarOff);
  const uint32_t full0 = bar_base;
  const uint32_t empty0 = bar_base + STAGES * 8;
  const uint32_t xs_empty0 = bar_base + 2 * STAGES * 8;  // the scale slots (local: warp 1 fills them)
  const uint32_t tile_bar = smem_u32(smem + C::kTileBarOff);
  const int rank = CLUSTER == 1 ? 0 : static_cast<int>(cluster_rank());

  if (threadIdx.x == 0) {
#pragma unroll 1
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + s * 8, 1 + 32);                     // arrive.expect_tx + the cp.async warp's lanes
      mbar_init(empty0 + s * 8, kConsumerWarps * CLUSTER);  // each consumer warp of the cluster
      mbar_init(xs_empty0 + s * 8, kConsumerWarps);
    }
#pragma unroll 1
    for (int i = 0; i < kTileSlots; ++i) {
      mbar_init(tile_bar + i * 8, 1);                                // tile_full
      mbar_init(tile_bar + (kTileSlots + i) * 8, kConsumerWarps);  // tile_empty
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tm_a)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tm_w)) : "memory");
  }
  __syncthreads();
  if constexpr (CLUSTER > 1) cluster_sync();  // the peer's barriers exist before anything reaches them

  const int G = static_cast<int>(p.G);
  const int* prefix = p.ws + kWsPrefix;
  const int* starts = p.ws + ws_start_off(p.G);
  const int* ends = p.ws + ws_end_off(p.G);
  const int NTU = (p.NT + CLUSTER - 1) / CLUSTER;  // schedule units per token tile
  const int total = __ldcg(p.ws + kWsTotalTiles) * NTU;
  const int L0 = blockIdx.x / CLUSTER, LS = gridDim.x / CLUSTER;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int KT = p.KT;

  if (warp < 4) {
    // ------------------------------- producer warpgroup -------------------------------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    int s = 0;
    uint32_t ph = 0;
    int gcur = 0;
    Tile t;
    if (warp == 0) {
      Tile* ring = reinterpret_cast<Tile*>(smem + C::kTileOff);
      int ts = 0;
      uint32_t tph = 0;
      auto publish = [&](const Tile& v) {
        if (lane == 0) {
          mbar_wait(tile_bar + (kTileSlots + ts) * 8, tph ^ 1);
          ring[ts] = v;
          mbar_arrive(tile_bar + ts * 8);
        }
        advance_stage<kTileSlots>(ts, tph);
      };
      for (int L = L0; find_tile_ordered(L, total, prefix, starts, ends, G, NTU, BTMAX, p.walk, gcur, t); L += LS) {
        t.n0 = t.n0 * CLUSTER + rank * kRowsW;  // this CTA's n-tile of the unit
        publish(t);
        const int nb = (t.rows + kBoxT - 1) / kBoxT;
        const uint32_t bytes = nb * (kBoxT * kBK) + kRowsW * kBK;
        const int row0 = static_cast<int>(t.row0);
        // an n-tile past N (odd n-tile count, cluster of 2) loads the group's first rows and drops them
        const int wrow = static_cast<int>(static_cast<int64_t>(t.g) * p.N + (t.n0 < p.N ? t.n0 : 0));
#pragma unroll 1
        for (int kt = 0; kt < KT; ++kt) {
          mbar_wait(empty0 + s * 8, ph ^ 1);
          if (P8_PROBE == 3 && lane == 0) mbar_arrive(full0 + s * 8);
          if (P8_PROBE != 3 && lane == 0) {
            const uint32_t st = smem_u32(smem) + s * C::kStage;
            const uint32_t full = full0 + s * 8;
            mbar_arrive_expect_tx(full, bytes);
            tma_load_2d(st + C::kWOff, &tm_w, full, kt * kBK, P8_WALIAS ? (t.n0 % (8 * kRowsW)) : wrow);
            for (int b = rank; b < nb; b += CLUSTER) {
              if constexpr (CLUSTER == 1)
                tma_load_2d(st + C::kActOff + b * (kBoxT * kBK), &tm_a, full, kt * kBK, row0 + b * kBoxT);
              else
                tma_load_2d_mc(st + C::kActOff + b * (kBoxT * kBK), &tm_a, full, kt * kBK, row0 + b * kBoxT, 0x3);
            }
          }
          advance_stage<STAGES>(s, ph);
        }
      }
      publish(Tile{0, 0, 0, 0});  // the end: a tile of no rows
    } else if (warp == 1) {
      // the tile's chunk scales, zero-filled past M
      const int64_t M = p.M;
      for (int L = L0; find_tile_ordered(L, total, prefix, starts, ends, G, NTU, BTMAX, p.walk, gcur, t); L += LS) {
#pragma unroll 1
        for (int kt = 0; kt < KT; ++kt) {
          mbar_wait(xs_empty0 + s * 8, ph ^ 1);
          const uint32_t xs = smem_u32(smem) + C::kXsOff + s * (BTMAX * 4);
#pragma unroll
          for (int i = 0; i < BTMAX / 32; ++i) {
            const int64_t tok = t.row0 + lane + 32 * i;
            const bool ok = tok < M;
            cp_async4(xs + (lane + 32 * i) * 4, p.xs + (ok ? kt * M + tok : 0), ok ? 4u : 0u);
          }
          cp_async_mbar_arrive(full0 + s * 8);
          advance_stage<STAGES>(s, ph);
        }
      }
    }
  } else {
    // ------------------------------- consumer warpgroups -------------------------------
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
    const int cw = warp - 4;
    const int wg = cw >> 2;
    const int r0 = cw * 16 + (lane >> 2);  // tile rows r0 and r0 + 8 (the m64 D fragment of warp cw % 4)
    float acc[BTMAX / 2];
    int s = 0;
    uint32_t ph = 0;
    const Tile* ring = reinterpret_cast<const Tile*>(smem + C::kTileOff);
    int ts = 0;
    uint32_t tph = 0;
    auto next_tile = [&](Tile& v) {
      mbar_wait(tile_bar + ts * 8, tph);
      v = ring[ts];
      __syncwarp();
      if (lane == 0) mbar_arrive(tile_bar + (kTileSlots + ts) * 8);
      advance_stage<kTileSlots>(ts, tph);
      return v.rows > 0;
    };
    Tile t, nxt;
    bool have = next_tile(t);
    if (CONSUMER == 2 && wg == 1) named_bar_arrive(kTurnBar, 256);  // warpgroup 0 issues first
    while (have) {
      asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p.alpha + t.g));
#pragma unroll
      for (int i = 0; i < BTMAX / 2; ++i) acc[i] = 0.0f;
      if constexpr (CONSUMER == 1)
        P8_WITH_TILE_N(BTMAX, t.rows,
                       (consumer_mainloop_overlap<NN, BTMAX, STAGES, CLUSTER>(acc, smem, bar_base, KT, wg, s, ph)));
      else
        P8_WITH_TILE_N(BTMAX, t.rows, (consumer_mainloop<NN, BTMAX, STAGES, CLUSTER, CONSUMER == 2>(
                                          acc, smem, bar_base, KT, wg, s, ph)));
      const bool have_next = next_tile(nxt);
      // undo the 2^-3 of the e4m3 weights (store_pair drops the rows past N)
      P8_WITH_TILE_N(BTMAX, t.rows, (store_tile<NN>(acc, p, t, r0, 8.0f)));
      t = nxt;
      have = have_next;
    }
    if (CONSUMER == 2 && wg == 0) named_bar_sync(kTurnBar, 256);  // warpgroup 1's grant after its last stage
  }
  // no CTA of a cluster exits while its peer may still multicast into it or arrive on its barriers
  if constexpr (CLUSTER > 1) cluster_sync();
#endif
}

template <int BTMAX, int STAGES, int CLUSTER, int CONSUMER = 0>
cudaError_t launch_prepared(const GroupedGemmParams& p, const P8Params& fp, cudaStream_t stream) {
  using C = P8Cfg<BTMAX, STAGES>;
  static_assert(CONSUMER != 1 || BTMAX <= 128, "overlapped consumer: registers");
  auto kernel = grouped_gemm_fp8_prepared_kernel<BTMAX, STAGES, CLUSTER, CONSUMER>;
  static std::atomic<uint64_t> done_mask{0};
  cudaError_t e = set_smem_once(kernel, C::kSmem, done_mask);
  if (e != cudaSuccess) return e;
  CUtensorMap tm_a, tm_w;
  // activations: e4m3 [M][K], box 128 k x 32 tokens, 128-byte swizzle (WGMMA K-major B)
  e = encode_2d(&tm_a, CU_TENSOR_MAP_DATA_TYPE_UINT8, p.lhs, p.K, p.M, 1, kBK, kBoxT, CU_TENSOR_MAP_SWIZZLE_128B);
  if (e != cudaSuccess) return e;
  // prepared weights: e4m3 [G * N][K], box 128 k x 128 rows, 128-byte swizzle (WGMMA K-major A)
  e = encode_2d(&tm_w, CU_TENSOR_MAP_DATA_TYPE_UINT8, p.rhs, p.K, p.G * p.N, 1, kBK, kRowsW,
                CU_TENSOR_MAP_SWIZZLE_128B);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = C::kSmem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = CLUSTER;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int grid = num_sms();
  if (CLUSTER > 1) {
    // as many clusters as can be resident at once (the GPCs' SM counts may leave SMs over)
    static std::atomic<int> max_clusters{0};
    int mc = max_clusters.load(std::memory_order_relaxed);
    if (mc == 0) {
      cfg.gridDim = dim3(grid / CLUSTER * CLUSTER);
      e = cudaOccupancyMaxActiveClusters(&mc, kernel, &cfg);
      if (e != cudaSuccess) return e;
      if (mc <= 0) return cudaErrorNotSupported;
      max_clusters.store(mc, std::memory_order_relaxed);
    }
    grid = std::min(grid / CLUSTER, mc) * CLUSTER;
  }
  cfg.gridDim = dim3(grid);
  return cudaLaunchKernelEx(&cfg, kernel, tm_a, tm_w, fp);
}

}  // namespace

// Lab entry point (declared by its callers; not part of csrc/grouped_gemm.h). p as for the FP8 mode
// (p.fp8, lhs e4m3 [M, K], lhs_chunk_scales [K/128, M], alpha [G], group_sizes, out, workspace) except
// p.rhs = the prepared e4m3 weights u8 [G, N, K] in the activations' k order; p.rhs_scales is unused.
// token_tile: 32, 64, 128 or 192; cluster: 1, or 2 (two CTAs share the token tile's activation loads by
// TMA multicast; tiles 64, 128, 192); walk: the walk order inside a group (find_tile_ordered: 0, 1, or a
// block of walk >= 2 n-tiles); consumer:
// 0 consumer_mainloop, 1 consumer_mainloop_overlap (tiles 64x2, 128x1, 128x2), 2 consumer_mainloop ORDERED
// (tiles 128x1, 128x2, 192x1, 192x2). Needs K % 128 == 0, K > 0, 16-byte aligned lhs / rhs, no SwiGLU epilogue.
cudaError_t LaunchGroupedGemmFp8Prepared(const GroupedGemmParams& p, int token_tile, int cluster, int walk,
                                         int consumer, cudaStream_t stream) {
  if (p.M < 0 || p.N < 0 || p.G < 1 || p.K <= 0 || p.K % kBK != 0 || p.glu || walk < 0) return cudaErrorInvalidValue;
  if (p.workspace_bytes < GroupedGemmWorkspaceBytes(p.G) || p.G > (1 << 20)) return cudaErrorInvalidValue;
  if (p.G * p.N > INT32_MAX || p.M > INT32_MAX - 1) return cudaErrorNotSupported;  // TMA row coordinates
  if ((reinterpret_cast<uintptr_t>(p.lhs) & 15) || (reinterpret_cast<uintptr_t>(p.rhs) & 15) ||
      (reinterpret_cast<uintptr_t>(p.lhs_chunk_scales) & 3))
    return cudaErrorNotSupported;
  if (get_encode_fn() == nullptr) return cudaErrorNotSupported;
  const int key = (token_tile * 10 + cluster) * 10 + consumer;
  if (key != 3210 && key != 6410 && key != 12810 && key != 19210 && key != 6420 && key != 12820 && key != 19220 &&
      key != 12811 && key != 12821 && key != 6421 && key != 12812 && key != 12822 && key != 19212 && key != 19222)
    return cudaErrorInvalidValue;
  if (p.M == 0 || p.N == 0) return cudaSuccess;

  int* ws = static_cast<int*>(p.workspace);
  cudaError_t e = launch_setup(p, token_tile, ws, stream);
  if (e != cudaSuccess) return e;

  P8Params fp;
  fp.xs = p.lhs_chunk_scales;
  fp.alpha = p.alpha;
  fp.out = p.out;
  fp.ws = ws;
  fp.M = p.M;
  fp.N = p.N;
  fp.K = p.K;
  fp.G = p.G;
  fp.NT = static_cast<int>((p.N + kRowsW - 1) / kRowsW);
  fp.KT = static_cast<int>(p.K / kBK);
  fp.out_f32 = p.out_f32;
  fp.walk = walk;
  fp.glu = false;
  fp.glu_limit = 0.0f;
  fp.row_scale = nullptr;
  switch (key) {
#if P8_PROBE
    case 12810:
      return launch_prepared<128, P8_ST128, 1>(p, fp, stream);
    case 12820:
      return launch_prepared<128, P8_ST128, 2>(p, fp, stream);
    case 19210:
      return launch_prepared<192, 5, 1>(p, fp, stream);
    case 12812:
      return launch_prepared<128, P8_ST128, 1, 2>(p, fp, stream);
    case 19212:
      return launch_prepared<192, 5, 1, 2>(p, fp, stream);
#else
    case 3210:
      return launch_prepared<32, 11, 1>(p, fp, stream);
    case 6410:
      return launch_prepared<64, 9, 1>(p, fp, stream);
    case 12810:
      return launch_prepared<128, P8_ST128, 1>(p, fp, stream);
    case 19210:
      return launch_prepared<192, 5, 1>(p, fp, stream);
    case 6420:
      return launch_prepared<64, 9, 2>(p, fp, stream);
    case 12820:
      return launch_prepared<128, P8_ST128, 2>(p, fp, stream);
    case 19220:
      return launch_prepared<192, 5, 2>(p, fp, stream);
    case 12811:
      return launch_prepared<128, P8_ST128, 1, 1>(p, fp, stream);
    case 12821:
      return launch_prepared<128, P8_ST128, 2, 1>(p, fp, stream);
    case 6421:
      return launch_prepared<64, 9, 2, 1>(p, fp, stream);
    case 12812:
      return launch_prepared<128, P8_ST128, 1, 2>(p, fp, stream);
    case 12822:
      return launch_prepared<128, P8_ST128, 2, 2>(p, fp, stream);
    case 19212:
      return launch_prepared<192, 5, 1, 2>(p, fp, stream);
    case 19222:
      return launch_prepared<192, 5, 2, 2>(p, fp, stream);
#endif
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace jax_nvfp4
