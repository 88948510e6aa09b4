// The MoE dispatch kernel ("jax_nvfp4_dispatch_rows", csrc/dispatch_rows.h): one CTA per source
// row. Thread i takes the row's 8-value chunks i, i + 128, ... (16 contiguous bytes per lane, so a
// warp's loads and each of its stores cover 512 contiguous bytes in whole 32-byte sectors); the
// two lanes of a 16-value NVFP4 block share its amax by a shuffle. Each chunk is made once and
// stored to every output row the scatter map names. A dynamic row scale comes from a first pass
// over the row (its finite amax, reduced over the CTA); the second pass reads the row again from
// L1/L2, so HBM sees it once. Memory bound: the row is read once and written slots times.
#include "csrc/dispatch_rows.h"

#include <cstdint>

#include <cuda_runtime.h>

namespace jax_nvfp4 {
namespace {

constexpr int kThreads = 128;
constexpr int kChunk = 8;  // values per thread and step: 16 bytes of bf16

// Chunk c of row t as float32 (bf16 or float32 x).
template <bool kF32>
__device__ __forceinline__ void load_chunk(const void* x, int64_t off, float* v) {
  if constexpr (kF32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + off);
    const float4 a = __ldg(p), b = __ldg(p + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(x) + off));
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[2 * j] = __uint_as_float(w[j] << 16);
      v[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
    }
  }
}

// What the row's values become: copied (bf16), quantized with a given global scale, or quantized
// with the dynamic scale made from the row itself.
enum class Mode { kCopy, kGiven, kDynamic };

// The maximum of each thread's v over a CTA of kT threads (v >= 0, no NaN).
template <int kT = kThreads>
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

template <Mode kMode, bool kF32>
__global__ void __launch_bounds__(kThreads, 16) dispatch_rows_kernel(const DispatchRowsParams p) {
  constexpr bool kQuant = kMode != Mode::kCopy;
  const int64_t t = blockIdx.x;
  const int64_t nc = p.K / kChunk;  // even: K % 16 == 0
  const int32_t* dst = p.scatter ? p.scatter + t * p.slots : nullptr;
  float gs = 1.0f;
  if constexpr (kMode == Mode::kGiven) gs = __ldg(p.row_scale + t);
  if constexpr (kMode == Mode::kDynamic) {
    float amax = 0.0f;
#pragma unroll 4
    for (int64_t c = threadIdx.x; c < nc; c += kThreads) {
      float v[kChunk];
      load_chunk<kF32>(p.x, t * p.K + c * kChunk, v);
#pragma unroll
      for (int i = 0; i < kChunk; ++i) amax = rows::FiniteAbsMax(amax, v[i]);
    }
    gs = rows::DynamicGlobalScale(cta_max(amax));
    for (int64_t j = threadIdx.x; j < p.slots; j += kThreads) {
      const int64_t r = dst ? static_cast<int64_t>(__ldg(dst + j)) : t;
      if (r >= 0 && r < p.R) p.row_scale_out[r] = gs;
    }
  }
  // Every lane runs every step (the block's shuffle needs both lanes); lanes past the row store nothing.
  for (int64_t base = 0; base < nc; base += kThreads) {
    const int64_t c = base + threadIdx.x;
    const bool active = c < nc;
    uint4 o = make_uint4(0, 0, 0, 0);
    if constexpr (kQuant) {
      float y[kChunk];
      float amax = 0.0f;
      bool nan = false;
      if (active) {
        load_chunk<kF32>(p.x, t * p.K + c * kChunk, y);
#pragma unroll
        for (int i = 0; i < kChunk; ++i) {
          y[i] = y[i] / gs;
          const float a = fabsf(y[i]);
          nan |= rows::IsNan(a);
          amax = a > amax ? a : amax;
        }
      }
      const float amax2 = __shfl_xor_sync(0xFFFFFFFFu, amax, 1);
      nan |= __shfl_xor_sync(0xFFFFFFFFu, static_cast<int>(nan), 1) != 0;
      amax = amax2 > amax ? amax2 : amax;
      const float s = rows::BlockScale(amax, nan, gs);
      if (s > 0.0f) {
        const rows::E2m1Grid grid(s);
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          w[j] = static_cast<uint32_t>(grid.Value(y[2 * j])) | static_cast<uint32_t>(grid.Value(y[2 * j + 1])) << 16;
        o = make_uint4(w[0], w[1], w[2], w[3]);
      } else {  // a NaN block (NaN values) or a zero one (+0), as QuantizedValue
        const uint32_t z = rows::IsNan(s) ? 0x7FC07FC0u : 0u;
        o = make_uint4(z, z, z, z);
      }
    } else if (active) {
      o = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + t * p.K + c * kChunk));
    }
    if (!active) continue;
    for (int64_t j = 0; j < p.slots; ++j) {
      const int64_t r = dst ? static_cast<int64_t>(__ldg(dst + j)) : t;
      if (r < 0 || r >= p.R) continue;
      *reinterpret_cast<uint4*>(p.out + r * p.K + c * kChunk) = o;
    }
  }
}

}  // namespace

cudaError_t LaunchDispatchRows(const DispatchRowsParams& p, cudaStream_t stream) {
  if (DispatchRowsCheckParams(p) != nullptr) return cudaErrorInvalidValue;
  // 16-byte vector accesses: rows of K % 16 == 0 values from 16-byte aligned buffers
  if ((reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.out)) & 15) return cudaErrorMisalignedAddress;
  if (p.T == 0 || p.K == 0 || p.R == 0) return cudaSuccess;
  if (p.T > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.T));
  if (p.row_scale_out && p.x_f32)
    dispatch_rows_kernel<Mode::kDynamic, true><<<grid, kThreads, 0, stream>>>(p);
  else if (p.row_scale_out)
    dispatch_rows_kernel<Mode::kDynamic, false><<<grid, kThreads, 0, stream>>>(p);
  else if (p.row_scale && p.x_f32)
    dispatch_rows_kernel<Mode::kGiven, true><<<grid, kThreads, 0, stream>>>(p);
  else if (p.row_scale)
    dispatch_rows_kernel<Mode::kGiven, false><<<grid, kThreads, 0, stream>>>(p);
  else
    dispatch_rows_kernel<Mode::kCopy, false><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_nvfp4
