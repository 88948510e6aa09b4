// Lab microbenchmark (tools/lab/): "v1" below is the mma kernel, "v2" the wgmma kernel, as the archived
// notes (docs/archive/perf-notes.md) name them.
// Supply ceiling of a persistent, warp-specialized weight stream (v2's shape, no math), Hopper.
//
// Question (docs/archive/perf-notes.md, session 7): v2's producers alone (DIAG 4) stream the decode case
// at ~2.8 TB/s, below the ~3.2 TB/s the decode targets need. Is the limit the weights' bulk copies,
// the block scales' 128 separate 4-byte copies per k-tile (from [N, K/16]: one 32-byte sector per
// row, 8 k-tiles apart), or the pipeline depth / CTAs per SM? Each CTA walks tiles b, b + grid, ...
// (128 rows x K of one expert, its k-tiles' 4 KB blocks contiguous, as in the sm90 layout); per
// k-tile one lane issues a bulk copy of the block, and the scales come
//   split: as v2 loads them (32 lanes x 4 rows x 4-byte cp.async, [N, K/16] rows),
//   fused: stored after each block (a 4608-byte record per k-tile: one bulk copy of both),
//   none:  not at all (weights only: the stream's ceiling without scales).
// A consumer warp waits for each stage and releases it after reading one word.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I. -o /tmp/sbm tools/lab/stream_bulk_microbench.cu
//   /tmp/sbm [K] [tiles]   # default: L1 decode, K 7168, 2016 tiles (42 experts x 48 n-tiles)
#include <cuda_runtime.h>

#include "csrc/mbarrier_sm90.cuh"

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "tools/bench/cuda_check.h"

using namespace jax_nvfp4;  // mbarrier helpers

enum Scales { kSplit = 0, kFused = 1, kNone = 2 };
constexpr int kStage = 4608 + 128;  // block + scales, padded

template <int STAGES, int S>
__global__ void __launch_bounds__(64) stream_kernel(const uint8_t* __restrict__ w, const uint8_t* __restrict__ sc,
                                                     int K, int tiles, unsigned* __restrict__ sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[2 * STAGES];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int KT = K / 64, KS = K / 16;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t full0 = static_cast<uint32_t>(__cvta_generic_to_shared(bars));
  const uint32_t empty0 = full0 + STAGES * 8;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, S == kSplit ? 33 : 1);
      mbar_init(empty0 + 8 * s, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  int s = 0;
  uint32_t ph = 0;
  unsigned acc = 0;
  const int64_t rec = S == kFused ? 4608 : 4096;  // bytes per k-tile record
  for (int L = blockIdx.x; L < tiles; L += gridDim.x) {
    for (int kt = 0; kt < KT; ++kt) {
      const uint32_t full = full0 + 8 * s, empty = empty0 + 8 * s, st = base + s * kStage;
      if (warp == 0) {
        mbar_wait(empty, ph ^ 1);
        if (lane == 0) {
          mbar_arrive_expect_tx(full, S == kFused ? 4608 : 4096);
          bulk_load(st, w + (static_cast<int64_t>(L) * KT + kt) * rec, S == kFused ? 4608 : 4096, full);
        }
        if (S == kSplit) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint8_t* src = sc + (static_cast<int64_t>(L) * 128 + lane + 32 * i) * KS + kt * 4;
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(st + 4096 + (lane + 32 * i) * 4), "l"(src)
                         : "memory");
          }
          cp_async_mbar_arrive(full);
        }
      } else {
        mbar_wait(full, ph);
        if (lane == 0) {
          acc += *reinterpret_cast<const unsigned*>(smem + s * kStage + (kt & 63) * 64);
          mbar_arrive(empty);
        }
      }
      advance_stage<STAGES>(s, ph);
    }
  }
  if (threadIdx.x == 32) sink[blockIdx.x] = acc;
}

template <int STAGES, int S>
void run(const uint8_t* w, const uint8_t* sc, int K, int tiles, int ctas_per_sm, int sms, unsigned* sink) {
  auto k = stream_kernel<STAGES, S>;
  const int smem = STAGES * kStage;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, 64, smem));
  if (per_sm < ctas_per_sm) return;
  const int grid = sms * ctas_per_sm;
  const float ms = ms_per_launch([&] { k<<<grid, 64, smem>>>(w, sc, K, tiles, sink); });
  const double bytes = static_cast<double>(tiles) * 128 * (K / 2 + (S == kNone ? 0 : K / 16));
  std::printf("| %s | %d | %d | %.0f | %.4f | %.0f |\n", S == kSplit ? "split" : S == kFused ? "fused" : "none", STAGES,
              ctas_per_sm, ctas_per_sm * STAGES * (S == kFused ? 4608 : 4096 + (S == kSplit ? 512 : 0)) / 1024.0, ms,
              bytes / ms / 1e6);
}

template <int S>
void sweep(const uint8_t* w, const uint8_t* sc, int K, int tiles, int sms, unsigned* sink) {
  run<8, S>(w, sc, K, tiles, 1, sms, sink);
  run<12, S>(w, sc, K, tiles, 1, sms, sink);
  run<24, S>(w, sc, K, tiles, 1, sms, sink);
  run<40, S>(w, sc, K, tiles, 1, sms, sink);
  run<12, S>(w, sc, K, tiles, 2, sms, sink);
  run<20, S>(w, sc, K, tiles, 2, sms, sink);
  run<8, S>(w, sc, K, tiles, 4, sms, sink);
}

int main(int argc, char** argv) {
  const int K = argc > 1 ? std::atoi(argv[1]) : 7168;
  const int tiles = argc > 2 ? std::atoi(argv[2]) : 2016;
  const size_t wbytes = static_cast<size_t>(tiles) * 128 * (K / 2 + K / 16);  // room for fused records
  const size_t sbytes = static_cast<size_t>(tiles) * 128 * (K / 16);
  uint8_t *w, *sc;
  unsigned* sink;
  CK(cudaMalloc(&w, wbytes));
  CK(cudaMalloc(&sc, sbytes));
  CK(cudaMalloc(&sink, 4096 * sizeof(unsigned)));
  CK(cudaMemset(w, 0x11, wbytes));
  CK(cudaMemset(sc, 0x38, sbytes));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("%d SMs; K %d, %d tiles, %.0f MB of weights + scales per call\n", sms, K, tiles, wbytes / 1e6);
  std::printf("| scales | stages | CTAs/SM | KB in flight/SM | ms | GB/s (weights + scales) |\n|---|---|---|---|---|---|\n");
  sweep<kSplit>(w, sc, K, tiles, sms, sink);
  sweep<kFused>(w, sc, K, tiles, sms, sink);
  sweep<kNone>(w, sc, K, tiles, sms, sink);
  CK(cudaFree(w));
  CK(cudaFree(sc));
  CK(cudaFree(sink));
  return 0;
}
