// Lab microbenchmark (tools/lab/): "v1" below is the mma kernel, "v2" the wgmma kernel, as the archived
// notes (docs/archive/perf-notes.md) name them.
// Microbenchmark: what one bf16 wgmma m64nNk16 costs an SM, by N, operand source (A from registers,
// "RS", as the v2 grouped GEMM uses; or A from shared memory, "SS"), independent accumulator chains
// and warpgroups per SM. It answers the question docs/archive/perf-notes.md leaves open: is a small-N RS
// wgmma bound by a per-instruction cost far above its math (N/2 clk at the dense bf16 peak)?
//
// Build and run (GPU machine):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -I. -I<cutlass>/include -o wgmma_microbench tools/lab/wgmma_microbench.cu && ./wgmma_microbench [alu|conv]
// Prints one row per configuration: clk per wgmma per SM (all warpgroups of the SM together),
// the math-only figure N/2, and their ratio. Operand values are zero (timing only).
// `wgmma_microbench alu` instead times v2's consumer pattern (wait_group 1, ALU work on the
// next fragments, 4 wgmmas) with 0-192 integer ops per thread per k-tile: fused (the wgmma warps
// do the ALU work), ping-pong (the two warpgroups take turns), and split (a third warpgroup does
// the same ALU work), and the fused pattern with SHF / PRMT / IMAD / HFMA2.BF16 / LOP3+IMAD in
// place of LOP3 (which pipes the conversion can spread over). `wgmma_microbench conv` times
// converter warpgroups beside SS wgmmas (see conv_kernel; run in session 5: one converter
// warpgroup cannot keep up, so v2 keeps converting inline). Results and what they mean:
// docs/archive/perf-notes.md, sessions 3-5.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include "tools/bench/cuda_check.h"

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

// K-major, 128-byte swizzle, 8-row groups 1024 bytes apart (as in csrc/grouped_gemm_wgmma_sm90.cu).
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

// Zero the A (64 x 64 bf16) and B (up to 256 x 64 bf16) operand tiles; returns A's shared address.
__device__ __forceinline__ uint32_t zero_operands(uint8_t* smem) {
  for (int i = threadIdx.x; i < (64 + 256) * 128 / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(smem)[i] = 0;
  __syncthreads();
  return static_cast<uint32_t>(__cvta_generic_to_shared(smem));
}

// ITERS batches of 4 wgmmas (one 64-wide k-tile), k-block kb into accumulator chain kb % NACC,
// each batch after wait_group 1 on the previous one (as the GEMM); zero A fragments for RS.
template <int N, bool RS, int NACC>
__device__ __forceinline__ void wgmma_batches(int iters, uint32_t a_smem, uint32_t b_smem, float (&acc)[NACC * N / 2]) {
  uint32_t a[4] = {0, 0, 0, 0};
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
}

// wgmma_batches on one accumulator chain, then thread 0 writes the clocks since t0 to clk[block]
// (the accumulators kept alive through sink).
template <int N, bool RS>
__device__ __forceinline__ void timed_batches(int iters, uint32_t a_smem, uint32_t b_smem, long long t0,
                                              long long* clk, float* sink) {
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  wgmma_batches<N, RS, 1>(iters, a_smem, b_smem, acc);
  long long t1 = clock64();
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) sum += acc[i];
  if (sum != 0.0f) sink[0] = sum;
  if (threadIdx.x == 0) clk[blockIdx.x] = t1 - t0;
}

// Each warpgroup issues ITERS batches of 4 wgmmas (one 64-wide k-tile, like the GEMM), k-block
// kb into chain kb % NACC, and waits for the previous batch before the next (wait_group 1).
template <int N, bool RS, int NACC>
__global__ void __launch_bounds__(256, 1) bench_kernel(int iters, long long* clk, float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t a_smem = zero_operands(smem), b_smem = a_smem + 64 * 128;
  float acc[NACC * N / 2];
#pragma unroll
  for (int i = 0; i < NACC * N / 2; ++i) acc[i] = 0.0f;
  long long t0 = clock64();
  wgmma_batches<N, RS, NACC>(iters, a_smem, b_smem, acc);
  long long t1 = clock64();
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < NACC * N / 2; ++i) s += acc[i];
  if (s != 0.0f) sink[0] = s;  // never true (zero operands); keeps the wgmmas alive
  if (threadIdx.x == 0) clk[blockIdx.x] = t1 - t0;
}

constexpr int kIters = 2048;
constexpr int kSmemBytes = (64 + 256) * 128 + 1024;

// Runs launch(16) as a warm-up, then launch(kIters); returns the clock counts the CTAs wrote to
// d_clk[0 .. n).
template <typename Launch>
std::vector<long long> timed(long long* d_clk, int n, Launch launch) {
  launch(16);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  launch(kIters);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<long long> h(n);
  CK(cudaMemcpy(h.data(), d_clk, sizeof(long long) * n, cudaMemcpyDeviceToHost));
  return h;
}

long long max_of(const std::vector<long long>& v, int off, int n) {
  long long m = 0;
  for (int i = off; i < off + n; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

template <int N, bool RS, int NACC>
void run(int sms, int wgs, long long* d_clk, float* d_sink) {
  auto k = bench_kernel<N, RS, NACC>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const auto h = timed(d_clk, sms, [&](int it) { k<<<sms, 128 * wgs, kSmemBytes>>>(it, d_clk, d_sink); });
  const double per = static_cast<double>(max_of(h, 0, sms)) / (kIters * 4.0 * wgs);  // clk per wgmma per SM
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

// --- "alu" mode: the same batches with ALU work between them, as v2's consumers do ---------------
// Each thread computes its next 16 fragment registers with OPS dependent-free LOP3s (16 chains,
// interleaved) after wait_group 1, like v2's conversion of the next k-tile, then issues the 4
// wgmmas (RS: from those registers; SS: A from shared memory, the registers only kept alive).
// Question (docs/archive/perf-notes.md, session 3): does ALU work on the issuing warps slow RS wgmmas
// down more than SS ones, i.e. is v2's ~50% tensor-pipe ceiling a register-operand effect?
// PP (ping-pong): the two warpgroups take turns for "convert + issue" (named barriers 1 and 2),
// so one converts while the other's wgmmas run instead of both converting at the same time.
__device__ __forceinline__ void named_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void named_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }

// One conversion-style op of kind OPK on x (c1, c2: run-time constants). Which pipe each kind
// uses decides how conversion work can be spread (the "ops" mode compares them): 0 LOP3, 1 SHF,
// 2 PRMT, 3 IMAD (shift as multiply-add), 4 HMUL2 (bf16x2), 5 LOP3 and IMAD alternating.
template <int OPK>
__device__ __forceinline__ void op(uint32_t& x, uint32_t c1, uint32_t c2, int i) {
  if (OPK == 0 || (OPK == 5 && (i & 1) == 0))
    asm volatile("lop3.b32 %0, %0, %1, %2, 0x96;\n" : "+r"(x) : "r"(c1), "r"(c2));
  else if (OPK == 3 || OPK == 5)
    asm volatile("mad.lo.u32 %0, %0, %1, %2;\n" : "+r"(x) : "r"(c1), "r"(c2));
  else if (OPK == 1)
    asm volatile("shf.r.wrap.b32 %0, %0, %1, %2;\n" : "+r"(x) : "r"(c1), "r"(c2));
  else if (OPK == 2)
    asm volatile("prmt.b32 %0, %0, %1, %2;\n" : "+r"(x) : "r"(c1), "r"(c2));
  else
    asm volatile("fma.rn.bf16x2 %0, %0, %1, %2;\n" : "+r"(x) : "r"(c1), "r"(c2));
}

template <int N, bool RS, int OPS, bool PP = false, int OPK = 0>
__global__ void __launch_bounds__(256, 1) alu_kernel(int iters, long long* clk, float* sink, uint32_t seed) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t a_smem = zero_operands(smem), b_smem = a_smem + 64 * 128;
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  uint32_t fr[2][16];
#pragma unroll
  for (int i = 0; i < 16; ++i) fr[0][i] = fr[1][i] = 0;
  const uint32_t c1 = seed, c2 = seed * 3u;
  const int wg = threadIdx.x >> 7;
  if (PP && wg == 1) named_arrive(1);  // warpgroup 0 goes first
  auto batch = [&](int it, auto buf_c) {
    constexpr int b = decltype(buf_c)::value;
    if (PP) named_sync(1 + wg);  // my turn
    // The inputs come from a shared-memory load issued after the previous wait_group (as v2's
    // weight words), so ptxas cannot hoist this ALU work in between the previous batch's wgmmas.
    uint32_t z;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(z) : "r"(b_smem + 256 * 128 - 4) : "memory");
    uint32_t x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = (static_cast<uint32_t>(it) + z) ^ (i * 0x9E3779B9u);
#pragma unroll
    for (int r = 0; r < OPS / 16; ++r)
#pragma unroll
      for (int i = 0; i < 16; ++i) op<OPK>(x[i], c1, c2, i);
    // Zero the values again (operands must stay zero for a timing-only run) without letting the
    // compiler drop the work: and with a mask that is zero at run time but unknown to it.
#pragma unroll
    for (int i = 0; i < 16; ++i) fr[b][i] = x[i] & (seed >> 31);
#pragma unroll
    for (int i = 0; i < 16; ++i) cute::warpgroup_fence_operand(fr[b][i]);
    uint64_t da[4], db[4];
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      da[kb] = desc_sw128(a_smem + 32 * kb);
      db[kb] = desc_sw128(b_smem + 32 * kb);
    }
    fence(acc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      const uint32_t(&a)[4] = *reinterpret_cast<const uint32_t(*)[4]>(&fr[b][4 * kb]);
      mma<N, RS>(a, da[kb], db[kb], acc, std::make_index_sequence<N / 2>{});
    }
    cute::warpgroup_commit_batch();
    if (PP) named_arrive(2 - wg);  // the other warpgroup's turn
    fence(acc);
    cute::warpgroup_wait<1>();
  };
  long long t0 = clock64();
#pragma unroll 1
  for (int it = 0; it < iters; it += 2) {
    batch(it, std::integral_constant<int, 0>{});
    batch(it + 1, std::integral_constant<int, 1>{});
  }
  cute::warpgroup_wait<0>();
  fence(acc);
  if (PP && wg == 0) named_sync(1);  // the last turn warpgroup 1 handed over
  long long t1 = clock64();
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) sum += acc[i];
  uint32_t keep = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) keep ^= fr[0][i] ^ fr[1][i];
  if (sum != 0.0f || keep == 0x12345678u) sink[0] = sum + keep;
  if (threadIdx.x == 0) clk[blockIdx.x] = t1 - t0;
}

template <int N, bool RS, int OPS, bool PP = false, int OPK = 0>
void run_alu(int sms, long long* d_clk, float* d_sink) {
  auto k = alu_kernel<N, RS, OPS, PP, OPK>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const auto h = timed(d_clk, sms, [&](int it) { k<<<sms, 256, kSmemBytes>>>(it, d_clk, d_sink, 12345u); });
  const double per_batch = static_cast<double>(max_of(h, 0, sms)) / kIters;  // clk per k-tile, both warpgroups
  const double math = 2.0 * 4 * N / 2.0;                     // 8 wgmmas per SM per k-tile
  const double issue = 2.0 * (OPS + 40);                     // two warps per scheduler, ~40 fixed
  static const char* kOpName[] = {"", " SHF", " PRMT", " IMAD", " HFMA2.BF16", " LOP3+IMAD"};
  std::printf("| %3d | %s%s%s | %3d | %7.1f | %6.1f | %6.1f | %5.2f |\n", N, RS ? "RS" : "SS", PP ? " ping-pong" : "",
              kOpName[OPK], OPS,
              per_batch, math,
              issue, per_batch / (math > issue ? math : issue));
}

// --- "split" mode: the same ALU work done by a third warpgroup instead of the wgmma warps -------
// Warpgroups 0-1 issue the wgmma batches with no ALU work (RS, zero fragments); warpgroup 2 runs
// 2 * OPS LOP3s per k-tile per thread (the fused case's total: 8 warps x OPS), unsynchronized.
// If the wgmma warpgroups keep their OPS = 0 time while warpgroup 2 finishes its ALU work in
// about the same time, ALU work overlaps tensor work when other warps do it: the conversion
// belongs in converter warps, not in the warps that issue the wgmmas.
template <int N, int OPS>
__global__ void __launch_bounds__(384, 1) split_kernel(int iters, long long* clk, float* sink, uint32_t seed) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t a_smem = zero_operands(smem), b_smem = a_smem + 64 * 128;
  long long t0 = clock64();
  if (threadIdx.x >= 256) {  // ALU warpgroup
    const uint32_t c1 = seed, c2 = seed * 3u;
    uint32_t x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = threadIdx.x ^ (i * 0x9E3779B9u);
#pragma unroll 1
    for (int it = 0; it < iters; ++it)
#pragma unroll
      for (int r = 0; r < 2 * OPS / 16; ++r)
#pragma unroll
        for (int i = 0; i < 16; ++i) asm volatile("lop3.b32 %0, %0, %1, %2, 0x96;\n" : "+r"(x[i]) : "r"(c1), "r"(c2));
    uint32_t keep = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) keep ^= x[i];
    if (keep == 0x12345678u) sink[0] = keep;
    long long t1 = clock64();
    if (threadIdx.x == 256) clk[gridDim.x + blockIdx.x] = t1 - t0;
    return;
  }
  timed_batches<N, true>(iters, a_smem, b_smem, t0, clk, sink);
}

template <int N, int OPS>
void run_split(int sms, long long* d_clk, float* d_sink) {
  auto k = split_kernel<N, OPS>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const auto h = timed(d_clk, 2 * sms, [&](int it) { k<<<sms, 384, kSmemBytes>>>(it, d_clk, d_sink, 12345u); });
  std::printf("| %3d | split | %3d | %7.1f | %7.1f | %6.1f |\n", N, OPS,
              static_cast<double>(max_of(h, 0, sms)) / kIters, static_cast<double>(max_of(h, sms, sms)) / kIters,
              2.0 * 4 * N / 2.0);
}

template <int N>
void run_alu_n(int sms, long long* c, float* s) {
  run_alu<N, true, 0>(sms, c, s);
  run_alu<N, false, 0>(sms, c, s);
  run_alu<N, true, 64>(sms, c, s);
  run_alu<N, false, 64>(sms, c, s);
  run_alu<N, true, 128>(sms, c, s);
  run_alu<N, false, 128>(sms, c, s);
  run_alu<N, true, 192>(sms, c, s);
  run_alu<N, false, 192>(sms, c, s);
  run_alu<N, true, 64, true>(sms, c, s);
  run_alu<N, true, 128, true>(sms, c, s);
  run_alu<N, true, 192, true>(sms, c, s);
  // the same 128 ops per thread per k-tile, by op kind (LOP3 is the first rows)
  run_alu<N, true, 128, false, 1>(sms, c, s);
  run_alu<N, true, 128, false, 2>(sms, c, s);
  run_alu<N, true, 128, false, 3>(sms, c, s);
  run_alu<N, true, 128, false, 4>(sms, c, s);
  run_alu<N, true, 128, false, 5>(sms, c, s);
}

// --- "conv" mode: converter warpgroups feeding SS wgmmas (the design session 4 proposes) ---------
// Warpgroups 0-1 issue SS wgmma batches (A: their own 64 x 64 bf16 weight tile, B: the N-token
// tile, both in shared memory), as a kernel whose weights were converted to bf16 in shared memory
// would. CWG converter warpgroups meanwhile do the conversion of one 128 x 64 weight tile per
// k-tile: one 16-byte shared load per 4 source words, the sm90-layout extraction (11 integer ops
// per word), one bf16x2 multiply per register and stmatrix.x4 stores of the 16 KB of bf16 into a
// separate buffer. With PROD, one more warp streams the stage's ~20 KB (activations + weights +
// scales) into shared memory with 16-byte cp.async from an L2-resident buffer, as the producer
// would. Nothing synchronizes the roles: each times its own ITERS k-tiles, so the table shows
// whether the wgmmas keep their no-conversion time while the shared-memory traffic of the
// conversion runs beside them, and whether the converters keep up (clk per k-tile <= the wgmmas').
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

constexpr int kConvA = 0;              // 2 x 8 KB: the two wgmma warpgroups' A tiles (zero)
constexpr int kConvB = 16 * 1024;      // up to 16 KB: B (N <= 128 tokens x 64 k, zero)
constexpr int kConvDst = 32 * 1024;    // 16 KB: the converters' bf16 output
constexpr int kConvSrc = 48 * 1024;    // 4 KB: the converters' packed source words
constexpr int kConvProd = 52 * 1024;   // 24 KB: the producer's cp.async destination
constexpr int kConvSmem = 76 * 1024 + 1024;
constexpr int kProdBytes = 20 * 1024;  // per k-tile: 16 KB activations + 4 KB weights (scales ~0.5 KB)

template <int N, int CWG, bool PROD>
__global__ void __launch_bounds__(128 * (2 + CWG + (PROD ? 1 : 0)), 1)
    conv_kernel(int iters, long long* clk, float* sink, uint32_t seed, const uint4* gsrc) {
  extern __shared__ __align__(1024) uint8_t smem[];
  for (int i = threadIdx.x; i < (kConvSmem - 1024) / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(smem)[i] = 0;
  __syncthreads();
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31;
  long long t0 = clock64();
  if (wg < 2) {
    timed_batches<N, false>(iters, base + kConvA + wg * 8192, base + kConvB, t0, clk, sink);
    return;
  }
  if constexpr (CWG > 0) {
    if (wg < 2 + CWG) {
    // 4096 output words per k-tile over CWG * 128 threads: 32 / CWG per thread, from 8 / CWG words.
    constexpr int kWords = 8 / CWG;
    const int ct = threadIdx.x - 256;  // 0 .. 128 CWG - 1
    const uint32_t scale = 0x3F803F80u ^ (seed & 1u);
    uint32_t keep = 0;
#pragma unroll 1
    for (int it = 0; it < iters; ++it) {
#pragma unroll
      for (int q = 0; q < kWords / 4; ++q) {
        uint4 w;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                     : "r"(base + kConvSrc + ((ct * (kWords / 4) + q) & 255) * 16)
                     : "memory");
        const uint32_t ws[4] = {w.x ^ it, w.y ^ it, w.z ^ it, w.w ^ it};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          constexpr uint32_t M = 0x81C081C0u;
          uint32_t a0 = ws[j] & M, a1 = (ws[j] << 3) & M, a2 = (ws[j] << 6) & M;
          uint32_t a3 = ((ws[j] << 1) & 0x80008000u) | ((ws[j] >> 5) & 0x01000100u) | ((ws[j] >> 4) & 0x00C000C0u);
          asm volatile("mul.rn.bf16x2 %0, %0, %1;\n" : "+r"(a0) : "r"(scale));
          asm volatile("mul.rn.bf16x2 %0, %0, %1;\n" : "+r"(a1) : "r"(scale));
          asm volatile("mul.rn.bf16x2 %0, %0, %1;\n" : "+r"(a2) : "r"(scale));
          asm volatile("mul.rn.bf16x2 %0, %0, %1;\n" : "+r"(a3) : "r"(scale));
          // 16 rows of 16 bytes per matrix quad: lane l gives row l's address (conflict-free)
          const uint32_t dst = base + kConvDst + (((ct * kWords + 4 * q + j) * 512 + lane * 16) & 16383);
          stmatrix_x4(dst, a0, a1, a2, a3);
          keep ^= a0 ^ a3;
        }
      }
    }
    if (keep == 0x12345678u) sink[0] = keep;
    long long t1 = clock64();
    if (threadIdx.x == 256) clk[gridDim.x + blockIdx.x] = t1 - t0;
    return;
    }
  }
  if (PROD && (threadIdx.x & 127) < 32) {  // one producer warp; the other three exit
    const uint4* src = gsrc + (blockIdx.x & 7) * (kProdBytes / 16);
#pragma unroll 1
    for (int it = 0; it < iters; ++it) {
      for (int i = lane; i < kProdBytes / 16; i += 32)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(base + kConvProd + i * 16), "l"(src + i)
                     : "memory");
      asm volatile("cp.async.commit_group;\n" ::: "memory");
      asm volatile("cp.async.wait_group 1;\n" ::: "memory");  // two k-tiles in flight
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    long long t1 = clock64();
    if (lane == 0) clk[2 * gridDim.x + blockIdx.x] = t1 - t0;
  }
}

template <int N, int CWG, bool PROD>
void run_conv(int sms, long long* d_clk, float* d_sink, const uint4* d_src) {
  auto k = conv_kernel<N, CWG, PROD>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kConvSmem));
  CK(cudaMemset(d_clk, 0, sizeof(long long) * 3 * sms));
  const int threads = 128 * (2 + CWG + (PROD ? 1 : 0));
  const auto h = timed(d_clk, 3 * sms,
                       [&](int it) { k<<<sms, threads, kConvSmem>>>(it, d_clk, d_sink, 12345u, d_src); });
  const double mm = static_cast<double>(max_of(h, 0, sms)) / kIters;
  const double cv = CWG ? static_cast<double>(max_of(h, sms, sms)) / kIters : 0.0;
  const double pr = PROD ? static_cast<double>(max_of(h, 2 * sms, sms)) / kIters : 0.0;
  std::printf("| %3d | %d | %s | %7.1f | %7.1f | %7.1f | %6.1f |\n", N, CWG, PROD ? "yes" : "no", mm, cv, pr,
              2.0 * 4 * N / 2.0);
}

template <int N>
void run_conv_n(int sms, long long* c, float* s, const uint4* src) {
  run_conv<N, 0, false>(sms, c, s, src);
  run_conv<N, 0, true>(sms, c, s, src);
  run_conv<N, 1, false>(sms, c, s, src);
  run_conv<N, 1, true>(sms, c, s, src);
  run_conv<N, 2, false>(sms, c, s, src);
  run_conv<N, 2, true>(sms, c, s, src);
}

int main(int argc, char** argv) {
  const bool alu = argc > 1 && std::strcmp(argv[1], "alu") == 0;
  const bool conv = argc > 1 && std::strcmp(argv[1], "conv") == 0;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("device: %s, %d SMs; clk per bf16 wgmma m64nNk16 per SM (all its warpgroups)\n", prop.name, sms);
  long long* d_clk;
  float* d_sink;
  CK(cudaMalloc(&d_clk, sizeof(long long) * 1024));
  CK(cudaMalloc(&d_sink, sizeof(float)));
  if (conv) {
    uint4* d_src;
    CK(cudaMalloc(&d_src, 8 * kProdBytes));
    CK(cudaMemset(d_src, 0, 8 * kProdBytes));
    std::printf("conv mode: 2 SS-wgmma warpgroups + converter warpgroups (+ a producer warp), unsynchronized;\n"
                "clk per 128 x N x 64 k-tile per SM (max over SMs) of each role\n"
                "| N | converter WGs | producer | wgmma WGs | converters | producer | math clk |\n"
                "|---|---|---|---|---|---|---|\n");
    run_conv_n<64>(sms, d_clk, d_sink, d_src);
    run_conv_n<128>(sms, d_clk, d_sink, d_src);
    return 0;
  }
  if (alu) {
    std::printf("alu mode: 2 warpgroups per SM, clk per k-tile (4 wgmmas per warpgroup) per SM\n");
    std::printf("| N | A | ALU ops/thread/k-tile | clk/k-tile | math clk | issue clk (est.) | ratio to max |\n"
                "|---|---|---|---|---|---|---|\n");
    run_alu_n<32>(sms, d_clk, d_sink);
    run_alu_n<128>(sms, d_clk, d_sink);
    std::printf("split: ALU work (same total) in a third warpgroup; clk per k-tile per SM\n"
                "| N | mode | ALU ops (fused-equivalent) | wgmma warpgroups | ALU warpgroup | math clk |\n"
                "|---|---|---|---|---|---|\n");
    run_split<32, 0>(sms, d_clk, d_sink);
    run_split<32, 64>(sms, d_clk, d_sink);
    run_split<32, 128>(sms, d_clk, d_sink);
    run_split<128, 0>(sms, d_clk, d_sink);
    run_split<128, 64>(sms, d_clk, d_sink);
    run_split<128, 128>(sms, d_clk, d_sink);
    run_split<128, 192>(sms, d_clk, d_sink);
    return 0;
  }
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
