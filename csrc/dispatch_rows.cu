// The MoE dispatch kernel ("jax_nvfp4_dispatch_rows", csrc/dispatch_rows.h): one CTA per source
// row. Thread i takes the row's 8-value chunks i, i + 128, ... (16 contiguous bytes per lane, so a
// warp's loads and each of its stores cover 512 contiguous bytes in whole 32-byte sectors); the
// two lanes of a 16-value NVFP4 block share its amax by a shuffle. Each chunk is made once and
// stored to every output row the scatter map names. Memory bound: the row is read once and
// written slots times.
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

template <bool kQuant, bool kF32>
__global__ void __launch_bounds__(kThreads) dispatch_rows_kernel(const DispatchRowsParams p) {
  const int64_t t = blockIdx.x;
  const int64_t nc = p.K / kChunk;  // even: K % 16 == 0
  const float gs = kQuant ? __ldg(p.row_scale + t) : 1.0f;
  const int32_t* dst = p.scatter ? p.scatter + t * p.slots : nullptr;
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
      uint32_t w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        w[j] = static_cast<uint32_t>(rows::QuantizedValue(y[2 * j], s)) |
               static_cast<uint32_t>(rows::QuantizedValue(y[2 * j + 1], s)) << 16;
      o = make_uint4(w[0], w[1], w[2], w[3]);
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
  if (!p.row_scale)
    dispatch_rows_kernel<false, false><<<grid, kThreads, 0, stream>>>(p);
  else if (p.x_f32)
    dispatch_rows_kernel<true, true><<<grid, kThreads, 0, stream>>>(p);
  else
    dispatch_rows_kernel<true, false><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_nvfp4
