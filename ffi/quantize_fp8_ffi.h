// The custom call "jax_nvfp4_quantize_fp8" as XLA FFI sees it (csrc/quantize_fp8.h), shared by the
// CPU and the CUDA handler: operands x (bf16, float16 or float32 [M, K]; or uint8 [M, K/2], NVFP4
// packed codes) and block_scales (float8_e4m3fn [M, K/16] for an NVFP4 x, else [0]); results codes
// (float8_e4m3fn [M, K], kernel k order) and scales (float32 [M, K/128], or [K/128, M] with the
// attribute scales_transposed). jax_nvfp4/ops/fp8.py builds the call.
#pragma once

#include <cstdint>
#include <string>

#include "csrc/quantize_fp8.h"
#include "ffi/ffi_text.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {

namespace ffi = ::xla::ffi;

// Checks the call and fills *p (every message names the operand).
inline ffi::Error DecodeQuantizeFp8(ffi::AnyBuffer x, ffi::AnyBuffer block_scales, ffi::Result<ffi::AnyBuffer> codes,
                                    ffi::Result<ffi::AnyBuffer> scales, bool scales_transposed,
                                    QuantizeFp8Params* p) {
  auto bad = [](const std::string& m) { return ffi::Error::InvalidArgument("jax_nvfp4_quantize_fp8: " + m); };
  const auto xd = x.dimensions();
  if (xd.size() != 2) return bad("x must be [M, K] (or [M, K/2] NVFP4 codes), got " + DimsToString(xd));
  p->M = xd[0];
  // uint8 x is NVFP4 (its block scales [M, K/16] may be empty with M = 0); a float x takes none
  const bool nvfp4 = x.element_type() == ffi::DataType::U8;
  if (nvfp4) {
    p->kind = Fp8InputKind::kNvfp4;
    p->K = 2 * xd[1];
    const auto sd = block_scales.dimensions();
    if (block_scales.element_type() != ffi::DataType::F8E4M3FN || sd.size() != 2 || sd[0] != p->M ||
        sd[1] * 16 != p->K)
      return bad("block_scales must be float8_e4m3fn [M, K/16] = [" + std::to_string(p->M) + ", " +
                 std::to_string(p->K / 16) + "], got " + DimsToString(sd));
    p->block_scales = static_cast<const uint8_t*>(block_scales.untyped_data());
  } else {
    switch (x.element_type()) {
      case ffi::DataType::BF16: p->kind = Fp8InputKind::kBf16; break;
      case ffi::DataType::F16: p->kind = Fp8InputKind::kF16; break;
      case ffi::DataType::F32: p->kind = Fp8InputKind::kF32; break;
      default: return bad("x must be bfloat16, float16 or float32 (or uint8 codes with block_scales)");
    }
    if (block_scales.element_count() != 0) return bad("block_scales must be empty ([0]) for a float x");
    p->K = xd[1];
    p->block_scales = nullptr;
  }
  p->x = x.untyped_data();
  const auto cd = codes->dimensions();
  if (codes->element_type() != ffi::DataType::F8E4M3FN || cd.size() != 2 || cd[0] != p->M || cd[1] != p->K)
    return bad("codes must be float8_e4m3fn [M, K] = [" + std::to_string(p->M) + ", " + std::to_string(p->K) +
               "], got " + DimsToString(cd));
  p->codes = static_cast<uint8_t*>(codes->untyped_data());
  const int64_t c = p->K / fp8q::kChunk;
  const auto sd = scales->dimensions();
  const int64_t want0 = scales_transposed ? c : p->M, want1 = scales_transposed ? p->M : c;
  if (scales->element_type() != ffi::DataType::F32 || sd.size() != 2 || sd[0] != want0 || sd[1] != want1)
    return bad(std::string("scales must be float32 ") + (scales_transposed ? "[K/128, M]" : "[M, K/128]") + " = [" +
               std::to_string(want0) + ", " + std::to_string(want1) + "], got " + DimsToString(sd));
  p->scales = static_cast<float*>(scales->untyped_data());
  p->scales_transposed = scales_transposed;
  if (const char* why = QuantizeFp8CheckParams(*p)) return bad(why);
  return ffi::Error::Success();
}

}  // namespace jax_nvfp4
