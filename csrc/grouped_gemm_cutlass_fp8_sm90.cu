// Grouped GEMM for Hopper (sm_90a), FP8 mode on weights prepared once as e4m3 (rhs_layout kFp8), on
// CUTLASS's SM90 pointer-array grouped GEMM with blockwise scaling (the collective builders'
// KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}FP8Blockwise mainloop, CUTLASS example 68).
//
// Contract: csrc/gemm_contract.h (params.fp8, RhsLayout::kFp8) and docs/design.md "FP8 mode". Per group g
// (rows [start_g, end_g) of the activations) CUTLASS computes D = alpha_g * sum_c part_c * (SFA * SFB):
//     A      = q [M, K] e4m3, row-major (the FP8 mode's activation codes, kernel k order)
//     B      = w8[g] [N, K] e4m3, K contiguous ("column-major" B), the same k order: a permutation of k
//              inside each 128-wide chunk on both operands leaves every chunk's dot product unchanged
//     SFA    = the activations' chunk scales (granularity 1 x 128), M-major: CUTLASS derives each group's
//              scale layout from its problem shape (compact [K/128, M_g], from the group's pointer), so a
//              second small kernel copies the call's [K/128, M] scales into one such block per group in
//              the workspace (each group's rows contiguous per chunk: a tile's 128 scales are one
//              512-byte run; the K-major [M, K/128] alternative measured the same, within 1%)
//     SFB    = 1 (one per tile-wide block of weight rows and 128 k, read from a buffer of ones: the weights' own rounding carries
//              their block scales), so each chunk's promotion is acc += part_c * s_c, exact in float32
//              like the definition's fma (s_c is a power of two)
//     alpha  = alpha[g] * 8 (per-group epilogue scalar; undoes the weights' 2^-3), D bf16 or float32.
// A setup kernel turns the device-side group sizes into CUTLASS's per-group arguments (problem shapes,
// pointers, strides, scale layouts, alpha) in the workspace; no host synchronisation. Empty groups have
// M = 0 and no tiles; the setup grid's other blocks zero the output rows past the last group; a second
// kernel regroups the chunk scales.
#include "csrc/grouped_gemm.h"
#include "csrc/grouped_gemm_schedule.cuh"

#include <atomic>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace jax_nvfp4 {
namespace {

using namespace cute;

// The GEMM of one configuration: TileM tokens x TileN weight rows x 128 k per tile (one promotion per
// k tile): 128 x 192 cooperative (each consumer warpgroup 64 x 192: two float32 accumulators of 96
// registers per thread, the promotion's, fit beside the rest) or 64 x 128 ping-pong, ClusterN CTAs along N sharing each activation tile (TMA multicast), cooperative (two consumer
// warpgroups on one tile) or ping-pong (two warpgroups on alternate tiles).
template <int TileM, int Stages, int ClusterN, bool Pingpong, typename ElementD>
struct CutlassFp8 {
  static constexpr int TileN = TileM == 128 ? 192 : 128;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16;
  static constexpr int kAlignD = 16 / static_cast<int>(sizeof(ElementD));
  using TileShape = Shape<Int<TileM>, Int<TileN>, _128>;
  using ClusterShape = Shape<_1, Int<ClusterN>, _1>;
  // SFB's granularity is the tile's N (CUTLASS's mainloop takes one weight scale per tile and k block)
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, TileN, 128, cute::GMMA::Major::MN, cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using KernelSchedule =
      cute::conditional_t<Pingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>;
  using EpilogueSchedule = cute::conditional_t<Pingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                               cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using Fusion = cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementD, float>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, EpilogueSchedule, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB,
      ElementB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  // the table's stage count is the one the builder fits into shared memory beside the bf16 epilogue's
  // (a float32 output's epilogue takes more: one stage fewer on the 128-token tile)
  static_assert(Mainloop::DispatchPolicy::Stages == Stages || !cute::is_same_v<ElementD, cutlass::bfloat16_t>,
                "kKernelConfigs' stages for cutlass_fp8");
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using ElementOut = ElementD;
};

// The per-group arguments CUTLASS reads from device memory, carved from the workspace past the
// schedule words the other families use (kCutlassFp8ArgsBytesPerGroup per group, kCutlassFp8OnesBytes of
// ones).
struct ArgArrays {
  void* shapes;
  const void** ptr_a;
  const void** ptr_b;
  void** ptr_d;
  const float** ptr_sfa;
  const float** ptr_sfb;
  void* stride_a;
  void* stride_b;
  void* stride_d;
  void* layout_sfa;
  void* layout_sfb;
  float* alpha;
  const float** alpha_ptr;
  float* ones;
  char* cutlass_ws;  // CUTLASS's own workspace (per-SM tensor maps)
  int* starts;        // [G]: each group's first row (the clamped bounds)
  float* sfa_t;      // the chunk scales regrouped: group g's [K/128, M_g] at start_g * K/128 (the extra bytes)
};

inline char* align_up(char* p, uintptr_t a) {
  return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + a - 1) & ~(a - 1));
}

// Carves the argument arrays (each 128-byte aligned) from the workspace at GroupedGemmScheduleBytes(G).
template <typename Cfg>
ArgArrays carve(void* workspace, int64_t G) {
  char* q = align_up(static_cast<char*>(workspace) + GroupedGemmScheduleBytes(G), 128);  // the 128 of the formula
  auto take = [&q, G](size_t elem) {
    char* r = q;
    q = align_up(q + elem * static_cast<size_t>(G), 128);
    return r;
  };
  ArgArrays a;
  a.shapes = take(sizeof(typename Cfg::Shape3));
  a.ptr_a = reinterpret_cast<const void**>(take(8));
  a.ptr_b = reinterpret_cast<const void**>(take(8));
  a.ptr_d = reinterpret_cast<void**>(take(8));
  a.ptr_sfa = reinterpret_cast<const float**>(take(8));
  a.ptr_sfb = reinterpret_cast<const float**>(take(8));
  a.stride_a = take(sizeof(typename Cfg::StrideA));
  a.stride_b = take(sizeof(typename Cfg::StrideB));
  a.stride_d = take(sizeof(typename Cfg::StrideD));
  a.layout_sfa = take(sizeof(typename Cfg::LayoutSFA));
  a.layout_sfb = take(sizeof(typename Cfg::LayoutSFB));
  a.alpha = reinterpret_cast<float*>(take(4));
  a.alpha_ptr = reinterpret_cast<const float**>(take(8));
  a.starts = reinterpret_cast<int*>(take(4));
  a.ones = reinterpret_cast<float*>(q);
  a.cutlass_ws = align_up(q + kCutlassFp8OnesBytes, 128);
  a.sfa_t = reinterpret_cast<float*>(static_cast<char*>(workspace) + GroupedGemmWorkspaceBytes(G));
  return a;
}

template <typename Cfg>
constexpr size_t args_bytes_per_group() {
  return sizeof(typename Cfg::Shape3) + 7 * 8 + sizeof(typename Cfg::StrideA) + sizeof(typename Cfg::StrideB) +
         sizeof(typename Cfg::StrideD) + sizeof(typename Cfg::LayoutSFA) + sizeof(typename Cfg::LayoutSFB) + 4 + 4;
}

struct SetupArgs {
  const int32_t* gs;
  const uint8_t* a;       // e4m3 [M, K]
  const uint8_t* b;       // e4m3 [G, N, K]
  char* d;                // [M, N] of esize-byte elements
  const float* sfa;       // [K/128, M]
  const float* alpha_in;  // [G]
  int64_t M, N, K, G;
  int esize;
};

// Block 0: clamped group bounds (the contract's), then each group's problem shape, pointers, strides,
// scale layouts and alpha; the buffer of ones. Blocks 1..: the output rows past the last group.
template <typename Cfg>
__global__ void __launch_bounds__(1024) cutlass_fp8_setup_kernel(SetupArgs s, ArgArrays w, TailZero tail) {
  __shared__ long long s_warp[32];
  if (blockIdx.x > 0) {
    zero_tail_rows(s.gs, s.G, s.M, tail, s_warp);
    return;
  }
  const int n = static_cast<int>(s.N), k = static_cast<int>(s.K);
  const int kb = k / 128, nb = (n + Cfg::TileN - 1) / Cfg::TileN;
  for_each_clamped_group(s.gs, s.G, s.M, group_run_of_thread(s.G), s_warp, [&](int64_t i, long long st, long long en) {
    const int m = static_cast<int>(en - st);
    reinterpret_cast<typename Cfg::Shape3*>(w.shapes)[i] = typename Cfg::Shape3(m, n, k);
    w.ptr_a[i] = s.a + st * s.K;
    w.ptr_b[i] = s.b + i * s.N * s.K;
    w.ptr_d[i] = s.d + st * s.N * s.esize;
    w.ptr_sfa[i] = w.sfa_t + st * kb;
    w.ptr_sfb[i] = w.ones;
    reinterpret_cast<typename Cfg::StrideA*>(w.stride_a)[i] =
        cutlass::make_cute_packed_stride(typename Cfg::StrideA{}, make_shape(m, k, 1));
    reinterpret_cast<typename Cfg::StrideB*>(w.stride_b)[i] =
        cutlass::make_cute_packed_stride(typename Cfg::StrideB{}, make_shape(n, k, 1));
    reinterpret_cast<typename Cfg::StrideD*>(w.stride_d)[i] =
        cutlass::make_cute_packed_stride(typename Cfg::StrideD{}, make_shape(m, n, 1));
    // the compact layouts CUTLASS derives from the problem shape itself (its mainloop recomputes them)
    reinterpret_cast<typename Cfg::LayoutSFA*>(w.layout_sfa)[i] =
        Cfg::ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
    reinterpret_cast<typename Cfg::LayoutSFB*>(w.layout_sfb)[i] =
        Cfg::ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
    w.starts[i] = static_cast<int>(st);
    w.alpha[i] = s.alpha_in[i] * kFp8WeightUndo;
    w.alpha_ptr[i] = w.alpha + i;
  });
  for (int c = threadIdx.x; c < nb * kb; c += 1024) w.ones[c] = 1.0f;
}

// After the setup kernel: row r's chunk scales (the call's [K/128, M], column r) into its group's
// [K/128, M_g] block. One thread per row, found in its group by a binary search over the starts; reads
// and writes are coalesced (a group's rows are consecutive in both). Rows past the groups are left.
template <typename Cfg>
__global__ void __launch_bounds__(256) cutlass_fp8_regroup_scales_kernel(SetupArgs s, ArgArrays w) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (r >= s.M) return;
  int64_t lo = 0, hi = s.G - 1;  // the last group starting at or before r
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (w.starts[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  const int64_t st = w.starts[lo];
  const int64_t m = get<0>(reinterpret_cast<const typename Cfg::Shape3*>(w.shapes)[lo]);
  if (r < st || r >= st + m) return;
  const int64_t kb = s.K / 128;
  float* out = w.sfa_t + st * kb + (r - st);
  for (int64_t c = 0; c < kb; ++c) out[c * m] = s.sfa[c * s.M + r];
}

int sm_count_of_current_device() {
  static std::atomic<int> cache[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev >= 0 && dev < 64) {
    const int v = cache[dev].load(std::memory_order_relaxed);
    if (v > 0) return v;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 0;
  if (dev >= 0 && dev < 64) cache[dev].store(sms, std::memory_order_relaxed);
  return sms;
}

template <typename Cfg>
cudaError_t run_cutlass_fp8(const GroupedGemmParams& p, int raster, cudaStream_t stream) {
  static_assert(args_bytes_per_group<Cfg>() <= kCutlassFp8ArgsBytesPerGroup, "per-group arguments fit the workspace");
  static_assert(Cfg::Kernel::SharedStorageSize <= 232448, "shared memory of the configuration's stages");
  const ArgArrays w = carve<Cfg>(p.workspace, p.G);
  SetupArgs s{p.group_sizes, static_cast<const uint8_t*>(p.lhs), p.rhs, static_cast<char*>(p.out),
              p.lhs_chunk_scales, p.alpha, p.M, p.N, p.K, p.G, p.out_f32 ? 4 : 2};
  TailZero tail;
  tail.out = p.out;
  tail.esize = s.esize;
  tail.row_bytes = p.N * tail.esize;
  const int64_t zero_blocks = (p.M * tail.row_bytes + 65535) / 65536;
  const unsigned grid = 1u + static_cast<unsigned>(zero_blocks < 256 ? zero_blocks : 256);
  cutlass_fp8_setup_kernel<Cfg><<<grid, 1024, 0, stream>>>(s, w, tail);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  cutlass_fp8_regroup_scales_kernel<Cfg><<<static_cast<unsigned>((p.M + 255) / 256), 256, 0, stream>>>(s, w);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;

  using Gemm = typename Cfg::Gemm;
  cutlass::KernelHardwareInfo hw;
  if (cudaGetDevice(&hw.device_id) != cudaSuccess) return cudaErrorInvalidDevice;
  hw.sm_count = sm_count_of_current_device();
  if (hw.sm_count <= 0) return cudaErrorInvalidDevice;  // CUTLASS's persistent grid is sized from it
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {static_cast<int>(p.G), static_cast<typename Cfg::Shape3*>(w.shapes), nullptr},
      {reinterpret_cast<const typename Cfg::ElementA**>(w.ptr_a), static_cast<typename Cfg::StrideA*>(w.stride_a),
       reinterpret_cast<const typename Cfg::ElementB**>(w.ptr_b), static_cast<typename Cfg::StrideB*>(w.stride_b),
       w.ptr_sfa, static_cast<typename Cfg::LayoutSFA*>(w.layout_sfa), w.ptr_sfb,
       static_cast<typename Cfg::LayoutSFB*>(w.layout_sfb)},
      {{}, nullptr, nullptr, reinterpret_cast<typename Cfg::ElementOut**>(w.ptr_d),
       static_cast<typename Cfg::StrideD*>(w.stride_d)},
      hw};
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 0.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = w.alpha_ptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {_0{}, _0{}, 1};
  fusion.dBeta = {_0{}, _0{}, 0};
  using Raster = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = raster == 1 ? Raster::AlongM : raster == 2 ? Raster::AlongN : Raster::Heuristic;

  const char* ws_end = static_cast<const char*>(p.workspace) + p.workspace_bytes;
  if (Gemm::get_workspace_size(args) > static_cast<size_t>(ws_end - w.cutlass_ws)) return cudaErrorInvalidValue;
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.initialize(args, w.cutlass_ws, stream) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    e = cudaGetLastError();
    return e != cudaSuccess ? e : cudaErrorLaunchFailure;
  }
  return cudaGetLastError();
}

template <int I>
cudaError_t launch_entry(const GroupedGemmParams& p, cudaStream_t stream) {
  constexpr KernelConfig c = kKernelConfigs[I];
  if constexpr (c.family != KernelFamily::kCutlassFp8) {
    return cudaErrorInvalidValue;
  } else {
    // 64-token tiles run ping-pong (each consumer warpgroup its own tile), 128-token ones cooperative
    constexpr bool pingpong = c.token_tile == 64;
    static_assert(c.token_tile == 64 || c.token_tile == 128, "cutlass_fp8 tiles are 64 or 128 tokens");
    if (p.out_f32)
      return run_cutlass_fp8<CutlassFp8<c.token_tile, c.stages, c.cluster, pingpong, float>>(p, c.raster, stream);
    return run_cutlass_fp8<CutlassFp8<c.token_tile, c.stages, c.cluster, pingpong, cutlass::bfloat16_t>>(p, c.raster,
                                                                                                        stream);
  }
}

}  // namespace

// Preconditions: LaunchGroupedGemm's (csrc/grouped_gemm.h), c of family cutlass_fp8 (p.fp8, fp8-prepared
// weights; CutlassFp8ShapeOk).
cudaError_t LaunchGroupedGemmCutlassFp8(const GroupedGemmParams& p, const KernelConfig& c, cudaStream_t stream) {
  if (p.M == 0 || p.N == 0) return cudaSuccess;
  return WithConfigEntry(c, cudaErrorInvalidValue,
                         [&](auto i) { return launch_entry<decltype(i)::value>(p, stream); });
}

}  // namespace jax_nvfp4
