// The consumer side of the two FP8 kernels (csrc/grouped_gemm_fp8_sm90.cu, NVFP4 weights rounded to
// e4m3 in registers; csrc/grouped_gemm_fp8_prepared_sm90.cu, weights prepared as e4m3): the consumer
// warpgroups' tile loop, one tile's mainloop, and the kernels' shared constants and launch entry.
// The kernels differ in how a stage's operands reach the wgmmas, which each kernel file gives as an
// Operands class (below); the rest of the consumer is this file's.
// Included by those .cu files after csrc/wgmma_sm90_common.cuh (internal linkage).
#pragma once

#include <cstdint>
#include <utility>

#include <cuda_runtime.h>

#include <cute/arch/mma_sm90_gmma.hpp>

#include "csrc/gemm_contract.h"
#include "csrc/mbarrier_sm90.cuh"
#include "csrc/wgmma_sm90_common.cuh"

namespace jax_nvfp4 {
namespace {

// Warp specialization of both kernels (1 CTA per SM, persistent): warpgroup 0 produces (warp 0: the
// schedule walk and TMA, warp 1: cp.async), warpgroups 1 and 2 consume, 64 weight rows each.
constexpr int kFp8Threads = 384;
constexpr int kFp8ConsumerWarps = 8;
constexpr int kFp8ProducerRegs = 40;
constexpr int kFp8ConsumerRegs = 232;

// acc += part * scale of the D fragment's column pair j8 (columns 8 j8 + 2 t4 + {0, 1}, t4 = lane % 4;
// rows +0 / +8).
template <int ACC, int P>
__device__ __forceinline__ void promote_pair(float (&acc)[ACC], const float (&part)[P], int j8, float2 sc) {
  acc[4 * j8 + 0] = fmaf(part[4 * j8 + 0], sc.x, acc[4 * j8 + 0]);
  acc[4 * j8 + 1] = fmaf(part[4 * j8 + 1], sc.y, acc[4 * j8 + 1]);
  acc[4 * j8 + 2] = fmaf(part[4 * j8 + 2], sc.x, acc[4 * j8 + 2]);
  acc[4 * j8 + 3] = fmaf(part[4 * j8 + 3], sc.y, acc[4 * j8 + 3]);
}
// Releases stage s to the producer (one arrival per warp) once every lane of the warp is done reading it.
__device__ __forceinline__ void release_stage(uint32_t empty0, int s, int lane) {
  __syncwarp();
  if (lane == 0) mbar_arrive(empty0 + s * 8);
}

// One tile's mainloop of a consumer thread, WGMMA N = NN: KT stages from (s, ph), each one 128-k chunk
// multiplied by four m64nNk32 e4m3 wgmmas into the chunk accumulator part, promoted,
// acc = fma(part, scale[token], acc), and released to the producer (empty[s]).
//
// Operands, built by ConsumerMainloop from the block's aligned shared memory, the thread's tile rows
// r0, r0 + 8 and its warpgroup wg, feeds the wgmmas (csrc/grouped_gemm_fp8_sm90.cu: E2m1RegisterA;
// csrc/grouped_gemm_fp8_prepared_sm90.cu: SharedAB):
//   kRegisterA               true: A from registers (RS), built from the stage in shared memory;
//                            false: both operands by shared-memory descriptor (SS);
//   Frag, load(s, f)         one stage's A fragments, and building stage s's into f (RS; empty for SS);
//   Desc, descriptors(s, f)  stage s's descriptors (and the fences the operands need before the wgmmas);
//   mma<NN>(f, d, j, part, sc)  the stage's k32 step j;
//   scales(s)                the shared address of stage s's chunk scales of this thread's first
//                            column pair (then every 8 columns, 32 bytes).
// RS: the next stage is waited for and its fragments built while this stage's wgmmas run (two
// fragment buffers; the loop unrolled by two keeps their index static); the scales are read from the
// stage after the wgmmas, and the stage is released after the promotion. SS: the stage is waited for
// at its start and its scales read then; it is released as soon as the wgmmas are done, before the
// promotion.
template <int NN, int STAGES, typename Operands, int ACC>
__device__ __forceinline__ void consumer_mainloop(float (&acc)[ACC], const Operands& op, uint32_t bar_base, int KT,
                                                  int& s, uint32_t& ph) {
  namespace gmma = cute::SM90::GMMA;
  constexpr bool kRegA = Operands::kRegisterA;
  const uint32_t full0 = bar_base;
  const uint32_t empty0 = bar_base + STAGES * 8;
  const int lane = threadIdx.x & 31;
  typename Operands::Frag frag[kRegA ? 2 : 1];
  float part[NN / 2];

  // stage kt, at s, with its A fragments in frag[buf]
  auto stage = [&](int kt, auto buf_c) {
    constexpr int buf = decltype(buf_c)::value;
    [[maybe_unused]] float2 xsc[NN / 8];  // SS: the stage's token scales
    if constexpr (!kRegA) {  // SS: wait for the stage, and its scales now (it is released before the promotion)
      mbar_wait(full0 + s * 8, ph);
      const uint32_t xs = op.scales(s);
#pragma unroll
      for (int j8 = 0; j8 < NN / 8; ++j8) xsc[j8] = lds64f(xs + 32 * j8);
    }
    const typename Operands::Desc d = op.descriptors(s, frag[buf]);
    const uint2 flags = fence_operands(0u, 1u);  // (zero, one): the scale-d of the first k32 step, the others
    fence_acc(part);
    cute::warpgroup_arrive();
#pragma unroll
    for (int j = 0; j < 4; ++j)
      op.template mma<NN>(frag[buf], d, j, part, static_cast<gmma::ScaleOut>(j == 0 ? flags.x : flags.y));
    cute::warpgroup_commit_batch();
    if constexpr (kRegA) {
      fence_acc(part);
      // the next stage's fragments while this stage's wgmmas run
      int s_next = s;
      uint32_t ph_next = ph;
      advance_stage<STAGES>(s_next, ph_next);
      if (kt + 1 < KT) {
        mbar_wait(full0 + s_next * 8, ph_next);
        op.load(s_next, frag[buf ^ 1]);
      }
      cute::warpgroup_wait<0>();
      fence_acc(part);
      const uint32_t xs = op.scales(s);
#pragma unroll
      for (int j8 = 0; j8 < NN / 8; ++j8) promote_pair(acc, part, j8, lds64f(xs + 32 * j8));
      release_stage(empty0, s, lane);
      s = s_next;
      ph = ph_next;
    } else {
      cute::warpgroup_wait<0>();
      fence_acc(part);
      release_stage(empty0, s, lane);  // the stage (operand tiles and scales) is free once the wgmmas are done
#pragma unroll
      for (int j8 = 0; j8 < NN / 8; ++j8) promote_pair(acc, part, j8, xsc[j8]);
      advance_stage<STAGES>(s, ph);
    }
  };

  int kt = 0;
  if constexpr (kRegA) {
    mbar_wait(full0 + s * 8, ph);
    op.load(s, frag[0]);
#pragma unroll 1
    for (; kt + 1 < KT; kt += 2) {
      stage(kt, std::integral_constant<int, 0>{});
      stage(kt + 1, std::integral_constant<int, 1>{});
    }
    if (kt < KT) stage(kt, std::integral_constant<int, 0>{});
  } else {
#pragma unroll 1
    for (; kt < KT; ++kt) stage(kt, std::integral_constant<int, 0>{});
  }
}

// consumer_mainloop<NN, ...> for with_tile_n (pointers for its references; Operands built here)
template <int STAGES, typename Operands>
struct ConsumerMainloop {
  template <int NN, int ACC>
  __device__ __forceinline__ void operator()(float (*acc)[ACC], uint8_t* smem, uint32_t bar_base, int KT, int r0,
                                             int wg, int* s, uint32_t* ph) const {
    consumer_mainloop<NN, STAGES>(*acc, Operands(smem, r0, wg), bar_base, KT, *s, *ph);
  }
};

// The consumer warpgroups (warps 4 .. 11): take each tile from the schedule ring, run its mainloop,
// store it (alpha times 2^3: the e4m3 weights carry 2^-3; store_pair drops the rows past N), until the
// ring's end tile. The kernel declares the ring and the two tiles (t, nxt) in its consumer branch and
// passes them: declared here, the loop-carried tile fields and ring state reach ptxas in another order
// and it allocates the kernels' registers differently (docs/archive/kernel-notes.md).
template <int BTMAX, int STAGES, typename Operands, typename KParams, int kTileOff>
__device__ __forceinline__ void fp8_consumer_tiles(const KParams& p, uint8_t* smem, uint32_t bar_base, int KT,
                                                   int warp, int lane, TileRing<kTileOff>& ring, Tile& t,
                                                   Tile& nxt) {
  setmaxnreg_inc<kFp8ConsumerRegs>();
  const int cw = warp - 4;
  const int wg = cw >> 2;
  const int r0 = cw * 16 + (lane >> 2);  // tile rows r0 and r0 + 8 (the m64 D fragment of warp cw % 4)
  float acc[BTMAX / 2];
  int s = 0;
  uint32_t ph = 0;
  bool have = ring.next(t, lane);
  while (have) {
    // the epilogue's alpha into L1 now, so that its load after the mainloop does not wait on L2
    prefetch_l1(p.alpha + t.g);
#pragma unroll
    for (int i = 0; i < BTMAX / 2; ++i) acc[i] = 0.0f;
    with_tile_n<BTMAX>(t.rows, ConsumerMainloop<STAGES, Operands>{}, &acc, smem, bar_base, KT, r0, wg, &s, &ph);
    const bool have_next = ring.next(nxt, lane);
    with_tile_n<BTMAX>(t.rows, StoreTile{}, &acc, &p, &t, r0, kFp8WeightUndo);
    t = nxt;
    have = have_next;
  }
}

// The entry of LaunchGroupedGemmFp8 / LaunchGroupedGemmFp8Prepared: run_fp8_gemm (the schedule and
// the kernel parameters) and then, for c's configuration entry, Launch::launch<token tile, stages>;
// cudaErrorInvalidValue for an entry of another family.
template <KernelFamily kFamily, typename Launch, typename KParams>
cudaError_t launch_fp8_family(const GroupedGemmParams& p, const KernelConfig& c, cudaStream_t stream) {
  return run_fp8_gemm<KParams>(p, c, stream, [&](auto i, const KParams& kp) -> cudaError_t {
    constexpr KernelConfig e = kKernelConfigs[decltype(i)::value];
    if constexpr (e.family != kFamily) {
      return cudaErrorInvalidValue;
    } else {
      static_assert(e.cluster == 1, "the FP8 kernels run one CTA per tile");
      return Launch::template launch<e.token_tile, e.stages>(p, kp, stream);
    }
  });
}

}  // namespace
}  // namespace jax_nvfp4
