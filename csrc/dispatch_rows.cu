// The MoE dispatch kernel ("jax_nvfp4_dispatch_rows", csrc/dispatch_rows.h): one CTA per source
// row, of 128 threads, or (quantizing) 256 / 512 when so few rows would leave the GPU's threads idle
// (decode: 32 token rows of 896 chunks would run 7 serial steps on 32 SMs; DispatchThreads).
// Thread i takes the row's 8-value chunks i, i + kT, ... (16 contiguous bytes per lane, so a
// warp's loads and each of its stores cover 512 contiguous bytes in whole 32-byte sectors); the
// two lanes of a 16-value NVFP4 block share its amax by a shuffle. Each chunk is made once and
// stored to every output row the scatter map names. A dynamic row scale comes from a first pass
// over the row (its finite amax, reduced over the CTA); the second pass reads the row again from
// L1/L2, so HBM sees it once. The row is read once and written slots times: the six-copy gate/up
// input is bound by those bytes, the one-copy down input by the per-value division and compares.
// The FP8 output (Fp8Chunk) quantizes the same bf16 values per 128-wide chunk in registers: a
// half-warp reduction per chunk, 8 bytes of codes per lane and value group instead of 16 of bf16.
#include "csrc/dispatch_rows.h"

#include <cstdint>

#include <cuda_runtime.h>

#include "csrc/fp8_codes.cuh"

namespace jax_nvfp4 {
namespace {

constexpr int kChunk = 8;  // values per thread and step: 16 bytes of bf16

// The 8 float32 values of x at off (a float32 x).
__device__ __forceinline__ void load_chunk_f32(const void* x, int64_t off, float* v) {
  const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + off);
  const float4 a = __ldg(p), b = __ldg(p + 1);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// What the row's values become: copied (bf16), quantized with a given global scale, or quantized
// with the dynamic scale made from the row itself.
enum class Mode { kCopy, kGiven, kDynamic };

// The maximum of each thread's v over a CTA of kT threads (v >= 0, no NaN).
template <int kT>
__device__ __forceinline__ float cta_max(float v) {
  __shared__ float warp_max[kT / 32];
#pragma unroll
  for (int m = 16; m > 0; m /= 2) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, m));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kT / 32; ++w) v = fmaxf(v, warp_max[w]);
  return v;
}

// The float32 bits of the largest |x| of 8 bf16 values (NaN: above 0x7F800000), by 16x2 integer
// maxima on the sign-cleared bit pairs: |x| orders as its bits.
__device__ __forceinline__ uint32_t abs_max_bits(uint4 u) {
  const uint32_t m = __vmaxu2(__vmaxu2(u.x & 0x7FFF7FFFu, u.y & 0x7FFF7FFFu),
                              __vmaxu2(u.z & 0x7FFF7FFFu, u.w & 0x7FFF7FFFu));
  return max(m & 0xFFFFu, m >> 16) << 16;
}

// A running maximum over finite |x| of 8 bf16 values, as 16x2 bit pairs offset by 0x80: finite
// |x| (at most 0x7F7F) becomes 0x80..0x7FFF, Inf and NaN become negative as int16, so one signed
// 16x2 maximum per word skips them (finite_abs_max_value reads the result).
__device__ __forceinline__ uint32_t finite_abs_max_pairs(uint32_t acc, uint4 u) {
  acc = __vmaxs2(acc, (u.x & 0x7FFF7FFFu) + 0x00800080u);
  acc = __vmaxs2(acc, (u.y & 0x7FFF7FFFu) + 0x00800080u);
  acc = __vmaxs2(acc, (u.z & 0x7FFF7FFFu) + 0x00800080u);
  return __vmaxs2(acc, (u.w & 0x7FFF7FFFu) + 0x00800080u);
}
__device__ __forceinline__ float finite_abs_max_value(uint32_t acc) {
  const uint32_t m = max(acc & 0xFFFFu, acc >> 16);  // both halves >= 0 as int16
  return m ? __uint_as_float((m - 0x80u) << 16) : 0.0f;
}

// The dynamic scale gs of row t, stored for each output row its copies go to (dst: its scatter
// row, or nullptr: output row t), by the CTA's kT threads.
template <int kT>
__device__ __forceinline__ void store_row_scale(const DispatchRowsParams& p, const int32_t* dst, int64_t t, float gs) {
  for (int64_t j = threadIdx.x; j < p.slots; j += kT) {
    const int64_t r = dst ? static_cast<int64_t>(__ldg(dst + j)) : t;
    if (r >= 0 && r < p.R) p.row_scale_out[r] = gs;
  }
}

// The FP8 operand of a thread's 8 output values o (bf16 bits) at 8-value chunk c of the row
// (logical k 8c .. 8c + 7): a 128-wide chunk is the 16 chunks of a half warp (K % 128 == 0, so all
// 16 lanes are active or none), whose amax one 4-step shuffle reduction gives; the two words of
// codes go to the kernel k order's positions (fp8q::KernelPosition: k = 32 t + 8 j + 4 h + i at
// 32 j + 16 h + 4 t + i, the chunk being 8 (4 t + j) .. + 7), the scale from the half warp's
// first lane. Every lane of the warp runs it (the shuffles).
struct Fp8Chunk {
  uint32_t lo, hi;  // codes of values 0..3 and 4..7
  float scale;

  __device__ __forceinline__ explicit Fp8Chunk(uint4 o) {
    const uint4 a = make_uint4(o.x << 16, o.x & 0xFFFF0000u, o.y << 16, o.y & 0xFFFF0000u);
    const uint4 b = make_uint4(o.z << 16, o.z & 0xFFFF0000u, o.w << 16, o.w & 0xFFFF0000u);
    const uint32_t m = __vmaxu2(__vmaxu2(o.x & 0x7FFF7FFFu, o.y & 0x7FFF7FFFu),
                                __vmaxu2(o.z & 0x7FFF7FFFu, o.w & 0x7FFF7FFFu));
    uint32_t amax = max(m & 0xFFFFu, m >> 16) << 16;  // |x| orders as its bits, NaN above Inf
#pragma unroll
    for (int s = 1; s < 16; s *= 2) amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, s));
    lo = fp8q::ChunkCodesWord(a, amax, &scale);
    hi = fp8q::ChunkCodesWord(b, amax, &scale);
  }

  // Stores chunk c's codes (and, from the first lane of the 128-wide chunk, its scale) to row r.
  __device__ __forceinline__ void Store(const DispatchRowsParams& p, int64_t r, int64_t c) const {
    const int a = static_cast<int>(c % 16);
    uint8_t* base = p.codes + r * p.K + (c / 16) * fp8q::kChunk + 32 * (a & 3) + 4 * (a >> 2);
    *reinterpret_cast<uint32_t*>(base) = lo;
    *reinterpret_cast<uint32_t*>(base + 16) = hi;
    if (a == 0) p.chunk_scales[r * (p.K / fp8q::kChunk) + c / 16] = scale;
  }
};

template <Mode kMode, bool kF32, bool kFp8, int kT>
__global__ void __launch_bounds__(kT, 2048 / kT) dispatch_rows_kernel(const DispatchRowsParams p) {
  constexpr bool kQuant = kMode != Mode::kCopy;
  const int64_t t = blockIdx.x;
  const int64_t nc = p.K / kChunk;  // even: K % 16 == 0
  const int32_t* dst = p.scatter ? p.scatter + t * p.slots : nullptr;
  const uint4* xb = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + t * p.K);  // bf16 x
  float gs = 1.0f;
  if constexpr (kMode == Mode::kGiven) gs = __ldg(p.row_scale + t);
  if constexpr (kMode == Mode::kDynamic) {
    float amax = 0.0f;
    if constexpr (kF32) {
#pragma unroll 4
      for (int64_t c = threadIdx.x; c < nc; c += kT) {
        float v[kChunk];
        load_chunk_f32(p.x, t * p.K + c * kChunk, v);
#pragma unroll
        for (int i = 0; i < kChunk; ++i) amax = rows::FiniteAbsMax(amax, v[i]);
      }
    } else {
      uint32_t acc = 0;
#pragma unroll 4
      for (int64_t c = threadIdx.x; c < nc; c += kT) acc = finite_abs_max_pairs(acc, __ldg(xb + c));
      amax = finite_abs_max_value(acc);
    }
    gs = rows::DynamicGlobalScale(cta_max<kT>(amax));
    store_row_scale<kT>(p, dst, t, gs);
  }
  // Every lane runs every step (the block's shuffle needs both lanes); lanes past the row store nothing.
  for (int64_t base = 0; base < nc; base += kT) {
    const int64_t c = base + threadIdx.x;
    const bool active = c < nc;
    uint4 o = make_uint4(0, 0, 0, 0);
    if constexpr (kQuant) {
      // The block's amax of |x / gs| is RN(max |x| / gs) (the rounded quotient is monotone in |x|),
      // so the maximum is taken on |x|'s bits and divided once; a NaN x makes the block NaN.
      float x[kChunk];
      uint32_t own = 0;
      if constexpr (kF32) {
        if (active) {
          load_chunk_f32(p.x, t * p.K + c * kChunk, x);
        } else {
#pragma unroll
          for (int i = 0; i < kChunk; ++i) x[i] = 0.0f;
        }
#pragma unroll
        for (int i = 0; i < kChunk; ++i) own = max(own, __float_as_uint(x[i]) & 0x7FFFFFFFu);
      } else {
        const uint4 u = active ? __ldg(xb + c) : make_uint4(0, 0, 0, 0);
        own = abs_max_bits(u);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) x[2 * j] = __uint_as_float(w[j] << 16), x[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
      }
      const uint32_t blk = max(own, __shfl_xor_sync(0xFFFFFFFFu, own, 1));
      const float s = rows::BlockScale(__uint_as_float(blk) / gs, blk > 0x7F800000u, gs);
      if (s > 0.0f) {
        const rows::E2m1Grid grid(s);
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          w[j] = static_cast<uint32_t>(grid.Value(x[2 * j] / gs)) |
                 static_cast<uint32_t>(grid.Value(x[2 * j + 1] / gs)) << 16;
        o = make_uint4(w[0], w[1], w[2], w[3]);
      } else {  // a NaN block (NaN values) or a zero one (+0), as QuantizedValue
        const uint32_t z = rows::IsNan(s) ? 0x7FC07FC0u : 0u;
        o = make_uint4(z, z, z, z);
      }
    } else if (active) {
      o = __ldg(xb + c);
    }
    if constexpr (kFp8) {
      const Fp8Chunk q(o);  // before the inactive lanes leave: the shuffles need the whole warp
      if (!active) continue;
      for (int64_t j = 0; j < p.slots; ++j) {
        const int64_t r = dst ? static_cast<int64_t>(__ldg(dst + j)) : t;
        if (r >= 0 && r < p.R) q.Store(p, r, c);
      }
    } else {
      if (!active) continue;
      for (int64_t j = 0; j < p.slots; ++j) {
        const int64_t r = dst ? static_cast<int64_t>(__ldg(dst + j)) : t;
        if (r < 0 || r >= p.R) continue;
        *reinterpret_cast<uint4*>(p.out + r * p.K + c * kChunk) = o;
      }
    }
  }
}

// The kernel of p's mode and output with CTAs of kT threads, one per source row.
template <bool kFp8, int kT>
cudaError_t launch(const DispatchRowsParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.T));
  if (p.row_scale_out && p.x_f32)
    dispatch_rows_kernel<Mode::kDynamic, true, kFp8, kT><<<grid, kT, 0, stream>>>(p);
  else if (p.row_scale_out)
    dispatch_rows_kernel<Mode::kDynamic, false, kFp8, kT><<<grid, kT, 0, stream>>>(p);
  else if (p.row_scale && p.x_f32)
    dispatch_rows_kernel<Mode::kGiven, true, kFp8, kT><<<grid, kT, 0, stream>>>(p);
  else if (p.row_scale)
    dispatch_rows_kernel<Mode::kGiven, false, kFp8, kT><<<grid, kT, 0, stream>>>(p);
  else
    dispatch_rows_kernel<Mode::kCopy, false, kFp8, kT><<<grid, kT, 0, stream>>>(p);
  return cudaGetLastError();
}

template <int kT>
cudaError_t launch(const DispatchRowsParams& p, cudaStream_t stream) {
  return p.codes ? launch<true, kT>(p, stream) : launch<false, kT>(p, stream);
}

}  // namespace

cudaError_t LaunchDispatchRows(const DispatchRowsParams& p, cudaStream_t stream) {
  if (DispatchRowsCheckParams(p) != nullptr) return cudaErrorInvalidValue;
  // rows of K % 16 == 0 values from 16-byte aligned buffers: 16-byte vector loads and bf16
  // stores; 4-byte code stores (K % 128 == 0 then)
  if ((reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.out)) & 15) return cudaErrorMisalignedAddress;
  if (reinterpret_cast<uintptr_t>(p.codes) & 3) return cudaErrorMisalignedAddress;
  if (p.T == 0 || p.K == 0 || p.R == 0) return cudaSuccess;
  if (p.T > 0x7FFFFFFF) return cudaErrorInvalidValue;
  int device = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return e;
  const int threads = DispatchThreads(p.T, sms, p.row_scale != nullptr || p.row_scale_out != nullptr);
  if (threads == 512) return launch<512>(p, stream);
  if (threads == 256) return launch<256>(p, stream);
  return launch<128>(p, stream);
}

}  // namespace jax_nvfp4
