// Lab (issue 48): the tensor pipe's rate for the prepared-weights kernel's consumer without loads, and
// the SM's ingress (L2 to shared memory) alone and beside that consumer.
// One CTA per SM, NWG consumer warpgroups (64 A rows each), operands static in shared memory (random e4m3
// bytes in 4 rotating stage buffers, 128-byte swizzle as the kernel's), each CTA runs `iters` stages of
// four m64nNk32 e4m3 SS wgmmas per warpgroup. Modes:
//   0 raw:      one accumulator across all stages, commit per stage, wait<1> (one stage in flight)
//   1 promote:  chunk accumulator, wait<0>, acc = fma(part, s, acc) with two scales held in registers
//   2 scales:   as 1, but the scales read from shared memory per stage as the package consumer does
//               (NN/8 ld.shared.v2 per thread: one scale pair per token column pair)
//   3 wait:     chunk accumulator and wait<0> per stage, no promotion
//   4 rs raw:   as 0 with A from registers (RS wgmma: shared memory feeds B only; A fixed fragments)
//   5 rs promote: as 1 with A from registers
//   6 lockstep: as 2, and every warpgroup meets at a named barrier before each stage's wgmmas (the
//               package consumers both wait on the stage's full barrier, so they issue together)
//   7 copy only: no math; the copy warp below runs 2 x 16 KiB per stage (a 128 x 128 stage's bytes)
//   8 raw+ffma: as 0, plus the promotion's 64 FFMA per thread and stage on registers of their own
//               (no wait<0>, no accumulator reads): the FFMA issue without the promotion's drain
//   9 raw+ffma wg1: as 8 with the FFMA in warpgroup 1 only (half the FFMA issue)
// CW copy warps (one by default) share the S slots: 4 warps put one on each SM sub-partition.
// "+copy sS" cases add one warp that keeps S 16 KiB bulk copies (cp.async.bulk) in flight from an
// L2-resident 16 MiB buffer into shared memory for as long as the math runs: the load path's traffic
// beside the math, without the pipeline's barriers; "copy mc sS" multicasts each copy into both CTAs
// of a 2-CTA cluster (each SM receives every byte, the L2 serves half). Copy columns: bytes per SM
// clock and all bytes landed over the launch time (TB/s).
// Prints ms per launch (median after --warm-ms of back-to-back launches), SM clocks per stage, the
// clock the SMs ran at (clock64 over elapsed time: a lower bound, the event time holds the launch and
// the shared-memory fill), TFLOP/s, and the copy columns.
//
// Build (the package's include paths; binary gitignored):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -cudart static \
//     -I. -I$CUT -o tools/lab/fp8_prepared/wgmma_rate tools/lab/fp8_prepared/wgmma_rate.cu
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include "csrc/mbarrier_sm90.cuh"
#include "csrc/wgmma_sm90_common.cuh"  // smem_desc_sw128, fence_acc: the kernels' own
#include "tools/bench/cuda_check.h"

namespace gmma = cute::SM90::GMMA;
using jax_nvfp4::fence_acc;
using jax_nvfp4::smem_desc_sw128;
using jax_nvfp4::smem_u32;

template <int NN>
struct Op;
template <>
struct Op<128> {
  using SS = gmma::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;
  using RS = gmma::MMA_64x128x32_F32E4M3E4M3_RS_TN<>;
};
template <>
struct Op<192> {
  using SS = gmma::MMA_64x192x32_F32E4M3E4M3_SS_TN<>;
  using RS = gmma::MMA_64x192x32_F32E4M3E4M3_RS_TN<>;
};
template <>
struct Op<256> {
  using SS = gmma::MMA_64x256x32_F32E4M3E4M3_SS_TN<>;
  using RS = gmma::MMA_64x256x32_F32E4M3E4M3_RS_TN<>;
};

template <int NN, typename Acc, size_t... I>
__device__ __forceinline__ void mma_rs(const uint4& a, uint64_t db, Acc& acc, gmma::ScaleOut sc,
                                       std::index_sequence<I...>) {
  Op<NN>::RS::fma(a.x, a.y, a.z, a.w, db, acc[I]..., sc);
}
template <int NN, typename Acc, size_t... I>
__device__ __forceinline__ void mma(uint64_t da, uint64_t db, Acc& acc, gmma::ScaleOut sc, std::index_sequence<I...>) {
  Op<NN>::SS::fma(da, db, acc[I]..., sc);
}

constexpr int kStages = 4;

constexpr int kCopyBytes = 16384;           // one bulk copy
constexpr int64_t kSrcBytes = 16 << 20;     // the copies' source, L2-resident after the first pass

// CS copy slots (0: no copy warp); without math (copy only) the operand buffers are left out.
template <int NN, int NWG, int CS, bool MATH>
struct Lay {
  static constexpr int kA = MATH ? NWG * 64 * 128 : 0;
  static constexpr int kStage = MATH ? kA + NN * 128 : 0;
  static constexpr int kXs = kStages * kStage;
  static constexpr int kCopy = kXs + (MATH ? kStages * NN * 4 : 0);
  static constexpr int kBar = kCopy + CS * kCopyBytes;  // full[CS], free[CS], the done flag
  static constexpr int kSmem = kBar + 16 * (CS > 0 ? CS : 1) + 16 + 1024;
};

// The bulk copy into the same offset of both CTAs of a 2-CTA cluster, completing on each one's mbarrier.
__device__ __forceinline__ void bulk_load_mc2(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "h"(static_cast<uint16_t>(3))
      : "memory");
}

// The copy warp's lane 0: 16 KiB bulk copies into CS slots, each reissued once its previous copy
// landed, until the math's warpgroup 0 raises the done flag (or, with ncopy > 0, after ncopy copies).
// MC (2-CTA cluster, copy only): slot j's copies are issued by CTA j % 2 and multicast into both; a
// slot is reissued once both CTAs saw its previous copy land (free[j], two arrivals), so each CTA
// receives every copy while the L2 serves each once.
// With CW copy warps (not with MC), warp cw keeps slots cw, cw + CW, ... (CS / CW of them).
template <typename L, int CS, bool MC, int CW = 1>
__device__ void copy_warp(uint8_t* smem, const uint8_t* src, int64_t ncopy, long long* cstats, int cw = 0) {
  static_assert(CS % CW == 0 && (!MC || CW == 1), "copy slots per warp");
  constexpr int kOwn = CS / CW;
  const uint32_t full = smem_u32(smem + L::kBar), freeb = full + 8 * CS;
  volatile int* done = reinterpret_cast<volatile int*>(smem + L::kBar + 16 * CS);
  const uint32_t rank = MC ? cute::block_rank_in_cluster() : 0u;
  const long long c0 = clock64();
  int64_t n = 0;
  for (; ncopy > 0 ? n < ncopy : !*done; ++n) {
    const int j = cw + CW * static_cast<int>(n % kOwn);
    const uint32_t ph = static_cast<uint32_t>((n / kOwn) & 1);
    if (n >= kOwn) jax_nvfp4::mbar_wait(full + 8 * j, ph ^ 1u);  // this slot's previous copy landed
    jax_nvfp4::mbar_arrive_expect_tx(full + 8 * j, kCopyBytes);
    const int64_t off =
        ((static_cast<int64_t>(blockIdx.x / (MC ? 2 : 1)) * 61 + n * CW + cw) * kCopyBytes) % kSrcBytes;
    const uint32_t dst = smem_u32(smem + L::kCopy + j * kCopyBytes);
    if constexpr (MC) {
      if (n >= CS) jax_nvfp4::mbar_arrive_cluster(freeb + 8 * j, static_cast<uint32_t>(j & 1));
      if (static_cast<uint32_t>(j & 1) == rank) {
        if (n >= CS) jax_nvfp4::mbar_wait(freeb + 8 * j, ph ^ 1u);  // and in the other CTA
        bulk_load_mc2(dst, src + off, kCopyBytes, full + 8 * j);
      }
    } else {
      jax_nvfp4::bulk_load(dst, src + off, kCopyBytes, full + 8 * j);
    }
  }
  for (int64_t m = n - kOwn < 0 ? 0 : n - kOwn; m < n; ++m)  // drain
    jax_nvfp4::mbar_wait(full + 8 * (cw + CW * static_cast<int>(m % kOwn)), static_cast<uint32_t>((m / kOwn) & 1));
  cstats[2 * (blockIdx.x * CW + cw)] = n * kCopyBytes;
  cstats[2 * (blockIdx.x * CW + cw) + 1] = clock64() - c0;
}

template <int NN, int NWG, int MODE, int CS, bool MC, int CW>
__global__ void __launch_bounds__(128 * NWG + (CS > 0 ? 32 * CW : 0), 1)
    rate_kernel(int iters, float* sink, long long* clocks, long long* cstats, const uint8_t* src) {
  constexpr bool kCopy = CS > 0;
  using L = Lay<NN, NWG, CS, MODE != 7>;
  static_assert(!MC || MODE == 7, "multicast copies only without math (both CTAs must issue as many)");
  extern __shared__ uint8_t raw[];
  uint8_t* smem = raw + ((1024u - (smem_u32(raw) & 1023u)) & 1023u);
  if (kCopy && threadIdx.x == 0) {
    for (int j = 0; j < CS; ++j) {
      jax_nvfp4::mbar_init(smem_u32(smem + L::kBar) + 8 * j, 1);
      jax_nvfp4::mbar_init(smem_u32(smem + L::kBar) + 8 * (CS + j), 2);
    }
    *reinterpret_cast<volatile int*>(smem + L::kBar + 16 * CS) = 0;
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // random e4m3 bytes without NaN (exponent field below 15), scales powers of two
  uint32_t h = 2654435761u * (blockIdx.x + 1);
  for (int i = threadIdx.x * 4; i < L::kXs; i += blockDim.x * 4) {
    h ^= h << 13; h ^= h >> 17; h ^= h << 5;
    *reinterpret_cast<uint32_t*>(smem + i) = (h ^ i) & 0x77777777u;
  }
  if constexpr (MODE != 7)
    for (int i = threadIdx.x; i < kStages * NN; i += blockDim.x)
      reinterpret_cast<float*>(smem + L::kXs)[i] = (i & 1) ? 0.5f : 0.25f;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  if constexpr (MC) cute::cluster_sync();  // the other CTA's barriers are initialized
  if constexpr (MODE == 7) {
    if (threadIdx.x >= 128 * NWG && threadIdx.x % 32 == 0)
      copy_warp<L, CS, MC, CW>(smem, src, 2 * static_cast<int64_t>(iters) / CW, cstats, (threadIdx.x - 128 * NWG) / 32);
    if (threadIdx.x == 0) clocks[blockIdx.x] = 0;
    __syncwarp();
    if constexpr (MC) cute::cluster_sync();  // no CTA leaves while copies into it are in flight
    return;
  }
  if constexpr (kCopy) {
    if (threadIdx.x >= 128 * NWG) {
      if (threadIdx.x % 32 == 0) copy_warp<L, CS, false, CW>(smem, src, 0, cstats, (threadIdx.x - 128 * NWG) / 32);
      return;
    }
  }

  const int wg = threadIdx.x >> 7;
  const int t4 = threadIdx.x & 3;
  const uint32_t base = smem_u32(smem);
  const uint64_t hi = smem_desc_sw128(0) & 0xFFFFFFFF00000000ull;
  const uint32_t a0 = static_cast<uint32_t>(smem_desc_sw128(base + wg * 64 * 128));
  const uint32_t b0 = static_cast<uint32_t>(smem_desc_sw128(base + L::kA));
  float acc[NN / 2];
#pragma unroll
  for (int i = 0; i < NN / 2; ++i) acc[i] = 0.0f;
  const float s0 = reinterpret_cast<float*>(smem + L::kXs)[t4], s1 = reinterpret_cast<float*>(smem + L::kXs)[t4 + 1];
  uint4 afr[4];  // RS modes: fixed A fragments (values only matter for power)
#pragma unroll
  for (int j = 0; j < 4; ++j) afr[j] = reinterpret_cast<const uint4*>(smem)[(threadIdx.x * 4 + j) & 1023];
  constexpr bool kBusy = MODE == 8 || MODE == 9;
  float busy[kBusy ? NN / 4 : 1];
#pragma unroll
  for (int i = 0; i < (kBusy ? NN / 4 : 1); ++i) busy[i] = static_cast<float>(i);
  const long long c0 = clock64();
  int s = 0;
#pragma unroll 1
  for (int it = 0; it < iters; ++it) {
    const uint32_t so = static_cast<uint32_t>(s) * (L::kStage >> 4);
    uint32_t zero = 0u, one = 1u;
    asm volatile("" : "+r"(zero), "+r"(one)::"memory");
    if constexpr (MODE == 0 || MODE == 4 || kBusy) {
      // no operand fence here: reading acc while a stage is in flight serializes the wgmmas (C7514)
      cute::warpgroup_arrive();
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if constexpr (MODE != 4)
          mma<NN>(hi | (a0 + so + 2 * j), hi | (b0 + so + 2 * j), acc, gmma::ScaleOut::One,
                  std::make_index_sequence<NN / 2>{});
        else
          mma_rs<NN>(afr[j], hi | (b0 + so + 2 * j), acc, gmma::ScaleOut::One, std::make_index_sequence<NN / 2>{});
      }
      cute::warpgroup_commit_batch();
      if (kBusy && (MODE == 8 || wg == 1)) {
#pragma unroll
        for (int i = 0; i < NN / 4; ++i) {
          busy[i] = fmaf(busy[i], s0, s1);
          busy[i] = fmaf(busy[i], s1, s0);
        }
      }
      cute::warpgroup_wait<1>();
    } else {
      float part[NN / 2];
      float2 xsc[MODE == 2 || MODE == 6 ? NN / 8 : 1];
      if constexpr (MODE == 6) asm volatile("bar.sync 1, %0;\n" ::"n"(128 * NWG) : "memory");
      if constexpr (MODE == 2 || MODE == 6) {
        const uint32_t xa = base + L::kXs + s * (NN * 4) + 8 * t4;
#pragma unroll
        for (int j8 = 0; j8 < NN / 8; ++j8)
          asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(xsc[j8].x), "=f"(xsc[j8].y) : "r"(xa + 32 * j8));
      }
      fence_acc(part);
      cute::warpgroup_arrive();
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const gmma::ScaleOut sc = static_cast<gmma::ScaleOut>(j == 0 ? zero : one);
        if constexpr (MODE == 5)
          mma_rs<NN>(afr[j], hi | (b0 + so + 2 * j), part, sc, std::make_index_sequence<NN / 2>{});
        else
          mma<NN>(hi | (a0 + so + 2 * j), hi | (b0 + so + 2 * j), part, sc, std::make_index_sequence<NN / 2>{});
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
      fence_acc(part);
      if constexpr (MODE == 1 || MODE == 5) {
#pragma unroll
        for (int i = 0; i < NN / 2; i += 2) {
          acc[i] = fmaf(part[i], s0, acc[i]);
          acc[i + 1] = fmaf(part[i + 1], s1, acc[i + 1]);
        }
      } else if constexpr (MODE == 2 || MODE == 6) {  // the package consumer's promotion
#pragma unroll
        for (int j8 = 0; j8 < NN / 8; ++j8) {
          acc[4 * j8 + 0] = fmaf(part[4 * j8 + 0], xsc[j8].x, acc[4 * j8 + 0]);
          acc[4 * j8 + 1] = fmaf(part[4 * j8 + 1], xsc[j8].y, acc[4 * j8 + 1]);
          acc[4 * j8 + 2] = fmaf(part[4 * j8 + 2], xsc[j8].x, acc[4 * j8 + 2]);
          acc[4 * j8 + 3] = fmaf(part[4 * j8 + 3], xsc[j8].y, acc[4 * j8 + 3]);
        }
      } else {
        // wait only: keep part alive through one register per thread
        acc[0] += part[0];
      }
    }
    s = (s + 1 == kStages) ? 0 : s + 1;
  }
  cute::warpgroup_wait<0>();
  fence_acc(acc);
  const long long c1 = clock64();
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < NN / 2; ++i) sum += acc[i];
  if constexpr (kBusy)
#pragma unroll
    for (int i = 0; i < NN / 4; ++i) sum += busy[i];
  if (sum == 1234.5f) sink[blockIdx.x * blockDim.x + threadIdx.x] = sum;  // keeps the math alive
  if (threadIdx.x == 0) {
    clocks[blockIdx.x] = c1 - c0;
    if constexpr (kCopy) *reinterpret_cast<volatile int*>(smem + L::kBar + 16 * CS) = 1;
  }
}

struct Case {
  const char* name;
  int nn, nwg, mode, cs;
  bool mc;
  int cw;
  void (*kernel)(int, float*, long long*, long long*, const uint8_t*);
  int smem;
};

template <int NN, int NWG, int MODE, int CS = 0, bool MC = false, int CW = 1>
Case make(const char* name) {
  constexpr int smem = Lay<NN, NWG, CS, MODE != 7>::kSmem;
  static_assert(smem <= 232448, "shared memory");
  return Case{name, NN, NWG, MODE, CS, MC, CW, rate_kernel<NN, NWG, MODE, CS, MC, CW>, smem};
}

int main(int argc, char** argv) {
  int iters = 4000;
  double warm_ms = 1500;
  int reps = 50;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--warm-ms")) warm_ms = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--only")) only = argv[++i];
  }
  std::vector<Case> cases = {
      make<128, 2, 0>("n128 wg2 raw"),     make<128, 2, 1>("n128 wg2 promote"),
      make<128, 2, 2>("n128 wg2 scales"),  make<128, 2, 3>("n128 wg2 wait"),
      make<192, 2, 0>("n192 wg2 raw"),     make<192, 2, 1>("n192 wg2 promote"),
      make<192, 2, 2>("n192 wg2 scales"),  make<192, 2, 3>("n192 wg2 wait"),
      make<256, 2, 0>("n256 wg2 raw"),     make<256, 2, 3>("n256 wg2 wait"),
      make<128, 3, 0>("n128 wg3 raw"),     make<128, 3, 1>("n128 wg3 promote"),
      make<128, 2, 4>("n128 wg2 rs raw"),  make<128, 2, 5>("n128 wg2 rs promote"),
      make<192, 2, 4>("n192 wg2 rs raw"),  make<192, 2, 5>("n192 wg2 rs promote"),
      make<256, 2, 4>("n256 wg2 rs raw"),
      make<128, 2, 6>("n128 wg2 lockstep"), make<192, 2, 6>("n192 wg2 lockstep"),
      make<128, 3, 2>("n128 wg3 scales"),  make<128, 3, 6>("n128 wg3 lockstep"),
      // the load path's ceiling: copies alone with 2 / 4 / 8 / 12 slots of 16 KiB in flight, and
      // multicast into 2-CTA clusters (each CTA receives every byte, the L2 serves half)
      make<128, 2, 7, 2>("copy only s2"),  make<128, 2, 7, 4>("copy only s4"),
      make<128, 2, 7, 8>("copy only s8"),  make<128, 2, 7, 12>("copy only s12"),
      make<128, 2, 7, 4, true>("copy mc s4"), make<128, 2, 7, 8, true>("copy mc s8"),
      make<128, 2, 7, 12, true>("copy mc s12"),
      // (three warpgroups + the copy warp leave 152 registers a thread: the wg3 modes spill)
      make<128, 2, 0, 2>("n128 wg2 raw+copy s2"), make<128, 2, 1, 2>("n128 wg2 promote+copy s2"),
      make<128, 2, 6, 2>("n128 wg2 lockstep+copy s2"),
      make<128, 2, 0, 4>("n128 wg2 raw+copy s4"), make<128, 2, 1, 4>("n128 wg2 promote+copy s4"),
      make<128, 2, 6, 4>("n128 wg2 lockstep+copy s4"),
      // what in the promotion costs the copies: its FFMA issue alone (raw+ffma), or its drain (wait)
      make<128, 2, 8>("n128 wg2 raw+ffma"), make<128, 2, 8, 4>("n128 wg2 raw+ffma+copy s4"),
      make<128, 2, 3, 4>("n128 wg2 wait+copy s4"), make<128, 2, 2, 4>("n128 wg2 scales+copy s4"),
      make<128, 2, 9, 4>("n128 wg2 raw+ffma wg1+copy s4"),
      // four copy warps, one slot each: is the copy warp's issue what the FFMA delays?
      make<128, 2, 7, 4, false, 4>("copy only s4 w4"), make<128, 2, 0, 4, false, 4>("n128 wg2 raw+copy s4 w4"),
      make<128, 2, 8, 4, false, 4>("n128 wg2 raw+ffma+copy s4 w4"),
      make<128, 2, 1, 4, false, 4>("n128 wg2 promote+copy s4 w4"),
  };
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("# %s, %d SMs, iters %d per CTA, warm %.0f ms, median of %d\n", prop.name, sms, iters, warm_ms, reps);
  std::printf("%-26s %9s %9s %11s %8s %9s %10s %8s %6s\n", "case", "ms", "clk/stage", "tensor clk", "GHz",
              "TFLOP/s", "copy B/clk", "in TB/s", "CTAs");
  float* sink;
  long long *clk, *cst;
  uint8_t* src;
  CK(cudaMalloc(&sink, sms * 512 * sizeof(float)));
  CK(cudaMalloc(&clk, sms * sizeof(long long)));
  CK(cudaMalloc(&cst, 8 * sms * sizeof(long long)));  // up to 4 copy warps a CTA
  CK(cudaMalloc(&src, kSrcBytes));
  CK(cudaMemset(src, 0x35, kSrcBytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (const Case& c : cases) {
    if (!only.empty() && std::string(c.name).find(only) == std::string::npos) continue;
    CK(cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, c.smem));
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = c.mc ? 2 : 1;
    attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cfg.blockDim = dim3(128 * c.nwg + (c.cs > 0 ? 32 * c.cw : 0));
    cfg.dynamicSmemBytes = c.smem;
    cfg.gridDim = dim3(sms);
    int ctas = sms;
    if (c.mc) {  // as many 2-CTA clusters as can run at once (a GPC with an odd SM count idles one)
      int clusters = 0;
      CK(cudaOccupancyMaxActiveClusters(&clusters, c.kernel, &cfg));
      ctas = std::min(sms, 2 * clusters);
      cfg.gridDim = dim3(ctas);
    }
    auto launch = [&] { CK(cudaLaunchKernelEx(&cfg, c.kernel, iters, sink, clk, cst, src)); };
    auto t0 = std::chrono::steady_clock::now();
    do {
      for (int i = 0; i < 10; ++i) launch();
      CK(cudaDeviceSynchronize());
    } while (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() < warm_ms);
    CK(cudaGetLastError());
    std::vector<float> ms(reps);
    std::vector<long long> cl(sms), cs(8 * sms);
    double clk_sum = 0, copy_bpc = 0, copy_bytes = 0;
    for (int r = 0; r < reps; ++r) {
      CK(cudaEventRecord(e0));
      launch();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      CK(cudaEventElapsedTime(&ms[r], e0, e1));
      CK(cudaMemcpy(cl.data(), clk, sms * sizeof(long long), cudaMemcpyDeviceToHost));
      clk_sum += *std::max_element(cl.begin(), cl.begin() + ctas);
      if (c.cs > 0) {
        CK(cudaMemcpy(cs.data(), cst, 8 * sms * sizeof(long long), cudaMemcpyDeviceToHost));
        double b = 0, k = 0;  // bytes of all copy warps; clocks: each CTA's longest copy warp
        for (int i = 0; i < ctas; ++i) {
          long long kmax = 0;
          for (int w = 0; w < c.cw; ++w) b += cs[2 * (i * c.cw + w)], kmax = std::max(kmax, cs[2 * (i * c.cw + w) + 1]);
          k += kmax;
        }
        copy_bpc += b / k;
        copy_bytes += b;
        if (c.mode == 7) clk_sum += k / ctas;  // copy only: the copy warp's clocks
      }
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[reps / 2];
    const double cps = clk_sum / reps / iters;
    const double tensor = c.nwg * 4 * 64.0 * c.nn / 128.0;  // m64nNk32 e4m3: N/2 clocks at 4096 MAC/clk/SM
    const double ghz = clk_sum / reps / (med * 1e6);
    const double flop = 2.0 * sms * double(iters) * c.nwg * 64 * c.nn * 128;
    // in TB/s: bytes landed in shared memory (all CTAs) over the median launch time
    if (c.cs > 0)
      std::printf("%-26s %9.3f %9.1f %11.0f %8.3f %9.1f %10.1f %8.2f %6d\n", c.name, med, cps, tensor, ghz,
                  c.mode == 7 ? 0.0 : flop / (med * 1e9), copy_bpc / reps, copy_bytes / reps / (med * 1e9), ctas);
    else
      std::printf("%-26s %9.3f %9.1f %11.0f %8.3f %9.1f\n", c.name, med, cps, tensor, ghz, flop / (med * 1e9));
  }
  return 0;
}
