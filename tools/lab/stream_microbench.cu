// Lab microbenchmark (tools/lab/): "v1" below is the mma kernel, "v2" the wgmma kernel, as the archived
// notes (docs/archive/perf-notes.md) name them.
// Streaming ceiling of v1's decode pipeline shape, without its math (Hopper, sm_90a).
//
// Question it answers (docs/archive/perf-notes.md, session 5): is v1 at decode (L1 192 rows: 2.3-2.6 TB/s
// of weights) limited by the bytes its cp.async pipeline keeps in flight, or by its instruction
// issue? This kernel copies what v1's 16-token config copies per 64-wide k-tile (per CTA of 128
// threads: 128 weight rows x 32 B, 128 x 4 B of block scales, 16 activation rows x 128 B that every
// CTA shares from L2), with the same wait / barrier / issue order, but consumes each stage with one
// shared load per thread. A second placement, "tiled", makes each 128 x 64 block's 4096 bytes
// contiguous: does a tile-major weight layout stream faster? Session 6 on the H200 (L1 shape): rows
// 1.6-1.7 TB/s at every depth (slower than v1 itself, ~2.2 TB/s on the same bytes: this kernel does
// not model v1's speed, for reasons not found), tiled 1.9-3.0 TB/s (best at 3 stages). The tiled
// placement, adopted by the sm90 layout, then gave v1 -8% at decode (docs/archive/perf-notes.md). The
// third placement, kmajor, streamed exactly as tiled (session 7). The persistent, bulk-copy
// counterpart is tools/lab/stream_bulk_microbench.cu.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I. -o /tmp/smb tools/lab/stream_microbench.cu
//   /tmp/smb            # L1 decode shape: 2016 CTAs (42 experts x 48 n-tiles), K 7168
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "tools/bench/cuda_check.h"

constexpr int kThreads = 128;
constexpr int kStage = 4096 + 512 + 16 * 144;  // weights, scales, activations (v1's pitch)

__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// TILED = false: the checkpoint placement (and the sm90 layout's before session 6), a 128-row x
// 64-k block is 128 runs of 32 bytes K/2 apart; lane pairs copy one row's two 16-byte halves (as v1
// does: 16 rows per instruction).
// TILED = true: the block's 4096 bytes are contiguous (a tile-major layout), one 16-byte run per
// lane per instruction, 512 contiguous bytes per warp instruction.
// P = kRows / kTiled / kKMajor: kKMajor orders one expert's blocks k-tile first, (k-tile, n-tile),
// so that the CTAs of one expert, which run in near lockstep, read one contiguous 48 x 4 KB region
// per k-tile (DRAM row locality) instead of 48 regions 458 KB apart.
enum Placement { kRows = 0, kTiled = 1, kKMajor = 2 };
constexpr int kTilesPerExpert = 48;  // L1: N 6144 / 128
template <int STAGES, int MIN_BLOCKS, int P>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS)
    stream_kernel(const uint8_t* __restrict__ w, const uint8_t* __restrict__ ws, const uint8_t* __restrict__ act,
                  int K, float* __restrict__ sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, KH = K / 2, KS = K / 16, KT = K / 64;
  const int64_t tile = blockIdx.x;
  const int64_t ex = tile / kTilesPerExpert, nt = tile % kTilesPerExpert;
  // kKMajor: the expert's region, then block (kt, nt) at (kt * 48 + nt) * 4096
  const uint8_t* wtile = P == kKMajor ? w + ex * kTilesPerExpert * 128 * KH + nt * 4096 : w + tile * 128 * KH;
  const uint8_t* srow = ws + (tile * 128 + tid) * KS;
  const uint8_t* arow = act + static_cast<int64_t>(tid >> 3) * K * 2 + (tid & 7) * 16;  // shared by all CTAs
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  auto load = [&](int s, int kt) {
    const uint32_t st = base + s * kStage;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int i = tid + j * kThreads;  // 16-byte chunk i of the block's 256
      const uint8_t* src = P == kKMajor ? wtile + static_cast<int64_t>(kt) * kTilesPerExpert * 4096 + i * 16
                           : P == kTiled  ? wtile + static_cast<int64_t>(kt) * 4096 + i * 16
                                          : wtile + static_cast<int64_t>(i >> 1) * KH + kt * 32 + (i & 1) * 16;
      cp16(st + i * 16, src);
    }
    cp4(st + 4096 + tid * 4, srow + kt * 4);
    cp16(st + 4608 + (tid >> 3) * 144 + (tid & 7) * 16, arow + kt * 128);
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) load(s, s);
    commit();
  }
  uint32_t acc = 0;
  for (int kt = 0; kt < KT; ++kt) {
    wait_group<STAGES - 2>();
    __syncthreads();
    if (kt + STAGES - 1 < KT) load((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
    commit();
    const uint8_t* st = smem + (kt % STAGES) * kStage;
    const uint4 v = *reinterpret_cast<const uint4*>(st + tid * 32);
    acc += v.x ^ v.y ^ v.z ^ v.w ^ *reinterpret_cast<const uint32_t*>(st + 4096 + tid * 4);
  }
  wait_group<0>();
  sink[tile * kThreads + tid] = static_cast<float>(acc);
}

template <int STAGES, int MIN_BLOCKS, int P>
float run(const uint8_t* w, const uint8_t* ws, const uint8_t* act, int K, int tiles, float* sink) {
  auto k = stream_kernel<STAGES, MIN_BLOCKS, P>;
  const int smem = STAGES * kStage;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kThreads, smem));
  const float ms = ms_per_launch([&] { k<<<tiles, kThreads, smem>>>(w, ws, act, K, sink); });
  const double bytes = static_cast<double>(tiles) * 128 * (K / 2 + K / 16);
  std::printf("| %s | %d | %d | %d | %.1f | %.4f | %.0f |\n", P == kKMajor ? "kmajor" : P == kTiled ? "tiled" : "rows", STAGES, MIN_BLOCKS, per_sm,
              per_sm * (STAGES - 1) * kStage / 1024.0, ms, bytes / ms / 1e6);
  return ms;
}

int main(int argc, char** argv) {
  const int K = argc > 1 ? std::atoi(argv[1]) : 7168;      // L1: 7168, L2: 3072
  const int tiles = argc > 2 ? std::atoi(argv[2]) : 2016;  // 42 active experts x 48 n-tiles (L1)
  const size_t wbytes = static_cast<size_t>(tiles) * 128 * (K / 2), sbytes = static_cast<size_t>(tiles) * 128 * (K / 16);
  uint8_t *w, *ws, *act;
  float* sink;
  CK(cudaMalloc(&w, wbytes));
  CK(cudaMalloc(&ws, sbytes));
  CK(cudaMalloc(&act, static_cast<size_t>(16) * K * 2));
  CK(cudaMalloc(&sink, static_cast<size_t>(tiles) * kThreads * sizeof(float)));
  CK(cudaMemset(w, 0x11, wbytes));
  CK(cudaMemset(ws, 0x38, sbytes));
  CK(cudaMemset(act, 0, static_cast<size_t>(16) * K * 2));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; K %d, %d CTAs, %.0f MB of weights + scales per call\n", prop.name,
              prop.multiProcessorCount, K, tiles, (wbytes + sbytes) / 1e6);
  std::printf("| placement | stages | min blocks | CTAs/SM | KB in flight/SM | ms | GB/s (weights + scales) |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  run<2, 4, kRows>(w, ws, act, K, tiles, sink);
  run<3, 4, kRows>(w, ws, act, K, tiles, sink);
  run<4, 4, kRows>(w, ws, act, K, tiles, sink);  // v1's decode config
  run<6, 4, kRows>(w, ws, act, K, tiles, sink);
  run<4, 8, kRows>(w, ws, act, K, tiles, sink);
  run<2, 4, kTiled>(w, ws, act, K, tiles, sink);
  run<3, 4, kTiled>(w, ws, act, K, tiles, sink);
  run<4, 4, kTiled>(w, ws, act, K, tiles, sink);
  run<6, 4, kTiled>(w, ws, act, K, tiles, sink);
  run<4, 8, kTiled>(w, ws, act, K, tiles, sink);
  if (tiles % kTilesPerExpert == 0) {  // whole experts only
    run<2, 4, kKMajor>(w, ws, act, K, tiles, sink);
    run<3, 4, kKMajor>(w, ws, act, K, tiles, sink);
    run<4, 4, kKMajor>(w, ws, act, K, tiles, sink);
    run<6, 4, kKMajor>(w, ws, act, K, tiles, sink);
    run<4, 8, kKMajor>(w, ws, act, K, tiles, sink);
  } else {
    std::printf("(kmajor skipped: CTAs %d not a multiple of %d)\n", tiles, kTilesPerExpert);
  }
  CK(cudaFree(w));
  CK(cudaFree(ws));
  CK(cudaFree(act));
  CK(cudaFree(sink));
  return 0;
}
