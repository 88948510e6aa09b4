// Pieces shared by the persistent Hopper kernels (csrc/grouped_gemm_wgmma_sm90.cu, exact mode;
// csrc/grouped_gemm_fp8_sm90.cu and csrc/grouped_gemm_fp8_prepared_sm90.cu, FP8 mode): the named
// wrappers of the PTX they use (setmaxnreg, TMA and tensor-map prefetch, shared loads and stores,
// fences, the K-major 128-byte-swizzle WGMMA descriptor; those of mbarriers and cp.async are in
// csrc/mbarrier_sm90.cuh), the persistent tile walk over the group schedule
// (csrc/grouped_gemm_schedule.cuh), the FP8 kernels' schedule ring, the tile epilogue, the host's
// tensor-map encoder and SM count, and the FP8 kernels' launch path (their consumer side:
// csrc/fp8_consumer_sm90.cuh).
// Included by each .cu file (internal linkage).
#pragma once

#include <atomic>
#include <cstdint>

#include <cuda.h>  // CUtensorMap and its enums (types only; the encoder comes via the runtime)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "csrc/epilogue.cuh"
#include "csrc/grouped_gemm_schedule.cuh"
#include "csrc/mbarrier_sm90.cuh"

namespace jax_nvfp4 {
namespace {

constexpr int kRowsW = 128;  // weight rows (output columns) per CTA tile of both kernels

// Warp-specialization register split (setmaxnreg, warpgroup-wide): the producer warpgroup lowers
// its per-thread register count to R, the consumers raise theirs to R.
template <uint32_t R>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <uint32_t R>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
// Fetches a __grid_constant__ tensor map's descriptor ahead of its first TMA.
__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// Brings the line holding p into L1 (no wait).
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p)); }
// Orders this thread's generic-proxy shared-memory stores before later async-proxy accesses
// (wgmma operand reads, TMA writes) of the same memory.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ uint32_t lds_u16(uint32_t a) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ uint2 lds64(uint32_t a) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}
__device__ __forceinline__ float2 lds64f(uint32_t a) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(a));
  return v;
}
__device__ __forceinline__ void sts64(uint32_t a, uint32_t x, uint32_t y) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(a), "r"(x), "r"(y) : "memory");
}
__device__ __forceinline__ void sts128(uint32_t a, uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}
// 16 zero bytes at a.
__device__ __forceinline__ void sts128_zero(uint32_t a) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(a), "r"(0u) : "memory");
}
// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

template <int N>
__device__ __forceinline__ void fence_acc(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}
// The same for wgmma inputs that are not accumulators (descriptors, scale-d flags): computed before
// the fence, not sunk between the wgmmas (which makes ptxas serialize them).
__device__ __forceinline__ void fence_operand(uint64_t& x) { asm volatile("" : "+l"(x)::"memory"); }
__device__ __forceinline__ uint2 fence_operands(uint32_t x, uint32_t y) {
  asm volatile("" : "+r"(x), "+r"(y)::"memory");
  return make_uint2(x, y);
}

// Runs f.template operator()<NN>(args...) with NN = the smallest WGMMA N of 32/64/128 covering a tile of
// `rows` rows, or 256 for the 256-token tile (the wgmma and wgmma_fp8 kernels' mainloops and epilogues
// alike; every branch is warpgroup-uniform). A 256-token tile runs N = 256 whatever its rows: any second
// branch beside it makes ptxas serialize the wgmmas (C7512). ptxas must see one straight-line mainloop per
// branch, so the kernel's PTX has to stay that of the call written out in each branch: f is a stateless
// functor (StoreTile, each kernel's ConsumerMainloop) and args travel by value, a pointer where the callee
// takes a reference. A lambda, a functor holding the locals, or args bound to references take addresses
// the direct call does not: other PTX, and ptxas schedules the kernels differently
// (docs/archive/kernel-notes.md).
// The ternaries keep the branches a small BTMAX never takes instantiable.
template <int BTMAX, typename F, typename... Args>
__device__ __forceinline__ void with_tile_n(int rows, F f, Args... args) {
  if (BTMAX >= 256) {
    f.template operator()<(BTMAX >= 256 ? 256 : 32)>(args...);
  } else if (BTMAX >= 128 && rows > 64) {
    f.template operator()<(BTMAX >= 128 ? 128 : 32)>(args...);
  } else if (BTMAX >= 64 && rows > 32) {
    f.template operator()<(BTMAX >= 64 ? 64 : 32)>(args...);
  } else {
    f.template operator()<32>(args...);
  }
}

// Tile lookup (one warp, all lanes; returns the same values in every lane).
struct Tile {
  int g;
  int n0;
  int64_t row0;
  int rows;
};

__device__ __forceinline__ bool find_tile(int L, int total, const int* __restrict__ prefix,
                                          const int* __restrict__ starts, const int* __restrict__ ends, int G,
                                          int NT, int BTMAX, int& gcur, Tile& t) {
  if (L >= total) return false;
  const int q = L / NT;
  const int lane = threadIdx.x & 31;
  // prefix is nondecreasing, prefix[gcur] <= q (gcur only moves forward) and prefix[G] > q.
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
  // Single-CTA kernels (BTMAX <= 128) walk a group's tiles token-tile-major: n-tile-major with the
  // grid's even stride would give each CTA a fixed token-tile parity, so that in two-tile groups
  // the even CTAs got every full first tile (an imbalanced grid).
  // The paired 256-token kernel keeps n-tile-major: its groups have many token tiles, and a weight
  // tile's re-reads should stay in the same round of the walk (L2).
  const bool tmajor = BTMAX <= 128;
  const int nt = tmajor ? local % NT : local / tg;
  const int tt = tmajor ? local / NT : local - nt * tg;
  const int64_t st = __ldcg(starts + g);
  const int64_t en = __ldcg(ends + g);
  t.g = g;
  t.n0 = nt * kRowsW;
  t.row0 = st + static_cast<int64_t>(tt) * BTMAX;
  const int64_t r = en - t.row0;
  t.rows = static_cast<int>(r < BTMAX ? r : BTMAX);
  return true;
}

// The schedule ring of the FP8 kernels (csrc/grouped_gemm_fp8_sm90.cu, csrc/grouped_gemm_fp8_prepared_sm90.cu):
// the TMA warp walks the schedule once and publishes each tile, and at the end a tile of no rows, into
// kTileSlots shared-memory slots; the consumer warps take their tiles from there instead of each walking the
// schedule (find_tile's dependent L2 loads would sit between two tiles' mainloops). Shared memory:
// kTileRingBytes: Tile[kTileSlots], then the mbarriers tile_full[kTileSlots] and tile_empty[kTileSlots].
constexpr int kTileSlots = 4;
constexpr int kTileSlotBytes = 32;
constexpr int kTileRingBytes = kTileSlots * kTileSlotBytes + 2 * kTileSlots * 8;
static_assert(sizeof(Tile) <= kTileSlotBytes, "tile slot");
// The ring at byte offset kOff (8-byte aligned) of the block's shared memory `smem`; every address is
// `smem` plus a constant, as the kernels address their other shared-memory regions.
template <int kOff>
struct TileRing {
  static constexpr int kBars = kOff + kTileSlots * kTileSlotBytes;  // tile_full[], then tile_empty[]
  uint8_t* smem;
  int s = 0;
  uint32_t ph = 0;

  // One thread, before the block's first __syncthreads: tile_full counts the publisher, tile_empty the
  // consumer warps.
  static __device__ __forceinline__ void init(uint8_t* smem, int consumer_warps) {
#pragma unroll 1
    for (int i = 0; i < kTileSlots; ++i) {
      mbar_init(smem_u32(smem + kBars) + i * 8, 1);
      mbar_init(smem_u32(smem + kBars) + (kTileSlots + i) * 8, consumer_warps);
    }
  }
  // The publishing warp, all lanes (lane 0 waits for the slot and writes it).
  __device__ __forceinline__ void publish(const Tile& v, int lane) {
    if (lane == 0) {
      mbar_wait(smem_u32(smem + kBars) + (kTileSlots + s) * 8, ph ^ 1);
      reinterpret_cast<Tile*>(smem + kOff)[s] = v;
      mbar_arrive(smem_u32(smem + kBars) + s * 8);
    }
    advance_stage<kTileSlots>(s, ph);
  }
  // A consumer warp, all lanes: the next tile into v; false at the end (a tile of no rows).
  __device__ __forceinline__ bool next(Tile& v, int lane) {
    mbar_wait(smem_u32(smem + kBars) + s * 8, ph);
    v = reinterpret_cast<const Tile*>(smem + kOff)[s];
    __syncwarp();
    if (lane == 0) mbar_arrive(smem_u32(smem + kBars) + (kTileSlots + s) * 8);
    advance_stage<kTileSlots>(s, ph);
    return v.rows > 0;
  }
};

// Epilogue of both kernels: thread (lane) of consumer warp rows r0, r0 + 8 stores its m64nNN
// accumulators (the WGMMA D fragment: column pair 8j + 2 (lane % 4), rows +0 / +8) through
// store_pair (csrc/epilogue.cuh; rows inside the tile's group only), scaled by alpha times `fix`.
// Row scales (SwiGLU epilogue with p.row_scale): lane l loads the tile's rows 32q + l up front and each
// store takes its row's value by a shuffle: loads inside the store loop, behind its branches, would
// wait one after another.
template <int NN, int ACC, typename KParams>
__device__ __forceinline__ void store_tile(const float (&acc)[ACC], const KParams& p, const Tile& t, int r0,
                                           float fix) {
  const int lane = threadIdx.x & 31, t4 = lane & 3;
  const int64_t n = static_cast<int64_t>(t.n0) + r0;  // rows n and n + 8 of the weights, n % 16 < 8
  const int64_t rend = t.row0 + t.rows;
  float mul_lo, mul_hi;
  epilogue_factors(p, t.g, fix, mul_lo, mul_hi);
  constexpr int kQ = (NN + 31) / 32;
  const bool scaled = p.glu && p.row_scale != nullptr;  // uniform
  float rs[kQ];
#pragma unroll
  for (int q = 0; q < kQ; ++q) {
    const int64_t tok = t.row0 + 32 * q + lane;
    rs[q] = scaled && tok < rend ? __ldg(p.row_scale + tok) : 1.0f;
  }
#pragma unroll
  for (int j = 0; j < NN / 8; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int64_t tok = t.row0 + 8 * j + 2 * t4 + c;
      const float s = __shfl_sync(0xffffffffu, rs[j / 4], 8 * (j % 4) + 2 * t4 + c);
      if (tok < rend) store_pair(p, tok, n, acc[4 * j + c], acc[4 * j + 2 + c], mul_lo, mul_hi, s);
    }
  }
}
// store_tile<NN>(acc, p, t, r0, fix) as with_tile_n<BTMAX>(t.rows, StoreTile{}, &acc, &p, &t, r0, fix)
struct StoreTile {
  template <int NN, int ACC, typename KParams>
  __device__ __forceinline__ void operator()(float (*acc)[ACC], const KParams* p, const Tile* t, int r0,
                                             float fix) const {
    store_tile<NN>(*acc, *p, *t, r0, fix);
  }
};

// Host side
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn get_encode_fn() {
  static EncodeTiledFn fn = []() -> EncodeTiledFn {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return nullptr;
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

int num_sms() {
  static std::atomic<int> cache[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 132;
  if (dev < 64) {
    int v = cache[dev].load(std::memory_order_relaxed);
    if (v > 0) return v;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) sms = 132;
  if (dev < 64) cache[dev].store(sms, std::memory_order_relaxed);
  return sms;
}

// Raises the kernel's dynamic shared memory limit to `bytes`, once per device (the first call on a
// device; later calls are one atomic load).
template <typename Kernel>
cudaError_t set_smem_once(Kernel kernel, int bytes, std::atomic<uint64_t>& done_mask) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const uint64_t bit = dev < 64 ? (uint64_t(1) << dev) : 0;
  if (bit == 0 || !(done_mask.load(std::memory_order_acquire) & bit)) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return e;
    done_mask.fetch_or(bit, std::memory_order_acq_rel);
  }
  return cudaSuccess;
}

// A 2D tensor map over a row-major [rows][cols] tensor of `elem_bytes`-byte elements (row pitch
// cols * elem_bytes), box [box_rows][box_cols]; cudaErrorInvalidValue if the driver rejects it.
inline cudaError_t encode_2d(CUtensorMap* map, CUtensorMapDataType type, const void* ptr, int64_t cols, int64_t rows,
                             int elem_bytes, uint32_t box_cols, uint32_t box_rows, CUtensorMapSwizzle swizzle) {
  EncodeTiledFn encode = get_encode_fn();
  if (!encode) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols * elem_bytes)};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t estr[2] = {1, 1};
  if (encode(map, type, 2, const_cast<void*>(ptr), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return cudaErrorInvalidValue;
  return cudaSuccess;
}

// Host side of the two FP8 kernels (csrc/grouped_gemm_fp8_sm90.cu, csrc/grouped_gemm_fp8_prepared_sm90.cu).
// kFp8BK: k per pipeline stage = one promotion chunk = one 128-byte swizzle row of e4m3; kFp8BoxT: tokens
// per activation TMA box.
constexpr int kFp8BK = 128;
constexpr int kFp8BoxT = 32;

// Launches `kernel` (persistent: one CTA of `threads` per SM, smem_bytes of dynamic shared memory, raised
// once per device through done_mask) on two tensor maps: tm_a, the e4m3 activations [M][K] in boxes of
// kFp8BK k x kFp8BoxT tokens, 128-byte swizzle (the WGMMA K-major B layout); tm_w, the weights as bytes
// [G * N][w_cols] in boxes of w_box bytes x kRowsW rows, swizzled by w_swizzle.
template <typename Kernel, typename KParams>
cudaError_t launch_fp8_kernel(Kernel kernel, int threads, int smem_bytes, std::atomic<uint64_t>& done_mask,
                              const GroupedGemmParams& p, const KParams& kp, int64_t w_cols, uint32_t w_box,
                              CUtensorMapSwizzle w_swizzle, cudaStream_t stream) {
  cudaError_t e = set_smem_once(kernel, smem_bytes, done_mask);
  if (e != cudaSuccess) return e;
  CUtensorMap tm_a, tm_w;
  e = encode_2d(&tm_a, CU_TENSOR_MAP_DATA_TYPE_UINT8, p.lhs, p.K, p.M, 1, kFp8BK, kFp8BoxT, CU_TENSOR_MAP_SWIZZLE_128B);
  if (e != cudaSuccess) return e;
  e = encode_2d(&tm_w, CU_TENSOR_MAP_DATA_TYPE_UINT8, p.rhs, w_cols, p.G * p.N, 1, w_box, kRowsW, w_swizzle);
  if (e != cudaSuccess) return e;
  kernel<<<num_sms(), threads, smem_bytes, stream>>>(tm_a, tm_w, kp);
  return cudaGetLastError();
}

// The FP8 kernels' entry (LaunchGroupedGemmFp8, LaunchGroupedGemmFp8Prepared): the schedule (setup
// kernel), the kernel parameters (KParams: F8Params or P8Params, with the chunk scales xs and the tile
// counts NT, KT), then launch_entry<I>(kp) for c's entry I of the configuration table.
template <typename KParams, typename LaunchEntry>
cudaError_t run_fp8_gemm(const GroupedGemmParams& p, const KernelConfig& c, cudaStream_t stream,
                         LaunchEntry launch_entry) {
  if (p.M == 0 || p.N == 0) return cudaSuccess;

  int* ws = static_cast<int*>(p.workspace);
  cudaError_t e = launch_setup(p, c.token_tile, ws, stream);
  if (e != cudaSuccess) return e;

  KParams kp;
  fill_common_params(kp, p, ws);
  kp.xs = p.lhs_chunk_scales;
  kp.NT = static_cast<int>((p.N + kRowsW - 1) / kRowsW);
  kp.KT = static_cast<int>(p.K / kFp8BK);

  return WithConfigEntry(c, cudaErrorInvalidValue, [&](auto i) { return launch_entry(i, kp); });
}

}  // namespace
}  // namespace jax_nvfp4
