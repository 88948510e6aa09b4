// Grouped NVFP4 GEMM for Hopper (sm_90a): WGMMA with the weights as register operand.
//
// Contract: csrc/gemm_contract.h. Handles W4A16 with K % 64 == 0 (WgmmaShapeOk there; the
// heuristic sends everything else to the mma kernels). Where it runs: docs/design.md; how fast: docs/archive/design-measurements.md.
//
// D^T = W X^T: a CTA tile is 128 weight rows (output columns n) x up to BTMAX tokens (rows of one
// group). The weights are the WGMMA A operand, from registers (wgmma ... RS); the tokens are the
// WGMMA N side, read by WGMMA straight from shared memory (bf16, 128-byte swizzle, loaded by TMA).
//
// Warp specialization (384 threads, 1 CTA per SM, persistent):
//   warpgroup 0 (producer; setmaxnreg 56):
//     warp 0 issues the TMA loads of the activation tile (64 k x rows, in boxes of 32 tokens),
//       and its 32 lanes fetch the 128 x 4 e4m3 scale bytes with 4-byte cp.async (sm90 layout:
//       lane 0 bulk-copies them, one contiguous 512-byte record per k-tile);
//     warp 3 loads the weight tile (128 rows x 32 bytes = 64 k of packed e2m1) with 16-byte
//       cp.async;
//     both arrive on full[s] through cp.async.mbarrier.arrive.noinc;
//     warps 1-2 wait for full[s], convert the stage's scales to bf16x2 (s, s) words and arrive
//       on ready[s].
//   warpgroups 1, 2 (consumers; setmaxnreg 224): 64 weight rows each. Per 64-wide k-tile each
//     thread reads its two weight rows (g, g+8 of its warp's 16) and their converted scales from
//     shared memory, builds the bf16 A fragments of the 4 k-blocks (e2m1 -> bf16 by byte permute +
//     shift/mask, times the e4m3 block scale) and issues 4 wgmma m64nNk16 (N = 32/64/128 chosen
//     per tile from the tile's row count). Fragments are double-buffered so the conversion of
//     k-tile i+1 overlaps the wgmmas of k-tile i (wait_group 1).
//   mbarriers: full[s] (1 arrive.expect_tx + 64 cp.async arrivals + TMA bytes), ready[s] (64
//     scale-warp threads), empty[s] (one arrival per consumer warp, 8).
//
// Mapping of the e2m1 codes onto the WGMMA A fragment. One 16-wide NVFP4 block = one k16 WGMMA
// k-block (k-tile kb = physical k 16kb..16kb+15 of the 64-wide tile), so each fragment register
// needs exactly one scale. In the bf16 A fragment of m64k16 (same as mma.sync m16n8k16) thread
// (g = lane/4, t = lane%4) of warp w holds rows 16w+g (regs 0, 2) and 16w+g+8 (regs 1, 3) and k
// pairs (2t, 2t+1) (regs 0, 1) and (2t+8, 2t+9) (regs 2, 3). The activations keep their natural k
// order (TMA), so the pair (2t, 2t+1) of core matrix c of k-block kb is byte t of the 32-bit word
// 2kb+c of the weight row (8 words per row per k-tile). With u = prmt(w << 4, w, sel_t) (byte t
// of w<<4 to byte 1, byte t of w to byte 3), bits 12-15 of u hold the even-k code and bits 28-31
// the odd-k code, and
//   bits = (u & 0x80008000) | ((u >> 6) & 0x01C001C0)
// is the bf16x2 of (e2m1 * 2^-126) (sign kept; code 1 is a bf16 subnormal). One mul.rn.bf16x2 by
// bf16(scale * 2^119) gives e2m1 * scale * 2^-7 exactly (range [2^-17, 21], normal). The epilogue
// multiplies by alpha * 2^7. bf16(scale * 2^-120) is the integer (sign << 15) | ((b & 0x7f) << 4)
// for every e4m3 byte b (normals, subnormals and zero alike); two exact bf16x2 multiplies by 2^120
// and 2^119 give bf16(scale * 2^119).
//
// Scheduler (no host sync, empty groups do no work): a setup kernel writes the clamped group row
// bounds and the prefix sums of ceil(rows_g / BTMAX) token tiles to the workspace (the layout of
// csrc/grouped_gemm_schedule.cuh). Linear tile L in [0, P_G * NT) (NT = ceil(N/128)) maps to group g with
// P_g <= L / NT < P_{g+1}, then (single-CTA kernels) token tile (L - P_g NT) / NT and n-tile
// (L - P_g NT) % NT, or (the paired 256-token kernel) n-tile (L - P_g NT) / T_g and token tile
// (L - P_g NT) % T_g: either way the tiles of one group run together, so concurrently running CTAs
// share its weight tiles and activations in L2 (see find_tile for why the orders differ). The grid
// is one CTA per SM; CTA b takes tiles b, b + grid, ... Each warp finds g by a forward scan from its last g
// (32 prefix entries per step, ballot), so the lookup is one or two L2 loads per tile.
// The setup kernel's other blocks zero the rows past the last group. The 256-token configuration runs each group's last
// tile of at most 128 rows on the 128-token kernel instead, from a second schedule in the
// workspace (LaunchGroupedGemmWgmma).
//
// The weights are converted inline by the consumers, not by a converter warpgroup feeding SS
// wgmmas: one converter warpgroup cannot keep up with two consumer warpgroups
// (tools/lab/wgmma_microbench.cu conv mode measures it).

#include "csrc/grouped_gemm.h"
#include "csrc/grouped_gemm_schedule.cuh"
#include "csrc/e2m1_sm90_layout.cuh"
#include "csrc/mbarrier_sm90.cuh"
#include "csrc/wgmma_sm90_common.cuh"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

#include <cuda.h>  // CUtensorMap and its enums (types only; the encoder comes via the runtime)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cute/arch/mma_sm90_gmma.hpp>

namespace jax_nvfp4 {
namespace {

namespace gmma = cute::SM90::GMMA;

constexpr int kBK = 64;        // k per pipeline stage (= one 128-byte swizzle row of bf16)
constexpr int kBoxT = 32;      // tokens per activation TMA box
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kConsumerWarps = 8;
// Registers after setmaxnreg: the producer warpgroup gives registers back and the consumers
// take them (128 * 56 + 256 * 224 fits the 64K register file). One CTA per SM: with two, ptxas
// compiles the consumers to the 80-register launch bound (spills, serialized wgmmas).
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 224;
constexpr int kScaleWarps = 2;  // producer warps 1-2 convert the stage's scales for the consumers

// Token tiles (kKernelConfigs): 32, 64 and 128 tokens run single CTAs; the 256-token tile
// (m64n256, 128 f32 accumulators per thread: each converted weight fragment feeds twice the tensor
// work) runs in pairs of CTAs (cluster 2) that take adjacent weight tiles of one (group, token
// tile) and each TMA-multicast half of the activation boxes into both, halving the activation
// reads from L2. The 256-token tile runs at the H200's power cap, where the activation loads are a
// large share of the energy, so pairing pays there; the smaller tiles are not power-capped at their
// sizes, and pairing costs them time.

// Workspace layout and the setup kernel (which also zeroes the tail rows): csrc/grouped_gemm_schedule.cuh.

// The configuration that runs the 256-token configuration's short last tiles (LaunchGroupedGemmWgmma).
constexpr KernelConfig kSplitTile = {KernelFamily::kWgmma, 128, 8, 1};
static_assert(IsKnownConfig(kSplitTile), "kSplitTile is a compiled configuration");

template <int BTMAX, int STAGES>
struct WCfg {
  static constexpr int kActOff = 0;                          // bf16 [BTMAX][64], 128B swizzle
  static constexpr int kWOff = BTMAX * kBK * 2;              // u8 [128][32] packed e2m1
  static constexpr int kSOff = kWOff + kRowsW * kBK / 2;     // u8 [128][4] e4m3 scales (raw)
  static constexpr int kS2Off = kSOff + kRowsW * 4;          // u32 [128][4] bf16x2 (s, s) * 2^119
  static constexpr int kStage = (kS2Off + kRowsW * 16 + 1023) / 1024 * 1024;  // 128B swizzle needs 1024B-aligned tiles
  static constexpr int kBarOff = STAGES * kStage;            // full[], ready[], empty[]
  static constexpr int kSmem = kBarOff + 3 * STAGES * 8 + 1024;  // + slack for 1024B alignment
  static_assert(kSmem <= 232448 - 1024, "shared memory");
  static_assert(BTMAX % kBoxT == 0 && BTMAX <= 256, "token tile");
};

struct WParams {
  const uint8_t* rhs;
  const uint8_t* rhs_scales;
  const float* alpha;
  void* out;
  const int* ws;
  int64_t M, N, K, G;
  int NT;   // n-tiles per group
  int KT;   // k-tiles
  bool out_f32;
  bool glu;  // SwiGLU epilogue (alpha [G, 2], out [M, N/2], optional row_scale)
  float glu_limit;
  const float* row_scale;
};

// ---------------------------------------------------------------------------------------------
// PTX helpers of this kernel alone (the shared ones: csrc/wgmma_sm90_common.cuh; mbarriers, cp.async's
// barrier arrival and bulk copies: csrc/mbarrier_sm90.cuh)
// The same box multicast into the shared memory of every CTA in ctas (a cluster rank mask), at the
// same offset, completing on each CTA's mbarrier at offset bar.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0,
                                                      int c1, uint16_t ctas) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, "
      "%4}], [%2], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "h"(ctas)
      : "memory");
}
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_id_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t cluster_count_x() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(r));
  return r;
}
// Every thread of the cluster that has not exited (exited threads do not hold it up).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// bf16x2 (e2m1 * 2^-126) of the two codes of byte t of w; sel = t | t << 4 | t << 8 | (4 + t) << 12.
__device__ __forceinline__ uint32_t e2m1_byte_pair(uint32_t w, uint32_t sel) {
  const uint32_t u = prmt(w << 4, w, sel);
  return (u & 0x80008000u) | ((u >> 6) & 0x01C001C0u);
}

// Two e4m3 bytes (bytes 0 and 1 of x) -> bf16x2 (scale * 2^119) of each, returned duplicated:
// lo = (s0, s0), hi = (s1, s1).
__device__ __forceinline__ void scale_pairs(uint32_t x, uint32_t& lo, uint32_t& hi) {
  // bytes [b0, b1] -> halves [b0, b1] (byte 0 of each half; the high byte is don't-care)
  const uint32_t h = prmt(x, 0u, 0x4140u);  // [b0, 0, b1, 0]
  uint32_t v = ((h << 8) & 0x80008000u) | ((h << 4) & 0x07F007F0u);  // bf16(scale * 2^-120)
  v = bf16x2_mul(v, 0x7B807B80u);  // * 2^120 (exact)
  v = bf16x2_mul(v, kExactScaleUpBf16x2);  // * 2^119 (exact: 448 * 2^119 < bf16 max)
  // e4m3 has no infinities; 0x7f/0xff are NaN. The bit recipe above makes them finite, so set
  // NaN explicitly (as the mma kernels and the reference give). Runs in the scale warps, off the
  // hot loop.
  if ((x & 0x7Fu) == 0x7Fu) v = (v & 0xFFFF0000u) | 0x00007FC0u;
  if (((x >> 8) & 0x7Fu) == 0x7Fu) v = (v & 0x0000FFFFu) | 0x7FC00000u;
  lo = prmt(v, v, 0x1010u);
  hi = prmt(v, v, 0x3232u);
}

// WGMMA m64nNk16 RS, both operands K-major: A (bf16) from registers, B from shared memory.
template <int NN>
struct WgOps;
template <>
struct WgOps<32> {
  using RS = gmma::MMA_64x32x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>;
};
template <>
struct WgOps<64> {
  using RS = gmma::MMA_64x64x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>;
};
template <>
struct WgOps<128> {
  using RS = gmma::MMA_64x128x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>;
};
template <>
struct WgOps<256> {
  using RS = gmma::MMA_64x256x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>;
};

template <int NN, typename Acc, size_t... I>
__device__ __forceinline__ void wgmma_rs(const uint32_t (&a)[4], uint64_t desc, Acc& acc, gmma::ScaleOut sc,
                                         std::index_sequence<I...>) {
  WgOps<NN>::RS::fma(a[0], a[1], a[2], a[3], desc, acc[I]..., sc);
}

// ---------------------------------------------------------------------------------------------
// Consumer: one tile's mainloop with WGMMA N = NN. Consumes KT stages starting at (s, ph).
template <int NN, int BTMAX, int STAGES, bool SM90L, int CL>
__device__ __forceinline__ void consumer_mainloop(float (&acc)[BTMAX / 2], uint8_t* smem, uint32_t bar_base, int KT,
                                                  int r0, uint32_t sel, int& s, uint32_t& ph) {
  using C = WCfg<BTMAX, STAGES>;
  const uint32_t full0 = bar_base;
  const uint32_t ready0 = bar_base + STAGES * 8;
  const uint32_t empty0 = bar_base + 2 * STAGES * 8;
  const int lane = threadIdx.x & 31;
  uint32_t frag[2][4][4];
  int prev_s = 0;
  const uint32_t desc_lo0 = static_cast<uint32_t>(smem_desc_sw128(smem_u32(smem) + C::kActOff));
  // A stage is free once the consumers of every CTA it was multicast to are done with it.
  auto release = [&](int stage) {
    if constexpr (CL == 2) {
      // lane 0 arrives here, lane 1 on the peer: one instruction
      if (lane < 2) mbar_arrive_cluster(empty0 + stage * 8, cluster_ctarank() ^ static_cast<uint32_t>(lane));
    } else if (lane == 0) {
      mbar_arrive(empty0 + stage * 8);
    }
  };

  auto body = [&](int kt, auto buf_c) {
    constexpr int buf = decltype(buf_c)::value;
    // ready[s] completes after full[s] (the scale warps wait for it); waiting on full[s] too is
    // one try_wait that succeeds at once and makes the TMA writes visible to this thread directly.
    mbar_wait(ready0 + s * 8, ph);
    mbar_wait(full0 + s * 8, ph);
    const uint32_t st = smem_u32(smem) + s * C::kStage;
    // checkpoint layout: rows r0 and r0 + 8 of the weight tile, 32 bytes each
    const uint32_t rowa = st + C::kWOff + r0 * 32;
    const uint32_t rowb = rowa + 8 * 32;
    const uint4 sca = lds128(st + C::kS2Off + r0 * 16);        // (s, s) of k-blocks 0..3, row r0
    const uint4 scb = lds128(st + C::kS2Off + (r0 + 8) * 16);  // row r0 + 8
    if constexpr (SM90L) {
      // sm90 layout: this thread's 4 words (k-blocks 0..3) of m16 tile r0 / 16 are 16 contiguous
      // bytes of the 4096-byte block the loader copied in order (jax_nvfp4/maths/layout.py).
      const uint4 wq = lds128(st + C::kWOff + (r0 >> 4) * 512 + lane * 16);
      const uint32_t wv[4] = {wq.x, wq.y, wq.z, wq.w};
      const uint32_t sa[4] = {sca.x, sca.y, sca.z, sca.w};
      const uint32_t sb[4] = {scb.x, scb.y, scb.z, scb.w};
#pragma unroll
      for (int kb = 0; kb < 4; ++kb) {
        uint32_t a0, a1, a2, a3;
        e2m1_sm90_word(wv[kb], a0, a1, a2, a3);
        frag[buf][kb][0] = e2m1_scale_mul(a0, sa[kb]);  // row g, k 2t..
        frag[buf][kb][1] = e2m1_scale_mul(a1, sb[kb]);  // row g + 8
        frag[buf][kb][2] = e2m1_scale_mul(a2, sa[kb]);  // row g, k 2t + 8..
        frag[buf][kb][3] = e2m1_scale_mul(a3, sb[kb]);  // row g + 8
      }
      (void)rowa;
      (void)rowb;
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // k-blocks 2h, 2h+1: 16 bytes of each row, loaded as needed (registers)
        const uint4 wa = lds128(rowa + 16 * h);
        const uint4 wb = lds128(rowb + 16 * h);
        const uint32_t sa0 = h ? sca.z : sca.x, sa1 = h ? sca.w : sca.y;
        const uint32_t sb0 = h ? scb.z : scb.x, sb1 = h ? scb.w : scb.y;
        // k-block 2h: words x (core matrix 0), y (core matrix 1); k-block 2h+1: words z, w
        frag[buf][2 * h][0] = bf16x2_mul(e2m1_byte_pair(wa.x, sel), sa0);
        frag[buf][2 * h][1] = bf16x2_mul(e2m1_byte_pair(wb.x, sel), sb0);
        frag[buf][2 * h][2] = bf16x2_mul(e2m1_byte_pair(wa.y, sel), sa0);
        frag[buf][2 * h][3] = bf16x2_mul(e2m1_byte_pair(wb.y, sel), sb0);
        frag[buf][2 * h + 1][0] = bf16x2_mul(e2m1_byte_pair(wa.z, sel), sa1);
        frag[buf][2 * h + 1][1] = bf16x2_mul(e2m1_byte_pair(wb.z, sel), sb1);
        frag[buf][2 * h + 1][2] = bf16x2_mul(e2m1_byte_pair(wa.w, sel), sa1);
        frag[buf][2 * h + 1][3] = bf16x2_mul(e2m1_byte_pair(wb.w, sel), sb1);
      }
    }
    // Pin the conversions before wgmma.fence: otherwise the compiler may sink them between the
    // wgmmas, and ptxas then serializes the wgmmas (C7513).
#pragma unroll
    for (int kb = 0; kb < 4; ++kb)
#pragma unroll
      for (int i = 0; i < 4; ++i) cute::warpgroup_fence_operand(frag[buf][kb][i]);
    // Same for the descriptors and the scale-d flag: all wgmma inputs are computed before the fence.
    uint64_t desc[4];
    // The descriptor's address field is (address >> 4) (shared addresses stay below 2^18, so the
    // mask of smem_desc_sw128 is a no-op): step it from stage 0's descriptor instead of rebuilding
    // it (fewer instructions per consumer k-tile).
    const uint32_t dlo = desc_lo0 + static_cast<uint32_t>(s) * (C::kStage >> 4);
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      desc[kb] = (smem_desc_sw128(0) & 0xFFFFFFFF00000000ull) | (dlo + kb * 2);
      fence_operand(desc[kb]);
    }
    const uint2 flags = fence_operands(kt > 0 ? 1u : 0u, 1u);  // (first k-block's, the others')
    fence_acc(acc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      const gmma::ScaleOut sc = static_cast<gmma::ScaleOut>(kb == 0 ? flags.x : flags.y);
      wgmma_rs<NN>(frag[buf][kb], desc[kb], acc, sc, std::make_index_sequence<NN / 2>{});
    }
    cute::warpgroup_commit_batch();
    fence_acc(acc);
    cute::warpgroup_wait<1>();  // the wgmmas of k-tile kt-1 are done: its stage and fragments are free
    if (kt > 0) release(prev_s);
    prev_s = s;
    advance_stage<STAGES>(s, ph);
  };

  int kt = 0;
#pragma unroll 1
  for (; kt + 1 < KT; kt += 2) {
    body(kt, std::integral_constant<int, 0>{});
    body(kt + 1, std::integral_constant<int, 1>{});
  }
  if (kt < KT) body(kt, std::integral_constant<int, 0>{});
  cute::warpgroup_wait<0>();
  fence_acc(acc);
  release(prev_s);
}
// consumer_mainloop<NN, ...> for with_tile_n (pointers for its references)
template <int BTMAX, int STAGES, bool SM90L, int CL>
struct ConsumerMainloop {
  template <int NN>
  __device__ __forceinline__ void operator()(float (*acc)[BTMAX / 2], uint8_t* smem, uint32_t bar_base, int KT,
                                             int r0, uint32_t sel, int* s, uint32_t* ph) const {
    consumer_mainloop<NN, BTMAX, STAGES, SM90L, CL>(*acc, smem, bar_base, KT, r0, sel, *s, *ph);
  }
};

// ---------------------------------------------------------------------------------------------
// The persistent tile walk: this CTA (CL = 2: its cluster) takes the linear tiles first_tile,
// first_tile + tile_step, ...; next_tile looks tile L up (false past the last), and with clusters
// gives CTA `rank` its n-tile of the pair. The CL = 1 kernels read blockIdx.x / gridDim.x where
// they use them, not hoisted.
struct TileWalk {
  int total;
  const int* prefix;
  const int* starts;
  const int* ends;
  int G, NTc, rank;
  int L0, Lstep;  // the cluster's first tile and step (CL = 2)
};
template <int CL>
__device__ __forceinline__ int first_tile(const TileWalk& w) {
  if constexpr (CL == 2) return w.L0;
  else return static_cast<int>(blockIdx.x);
}
template <int CL>
__device__ __forceinline__ int tile_step(const TileWalk& w) {
  if constexpr (CL == 2) return w.Lstep;
  else return static_cast<int>(gridDim.x);
}
template <int CL, int BTMAX>
__device__ __forceinline__ bool next_tile(const TileWalk& w, int L, int& gcur, Tile& t) {
  if (!find_tile(L, w.total, w.prefix, w.starts, w.ends, w.G, w.NTc, BTMAX, gcur, t)) return false;
  if constexpr (CL == 2) t.n0 = t.n0 * CL + w.rank * kRowsW;
  return true;
}

// ---------------------------------------------------------------------------------------------
// Producer roles (warpgroup 0): each walks the same tiles as the consumers and steps through the
// stage ring on its own (s, ph).

// Warp 3, the weight loader: 128 rows x 32 bytes per stage = 256 x 16-byte cp.async, 8 per lane;
// rows past N are zero-filled. Arrives on full[s] once this lane's copies have landed.
template <int BTMAX, int STAGES, bool SM90L, int CL>
__device__ __forceinline__ void load_weight_tiles(const WParams& p, const TileWalk& walk, uint8_t* smem,
                                                  uint32_t full0, uint32_t empty0, int KT, int lane) {
  using C = WCfg<BTMAX, STAGES>;
  const int64_t N = p.N, KH = p.K / 2;
  int s = 0;
  uint32_t ph = 0;
  int gcur = 0;
  Tile t;
  for (int L = first_tile<CL>(walk); next_tile<CL, BTMAX>(walk, L, gcur, t); L += tile_step<CL>(walk)) {
    // Checkpoint layout: lane pairs copy one row's 32 bytes (two 16-byte halves), 16 rows per
    // instruction. sm90 layout: the k-tile's block is 4096 contiguous bytes (the tile's blocks
    // follow each other; N % 128 == 0), 512 per instruction, landing in the same order.
    const int half = lane & 1;
    const int rows_ok = static_cast<int>(N - t.n0 < kRowsW ? N - t.n0 : kRowsW);  // <= 0: a cluster's spare n-tile
    const uint8_t* wtile = CL == 1 || rows_ok > 0 ? p.rhs + (static_cast<int64_t>(t.g) * N + t.n0) * KH : p.rhs;
    const uint8_t* base = wtile + 16 * half;
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
      mbar_wait(empty0 + s * 8, ph ^ 1);
      const uint32_t dst = smem_u32(smem) + s * C::kStage + C::kWOff + 16 * half;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int q = (lane >> 1) + 16 * i;
        const bool ok = q < rows_ok;
        const uint8_t* src = SM90L ? base + static_cast<int64_t>(kt) * 4096 + q * 32
                                   : base + (ok ? q * KH + kt * 32 : 0);
        cp_async16(dst + q * 32, src, SM90L || ok ? 16u : 0u);
      }
      cp_async_mbar_arrive(full0 + s * 8);
      advance_stage<STAGES>(s, ph);
    }
  }
}

// Warps 1-2, the scale converters: once a stage has landed, turn its 128 x 4 e4m3 bytes into
// bf16x2 (s, s) words (s * 2^119, exact) so each consumer thread reads its 8 scales with two
// LDS.128 instead of converting them (the 4 threads of a quad would each redo the same work).
// Thread c (0..63) converts rows 2c and 2c + 1. Arrives on ready[s].
template <int BTMAX, int STAGES, int CL>
__device__ __forceinline__ void convert_scales(const TileWalk& walk, uint8_t* smem, uint32_t full0, uint32_t ready0,
                                               int KT, int c) {
  using C = WCfg<BTMAX, STAGES>;
  int s = 0;
  uint32_t ph = 0;
  int gcur = 0;
  Tile t;
  for (int L = first_tile<CL>(walk); next_tile<CL, BTMAX>(walk, L, gcur, t); L += tile_step<CL>(walk)) {
    const int zbox = min(BTMAX, (t.rows + kBoxT - 1) / kBoxT * kBoxT);  // rows the TMA rewrites
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
      mbar_wait(full0 + s * 8, ph);
      const uint32_t st = smem_u32(smem) + s * C::kStage;
      const uint2 raw = lds64(st + C::kSOff + 8 * c);
      uint32_t o[8];
      scale_pairs(raw.x, o[0], o[1]);
      scale_pairs(raw.x >> 16, o[2], o[3]);
      scale_pairs(raw.y, o[4], o[5]);
      scale_pairs(raw.y >> 16, o[6], o[7]);
      sts128(st + C::kS2Off + 32 * c, o[0], o[1], o[2], o[3]);
      sts128(st + C::kS2Off + 32 * c + 16, o[4], o[5], o[6], o[7]);
      if (BTMAX == 256) {
        // Zero the activation rows the tile's N = 256 wgmmas read past the group's end (the
        // next group's rows, or a stale tile's), 128 bytes per row (the swizzle permutes
        // 16-byte chunks within a row): this kernel runs at the H200's power cap and the
        // tensor cores draw less on zero operands (outputs bitwise equal). Rows [zbox, 256)
        // stay zero after a stage's first visit in the tile; later visits zero only what the
        // TMA boxes rewrite.
        const int zhi = kt < STAGES ? BTMAX : zbox;
        for (int q = c; q < (zhi - t.rows) * 8; q += kScaleWarps * 32)
          sts128_zero(st + C::kActOff + (t.rows * 8 + q) * 16);
        // the wgmmas read the tile through the async proxy (and the next TMA into this stage
        // writes through it): order these generic-proxy stores before both
        if (zhi > t.rows) fence_proxy_async_shared();
      }
      mbar_arrive(ready0 + s * 8);
      advance_stage<STAGES>(s, ph);
    }
  }
}

// Warp 0, the activation loader: lane 0 issues the TMA boxes of the tile's rows (with clusters,
// every other box, multicast into both CTAs) and, in the sm90 layout, bulk-copies the k-tile's
// 512-byte scale record; in the checkpoint layout the 32 lanes fetch the 128 x 4 scale bytes with
// 4-byte cp.async (zero past N) and arrive on full[s].
template <int BTMAX, int STAGES, bool SM90L, int CL>
__device__ __forceinline__ void load_activations(const CUtensorMap* tm_a, const WParams& p, const TileWalk& walk,
                                                 uint32_t full0, uint32_t empty0, int KT, int lane) {
  using C = WCfg<BTMAX, STAGES>;
  // The kernel's aligned shared memory (as the kernel computes it), derived here rather than
  // passed in: nvcc simplifies each function on its own before inlining it, and with the alignment
  // offset's bound (< 1024) in sight it folds a stage's offset into one `or` shared by the stage's
  // addresses (passed in, the pointer gives other instructions and register choices).
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const int64_t N = p.N, KS = p.K / 16;
  int s = 0;
  uint32_t ph = 0;
  int gcur = 0;
  Tile t;
  for (int L = first_tile<CL>(walk); next_tile<CL, BTMAX>(walk, L, gcur, t); L += tile_step<CL>(walk)) {
    // Only the 32-row boxes that hold the tile's rows.
    const int nb = (t.rows + kBoxT - 1) / kBoxT;
    // sm90 layout: the tile's k-tile scales are one 512-byte record (bulk copy, on the same bytes)
    const uint32_t bytes = nb * (kBoxT * kBK * 2) + (SM90L ? 512u : 0u);
    const int row0 = static_cast<int>(t.row0);
    const uint8_t* srec = CL == 1 || t.n0 < N ? p.rhs_scales + (static_cast<int64_t>(t.g) * N + t.n0) * KS
                                              : p.rhs_scales;  // a cluster's spare n-tile
    // per-lane scale rows: lane, lane+32, lane+64, lane+96
    const uint8_t* ssrc[4];
    uint32_t sbytes[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t n = t.n0 + lane + 32 * i;
      const bool ok = n < N;
      ssrc[i] = ok ? p.rhs_scales + (static_cast<int64_t>(t.g) * N + n) * KS : p.rhs_scales;
      sbytes[i] = ok ? 4u : 0u;
    }
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
      mbar_wait(empty0 + s * 8, ph ^ 1);
      uint8_t* st = smem + s * C::kStage;
      const uint32_t full = full0 + s * 8;
      if (lane == 0) {
        mbar_arrive_expect_tx(full, bytes);  // every box lands here; with clusters half come from the peer
        if constexpr (CL == 2) {
          for (int b = walk.rank; b < nb; b += 2)
            tma_load_2d_multicast(smem_u32(st + C::kActOff + b * (kBoxT * kBK * 2)), tm_a, full, kt * kBK,
                                  row0 + b * kBoxT, 0x3);
        } else {
          for (int b = 0; b < nb; ++b)
            tma_load_2d(smem_u32(st + C::kActOff + b * (kBoxT * kBK * 2)), tm_a, full, kt * kBK,
                        row0 + b * kBoxT);
        }
        if constexpr (SM90L) bulk_load(smem_u32(st + C::kSOff), srec + static_cast<int64_t>(kt) * 512, 512, full);
      }
      if constexpr (!SM90L) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
          cp_async4(smem_u32(st + C::kSOff + (lane + 32 * i) * 4), sbytes[i] ? ssrc[i] + kt * 4 : ssrc[i],
                    sbytes[i]);
        cp_async_mbar_arrive(full);
      }
      advance_stage<STAGES>(s, ph);
    }
  }
}

template <int BTMAX, int STAGES, bool SM90L, int CL>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_wgmma_kernel(const __grid_constant__ CUtensorMap tm_a,
                              const WParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = WCfg<BTMAX, STAGES>;
  extern __shared__ uint8_t smem_raw[];
  // Align by an offset from smem_raw (not by casting an integer back to a pointer), so that the
  // compiler keeps the shared address space and emits LDS rather than generic loads.
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t bar_base = smem_u32(smem + C::kBarOff);
  const uint32_t full0 = bar_base;
  const uint32_t ready0 = bar_base + STAGES * 8;
  const uint32_t empty0 = bar_base + 2 * STAGES * 8;

  if (threadIdx.x == 0) {
#pragma unroll 1
    for (int s = 0; s < STAGES; ++s) {
      // arrive.expect_tx + scale cp.async lanes (none for the sm90 layout's bulk-copied scales) +
      // weight cp.async lanes
      mbar_init(full0 + s * 8, 1 + (SM90L ? 0 : 32) + 32);
      mbar_init(ready0 + s * 8, kScaleWarps * 32); // every thread of the scale warps
      mbar_init(empty0 + s * 8, kConsumerWarps * CL);  // one per consumer warp of each CTA the stage feeds
    }
    fence_mbarrier_init();
    prefetch_tensormap(&tm_a);
  }
  // With clusters the peer CTA arrives on these barriers and multicasts into this CTA's stages:
  // it must see them initialized.
  if constexpr (CL == 2)
    cluster_sync();
  else
    __syncthreads();

  const int G = static_cast<int>(p.G);
  const int* prefix = p.ws + kWsPrefix;
  const int* starts = p.ws + ws_start_off(p.G);
  const int* ends = p.ws + ws_end_off(p.G);
  // Clusters of CL CTAs take the same (group, token tile) with adjacent n-tiles, so that the
  // activation tile is read from L2 once for both (multicast): cluster c walks tile pairs c, c +
  // #clusters, ...; CTA rank r takes n-tile CL * pair + r (past N when NT is odd: the weights and
  // scales are then read from the tensor's start and the epilogue stores nothing).
  const int NTc = (p.NT + CL - 1) / CL;
  const int total = __ldcg(p.ws + kWsTotalTiles) * NTc;
  const int rank = CL == 2 ? static_cast<int>(cluster_ctarank()) : 0;
  const TileWalk walk{total, prefix, starts, ends, G, NTc, rank,
                      CL == 2 ? static_cast<int>(cluster_id_x()) : static_cast<int>(blockIdx.x),
                      CL == 2 ? static_cast<int>(cluster_count_x()) : static_cast<int>(gridDim.x)};
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int KT = p.KT;

  if (warp < 4) {
    // ------------------------------- producer warpgroup -------------------------------
    setmaxnreg_dec<kProducerRegs>();
    if (warp == 3) {
      load_weight_tiles<BTMAX, STAGES, SM90L, CL>(p, walk, smem, full0, empty0, KT, lane);
      return;
    }
    if (warp > kScaleWarps) return;
    if (warp != 0) {
      convert_scales<BTMAX, STAGES, CL>(walk, smem, full0, ready0, KT, (warp - 1) * 32 + lane);
      return;
    }
    load_activations<BTMAX, STAGES, SM90L, CL>(&tm_a, p, walk, full0, empty0, KT, lane);
  } else {
    // ------------------------------- consumer warpgroups -------------------------------
    // The tile loop stays here: as a device function the PHIs of its tile's fields come out in
    // another order and the kernels compile to other SASS (docs/archive/kernel-notes.md).
    setmaxnreg_inc<kConsumerRegs>();
    const int cw = warp - 4;                    // consumer warp 0..7
    const int g8 = lane >> 2, t4 = lane & 3;
    const int r0 = cw * 16 + g8;                // tile rows r0 and r0 + 8 (warp cw covers 16cw..16cw+15)
    const uint32_t sel = t4 | (t4 << 4) | (t4 << 8) | ((4 + t4) << 12);
    float acc[BTMAX / 2];
#pragma unroll
    for (int i = 0; i < BTMAX / 2; ++i) acc[i] = 0.0f;
    int s = 0;
    uint32_t ph = 0;
    int gcur = 0;
    Tile t, nxt;
    int L = first_tile<CL>(walk);
    bool have = next_tile<CL, BTMAX>(walk, L, gcur, t);
    while (have) {
      with_tile_n<BTMAX>(t.rows, ConsumerMainloop<BTMAX, STAGES, SM90L, CL>{}, &acc, smem, bar_base, KT, r0, sel,
                         &s, &ph);
      L += tile_step<CL>(walk);
      const bool have_next = next_tile<CL, BTMAX>(walk, L, gcur, nxt);
      // undo the 2^-7 of the fp4 weights
      with_tile_n<BTMAX>(t.rows, StoreTile{}, &acc, &p, &t, r0, kExactWeightUndo);
      t = nxt;
      have = have_next;
    }
    // The peer still arrives on this CTA's empty barriers and multicasts into its stages until
    // its last k-tile: stay resident until it is done (exited producer warps do not hold this up).
    if constexpr (CL == 2) cluster_sync();
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Host side
template <int BTMAX, int STAGES, bool SM90L, int CL = 1>
cudaError_t launch_wgmma(const GroupedGemmParams& p, const WParams& wp, cudaStream_t stream) {
  using C = WCfg<BTMAX, STAGES>;
  auto kernel = grouped_gemm_wgmma_kernel<BTMAX, STAGES, SM90L, CL>;
  static std::atomic<uint64_t> done_mask{0};
  cudaError_t e = set_smem_once(kernel, C::kSmem, done_mask);
  if (e != cudaSuccess) return e;
  int dev = 0;
  e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  CUtensorMap tm_a;
  // activations: bf16 [M][K], box 64 k x 32 tokens, 128-byte swizzle (the WGMMA K-major B layout)
  e = encode_2d(&tm_a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, p.lhs, p.K, p.M, 2, kBK, kBoxT, CU_TENSOR_MAP_SWIZZLE_128B);
  if (e != cudaSuccess) return e;
  if constexpr (CL == 1) {
    kernel<<<num_sms(), kThreads, C::kSmem, stream>>>(tm_a, wp);
    return cudaGetLastError();
  } else {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = CL;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = C::kSmem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    // Persistent grid: as many clusters as fit at once (pairs of SMs of one GPC), queried once per
    // device.
    static std::atomic<int> clusters[64];
    int ncl = dev < 64 ? clusters[dev].load(std::memory_order_relaxed) : 0;
    if (ncl <= 0) {
      cfg.gridDim = dim3(num_sms() / CL * CL);
      e = cudaOccupancyMaxActiveClusters(&ncl, kernel, &cfg);
      if (e != cudaSuccess) return e;
      if (ncl <= 0) return cudaErrorNotSupported;
      if (dev < 64) clusters[dev].store(ncl, std::memory_order_relaxed);
    }
    cfg.gridDim = dim3(ncl * CL);
    e = cudaLaunchKernelEx(&cfg, kernel, tm_a, wp);
    if (e != cudaSuccess) return e;
    return cudaGetLastError();
  }
}

template <int I>
cudaError_t launch_entry(const GroupedGemmParams& p, const WParams& wp, cudaStream_t stream) {
  constexpr KernelConfig c = kKernelConfigs[I];
  if constexpr (c.family != KernelFamily::kWgmma) {
    return cudaErrorInvalidValue;  // csrc/grouped_gemm_mma.cu
  } else {
    if (p.rhs_layout == RhsLayout::kSm90) return launch_wgmma<c.token_tile, c.stages, true, c.cluster>(p, wp, stream);
    return launch_wgmma<c.token_tile, c.stages, false, c.cluster>(p, wp, stream);
  }
}

// Launches the wgmma table entry equal to c.
cudaError_t launch_config(const GroupedGemmParams& p, const KernelConfig& c, const WParams& wp, cudaStream_t stream) {
  return WithConfigEntry(c, cudaErrorInvalidValue,
                         [&](auto i) { return launch_entry<decltype(i)::value>(p, wp, stream); });
}

}  // namespace

bool TensorMapEncoderAvailable() { return get_encode_fn() != nullptr; }

// Preconditions: LaunchGroupedGemm's (csrc/grouped_gemm.h), c of family wgmma.
cudaError_t LaunchGroupedGemmWgmma(const GroupedGemmParams& p, const KernelConfig& c, cudaStream_t stream) {
  if (p.M == 0 || p.N == 0) return cudaSuccess;

  // The 256-token tile runs N = 256 wgmmas whatever its rows, so a group's last tile of at most
  // 128 rows goes to the 128-token kernel (N 32/64/128 by its rows), launched after it on a
  // schedule of its own.
  const bool split = c.token_tile == 256;
  int* ws = static_cast<int*>(p.workspace);
  cudaError_t e = launch_setup(p, c.token_tile, ws, stream, split ? kSplitTile.token_tile : 0);
  if (e != cudaSuccess) return e;

  WParams wp;
  fill_common_params(wp, p, ws);
  wp.NT = static_cast<int>((p.N + kRowsW - 1) / kRowsW);
  wp.KT = static_cast<int>(p.K / kBK);

  e = launch_config(p, c, wp, stream);
  if (e != cudaSuccess) return e;
  if (split) {
    WParams tail = wp;
    tail.ws = ws + ws_split_off(p.G);
    e = launch_config(p, kSplitTile, tail, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace jax_nvfp4
