// The FP8 mode's activation quantizer kernel ("jax_nvfp4_quantize_fp8", csrc/quantize_fp8.h): one
// warp per (row, 128-wide chunk), lane l holding the chunk's logical k 4l .. 4l + 3 (8 bytes of bf16
// or float16, 16 of float32, 2 of NVFP4 codes). The chunk's amax is one warp reduction of the
// sign-cleared float32 bits (they order as the magnitudes, Inf and NaN above every finite value);
// each lane then writes its four codes as one word at the word the kernel k order gives them, so
// a warp's stores cover the chunk's 128 bytes. Each warp takes kChunksPerWarp chunks of a row
// with their loads issued first: x is read once, in whole sectors, with enough loads in flight to
// stream it (one chunk per warp leaves 256 bytes per warp outstanding).
#include "csrc/quantize_fp8.h"

#include <cstdint>

#include <cuda_runtime.h>

#include "csrc/fp8_codes.cuh"

namespace jax_nvfp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kChunksPerWarp = 2;

// The float32 bits of lane's four values of chunk c of row r.
template <Fp8InputKind kKind>
__device__ __forceinline__ uint4 load_bits(const QuantizeFp8Params& p, int64_t r, int64_t c, int lane) {
  const int64_t k = c * fp8q::kChunk + 4 * lane;
  if constexpr (kKind == Fp8InputKind::kF32) {
    return __ldg(reinterpret_cast<const uint4*>(static_cast<const float*>(p.x) + r * p.K + k));
  } else if constexpr (kKind == Fp8InputKind::kNvfp4) {
    const uint32_t codes = __ldg(reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(p.x) + r * (p.K / 2) + k / 2));
    const float scale = E4m3Value(__ldg(p.block_scales + r * (p.K / 16) + k / 16));
    return make_uint4(fp8q::BitsFromNvfp4(codes & 0xFu, scale), fp8q::BitsFromNvfp4((codes >> 4) & 0xFu, scale),
                      fp8q::BitsFromNvfp4((codes >> 8) & 0xFu, scale), fp8q::BitsFromNvfp4(codes >> 12, scale));
  } else {
    const uint2 h = __ldg(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p.x) + r * p.K + k));
    if constexpr (kKind == Fp8InputKind::kBf16) {
      return make_uint4(h.x << 16, h.x & 0xFFFF0000u, h.y << 16, h.y & 0xFFFF0000u);
    } else {
      return make_uint4(fp8q::BitsFromF16(h.x & 0xFFFFu), fp8q::BitsFromF16(h.x >> 16), fp8q::BitsFromF16(h.y & 0xFFFFu),
                        fp8q::BitsFromF16(h.y >> 16));
    }
  }
}

template <Fp8InputKind kKind>
__global__ void __launch_bounds__(kThreads) quantize_fp8_kernel(const QuantizeFp8Params p) {
  const int lane = threadIdx.x % 32;
  const int64_t chunks = p.K / fp8q::kChunk;
  const int64_t groups = (chunks + kChunksPerWarp - 1) / kChunksPerWarp;  // chunk groups per row
  const int64_t w = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (w >= p.M * groups) return;
  // transposed scales: consecutive warps take consecutive rows, so their scale stores are adjacent
  const int64_t r = p.scales_transposed ? w % p.M : w / groups;
  const int64_t c0 = (p.scales_transposed ? w / p.M : w % groups) * kChunksPerWarp;
  uint4 v[kChunksPerWarp];
#pragma unroll
  for (int u = 0; u < kChunksPerWarp; ++u)
    if (c0 + u < chunks) v[u] = load_bits<kKind>(p, r, c0 + u, lane);
  // lane l holds logical k = 4 l + i = 32 t + 8 j + 4 h + i; its word goes to position 8 j + 4 h + t
  const int word = 8 * ((lane >> 1) & 3) + 4 * (lane & 1) + (lane >> 3);
#pragma unroll
  for (int u = 0; u < kChunksPerWarp; ++u) {
    const int64_t c = c0 + u;
    if (c >= chunks) break;
    const uint32_t local = max(max(v[u].x & 0x7FFFFFFFu, v[u].y & 0x7FFFFFFFu),
                               max(v[u].z & 0x7FFFFFFFu, v[u].w & 0x7FFFFFFFu));
    const uint32_t amax = __reduce_max_sync(0xFFFFFFFFu, local);
    float s;
    const uint32_t out = fp8q::ChunkCodesWord(v[u], amax, &s);
    reinterpret_cast<uint32_t*>(p.codes + r * p.K + c * fp8q::kChunk)[word] = out;
    if (lane == 0) p.scales[p.scales_transposed ? c * p.M + r : r * chunks + c] = s;
  }
}

template <Fp8InputKind kKind>
cudaError_t launch(const QuantizeFp8Params& p, cudaStream_t stream) {
  const int64_t chunks = p.K / fp8q::kChunk;
  const int64_t warps = p.M * ((chunks + kChunksPerWarp - 1) / kChunksPerWarp);
  if (warps == 0) return cudaSuccess;
  const int64_t blocks = (warps + kThreads / 32 - 1) / (kThreads / 32);
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  quantize_fp8_kernel<kKind><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchQuantizeFp8(const QuantizeFp8Params& p, cudaStream_t stream) {
  switch (p.kind) {
    case Fp8InputKind::kBf16: return launch<Fp8InputKind::kBf16>(p, stream);
    case Fp8InputKind::kF16: return launch<Fp8InputKind::kF16>(p, stream);
    case Fp8InputKind::kF32: return launch<Fp8InputKind::kF32>(p, stream);
    case Fp8InputKind::kNvfp4: return launch<Fp8InputKind::kNvfp4>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_nvfp4
