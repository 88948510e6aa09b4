// Microbenchmark: what one bf16 wgmma m64nNk16 costs an SM, by N, operand source (A from registers,
// "RS", as the v2 grouped GEMM uses; or A from shared memory, "SS"), independent accumulator chains
// and warpgroups per SM. It answers the question docs/perf-notes.md leaves open: is a small-N RS
// wgmma bound by a per-instruction cost far above its math (N/2 clk at the dense bf16 peak)?
//
// Build and run (GPU machine):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -I<cutlass>/include -o wgmma_microbench tools/wgmma_microbench.cu && ./wgmma_microbench
// Prints one row per configuration: clk per wgmma per SM (all warpgroups of the SM together),
// the math-only figure N/2, and their ratio. Operand values are zero (timing only).
#include <cstdio>
#include <cstdlib>
#include <utility>

#include <cuda_runtime.h>

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#define CK(x)                                                                                      \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)

namespace gmma = cute::SM90::GMMA;

template <int N, bool RS>
struct Op;
#define JN_OPS(NV)                                                                         \
  template <>                                                                              \
  struct Op<NV, true> {                                                                    \
    using T = gmma::MMA_64x##NV##x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K>;       \
  };                                                                                       \
  template <>                                                                              \
  struct Op<NV, false> {                                                                   \
    using T = gmma::MMA_64x##NV##x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;       \
  };
JN_OPS(8)
JN_OPS(16)
JN_OPS(32)
JN_OPS(64)
JN_OPS(128)
JN_OPS(256)
#undef JN_OPS

// K-major, 128-byte swizzle, 8-row groups 1024 bytes apart (as in csrc/grouped_gemm_sm90_wgmma.cu).
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

template <int N, bool RS, size_t... I>
__device__ __forceinline__ void mma(const uint32_t (&a)[4], uint64_t da, uint64_t db, float* acc,
                                    std::index_sequence<I...>) {
  if constexpr (RS)
    Op<N, RS>::T::fma(a[0], a[1], a[2], a[3], db, acc[I]..., gmma::ScaleOut::One);
  else
    Op<N, RS>::T::fma(da, db, acc[I]..., gmma::ScaleOut::One);
}

template <int N>
__device__ __forceinline__ void fence(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// Each warpgroup issues ITERS batches of 4 wgmmas (one 64-wide k-tile, like the GEMM), k-block
// kb into chain kb % NACC, and waits for the previous batch before the next (wait_group 1).
template <int N, bool RS, int NACC>
__global__ void __launch_bounds__(256, 1) bench_kernel(int iters, long long* clk, float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  for (int i = threadIdx.x; i < (64 + 256) * 128 / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(smem)[i] = 0;
  __syncthreads();
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t a_smem = base, b_smem = base + 64 * 128;
  float acc[NACC * N / 2];
#pragma unroll
  for (int i = 0; i < NACC * N / 2; ++i) acc[i] = 0.0f;
  uint32_t a[4] = {0, 0, 0, 0};
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    uint64_t da[4], db[4];
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      da[kb] = desc_sw128(a_smem + 32 * kb);
      db[kb] = desc_sw128(b_smem + 32 * kb);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) cute::warpgroup_fence_operand(a[i]);
    fence(acc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kb = 0; kb < 4; ++kb)
      mma<N, RS>(a, da[kb], db[kb], acc + (kb % NACC) * (N / 2), std::make_index_sequence<N / 2>{});
    cute::warpgroup_commit_batch();
    fence(acc);
    cute::warpgroup_wait<1>();
  }
  cute::warpgroup_wait<0>();
  fence(acc);
  long long t1 = clock64();
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < NACC * N / 2; ++i) s += acc[i];
  if (s != 0.0f) sink[0] = s;  // never true (zero operands); keeps the wgmmas alive
  if (threadIdx.x == 0) clk[blockIdx.x] = t1 - t0;
}

template <int N, bool RS, int NACC>
void run(int sms, int wgs, long long* d_clk, float* d_sink) {
  auto k = bench_kernel<N, RS, NACC>;
  const int smem = (64 + 256) * 128 + 1024;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int iters = 2048;
  k<<<sms, 128 * wgs, smem>>>(16, d_clk, d_sink);  // warm up
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  k<<<sms, 128 * wgs, smem>>>(iters, d_clk, d_sink);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  long long h[1024];
  CK(cudaMemcpy(h, d_clk, sizeof(long long) * sms, cudaMemcpyDeviceToHost));
  long long mx = 0;
  for (int i = 0; i < sms; ++i) mx = h[i] > mx ? h[i] : mx;
  const double per = static_cast<double>(mx) / (iters * 4.0 * wgs);  // clk per wgmma per SM
  std::printf("| %3d | %s | %d | %d | %7.1f | %5.1f | %5.2f |\n", N, RS ? "RS" : "SS", NACC, wgs, per, N / 2.0,
              per / (N / 2.0));
}

template <int N>
void run_n(int sms, long long* c, float* s) {
  constexpr int kMany = N <= 64 ? 4 : 2;  // independent chains, within the 255-register limit
  for (int wgs = 1; wgs <= 2; ++wgs) {
    run<N, true, 1>(sms, wgs, c, s);
    run<N, true, kMany>(sms, wgs, c, s);
    run<N, false, 1>(sms, wgs, c, s);
    run<N, false, kMany>(sms, wgs, c, s);
  }
}

int main() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("device: %s, %d SMs; clk per bf16 wgmma m64nNk16 per SM (all its warpgroups)\n", prop.name, sms);
  long long* d_clk;
  float* d_sink;
  CK(cudaMalloc(&d_clk, sizeof(long long) * 1024));
  CK(cudaMalloc(&d_sink, sizeof(float)));
  std::printf("| N | A | chains | warpgroups/SM | clk/wgmma | math clk (N/2) | ratio |\n|---|---|---|---|---|---|---|\n");
  run_n<8>(sms, d_clk, d_sink);
  run_n<16>(sms, d_clk, d_sink);
  run_n<32>(sms, d_clk, d_sink);
  run_n<64>(sms, d_clk, d_sink);
  run_n<128>(sms, d_clk, d_sink);
  // N = 256 with 4 chains needs 512 accumulator registers: one chain only.
  for (int wgs = 1; wgs <= 2; ++wgs) {
    run<256, true, 1>(sms, wgs, d_clk, d_sink);
    run<256, false, 1>(sms, wgs, d_clk, d_sink);
  }
  return 0;
}
