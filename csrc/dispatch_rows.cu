// The MoE dispatch kernel ("jax_nvfp4_dispatch_rows", csrc/dispatch_rows.h): one CTA per source
// row; each thread takes 16-value blocks of the row (strided by the CTA), quantizes a block once
// (or copies it) and stores its 32 bytes to each output row the scatter map names. Memory bound:
// the row is read once and written slots times (the XLA gather reads it once per copy and, for
// W4A4, the codes path adds a quantizer, a packed-code gather and a decode pass; docs/perf-log-layer.md).
#include "csrc/dispatch_rows.h"

#include <cstdint>

#include <cuda_runtime.h>

namespace jax_nvfp4 {
namespace {

constexpr int kThreads = 128;

struct alignas(16) Bf16x8 {
  uint32_t w[4];
};

// The block b of row t as float32 (bf16 or float32 x).
template <bool kF32>
__device__ __forceinline__ void load_block(const void* x, int64_t off, float* v) {
  if constexpr (kF32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + off);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 f = __ldg(p + i);
      v[4 * i] = f.x;
      v[4 * i + 1] = f.y;
      v[4 * i + 2] = f.z;
      v[4 * i + 3] = f.w;
    }
  } else {
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(x) + off);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint4 u = __ldg(p + i);
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[8 * i + 2 * j] = __uint_as_float(w[j] << 16);
        v[8 * i + 2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
      }
    }
  }
}

template <bool kQuant, bool kF32>
__global__ void __launch_bounds__(kThreads) dispatch_rows_kernel(const DispatchRowsParams p) {
  const int64_t t = blockIdx.x;
  const int64_t nb = p.K / rows::kBlock;
  const float gs = kQuant ? __ldg(p.row_scale + t) : 1.0f;
  const int32_t* dst = p.scatter ? p.scatter + t * p.slots : nullptr;
  for (int64_t b = threadIdx.x; b < nb; b += kThreads) {
    uint4 o[2];
    if constexpr (kQuant) {
      float v[rows::kBlock];
      load_block<kF32>(p.x, t * p.K + b * rows::kBlock, v);
      uint16_t h[rows::kBlock];
      rows::QuantizeBlock16(v, gs, h);
      uint32_t w[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) w[j] = static_cast<uint32_t>(h[2 * j]) | static_cast<uint32_t>(h[2 * j + 1]) << 16;
      o[0] = make_uint4(w[0], w[1], w[2], w[3]);
      o[1] = make_uint4(w[4], w[5], w[6], w[7]);
    } else {
      const uint4* src = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + t * p.K + b * rows::kBlock);
      o[0] = __ldg(src);
      o[1] = __ldg(src + 1);
    }
    for (int64_t j = 0; j < p.slots; ++j) {
      const int64_t r = dst ? static_cast<int64_t>(__ldg(dst + j)) : t;
      if (r < 0 || r >= p.R) continue;
      uint4* out = reinterpret_cast<uint4*>(p.out + r * p.K + b * rows::kBlock);
      out[0] = o[0];
      out[1] = o[1];
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
