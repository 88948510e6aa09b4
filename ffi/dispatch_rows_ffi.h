// The custom call "jax_nvfp4_dispatch_rows" as XLA FFI sees it (csrc/dispatch_rows.h), shared by
// the CPU and the CUDA handler: operands x (bf16 or float32 [T, K]), row_scale (float32 [T]: the
// rows' given global scales, or [0]), scatter (int32 [T, slots], or [0]: output row t is row t);
// results out (bf16 [R, K], or float8_e4m3fn [R, K]: the rows as the FP8 mode's operand, codes in
// its kernel k order), row_scale_out (float32 [R]: quantize with the dynamic scale made from each
// row and store it per output row, or [0]) and chunk_scales (float32 [R, K/128] with e4m3 out,
// each 128-wide chunk's scale; else [0, 0]). Neither row scale: bf16 rows are copied.
// No attributes. jax_nvfp4/ops/dispatch.py builds the call.
#pragma once

#include <cstdint>
#include <string>

#include "csrc/dispatch_rows.h"
#include "ffi/ffi_text.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {

namespace ffi = ::xla::ffi;

// An alias: template commas cannot appear inside the XLA_FFI_DEFINE_HANDLER_SYMBOL macro.
using RowScaleBuffer = ffi::Buffer<ffi::F32, 1>;

// Checks the call and fills *p (every message names the operand).
inline ffi::Error DecodeDispatchRows(ffi::AnyBuffer x, RowScaleBuffer row_scale, ffi::AnyBuffer scatter,
                                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<RowScaleBuffer> row_scale_out,
                                     ffi::Result<ffi::AnyBuffer> chunk_scales, DispatchRowsParams* p) {
  auto bad = [](const std::string& m) { return ffi::Error::InvalidArgument("jax_nvfp4_dispatch_rows: " + m); };
  const auto xd = x.dimensions();
  if (xd.size() != 2) return bad("x must be [T, K], got " + DimsToString(xd));
  if (x.element_type() != ffi::DataType::BF16 && x.element_type() != ffi::DataType::F32)
    return bad("x must be bfloat16 or float32");
  p->x = x.untyped_data();
  p->x_f32 = x.element_type() == ffi::DataType::F32;
  p->T = xd[0];
  p->K = xd[1];
  const int64_t ns = row_scale.dimensions()[0];
  if (ns != 0 && ns != p->T)
    return bad("row_scale must be [T] = [" + std::to_string(p->T) + "] or [0], got [" + std::to_string(ns) + "]");
  p->row_scale = ns ? row_scale.typed_data() : nullptr;
  const auto sd = scatter.dimensions();
  if (scatter.element_type() != ffi::DataType::S32) return bad("scatter must be int32");
  if (scatter.element_count() == 0) {
    p->scatter = nullptr;
    p->slots = 1;
  } else {
    if (sd.size() != 2 || sd[0] != p->T)
      return bad("scatter must be [T, slots] = [" + std::to_string(p->T) + ", slots] or empty, got " + DimsToString(sd));
    p->scatter = static_cast<const int32_t*>(scatter.untyped_data());
    p->slots = sd[1];
  }
  const auto od = out->dimensions();
  const bool fp8 = out->element_type() == ffi::DataType::F8E4M3FN;
  if ((!fp8 && out->element_type() != ffi::DataType::BF16) || od.size() != 2 || od[1] != p->K)
    return bad("out must be bfloat16 or float8_e4m3fn [R, K] with K = " + std::to_string(p->K) + ", got " +
               DimsToString(od));
  p->R = od[0];
  p->e4m3 = fp8;
  if (fp8) {
    p->codes = static_cast<uint8_t*>(out->untyped_data());
  } else {
    p->out = static_cast<uint16_t*>(out->untyped_data());
  }
  const auto cd = chunk_scales->dimensions();
  const int64_t chunks = fp8 ? p->K / fp8q::kChunk : 0;
  if (chunk_scales->element_type() != ffi::DataType::F32 || cd.size() != 2 || cd[0] != (fp8 ? p->R : 0) ||
      cd[1] != chunks)
    return bad("chunk_scales must be float32 " +
               (fp8 ? "[R, K/128] = [" + std::to_string(p->R) + ", " + std::to_string(chunks) + "]"
                    : std::string("[0, 0] with a bfloat16 out")) +
               ", got " + DimsToString(cd));
  p->chunk_scales = fp8 ? static_cast<float*>(chunk_scales->untyped_data()) : nullptr;
  const int64_t no = row_scale_out->dimensions()[0];
  if (no != 0 && no != p->R)
    return bad("row_scale_out must be [R] = [" + std::to_string(p->R) + "] or [0], got [" + std::to_string(no) + "]");
  p->row_scale_out = no ? row_scale_out->typed_data() : nullptr;
  if (const char* why = DispatchRowsCheckParams(*p)) return bad(why);
  return ffi::Error::Success();
}

}  // namespace jax_nvfp4
