// XLA FFI CPU handler of "jax_nvfp4_dispatch_rows" (ffi/dispatch_rows_ffi.h): the CUDA kernel's
// loop on the host, with the same per-block arithmetic (csrc/dispatch_rows.h) and, for the e4m3
// output, the quantizer's per-chunk arithmetic (csrc/quantize_fp8.h).
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "ffi/dispatch_rows_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// XLA runs CPU handlers with subnormals flushed (FTZ/DAZ); the NVFP4 arithmetic keeps them, as the
// CUDA kernel does (nvcc's default), so they are off while the handler runs.
class IeeeSubnormals {
 public:
  IeeeSubnormals() {
#if defined(__x86_64__) || defined(__i386__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~0x8040u);  // FTZ (bit 15), DAZ (bit 6)
#elif defined(__aarch64__)
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t v = saved_ & ~(uint64_t{1} << 24);  // FZ
    asm volatile("msr fpcr, %0" ::"r"(v));
#endif
  }
  ~IeeeSubnormals() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(saved_);
#elif defined(__aarch64__)
    asm volatile("msr fpcr, %0" ::"r"(saved_));
#endif
  }

 private:
#if defined(__aarch64__)
  uint64_t saved_ = 0;
#else
  unsigned saved_ = 0;
#endif
};

// The FP8 operand of one 128-wide chunk of output values h (bf16 bits): codes in the kernel k
// order and the chunk's scale, as the quantizer's CPU handler makes them (csrc/quantize_fp8.h).
float QuantizeChunkFp8(const uint16_t* h, uint8_t* codes) {
  namespace fp8q = jax_nvfp4::fp8q;
  uint32_t amax = 0;
  for (int i = 0; i < fp8q::kChunk; ++i) {
    const uint32_t a = fp8q::BitsFromBf16(h[i]) & 0x7FFFFFFFu;
    amax = a > amax ? a : amax;
  }
  bool nonfinite;
  const int e = fp8q::ScaleExponent(amax, &nonfinite);
  for (int i = 0; i < fp8q::kChunk; ++i)
    codes[fp8q::KernelPosition(i)] = nonfinite ? 0x7F : fp8q::E4m3Scaled(fp8q::BitsFromBf16(h[i]), e);
  return nonfinite ? 1.0f : fp8q::Pow2(e);
}

ffi::Error DispatchRowsCpu(ffi::AnyBuffer x, jax_nvfp4::RowScaleBuffer row_scale, ffi::AnyBuffer scatter,
                           ffi::Result<ffi::AnyBuffer> out, ffi::Result<jax_nvfp4::RowScaleBuffer> row_scale_out,
                           ffi::Result<ffi::AnyBuffer> chunk_scales) {
  jax_nvfp4::DispatchRowsParams p;
  if (ffi::Error err = jax_nvfp4::DecodeDispatchRows(x, row_scale, scatter, out, row_scale_out, chunk_scales, &p);
      err.failure())
    return err;
  namespace rows = jax_nvfp4::rows;
  constexpr int kChunk = jax_nvfp4::fp8q::kChunk;
  IeeeSubnormals ieee;
  const uint16_t* x16 = static_cast<const uint16_t*>(p.x);
  const float* x32 = static_cast<const float*>(p.x);
  const bool quant = p.row_scale || p.row_scale_out;
  // values made and stored per unit: an NVFP4 block, or a 128-wide chunk of the e4m3 output
  const int unit = p.codes ? kChunk : rows::kBlock;
  auto value = [&](int64_t i) { return p.x_f32 ? x32[i] : rows::F32FromBf16(x16[i]); };
  auto out_row = [&](int64_t t, int64_t j) { return p.scatter ? static_cast<int64_t>(p.scatter[t * p.slots + j]) : t; };
  for (int64_t t = 0; t < p.T; ++t) {
    float gs = p.row_scale ? p.row_scale[t] : 1.0f;
    if (p.row_scale_out) {
      float amax = 0.0f;
      for (int64_t i = 0; i < p.K; ++i) amax = rows::FiniteAbsMax(amax, value(t * p.K + i));
      gs = rows::DynamicGlobalScale(amax);
      for (int64_t j = 0; j < p.slots; ++j) {
        const int64_t r = out_row(t, j);
        if (r >= 0 && r < p.R) p.row_scale_out[r] = gs;
      }
    }
    for (int64_t u = 0; u < p.K / unit; ++u) {
      uint16_t h[kChunk];
      uint8_t codes[kChunk];
      float scale = 0.0f;
      for (int b = 0; b < unit / rows::kBlock; ++b) {
        const int64_t off = t * p.K + u * unit + b * rows::kBlock;
        if (quant) {
          float v[rows::kBlock];
          for (int i = 0; i < rows::kBlock; ++i) v[i] = value(off + i);
          rows::QuantizeBlock16(v, gs, h + b * rows::kBlock);
        } else {
          std::memcpy(h + b * rows::kBlock, x16 + off, rows::kBlock * sizeof(uint16_t));
        }
      }
      if (p.codes) scale = QuantizeChunkFp8(h, codes);
      for (int64_t j = 0; j < p.slots; ++j) {
        const int64_t r = out_row(t, j);
        if (r < 0 || r >= p.R) continue;
        if (p.codes) {
          std::memcpy(p.codes + r * p.K + u * unit, codes, kChunk);
          p.chunk_scales[r * (p.K / kChunk) + u] = scale;
        } else {
          std::memcpy(p.out + r * p.K + u * unit, h, unit * sizeof(uint16_t));
        }
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4DispatchRowsCpu, DispatchRowsCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()               // x [T, K]
                                  .Arg<jax_nvfp4::RowScaleBuffer>()    // row_scale [T] or [0]
                                  .Arg<ffi::AnyBuffer>()               // scatter [T, slots] or [0]
                                  .Ret<ffi::AnyBuffer>()               // out bf16 or e4m3 [R, K]
                                  .Ret<jax_nvfp4::RowScaleBuffer>()    // row_scale_out [R] or [0]
                                  .Ret<ffi::AnyBuffer>());             // chunk_scales [R, K/128] or [0, 0]
