// Grouped NVFP4 GEMM for Hopper (sm_90a), FP8 mode: e4m3 WGMMA, the weights rounded to e4m3 in
// registers, float32 promotion every 128 k.
//
// Contract: csrc/gemm_contract.h (params.fp8) and docs/design.md "FP8 mode": activations arrive as
// e4m3 codes [M, K] in the kernel k order with one power-of-two float32 scale per row and 128-wide
// chunk ([K/128, M]); weights are NVFP4 in the checkpoint layout (K % 128 == 0) and enter the
// tensor cores as e4m3(e2m1 * scale * 2^-3); each chunk's dot (one pipeline stage) is added to the
// float32 accumulator times the row's chunk scale; the epilogue multiplies by alpha * 2^3.
//
// D^T = W X^T as in the exact wgmma kernel (csrc/grouped_gemm_wgmma_sm90.cu, whose persistent
// schedule and tile walk this kernel shares through csrc/wgmma_sm90_common.cuh): a CTA tile is 128
// weight rows x up to BTMAX tokens of one group; the weights are the WGMMA A operand from
// registers (RS), the tokens the N side from shared memory (e4m3, 128-byte swizzle, TMA).
// The consumer warpgroups' tile loop and mainloop are the FP8 kernels' shared ones
// (csrc/fp8_consumer_sm90.cuh), their operands E2m1RegisterA (csrc/fp8_e2m1_operands_sm90.cuh: the
// decode below, with the stage layout F8Cfg).
//
// Warp specialization (384 threads, 1 CTA per SM, persistent):
//   warpgroup 0 (producer): warp 0 walks the schedule, publishes each tile to the consumers
//     through the shared-memory ring (TileRing) and issues the TMA loads of its stages (the
//     activation boxes of 32 tokens x 128 k that hold rows, and the weight box of 128 rows x 64
//     bytes = 128 k of codes);
//     warp 1 cp.asyncs the stage's 128 x 8 block-scale bytes and the tile's BTMAX chunk scales;
//     both complete full[s].
//   warpgroups 1, 2 (consumers): 64 weight rows each. Per stage each thread reads its two rows'
//     16 code bytes (k 32t .. 32t+31 of the chunk, t = lane % 4) with one LDS.128 each, looks up
//     the e4m3 product table of each 16-wide block (below), builds the A fragments of the stage's
//     four k32 steps and issues four m64nNk32 e4m3 wgmmas into a chunk accumulator. The next
//     stage's fragments are built while those run; then the chunk accumulator is promoted,
//     acc = fma(chunk, scale[token], acc), and the stage is released (empty[s]).
//
// Weight decoding. An e2m1 code is a sign and a 3-bit magnitude m; with the block's scale s fixed,
// the e4m3 value of the magnitude is one of 8 bytes, T_s[m] = e4m3_rn(e2m1(m) * s * 2^-3) (the
// product is at most 336: no saturation). Each CTA builds the table of all 256 scale bytes once
// (2 KB of shared memory). A 32-bit word of 8 codes then becomes two fragment registers (4 e4m3
// each) with one byte permute of the table per register (selector: the 4 magnitudes) and one byte
// permute of the word and the word << 4 in sign-replicate mode (the 4 sign bits as 0x00 / 0xFF
// bytes), merged by one LOP3: 9 integer instructions per 8 weights.
//
// Kernel k order. The 8-bit A fragment of m64k32 gives thread (g = lane/4, t = lane%4) k slots
// 4t..4t+3 (registers 0, 1: rows g, g+8) and 16+4t..16+4t+3 (registers 2, 3). Slots are matched
// to logical k so that a thread's codes for one stage are 16 contiguous bytes of its row: slot
// 32j + 16h + 4t + i of a chunk (k32 step j) holds logical k 32t + 8j + 4h + i. The activations
// are written in that order by jax_nvfp4 (a transpose fused into their quantization); the weights
// keep the checkpoint layout.

#include "csrc/float_bits.h"
#include "csrc/grouped_gemm.h"
#include "csrc/grouped_gemm_schedule.cuh"
#include "csrc/e2m1_e4m3_decode.cuh"
#include "csrc/e2m1_sm90_layout.cuh"
#include "csrc/fp8_consumer_sm90.cuh"
#include "csrc/fp8_e2m1_operands_sm90.cuh"
#include "csrc/mbarrier_sm90.cuh"
#include "csrc/wgmma_sm90_common.cuh"

#include <atomic>
#include <cstdint>
#include <utility>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cute/arch/mma_sm90_gmma.hpp>

namespace jax_nvfp4 {
namespace {

namespace gmma = cute::SM90::GMMA;

constexpr int kBK = kFp8BK;    // k per pipeline stage = one promotion chunk = one 128-byte e4m3 swizzle row
constexpr int kBoxT = kFp8BoxT;  // tokens per activation TMA box

struct F8Params {
  const uint8_t* rhs_scales;
  const float* xs;  // [K/128, M]
  const float* alpha;
  void* out;
  const int* ws;
  int64_t M, N, K, G;
  int NT;  // n-tiles per group
  int KT;  // stages (k chunks)
  bool out_f32;
  const uint8_t* rhs;  // (fill_common_params sets it; the kernel reads the codes through the tensor map)
  bool glu;  // (always false: the FP8 mode has no SwiGLU epilogue; the shared epilogue reads it)
  float glu_limit;
  const float* row_scale;
};

// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
template <int BTMAX, int STAGES>
__global__ void __launch_bounds__(kFp8Threads, 1)
    grouped_gemm_fp8_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_w,
                            const F8Params p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = F8Cfg<BTMAX, STAGES>;
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
  if (threadIdx.x < 256) {
    const uint2 e = product_table(threadIdx.x);
    sts64(smem_u32(smem + C::kTableOff) + threadIdx.x * 8, e.x, e.y);
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
      // TMA: the activation boxes that hold the tile's rows, and the weight box (rows past G*N
      // are zero-filled; rows past N of group g read the next group's, which the epilogue drops).
      // Each tile (and at the end a tile of no rows) is first published to the consumers' ring.
      TileRing<C::kTileOff> ring{smem};
      for (int L = blockIdx.x; find_tile(L, total, prefix, starts, ends, G, NT, BTMAX, gcur, t); L += gridDim.x) {
        ring.publish(t, lane);
        const int nb = (t.rows + kBoxT - 1) / kBoxT;
        const uint32_t bytes = nb * (kBoxT * kBK) + kRowsW * kBK / 2;
        const int row0 = static_cast<int>(t.row0);
        const int wrow = static_cast<int>(static_cast<int64_t>(t.g) * p.N + t.n0);
#pragma unroll 1
        for (int kt = 0; kt < KT; ++kt) {
          mbar_wait(empty0 + s * 8, ph ^ 1);
          if (lane == 0) {
            const uint32_t st = smem_u32(smem) + s * C::kStage;
            const uint32_t full = full0 + s * 8;
            mbar_arrive_expect_tx(full, bytes);
            for (int b = 0; b < nb; ++b)
              tma_load_2d(st + C::kActOff + b * (kBoxT * kBK), &tm_a, full, kt * kBK, row0 + b * kBoxT);
            tma_load_2d(st + C::kWOff, &tm_w, full, kt * (kBK / 2), wrow);
          }
          advance_stage<STAGES>(s, ph);
        }
      }
      ring.publish(Tile{0, 0, 0, 0}, lane);  // the end: a tile of no rows
      return;
    }
    // warp 1: the block scales (8 bytes per row and stage) and the tokens' chunk scales, cp.async,
    // zero-filled past N and past M.
    const int64_t N = p.N, M = p.M, KS = p.K / 16;
    for (int L = blockIdx.x; find_tile(L, total, prefix, starts, ends, G, NT, BTMAX, gcur, t); L += gridDim.x) {
      const uint8_t* srow[4];
      uint32_t sbytes[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t n = t.n0 + lane + 32 * i;
        sbytes[i] = n < N ? 8u : 0u;
        srow[i] = p.rhs_scales + (n < N ? (static_cast<int64_t>(t.g) * N + n) * KS : 0);
      }
#pragma unroll 1
      for (int kt = 0; kt < KT; ++kt) {
        mbar_wait(empty0 + s * 8, ph ^ 1);
        const uint32_t st = smem_u32(smem) + s * C::kStage;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          cp_async8(st + C::kSOff + (lane + 32 * i) * 8, srow[i] + (sbytes[i] ? kt * 8 : 0), sbytes[i]);
#pragma unroll
        for (int i = 0; i < BTMAX / 32; ++i) {
          const int64_t tok = t.row0 + lane + 32 * i;
          const bool ok = tok < M;
          cp_async4(st + C::kXsOff + (lane + 32 * i) * 4, p.xs + (ok ? kt * M + tok : 0), ok ? 4u : 0u);
        }
        cp_async_mbar_arrive(full0 + s * 8);
        advance_stage<STAGES>(s, ph);
      }
    }
  } else {
    // ------------------------------- consumer warpgroups -------------------------------
    TileRing<C::kTileOff> ring{smem};
    Tile t, nxt;
    fp8_consumer_tiles<BTMAX, STAGES, E2m1RegisterA<BTMAX, STAGES>>(p, smem, bar_base, KT, warp, lane, ring, t, nxt);
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Host side: launch_fp8_family (csrc/fp8_consumer_sm90.cuh) calls launch<token tile, stages>.
struct Fp8Launch {
  template <int BTMAX, int STAGES>
  static cudaError_t launch(const GroupedGemmParams& p, const F8Params& fp, cudaStream_t stream) {
    static std::atomic<uint64_t> done_mask{0};
    // weight codes: u8 [G * N][K / 2], box 64 bytes (128 k) x 128 rows, no swizzle
    return launch_fp8_kernel(grouped_gemm_fp8_kernel<BTMAX, STAGES>, kFp8Threads, F8Cfg<BTMAX, STAGES>::kSmem,
                             done_mask, p, fp, p.K / 2, kBK / 2, CU_TENSOR_MAP_SWIZZLE_NONE, stream);
  }
};

}  // namespace

// Preconditions: LaunchGroupedGemm's (csrc/grouped_gemm.h), c of family wgmma_fp8 (p.fp8; with
// WgmmaFp8ShapeOk: K % kBK == 0, checkpoint weights, G * N within the tensor map's int32 rows).
cudaError_t LaunchGroupedGemmFp8(const GroupedGemmParams& p, const KernelConfig& c, cudaStream_t stream) {
  return launch_fp8_family<KernelFamily::kWgmmaFp8, Fp8Launch, F8Params>(p, c, stream);
}

}  // namespace jax_nvfp4
