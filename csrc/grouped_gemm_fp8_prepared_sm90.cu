// Grouped GEMM for Hopper (sm_90a), FP8 mode on weights prepared once as e4m3 (rhs_layout kFp8):
// both operands by TMA, e4m3 x e4m3 SS WGMMA, float32 promotion every 128 k.
//
// Contract: csrc/gemm_contract.h (params.fp8, RhsLayout::kFp8) and docs/design.md "FP8 mode" /
// "Weight layouts" (fp8). The math is the FP8 mode's with the weight rounding done ahead of time:
//     w8[g, n, k] = e4m3(e2m1 * block scale * 2^-3)                  (u8 [G, N, K], K contiguous)
//     part_c      = sum_{k in chunk c} q[r, k] * w8[g, n, k]         (128-wide chunks)
//     acc         = fma(part_c, xs[c, r], acc), c = 0 .. K/128 - 1   (float32)
//     out[r, n]   = acc * (alpha[g] * 8)                             (bf16 or float32)
// Activations are the FP8 mode's operands (e4m3 codes [M, K] in the kernel k order, float32 chunk
// scales [K/128, M]); the weights are prepared in the same k order inside each chunk, and a chunk's dot
// product is one sum, so the order needs no further handling here.
//
// D^T = W X^T as in csrc/grouped_gemm_fp8_sm90.cu, whose persistent schedule, tile walk, tile ring,
// consumer loop and epilogue this kernel shares (csrc/wgmma_sm90_common.cuh, csrc/grouped_gemm_schedule.cuh,
// csrc/fp8_consumer_sm90.cuh, to which this file gives its operands: SharedAB): a CTA tile is 128 weight
// rows x up to BTMAX tokens of one group; one pipeline stage is one 128-k chunk.
//
// Warp specialization (384 threads, 1 CTA per SM, persistent):
//   warp 0: walks the schedule, publishes each tile to the consumers' ring, and per stage TMA-loads the
//     weight box (128 rows x 128 bytes) and the activation boxes (32 tokens x 128 bytes, those that
//     hold the tile's rows), both 128-byte swizzled as the WGMMA descriptors expect;
//   warp 1: cp.asyncs the tile's BTMAX chunk scales of the stage (zero-filled past M);
//   warpgroups 1, 2 (consumers, 64 weight rows each): per stage, wait full[s], four m64nNk32 SS wgmmas
//     (A = weights, B = tokens, N = 32/64/128 by the tile's rows) into a chunk accumulator, wait,
//     release the stage (empty[s]), promote acc = fma(part, scale[token], acc).
// Out of bounds: every TMA box starts inside its tensor; parts past M (tokens) or past G*N (weight rows)
// are zero-filled by TMA. Token columns past the group's end and weight rows past N (the next
// group's) are computed and dropped by the epilogue.
// Design: docs/design.md; counts and measurements: docs/archive/design-measurements.md; the configurations tried: docs/archive/fp8-prepared-lab.md.

#include "csrc/fp8_consumer_sm90.cuh"
#include "csrc/grouped_gemm.h"
#include "csrc/grouped_gemm_schedule.cuh"
#include "csrc/mbarrier_sm90.cuh"
#include "csrc/wgmma_sm90_common.cuh"

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

constexpr int kBK = kFp8BK;      // k per stage = one promotion chunk = one 128-byte swizzle row of e4m3
constexpr int kBoxT = kFp8BoxT;  // tokens per activation TMA box

template <int BTMAX, int STAGES>
struct P8Cfg {
  static constexpr int kActOff = 0;                        // e4m3 [BTMAX][128], 128B swizzle
  static constexpr int kWOff = BTMAX * kBK;                // e4m3 [128][128], 128B swizzle
  static constexpr int kStage = kWOff + kRowsW * kBK;      // a multiple of 1024 (swizzle atoms)
  static constexpr int kXsOff = STAGES * kStage;           // f32 [STAGES][BTMAX] chunk scales
  static constexpr int kBarOff = kXsOff + STAGES * BTMAX * 4;  // full[], empty[]
  static constexpr int kTileOff = kBarOff + 2 * STAGES * 8;  // the schedule ring (TileRing)
  static constexpr int kSmem = kTileOff + kTileRingBytes + 1024;  // + slack for 1024B alignment
  static_assert(kStage % 1024 == 0, "stage alignment");
  static_assert(kSmem <= 232448, "shared memory");
  static_assert(BTMAX % kBoxT == 0 && BTMAX <= 128, "token tile");
};

struct P8Params {
  const uint8_t* rhs;         // (fill_common_params sets it; the kernel reads it through the tensor map)
  const uint8_t* rhs_scales;  // (null: prepared weights carry no block scales)
  const float* xs;            // [K/128, M]
  const float* alpha;
  void* out;
  const int* ws;
  int64_t M, N, K, G;
  int NT;  // n-tiles per group
  int KT;  // stages (k chunks)
  bool out_f32;
  bool glu;  // (always false: the FP8 mode has no SwiGLU epilogue; the shared epilogue reads it)
  float glu_limit;
  const float* row_scale;
};


// WGMMA m64nNk32 SS, e4m3 x e4m3 -> f32, both operands K-major from shared memory.
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

template <int NN, typename Acc, size_t... I>
__device__ __forceinline__ void wgmma_ss(uint64_t da, uint64_t db, Acc& acc, gmma::ScaleOut sc,
                                         std::index_sequence<I...>) {
  P8Ops<NN>::SS::fma(da, db, acc[I]..., sc);
}

// The consumer's operands (csrc/fp8_consumer_sm90.cuh, consumer_mainloop): both by descriptor, A the
// weight rows 64 wg .. 64 wg + 63 of the tile (warpgroup wg), B the tokens. The other warpgroup's
// wgmmas overlap this one's promotion.
template <int BTMAX, int STAGES>
struct SharedAB {
  using C = P8Cfg<BTMAX, STAGES>;
  static constexpr bool kRegisterA = false;
  struct Frag {};
  struct Desc {
    uint64_t a[4], b[4];
  };
  uint32_t base;
  int t4;
  // descriptor low words of stage 0: a stage is kStage bytes further, a k32 step 32 bytes (+2)
  uint64_t desc_hi;
  uint32_t a_lo0, b_lo0;

  __device__ __forceinline__ SharedAB(uint8_t* smem, int /*r0*/, int wg)
      : base(smem_u32(smem)),
        t4(threadIdx.x & 3),
        desc_hi(smem_desc_sw128(0) & 0xFFFFFFFF00000000ull),
        a_lo0(static_cast<uint32_t>(smem_desc_sw128(base + C::kWOff + wg * 64 * kBK))),
        b_lo0(static_cast<uint32_t>(smem_desc_sw128(base + C::kActOff))) {}

  __device__ __forceinline__ void load(int, Frag&) const {}
  __device__ __forceinline__ Desc descriptors(int s, Frag&) const {
    const uint32_t soff = static_cast<uint32_t>(s) * (C::kStage >> 4);
    Desc d;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      d.a[j] = desc_hi | (a_lo0 + soff + j * 2);
      d.b[j] = desc_hi | (b_lo0 + soff + j * 2);
    }
    return d;
  }
  template <int NN, typename Acc>
  __device__ __forceinline__ void mma(const Frag&, const Desc& d, int j, Acc& part, gmma::ScaleOut sc) const {
    wgmma_ss<NN>(d.a[j], d.b[j], part, sc, std::make_index_sequence<NN / 2>{});
  }
  // the tokens' chunk scales, beside the stages
  __device__ __forceinline__ uint32_t scales(int s) const { return base + C::kXsOff + s * (BTMAX * 4) + 8 * t4; }
};

template <int BTMAX, int STAGES>
__global__ void __launch_bounds__(kFp8Threads, 1)
    grouped_gemm_fp8_prepared_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_w,
                                     const P8Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = P8Cfg<BTMAX, STAGES>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t bar_base = smem_u32(smem + C::kBarOff);
  const uint32_t full0 = bar_base;
  const uint32_t empty0 = bar_base + STAGES * 8;

  if (threadIdx.x == 0) {
#pragma unroll 1
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + s * 8, 1 + 32);           // arrive.expect_tx + the cp.async warp's lanes
      mbar_init(empty0 + s * 8, kFp8ConsumerWarps);  // one per consumer warp
    }
    TileRing<C::kTileOff>::init(smem, kFp8ConsumerWarps);
    fence_mbarrier_init();
    prefetch_tensormap(&tm_a);
    prefetch_tensormap(&tm_w);
  }
  __syncthreads();

  const int G = static_cast<int>(p.G);
  const int* prefix = p.ws + kWsPrefix;
  const int* starts = p.ws + ws_start_off(p.G);
  const int* ends = p.ws + ws_end_off(p.G);
  const int NT = p.NT;
  const int total = __ldcg(p.ws + kWsTotalTiles) * NT;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int KT = p.KT;

  if (warp < 4) {
    // ------------------------------- producer warpgroup -------------------------------
    setmaxnreg_dec<kFp8ProducerRegs>();
    if (warp >= 2) return;
    int s = 0;
    uint32_t ph = 0;
    int gcur = 0;
    Tile t;
    if (warp == 0) {
      TileRing<C::kTileOff> ring{smem};
      for (int L = blockIdx.x; find_tile(L, total, prefix, starts, ends, G, NT, BTMAX, gcur, t); L += gridDim.x) {
        ring.publish(t, lane);
        const int nb = (t.rows + kBoxT - 1) / kBoxT;
        const uint32_t bytes = nb * (kBoxT * kBK) + kRowsW * kBK;
        const int row0 = static_cast<int>(t.row0);
        const int wrow = static_cast<int>(static_cast<int64_t>(t.g) * p.N + t.n0);
#pragma unroll 1
        for (int kt = 0; kt < KT; ++kt) {
          mbar_wait(empty0 + s * 8, ph ^ 1);
          if (lane == 0) {
            const uint32_t st = smem_u32(smem) + s * C::kStage;
            const uint32_t full = full0 + s * 8;
            mbar_arrive_expect_tx(full, bytes);
            tma_load_2d(st + C::kWOff, &tm_w, full, kt * kBK, wrow);
            for (int b = 0; b < nb; ++b)
              tma_load_2d(st + C::kActOff + b * (kBoxT * kBK), &tm_a, full, kt * kBK, row0 + b * kBoxT);
          }
          advance_stage<STAGES>(s, ph);
        }
      }
      ring.publish(Tile{0, 0, 0, 0}, lane);  // the end: a tile of no rows
    } else {
      // warp 1: the tile's chunk scales, zero-filled past M
      const int64_t M = p.M;
      for (int L = blockIdx.x; find_tile(L, total, prefix, starts, ends, G, NT, BTMAX, gcur, t); L += gridDim.x) {
#pragma unroll 1
        for (int kt = 0; kt < KT; ++kt) {
          mbar_wait(empty0 + s * 8, ph ^ 1);
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
    TileRing<C::kTileOff> ring{smem};
    Tile t, nxt;
    fp8_consumer_tiles<BTMAX, STAGES, SharedAB<BTMAX, STAGES>>(p, smem, bar_base, KT, warp, lane, ring, t, nxt);
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Host side: launch_fp8_family (csrc/fp8_consumer_sm90.cuh) calls launch<token tile, stages>.
struct PreparedLaunch {
  template <int BTMAX, int STAGES>
  static cudaError_t launch(const GroupedGemmParams& p, const P8Params& fp, cudaStream_t stream) {
    static std::atomic<uint64_t> done_mask{0};
    // prepared weights: e4m3 [G * N][K], box 128 k x 128 rows, 128-byte swizzle (WGMMA K-major A)
    return launch_fp8_kernel(grouped_gemm_fp8_prepared_kernel<BTMAX, STAGES>, kFp8Threads,
                             P8Cfg<BTMAX, STAGES>::kSmem, done_mask, p, fp, p.K, kBK, CU_TENSOR_MAP_SWIZZLE_128B,
                             stream);
  }
};

}  // namespace

// Preconditions: LaunchGroupedGemm's (csrc/grouped_gemm.h), c of family wgmma_fp8_prepared (p.fp8,
// fp8-prepared weights; with WgmmaFp8PreparedShapeOk: K % kBK == 0, G * N within the tensor map's
// int32 rows).
cudaError_t LaunchGroupedGemmFp8Prepared(const GroupedGemmParams& p, const KernelConfig& c, cudaStream_t stream) {
  return launch_fp8_family<KernelFamily::kWgmmaFp8Prepared, PreparedLaunch, P8Params>(p, c, stream);
}

}  // namespace jax_nvfp4
