// Lab microbenchmark (tools/lab/): where the dispatch kernel's time goes (csrc/dispatch_rows.cu).
//
// Times the production kernel (through LaunchDispatchRows) on the MoE layer's two W4A4 calls at
// 4096 tokens (gate/up input: T 4096, K 7168, 6 copies per row through a scatter map; down input:
// T 24576, K 3072, no scatter), in its three modes (copy, given scale, dynamic scale), beside lab
// copies of the dynamic kernel that drop pieces of its work:
//   fastdiv  both divisions as products with a reciprocal (not exact: an upper bound of what a
//            cheaper exact division could save)
//   regs     the row kept in registers between the amax pass and the quantizing pass (no re-read)
//   amax     the amax pass and the copy, no quantization (the bytes and the reduction alone)
//   staged   persistent CTAs copying the next row into shared memory (cp.async) during this one
//   diet     the bit-pattern maxima and the float count (production since it was measured here),
//            with the int count or the fast exact division (RN(1/gs) and two FMA corrections)
//
// With --decode: the two calls at 32 tokens (T 32 x 6 copies, T 192), the production kernel (its
// CTA width chosen by DispatchThreads) against diet float, the same arithmetic in 128-thread CTAs.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I. -o /tmp/dkb tools/lab/dispatch_kernel_bench.cu
//   /tmp/dkb [--decode]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "csrc/dispatch_rows.cu"
#include "tools/bench/cuda_check.h"

namespace lab {
using jax_nvfp4::DispatchRowsParams;
namespace rows = jax_nvfp4::rows;
constexpr int kThreads = 128, kChunk = 8;

__device__ __forceinline__ void unpack(uint4 u, float* v) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) v[2 * j] = __uint_as_float(w[j] << 16), v[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
}

// The rounding by division that rows::E2m1Grid replaces: q = RN(y / s), clamped, rounded to the
// nearest e2m1 value (ties to the even code) by rintf on its step.
__device__ __forceinline__ uint16_t quantized_by_division(float y, float s) {
  float q = 0.0f;
  if (s > 0.0f && !rows::IsNan(y)) q = fminf(fmaxf(y / s, -6.0f), 6.0f);
  const float a = fabsf(q);
  const float step = a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f);
  const float inv = a < 2.0f ? 2.0f : (a < 4.0f ? 1.0f : 0.5f);
  const float m = copysignf(rintf(a * inv) * step, q);
  return rows::Bf16Exact(m * s);
}

// x / gs rounded to nearest even, for r = RN(1 / gs) with gs in [2^-100, 2^100]: two FMA
// corrections of x * r where no intermediate can underflow or overflow, the IEEE division elsewhere.
__device__ __forceinline__ float div_by_scale(float x, float gs, float r) {
  const float q0 = __fmul_rn(x, r);
  const float ax = fabsf(x), aq = fabsf(q0);
  if (!(ax >= 0x1p-100f && ax <= 0x1p100f && aq >= 0x1p-100f && aq <= 0x1p100f)) return __fdiv_rn(x, gs);
  const float q1 = __fmaf_rn(__fmaf_rn(-q0, gs, x), r, q0);
  return __fmaf_rn(__fmaf_rn(-q1, gs, x), r, q1);
}

// Mismatches of div_by_scale against the IEEE division: every finite bf16 x, for gs[blockIdx.y].
__global__ void div_check_kernel(const float* gs_list, unsigned long long* bad) {
  const float gs = gs_list[blockIdx.y];
  const float r = __frcp_rn(gs);
  const uint32_t h = blockIdx.x * blockDim.x + threadIdx.x;
  const float x = __uint_as_float(h << 16);
  if (h < 65536 && !isnan(x) && __float_as_uint(div_by_scale(x, gs, r)) != __float_as_uint(__fdiv_rn(x, gs)))
    atomicAdd(bad, 1ull);
}

// The diet kernel's fast division against the IEEE one where the diet takes it (gs in
// [2^-91, 2^60], |x| <= 2^64 gs): equal, or both quotients below 2^-11 (under every threshold).
__global__ void diet_div_check_kernel(const float* gs_list, unsigned long long* bad) {
  const float gs = gs_list[blockIdx.y];
  if (!(gs >= 0x1p-91f && gs <= 0x1p60f)) return;
  const float r = __frcp_rn(gs);
  const uint32_t h = blockIdx.x * blockDim.x + threadIdx.x;
  const float ax = __uint_as_float((h & 0x7FFFu) << 16);
  if (h >= 32768 || isnan(ax) || !(ax <= gs * 0x1p64f)) return;
  const float q0 = __fmul_rn(ax, r);
  const float q1 = __fmaf_rn(__fmaf_rn(-q0, gs, ax), r, q0);
  const float q2 = __fmaf_rn(__fmaf_rn(-q1, gs, ax), r, q1);
  const float e = __fdiv_rn(ax, gs);
  if (__float_as_uint(q2) != __float_as_uint(e) && !(q2 < 0x1p-11f && e < 0x1p-11f)) atomicAdd(bad, 1ull);
}

// How a lab kernel divides x by the row's global scale: the IEEE division (production), the
// product with the reciprocal (not exact), div_by_scale.
enum Div { kIeee, kReciprocal, kFastExact };

// One row's chunk c (8 bf16 values) quantized with the row's global scale gs (r = RN(1 / gs)),
// rounded by threshold counts (production) or, kByDivision, by quantized_by_division.
template <Div kDiv, bool kByDivision = false>
__device__ __forceinline__ uint4 quantize_chunk(uint4 u, bool active, float gs, float r) {
  float y[kChunk];
  unpack(u, y);
  float bmax = 0.0f;
  bool nan = false;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    y[i] = kDiv == kFastExact ? div_by_scale(y[i], gs, r) : (kDiv == kReciprocal ? y[i] * r : y[i] / gs);
    nan |= rows::IsNan(y[i]);
    bmax = fmaxf(bmax, fabsf(y[i]));
  }
  if (!active) bmax = 0.0f, nan = false;
  bmax = fmaxf(bmax, __shfl_xor_sync(0xFFFFFFFFu, bmax, 1));
  nan |= __shfl_xor_sync(0xFFFFFFFFu, static_cast<int>(nan), 1) != 0;
  const float sc = rows::BlockScale(bmax, nan, gs);
  uint32_t w[4];
  if constexpr (kByDivision) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      w[j] = quantized_by_division(y[2 * j], sc) | static_cast<uint32_t>(quantized_by_division(y[2 * j + 1], sc)) << 16;
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
  if (!(sc > 0.0f)) {
    const uint32_t z = rows::IsNan(sc) ? 0x7FC07FC0u : 0u;
    return make_uint4(z, z, z, z);
  }
  const rows::E2m1Grid grid(sc);
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = grid.Value(y[2 * j]) | static_cast<uint32_t>(grid.Value(y[2 * j + 1])) << 16;
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Persistent CTAs: row t + gridDim.x is copied into shared memory while row t is quantized.
template <bool kFast>
__global__ void __launch_bounds__(kThreads) staged_kernel(const DispatchRowsParams p) {
  extern __shared__ uint4 rowbuf[];  // [2][K / 8]
  const int64_t nc = p.K / kChunk;
  auto stage = [&](int64_t t, int b) {
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + t * p.K);
    for (int64_t c = threadIdx.x; c < nc; c += kThreads) {
      const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(rowbuf + b * nc + c));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src + c));
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  int b = 0;
  if (blockIdx.x < p.T) stage(blockIdx.x, 0);
  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x, b ^= 1) {
    if (t + gridDim.x < p.T) {
      stage(t + gridDim.x, b ^ 1);
      asm volatile("cp.async.wait_group 1;\n" ::);
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    __syncthreads();  // row t is in rowbuf[b] for every thread
    const uint4* row = rowbuf + b * nc;
    const int32_t* dst = p.scatter ? p.scatter + t * p.slots : nullptr;
    float amax = 0.0f;
    for (int64_t c = threadIdx.x; c < nc; c += kThreads) {
      float v[kChunk];
      unpack(row[c], v);
#pragma unroll
      for (int i = 0; i < kChunk; ++i) amax = rows::FiniteAbsMax(amax, v[i]);
    }
    const float gs = rows::DynamicGlobalScale(jax_nvfp4::cta_max<kThreads>(amax));
    const bool fast = kFast && gs >= 0x1p-100f && gs <= 0x1p100f;
    const float r = __frcp_rn(gs);
    jax_nvfp4::store_row_scale<kThreads>(p, dst, t, gs);
    for (int64_t base = 0; base < nc; base += kThreads) {
      const int64_t c = base + threadIdx.x;
      const bool active = c < nc;
      const uint4 u = active ? row[c] : make_uint4(0, 0, 0, 0);
      const uint4 q = fast ? quantize_chunk<kFastExact>(u, active, gs, r) : quantize_chunk<kIeee>(u, active, gs, r);
      if (!active) continue;
      for (int64_t j = 0; j < p.slots; ++j) {
        const int64_t o = dst ? static_cast<int64_t>(__ldg(dst + j)) : t;
        if (o >= 0 && o < p.R) *reinterpret_cast<uint4*>(p.out + o * p.K + c * kChunk) = q;
      }
    }
    __syncthreads();  // rowbuf[b] and cta_max's shared words are free for the next row
  }
}

template <bool kFast>
void launch_staged(const DispatchRowsParams& p) {
  const size_t smem = 2 * static_cast<size_t>(p.K) * 2;
  int per_sm = 0, sms = 0, dev = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, staged_kernel<kFast>, kThreads, smem));
  const int64_t grid = std::min<int64_t>(p.T, static_cast<int64_t>(sms) * per_sm);
  staged_kernel<kFast><<<static_cast<unsigned>(grid), kThreads, smem>>>(p);
}

// kVariant 0 division, 1 fastdiv, 2 regs (kSteps chunks per thread), 3 amax + copy, 4 unbounded
template <int kVariant, int kSteps, int kT = kThreads>
__global__ void __launch_bounds__(kT, kVariant == 4 ? 1 : 2048 / kT) variant_kernel(const DispatchRowsParams p) {
  const int64_t t = blockIdx.x;
  const int64_t nc = p.K / kChunk;
  const int32_t* dst = p.scatter ? p.scatter + t * p.slots : nullptr;
  const uint4* x = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + t * p.K);
  uint4 held[kSteps];
  float amax = 0.0f;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int64_t c = s * kT + threadIdx.x;
    held[s] = c < nc ? __ldg(x + c) : make_uint4(0, 0, 0, 0);
    float v[kChunk];
    unpack(held[s], v);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) amax = rows::FiniteAbsMax(amax, v[i]);
  }
  const float gs = rows::DynamicGlobalScale(jax_nvfp4::cta_max<kT>(amax));  // the production reduction
  const float rgs = 1.0f / gs;
  jax_nvfp4::store_row_scale<kT>(p, dst, t, gs);
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int64_t c = s * kT + threadIdx.x;
    uint4 o = kVariant == 2 ? held[s] : (c < nc ? __ldg(x + c) : make_uint4(0, 0, 0, 0));
    if (kVariant == 0) o = quantize_chunk<kIeee, true>(o, c < nc, gs, rgs);
    else if (kVariant == 1) o = quantize_chunk<kReciprocal>(o, c < nc, gs, rgs);
    else if (kVariant != 3) o = quantize_chunk<kIeee>(o, c < nc, gs, rgs);
    if (c >= nc) continue;
    for (int64_t j = 0; j < p.slots; ++j) {
      const int64_t r = dst ? static_cast<int64_t>(__ldg(dst + j)) : t;
      if (r < 0 || r >= p.R) continue;
      *reinterpret_cast<uint4*>(p.out + r * p.K + c * kChunk) = o;
    }
  }
}

// The dynamic kernel with fewer instructions per value, for bf16 x: the amax pass on bf16 bit
// pairs (|x| + 0x80 per half makes Inf and NaN negative as int16, so one signed 16x2 max skips
// them); the quantizing pass takes each block's amax of |x| on bits as well and divides it once
// (RN(max |x| / gs) = max RN(|x| / gs): the rounded quotient is monotone), counts thresholds in
// float (no int-to-float conversion), and puts x's sign bits back by a byte permute.
// kMarkstein: |x| / gs as RN(1/gs) and two FMA corrections where no intermediate can underflow
// or overflow (gs in [2^-91, 2^60] and the chunk's |x| <= 2^64 gs; a smaller |x| than 2^-103
// gives a quotient below 2^-12, under every nonzero threshold, exact or not), IEEE elsewhere.
template <bool kMarkstein, bool kFloatCount>
__global__ void __launch_bounds__(kThreads, 16) diet_kernel(const DispatchRowsParams p) {
  const int64_t t = blockIdx.x;
  const int64_t nc = p.K / kChunk;
  const int32_t* dst = p.scatter ? p.scatter + t * p.slots : nullptr;
  const uint4* x = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + t * p.K);
  uint32_t acc = 0;
#pragma unroll 4
  for (int64_t c = threadIdx.x; c < nc; c += kThreads) acc = jax_nvfp4::finite_abs_max_pairs(acc, __ldg(x + c));
  const float amax = jax_nvfp4::finite_abs_max_value(acc);
  const float gs = rows::DynamicGlobalScale(jax_nvfp4::cta_max<kThreads>(amax));
  const float r = __frcp_rn(gs);
  const bool row_fast = kMarkstein && gs >= 0x1p-91f && gs <= 0x1p60f;
  const float lim = gs * 0x1p64f;
  jax_nvfp4::store_row_scale<kThreads>(p, dst, t, gs);
  for (int64_t base = 0; base < nc; base += kThreads) {
    const int64_t c = base + threadIdx.x;
    const bool active = c < nc;
    const uint4 u = active ? __ldg(x + c) : make_uint4(0, 0, 0, 0);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
    const uint32_t own = jax_nvfp4::abs_max_bits(u);  // float32 bits
    const uint32_t blk = max(own, __shfl_xor_sync(0xFFFFFFFFu, own, 1));
    const float s = rows::BlockScale(__uint_as_float(blk) / gs, blk > 0x7F800000u, gs);
    uint4 o;
    if (s > 0.0f) {
      const rows::E2m1Grid grid(s);
      const bool fast = row_fast && __uint_as_float(own) <= lim;
      uint32_t ow[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float v[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float ax = __uint_as_float(h ? w[j] & 0x7FFF0000u : (w[j] & 0x7FFFu) << 16);
          float ay;
          if (fast) {
            const float q0 = __fmul_rn(ax, r);
            const float q1 = __fmaf_rn(__fmaf_rn(-q0, gs, ax), r, q0);
            ay = __fmaf_rn(__fmaf_rn(-q1, gs, ax), r, q1);
          } else {
            ay = __fdiv_rn(ax, gs);
          }
          if constexpr (kFloatCount) {
            const float n = (ay > grid.t[0] ? 1.0f : 0.0f) + (ay >= grid.t[1] ? 1.0f : 0.0f) +
                            (ay > grid.t[2] ? 1.0f : 0.0f) + (ay >= grid.t[3] ? 1.0f : 0.0f) +
                            2.0f * ((ay > grid.t[4] ? 1.0f : 0.0f) + (ay >= grid.t[5] ? 1.0f : 0.0f)) +
                            (ay > grid.t[6] ? 4.0f : 0.0f);
            v[h] = n * grid.half;
          } else {
            const int n = (ay > grid.t[0]) + (ay >= grid.t[1]) + (ay > grid.t[2]) + (ay >= grid.t[3]) +
                          2 * ((ay > grid.t[4]) + (ay >= grid.t[5])) + 4 * (ay > grid.t[6]);
            v[h] = static_cast<float>(n) * grid.half;
          }
        }
        ow[j] = __byte_perm(__float_as_uint(v[0]), __float_as_uint(v[1]), 0x7632) | (w[j] & 0x80008000u);
      }
      o = make_uint4(ow[0], ow[1], ow[2], ow[3]);
    } else {
      const uint32_t z = rows::IsNan(s) ? 0x7FC07FC0u : 0u;
      o = make_uint4(z, z, z, z);
    }
    if (!active) continue;
    for (int64_t j = 0; j < p.slots; ++j) {
      const int64_t rr = dst ? static_cast<int64_t>(__ldg(dst + j)) : t;
      if (rr >= 0 && rr < p.R) *reinterpret_cast<uint4*>(p.out + rr * p.K + c * kChunk) = o;
    }
  }
}

template <bool kMarkstein, bool kFloatCount>
void launch_diet(const DispatchRowsParams& p) {
  diet_kernel<kMarkstein, kFloatCount><<<static_cast<unsigned>(p.T), kThreads>>>(p);
}

template <int kVariant>
void launch(const DispatchRowsParams& p) {
  const int steps = static_cast<int>((p.K / kChunk + kThreads - 1) / kThreads);
  if (kVariant == 5 && steps <= 3) variant_kernel<5, 6, 64><<<p.T, 64>>>(p);
  else if (kVariant == 5) variant_kernel<5, 14, 64><<<p.T, 64>>>(p);
  else if (steps <= 3) variant_kernel<kVariant, 3><<<p.T, kThreads>>>(p);
  else variant_kernel<kVariant, 7><<<p.T, kThreads>>>(p);
}
}  // namespace lab

struct Case {
  const char* name;
  int64_t T, K, slots;
};

// div_by_scale against the IEEE division on the device: every finite bf16 x for 4096 scales
// (random over [2^-100, 2^100] and dynamic ones, amax / 2688 of bf16 amaxes).
void check_division() {
  std::vector<float> gs;
  std::mt19937 rng(3);
  for (int i = 0; i < 2048; ++i) {
    const uint32_t b = (27u + rng() % 200u) << 23 | (rng() & 0x7FFFFFu);
    float f;
    std::memcpy(&f, &b, 4);
    gs.push_back(f);
  }
  for (int i = 0; i < 2048; ++i) {
    const uint32_t b = (0x3000u + rng() % 0x2000u) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    gs.push_back(f / 2688.0f);
  }
  float* dg;
  unsigned long long* dbad;
  CK(cudaMalloc(&dg, gs.size() * 4));
  CK(cudaMalloc(&dbad, 8));
  CK(cudaMemcpy(dg, gs.data(), gs.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dbad, 0, 8));
  lab::div_check_kernel<<<dim3(256, static_cast<unsigned>(gs.size())), 256>>>(dg, dbad);
  CK(cudaGetLastError());
  unsigned long long bad = 0;
  CK(cudaMemcpy(&bad, dbad, 8, cudaMemcpyDeviceToHost));
  std::printf("fast exact division against the IEEE division: %llu of %zu quotients differ\n", bad,
              gs.size() * 65280);
  CK(cudaMemset(dbad, 0, 8));
  lab::diet_div_check_kernel<<<dim3(128, static_cast<unsigned>(gs.size())), 256>>>(dg, dbad);
  CK(cudaGetLastError());
  CK(cudaMemcpy(&bad, dbad, 8, cudaMemcpyDeviceToHost));
  std::printf("diet fast division against the IEEE division (where taken): %llu differ\n\n", bad);
  CK(cudaFree(dg));
  CK(cudaFree(dbad));
}

int main(int argc, char** argv) {
  const bool decode = argc > 1 && std::strcmp(argv[1], "--decode") == 0;
  if (!decode) check_division();
  const Case prefill[] = {{"gate/up input T4096 K7168 x6", 4096, 7168, 6}, {"down input T24576 K3072", 24576, 3072, 1}};
  const Case small[] = {{"gate/up input T32 K7168 x6", 32, 7168, 6}, {"down input T192 K3072", 192, 3072, 1}};
  const Case* const cases = decode ? small : prefill;
  std::printf("| case | kernel | us | GB/s (read x once + write) |\n|---|---|---|---|\n");
  for (int ci = 0; ci < 2; ++ci) {
    const Case& c = cases[ci];
    const int64_t R = c.T * c.slots;
    std::vector<uint16_t> hx(c.T * c.K);
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    for (auto& v : hx) {
      const float f = nd(rng) * 3.0f;
      uint32_t b;
      std::memcpy(&b, &f, 4);
      v = static_cast<uint16_t>(b >> 16);
    }
    // special rows for the equality checks: NaN, Inf, zeros, tiny and huge values, subnormals
    auto put = [&](int64_t row, int64_t col, uint16_t b) { hx[row * c.K + col] = b; };
    for (int64_t k = 0; k < c.K; k += 37) put(0, k, 0x7FC0);
    for (int64_t k = 0; k < c.K; k += 53) put(1, k, (k & 1) ? 0xFF80 : 0x7F80);
    for (int64_t k = 0; k < c.K; ++k) put(2, k, 0), put(3, k, (k % 3) ? 0x0001 : 0x8005);
    for (int64_t k = 0; k < c.K; ++k) put(4, k, (k % 5 == 0) ? 0x7F7F : static_cast<uint16_t>(0x0080 + k % 97));
    for (int64_t k = 0; k < c.K; ++k) put(5, k, static_cast<uint16_t>(((k * 2654435761u) >> 7) & 0xFFFF));
    for (int64_t k = 0; k < c.K; k += 16) put(6, k, 0x8000), put(6, k + 1, 0x0C00), put(6, k + 2, 0x0BFF);
    std::vector<int32_t> perm(R);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<float> hs(c.T);
    for (int64_t t = 0; t < c.T; ++t) hs[t] = 0.01f + 0.001f * (t % 7);
    void *dx, *dout, *dsc, *drs, *drso;
    CK(cudaMalloc(&dx, hx.size() * 2));
    CK(cudaMalloc(&dout, R * c.K * 2));
    CK(cudaMalloc(&dsc, R * 4));
    CK(cudaMalloc(&drs, c.T * 4));
    CK(cudaMalloc(&drso, R * 4));
    CK(cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsc, perm.data(), R * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(drs, hs.data(), c.T * 4, cudaMemcpyHostToDevice));
    jax_nvfp4::DispatchRowsParams base;
    base.x = dx, base.T = c.T, base.K = c.K, base.slots = c.slots, base.R = R;
    base.scatter = c.slots > 1 ? static_cast<const int32_t*>(dsc) : nullptr;
    base.out = static_cast<uint16_t*>(dout);
    const double bytes = c.T * c.K * 2.0 + R * c.K * 2.0;
    auto time = [&](const char* name, auto&& fn) {
      cudaEvent_t a, b;
      CK(cudaEventCreate(&a));
      CK(cudaEventCreate(&b));
      for (int i = 0; i < 3; ++i) fn();
      CK(cudaGetLastError());
      std::vector<float> ms;
      for (int rep = 0; rep < 7; ++rep) {
        CK(cudaEventRecord(a));
        for (int i = 0; i < 20; ++i) fn();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float m;
        CK(cudaEventElapsedTime(&m, a, b));
        ms.push_back(m / 20);
      }
      CK(cudaGetLastError());
      std::sort(ms.begin(), ms.end());
      std::printf("| %s | %s | %.1f | %.0f |\n", c.name, name, ms[3] * 1e3, bytes / (ms[3] * 1e-3) / 1e9);
    };
    auto prod = [&](bool given, bool dynamic) {
      jax_nvfp4::DispatchRowsParams p = base;
      if (given) p.row_scale = static_cast<const float*>(drs);
      if (dynamic) p.row_scale_out = static_cast<float*>(drso);
      return [p] { CK(jax_nvfp4::LaunchDispatchRows(p, 0)); };
    };
    jax_nvfp4::DispatchRowsParams pv = base;
    pv.row_scale_out = static_cast<float*>(drso);
    time("copy (production)", prod(false, false));
    time("given scale (production)", prod(true, false));
    time("dynamic scale (production)", prod(false, true));
    time("lab: diet (bit amax, IEEE division, float count)", [&] { lab::launch_diet<false, true>(pv); });
    if (!decode) {
      time("lab: dynamic, rounding by division", [&] { lab::launch<0>(pv); });
      time("lab: dynamic, x * (1/gs)", [&] { lab::launch<1>(pv); });
      time("lab: dynamic, row in registers", [&] { lab::launch<2>(pv); });
      time("lab: amax pass + copy", [&] { lab::launch<3>(pv); });
      time("lab: production arithmetic, 40 regs", [&] { lab::launch<4>(pv); });
      time("lab: production arithmetic, 40 regs, 64-thread CTAs", [&] { lab::launch<5>(pv); });
      time("lab: staged (cp.async one row ahead)", [&] { lab::launch_staged<false>(pv); });
      time("lab: staged, fast exact division", [&] { lab::launch_staged<true>(pv); });
      time("lab: diet (bit amax, IEEE division, int count)", [&] { lab::launch_diet<false, false>(pv); });
      time("lab: diet (bit amax, fast exact division, int count)", [&] { lab::launch_diet<true, false>(pv); });
      time("lab: diet (bit amax, fast exact division, float count)", [&] { lab::launch_diet<true, true>(pv); });
    }
    // the register and division variants must make the production bytes
    std::vector<uint16_t> a(R * c.K), b(R * c.K);
    CK(jax_nvfp4::LaunchDispatchRows(pv, 0));
    CK(cudaMemcpy(a.data(), dout, a.size() * 2, cudaMemcpyDeviceToHost));
    std::vector<float> sa(R), sb(R);
    CK(cudaMemcpy(sa.data(), drso, R * 4, cudaMemcpyDeviceToHost));
    const std::vector<int> checked = decode ? std::vector<int>{9} : std::vector<int>{0, 2, 5, 6, 7, 8, 9, 10, 11};
    for (int v : checked) {
      CK(cudaMemset(dout, 0xFF, R * c.K * 2));
      CK(cudaMemset(drso, 0xFF, R * 4));
      if (v == 0) lab::launch<0>(pv);
      else if (v == 2) lab::launch<2>(pv);
      else if (v == 5) lab::launch<5>(pv);
      else if (v == 6) lab::launch_staged<false>(pv);
      else if (v == 8) lab::launch_diet<false, false>(pv);
      else if (v == 9) lab::launch_diet<false, true>(pv);
      else if (v == 10) lab::launch_diet<true, false>(pv);
      else if (v == 11) lab::launch_diet<true, true>(pv);
      else lab::launch_staged<true>(pv);
      CK(cudaGetLastError());
      CK(cudaMemcpy(b.data(), dout, b.size() * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(sb.data(), drso, R * 4, cudaMemcpyDeviceToHost));
      const char* names[] = {"division", "", "registers", "", "", "64-thread", "staged", "staged fast-division",
                             "diet IEEE int", "diet IEEE float", "diet fast int", "diet fast float"};
      std::printf("| %s | %s variant equals production (values, scales) | %s, %s | |\n", c.name, names[v],
                  a == b ? "yes" : "NO", std::memcmp(sa.data(), sb.data(), R * 4) == 0 ? "yes" : "NO");
    }
    for (void* q : {dx, dout, dsc, drs, drso}) CK(cudaFree(q));
  }
  return 0;
}
