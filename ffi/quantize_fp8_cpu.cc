// XLA FFI CPU handler of "jax_nvfp4_quantize_fp8" (ffi/quantize_fp8_ffi.h): the CUDA kernel's
// per-chunk arithmetic (csrc/quantize_fp8.h) in a host loop. Integer operations only, so XLA's
// flush-to-zero mode on the CPU does not reach it.
#include <cstdint>

#include "ffi/quantize_fp8_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error QuantizeFp8Cpu(ffi::AnyBuffer x, ffi::AnyBuffer block_scales, ffi::Result<ffi::AnyBuffer> codes,
                          ffi::Result<ffi::AnyBuffer> scales, bool scales_transposed) {
  jax_nvfp4::QuantizeFp8Params p;
  if (ffi::Error err = jax_nvfp4::DecodeQuantizeFp8(x, block_scales, codes, scales, scales_transposed, &p);
      err.failure())
    return err;
  namespace q = jax_nvfp4::fp8q;
  const int64_t chunks = p.K / q::kChunk;
  for (int64_t r = 0; r < p.M; ++r) {
    for (int64_t c = 0; c < chunks; ++c) {
      uint32_t bits[q::kChunk];
      uint32_t amax = 0;
      for (int i = 0; i < q::kChunk; ++i) {
        bits[i] = q::ValueBits(p, r, c * q::kChunk + i);
        const uint32_t a = bits[i] & 0x7FFFFFFFu;
        amax = a > amax ? a : amax;
      }
      bool nonfinite;
      const int e = q::ScaleExponent(amax, &nonfinite);
      uint8_t* out = p.codes + r * p.K + c * q::kChunk;
      for (int i = 0; i < q::kChunk; ++i) out[q::KernelPosition(i)] = nonfinite ? 0x7F : q::E4m3Scaled(bits[i], e);
      p.scales[p.scales_transposed ? c * p.M + r : r * chunks + c] = nonfinite ? 1.0f : q::Pow2(e);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4QuantizeFp8Cpu, QuantizeFp8Cpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()   // x [M, K] float, or uint8 [M, K/2]
                                  .Arg<ffi::AnyBuffer>()   // block_scales e4m3 [M, K/16] or [0]
                                  .Ret<ffi::AnyBuffer>()   // codes e4m3 [M, K], kernel k order
                                  .Ret<ffi::AnyBuffer>()   // scales float32 [M, K/128] or [K/128, M]
                                  .Attr<bool>("scales_transposed"));
