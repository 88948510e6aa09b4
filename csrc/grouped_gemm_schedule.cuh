// Group schedule shared by the grouped-GEMM kernels (csrc/grouped_gemm_mma.cu,
// csrc/grouped_gemm_wgmma_sm90.cu, csrc/grouped_gemm_fp8_sm90.cu): the workspace layout and the
// setup kernel that turns the device-side group sizes into clamped row bounds and token-tile prefix
// sums, and whose other blocks zero the output rows past the last group (the GEMM kernels never
// write them), so a GEMM is two launches (three for the 256-token wgmma configuration, whose short
// group tails go to the 128-token kernel). Included by the .cu files (internal linkage).
//
// Programmatic dependent launch (sm_90): the setup kernel lets the mma GEMM kernel launch while it
// runs; the dependent waits (griddepcontrol.wait) for its predecessor's completion and memory
// before touching the workspace or the output, so only the launch latencies overlap (which shows
// at decode sizes). griddepcontrol.wait is a no-op in a kernel launched
// without the attribute (the wgmma kernels are, and wait for the setup kernel as usual). Images for
// older architectures have no griddepcontrol, so their launches must not use the attribute
// (launch_maybe_pdl's pdl = false).
#pragma once

#include <cstdint>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "csrc/grouped_gemm.h"

namespace jax_nvfp4 {
namespace {

// Wait for the preceding kernel of the stream (programmatic dependent launch; no-op otherwise).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Let the next kernel of the stream launch now (it still waits for this one in pdl_wait).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent of the
// stream's previous kernel when pdl is set.
template <typename... KArgs, typename... Args>
inline cudaError_t launch_maybe_pdl(bool pdl, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                                    cudaStream_t stream, Args&&... args) {
  if (!pdl) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// Workspace (int32 words): one schedule is [1] total token tiles ([0] unused),
// [64, 64 + G] tile prefix sums, then [G] clamped group starts, then [G] clamped group ends. A split
// schedule (setup_kernel with BTB > 0) writes a second one at ws_split_off(G) for the rows of each
// group the first leaves to a kernel of BTB-row tiles (GroupedGemmWorkspaceBytes holds both).
constexpr int kWsTotalTiles = 1;
constexpr int kWsPrefix = 64;
__host__ __device__ constexpr int64_t ws_start_off(int64_t G) { return kWsPrefix + G + 1; }
__host__ __device__ constexpr int64_t ws_end_off(int64_t G) { return kWsPrefix + 2 * G + 1; }
__host__ __device__ constexpr int64_t ws_split_off(int64_t G) { return (kWsPrefix + 3 * G + 1 + 31) / 32 * 32; }
static_assert(4 * (2 * ws_split_off(1 << 20)) <= GroupedGemmWorkspaceBytes(1 << 20), "two schedules fit");
static_assert(4 * (2 * ws_split_off(1)) <= GroupedGemmWorkspaceBytes(1), "two schedules fit");

// Rows of a group of `rows` rows that a split schedule gives the BT-row tiles: all but a last
// partial tile of at most BTB rows (that one goes to the BTB-row tiles); everything without a split.
__device__ __forceinline__ long long split_head_rows(long long rows, int BT, int BTB) {
  const long long rem = rows % BT;
  return BTB > 0 && rem <= BTB ? rows - rem : rows;
}

// Inclusive scan of v over the block's 1024 threads: shuffles within each warp, then warp 0 scans
// the 32 warp totals (s_warp: 32 shared words, left holding their inclusive scan, so s_warp[31]
// is the block's total). Three barriers (a Hillis-Steele scan over shared
// memory takes twenty): the setup kernel sits on the GEMM's critical path.
__device__ __forceinline__ long long block_inclusive_scan(long long v, long long* s_warp, int tid) {
  const int lane = tid % 32, warp = tid / 32;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const long long u = __shfl_up_sync(0xFFFFFFFFu, v, off);
    if (lane >= off) v += u;
  }
  __syncthreads();  // s_warp's previous use is over
  if (lane == 31) s_warp[warp] = v;
  __syncthreads();
  if (warp == 0) {
    long long w = s_warp[lane];
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
      const long long u = __shfl_up_sync(0xFFFFFFFFu, w, off);
      if (lane >= off) w += u;
    }
    s_warp[lane] = w;
  }
  __syncthreads();
  return warp > 0 ? v + s_warp[warp - 1] : v;
}

// ---------------------------------------------------------------------------------------------
// Setup: clamped row offsets and token-tile prefix sums. One block of 1024 threads.
// Prefix sums of ceil(rows / bt) over this thread's groups [b, e), rows = ends - starts, scanned
// over the block; writes prefix[0..G] and the header's tile count.
__device__ __forceinline__ void write_tile_prefix(long long* s_warp, int tid, int64_t b, int64_t e, int64_t G,
                                                  int bt, int* __restrict__ sched) {
  const int* starts = sched + ws_start_off(G);
  const int* ends = sched + ws_end_off(G);
  long long tiles_local = 0;
  for (int64_t i = b; i < e; ++i) tiles_local += (ends[i] - starts[i] + bt - 1) / bt;
  const long long tiles_incl = block_inclusive_scan(tiles_local, s_warp, tid);
  long long tpre = tiles_incl - tiles_local;
  int* prefix = sched + kWsPrefix;
  for (int64_t i = b; i < e; ++i) {
    prefix[i] = static_cast<int>(tpre);
    tpre += (ends[i] - starts[i] + bt - 1) / bt;
  }
  if (tid == 1023) {
    prefix[G] = static_cast<int>(tiles_incl);
    sched[kWsTotalTiles] = static_cast<int>(tiles_incl);
  }
}

// The output rows past the last group, [min(sum of sizes, M), M) of an [M, row_bytes / esize]
// output (the element size esize: 2 or 4 bytes), set to +0 by blocks 1.. of the setup grid, each
// summing the group sizes itself (G words) rather than waiting for block 0.
struct TailZero {
  void* out;
  int64_t row_bytes;
  int esize;
};

__device__ __forceinline__ void store_zero(char* p, int esize) {
  if (esize == 4)
    *reinterpret_cast<uint32_t*>(p) = 0u;
  else
    *reinterpret_cast<uint16_t*>(p) = 0;
}

__device__ __forceinline__ void zero_tail_rows(const int32_t* __restrict__ gs, int64_t G, int64_t M,
                                               const TailZero& z, long long* s_warp) {
  const int tid = threadIdx.x;
  long long local = 0;
  for (int64_t i = tid; i < G; i += 1024) local += max(gs[i], 0);
  block_inclusive_scan(local, s_warp, tid);
  const long long total = s_warp[31] < M ? s_warp[31] : M;  // the scan leaves the block total there
  // 16-byte stores over the 16-byte aligned middle, element stores at the edges (rows of any width)
  char* const base = static_cast<char*>(z.out);
  const int64_t b0 = total * z.row_bytes, b1 = M * z.row_bytes;
  const int64_t mis = static_cast<int64_t>(reinterpret_cast<uintptr_t>(base) & 15);
  const int64_t v0 = (b0 + mis + 15) / 16 * 16 - mis, v1 = (b1 + mis) / 16 * 16 - mis;
  const int64_t stride = static_cast<int64_t>(gridDim.x - 1) * 1024;
  const int64_t first = static_cast<int64_t>(blockIdx.x - 1) * 1024 + tid;
  if (v0 < v1) {
    uint4* const vec = reinterpret_cast<uint4*>(base + v0);
    for (int64_t i = first; i < (v1 - v0) / 16; i += stride) vec[i] = make_uint4(0, 0, 0, 0);
    if (first == 0)
      for (int64_t b = b0; b < v0; b += z.esize) store_zero(base + b, z.esize);
    if (first == 1)
      for (int64_t b = v1; b < b1; b += z.esize) store_zero(base + b, z.esize);
  } else {
    for (int64_t b = b0 + first * z.esize; b < b1; b += stride * z.esize) store_zero(base + b, z.esize);
  }
}

// Setup kernels run one block of 1024 threads over the groups, each thread a contiguous run [b, e).
struct GroupRun {
  int64_t b, e;
};
__device__ __forceinline__ GroupRun group_run_of_thread(int64_t G) {
  const int64_t per = (G + 1023) / 1024;
  const int64_t b = threadIdx.x * per;
  return {b, b + per < G ? b + per : G};
}

// Every group's clamped row bounds (the contract's: [min(start, M), min(end, M)), a negative size
// read as 0): one block scan gives the thread's first start, then f(i, start, end) for each group i
// of its run, in order.
template <typename F>
__device__ __forceinline__ void for_each_clamped_group(const int32_t* __restrict__ gs, int64_t G, int64_t M,
                                                       GroupRun run, long long* s_warp, F&& f) {
  long long local = 0;
  for (int64_t i = run.b; i < run.e; ++i) local += max(gs[i], 0);
  long long pre = block_inclusive_scan(local, s_warp, threadIdx.x) - local;
  for (int64_t i = run.b; i < run.e; ++i) {
    const long long st = pre < M ? pre : M;
    pre += max(gs[i], 0);
    f(i, st, pre < M ? pre : M);
  }
}

// Block 0: tiles of BT rows; with BTB > 0 also the split schedule at ws_split_off(G): each group's
// last partial tile of at most BTB rows there, in tiles of BTB rows (split_head_rows). Blocks 1..:
// the output rows past the last group (zero_tail_rows).
__global__ void __launch_bounds__(1024) setup_kernel(const int32_t* __restrict__ gs, int64_t G, int64_t M, int BT,
                                                     int BTB, int* __restrict__ ws, TailZero tail) {
  pdl_launch_dependents();  // the GEMM kernel may get resident now; it waits for our writes
  __shared__ long long s_warp[32];
  if (blockIdx.x > 0) {
    zero_tail_rows(gs, G, M, tail, s_warp);
    return;
  }
  const int tid = threadIdx.x;
  int* split = ws + ws_split_off(G);
  const GroupRun run = group_run_of_thread(G);
  for_each_clamped_group(gs, G, M, run, s_warp, [&](int64_t i, long long st, long long en) {
    const long long mid = st + split_head_rows(en - st, BT, BTB);
    ws[ws_start_off(G) + i] = static_cast<int>(st);
    ws[ws_end_off(G) + i] = static_cast<int>(mid);
    if (BTB > 0) {
      split[ws_start_off(G) + i] = static_cast<int>(mid);
      split[ws_end_off(G) + i] = static_cast<int>(en);
    }
  });
  write_tile_prefix(s_warp, tid, run.b, run.e, G, BT, ws);
  if (BTB > 0) write_tile_prefix(s_warp, tid, run.b, run.e, G, BTB, split);
}

// ---------------------------------------------------------------------------------------------

// The fields both kernels' parameter blocks (mma KParams, wgmma WParams) copy from the launch params.
template <typename KernelParams>
inline void fill_common_params(KernelParams& k, const GroupedGemmParams& p, const int* ws) {
  k.rhs = p.rhs;
  k.rhs_scales = p.rhs_scales;
  k.alpha = p.alpha;
  k.out = p.out;
  k.ws = ws;
  k.M = p.M;
  k.N = p.N;
  k.K = p.K;
  k.G = p.G;
  k.out_f32 = p.out_f32;
  k.glu = p.glu;
  k.glu_limit = p.glu_limit;
  k.row_scale = p.row_scale;
}

// Enqueues the setup kernel for token tiles of BT rows (before the GEMM kernel); with BTB > 0 the
// split schedule too (setup_kernel). Its blocks past the first zero the output rows past the last
// group: one per 64 KiB of output, at most 256 (they exit at once when the groups fill the output).
inline cudaError_t launch_setup(const GroupedGemmParams& p, int BT, int* ws, cudaStream_t stream, int BTB = 0) {
  TailZero tail;
  tail.out = p.out;
  tail.esize = p.out_f32 ? 4 : 2;
  tail.row_bytes = OutputColumns(p) * tail.esize;
  const int64_t bytes = p.M * tail.row_bytes;
  const int64_t zero_blocks = (bytes + 65535) / 65536;
  const unsigned grid = 1u + static_cast<unsigned>(zero_blocks < 256 ? zero_blocks : 256);
  setup_kernel<<<grid, 1024, 0, stream>>>(p.group_sizes, p.G, p.M, BT, BTB, ws, tail);
  return cudaGetLastError();
}

}  // namespace
}  // namespace jax_nvfp4
