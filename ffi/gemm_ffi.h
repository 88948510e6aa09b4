// The custom calls "jax_nvfp4_grouped_gemm" (exact or FP8 mode) and "jax_nvfp4_grouped_gemm_glu"
// (exact, SwiGLU epilogue) as XLA FFI sees them, shared by the CPU and the CUDA handlers: the typed
// attributes (decoded into GemmAttrs) and the buffer checks that turn the call frame into
// GroupedGemmParams (csrc/gemm_contract.h). Both handlers accept and check the same attributes; the
// CPU handlers ignore the kernel configuration once it is checked.
//
// The compute mode is stated once, by the kernel attribute: a family that computes the FP8 mode
// (IsFp8Family) makes "jax_nvfp4_grouped_gemm" decode its operands as the FP8 mode's and set
// GroupedGemmParams::fp8. The decoders run GroupedGemmCheckParams once; what the handlers and
// launchers do after that takes it as given.
//
// Attributes (jax_nvfp4/ops/gemm.py sets them; the lowered program shows them):
//   rhs_layout  i32 enum RhsLayout      0 checkpoint, 1 sm90, 2 fp8 (e4m3-prepared; FP8 kernels only)
//   kernel      i32 enum KernelFamily   0 mma, 1 mma_ws, 2 wgmma (exact mode); 3 wgmma_fp8,
//                                       4 wgmma_fp8_prepared, 5 cutlass_fp8 (FP8 mode)
//   token_tile, stages, cluster, raster  i32    together with kernel: one kKernelConfigs entry
//   glu_limit   f32 (SwiGLU call "jax_nvfp4_grouped_gemm_glu" only)  > 0, +inf for no clamp
#pragma once

#include <cstdint>
#include <string>

#include "csrc/gemm_contract.h"
#include "ffi/ffi_text.h"
#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {

struct GemmAttrs {
  RhsLayout rhs_layout;
  KernelFamily kernel;
  int32_t token_tile;
  int32_t stages;
  int32_t cluster;
  int32_t raster;
  KernelConfig config() const { return KernelConfig{kernel, token_tile, stages, cluster, raster}; }
};

// The SwiGLU call's attributes: the exact call's and the clamp limit.
struct GluAttrs {
  RhsLayout rhs_layout;
  KernelFamily kernel;
  int32_t token_tile;
  int32_t stages;
  int32_t cluster;
  int32_t raster;
  float glu_limit;
  GemmAttrs gemm() const { return GemmAttrs{rhs_layout, kernel, token_tile, stages, cluster, raster}; }
};

}  // namespace jax_nvfp4

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jax_nvfp4::RhsLayout);
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jax_nvfp4::KernelFamily);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_nvfp4::GemmAttrs,
                                      ::xla::ffi::StructMember<jax_nvfp4::RhsLayout>("rhs_layout"),
                                      ::xla::ffi::StructMember<jax_nvfp4::KernelFamily>("kernel"),
                                      ::xla::ffi::StructMember<int32_t>("token_tile"),
                                      ::xla::ffi::StructMember<int32_t>("stages"),
                                      ::xla::ffi::StructMember<int32_t>("cluster"),
                                      ::xla::ffi::StructMember<int32_t>("raster"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_nvfp4::GluAttrs,
                                      ::xla::ffi::StructMember<jax_nvfp4::RhsLayout>("rhs_layout"),
                                      ::xla::ffi::StructMember<jax_nvfp4::KernelFamily>("kernel"),
                                      ::xla::ffi::StructMember<int32_t>("token_tile"),
                                      ::xla::ffi::StructMember<int32_t>("stages"),
                                      ::xla::ffi::StructMember<int32_t>("cluster"),
                                      ::xla::ffi::StructMember<int32_t>("raster"),
                                      ::xla::ffi::StructMember<float>("glu_limit"));

namespace jax_nvfp4 {

namespace ffi = ::xla::ffi;

// Aliases: template commas cannot appear inside the XLA_FFI_DEFINE_HANDLER_SYMBOL macro.
using U8Buffer3 = ffi::Buffer<ffi::U8, 3>;
using F32Buffer1 = ffi::Buffer<ffi::F32, 1>;
using S32Buffer1 = ffi::Buffer<ffi::S32, 1>;
using U8Buffer1 = ffi::Buffer<ffi::U8, 1>;

inline ffi::Error BadArgument(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_nvfp4_grouped_gemm: " + msg);
}

inline std::string ConfigToString(const KernelConfig& c) {
  return std::string("kernel=") + FamilyName(c.family) + " (" + std::to_string(static_cast<int>(c.family)) +
         "), token_tile=" + std::to_string(c.token_tile) + ", stages=" + std::to_string(c.stages) +
         ", cluster=" + std::to_string(c.cluster) + (c.raster ? ", raster=" + std::to_string(c.raster) : "");
}

// Checks the attributes every call shares: rhs_layout, a compiled configuration, and a layout the
// configuration's family reads (fp8-prepared weights: the FP8 families that read them).
inline ffi::Error CheckAttributes(const std::string& target, const GemmAttrs& attrs) {
  auto bad = [&target](const std::string& m) { return ffi::Error::InvalidArgument(target + ": " + m); };
  if (!IsKnownLayout(attrs.rhs_layout))
    return bad("attribute rhs_layout must be 0 (checkpoint), 1 (sm90) or 2 (fp8), got " +
               std::to_string(static_cast<int>(attrs.rhs_layout)));
  if (!IsKnownConfig(attrs.config()))
    return bad("attributes " + ConfigToString(attrs.config()) +
               " are not a compiled kernel configuration (jax_nvfp4.kernel_configs() lists them)");
  if (attrs.rhs_layout == RhsLayout::kFp8 && !IsFp8Family(attrs.kernel))
    return bad("rhs_layout 2 (weights prepared as e4m3 by jax_nvfp4.prepare_weights(w, 'fp8')) belongs to the FP8 "
               "mode: kernels 4 (wgmma_fp8_prepared) and 5 (cutlass_fp8), got " + ConfigToString(attrs.config()));
  if (IsFp8Family(attrs.kernel) && !Fp8FamilyReadsLayout(attrs.kernel, attrs.rhs_layout))
    return bad("attributes " + ConfigToString(attrs.config()) + " do not read rhs_layout " +
               std::to_string(static_cast<int>(attrs.rhs_layout)) +
               ": kernels 4 (wgmma_fp8_prepared) and 5 (cutlass_fp8) read the fp8-prepared weights (rhs_layout 2), "
               "kernel 3 (wgmma_fp8) the checkpoint layout (rhs_layout 0)");
  return ffi::Error::Success();
}

// The last check of every decoder: GroupedGemmCheckParams on the filled *p (a call without output
// elements launches nothing and is not checked further).
inline ffi::Error CheckParams(const std::string& target, const GroupedGemmParams& p) {
  if (p.M > 0 && OutputColumns(p) > 0) {
    if (const char* why = GroupedGemmCheckParams(p)) return ffi::Error::InvalidArgument(target + ": " + why);
  }
  return ffi::Error::Success();
}

// Checks all calls share (their error messages start with `target`): rhs_scales [G, N, K/16]
// e4m3 (prepared: [0], rhs_data holding one e4m3 byte per weight), alpha and group_sizes [G], out
// [M, N] f32/bf16, the workspace size; with glu (the SwiGLU call) alpha [2G] and out [M, N/2]. On
// success fills the pointers, sizes and out_f32 of *p that do not depend on the activation type.
inline ffi::Error CheckRhsAndOutputs(const std::string& target, U8Buffer3 rhs, ffi::AnyBuffer rhs_scales,
                                     F32Buffer1 alpha, S32Buffer1 group_sizes, ffi::Result<ffi::AnyBuffer> out,
                                     ffi::Result<U8Buffer1> workspace, int64_t M, GroupedGemmParams* p,
                                     bool glu = false, bool prepared = false) {
  auto bad = [&](const std::string& m) { return ffi::Error::InvalidArgument(target + ": " + m); };
  const auto rd = rhs.dimensions();
  const int64_t G = rd[0], N = rd[1], K = prepared ? rd[2] : 2 * rd[2];
  if (rhs_scales.element_type() != ffi::DataType::F8E4M3FN) return bad("rhs_scales must be float8_e4m3fn");
  const auto rsd = rhs_scales.dimensions();
  if (prepared) {
    if (rsd.size() != 1 || rsd[0] != 0)
      return bad("with fp8-prepared weights (rhs_layout 2) rhs_scales must have shape [0], got " + DimsToString(rsd));
  } else if (rsd.size() != 3 || rsd[0] != G || rsd[1] != N || rsd[2] != K / 16) {
    return bad("rhs_scales shape " + DimsToString(rsd) + " does not match [G, N, K/16] = [" + std::to_string(G) +
               ", " + std::to_string(N) + ", " + std::to_string(K / 16) + "]");
  }
  if (alpha.dimensions()[0] != (glu ? 2 * G : G))
    return bad(std::string(glu ? "alpha must have shape [2G] (gate, up per group) = [" : "alpha must have shape [G] = [") +
               std::to_string(glu ? 2 * G : G) + "], got " + DimsToString(alpha.dimensions()));
  if (group_sizes.dimensions()[0] != G)
    return bad("group_sizes must have shape [G] = [" + std::to_string(G) + "], got " +
               DimsToString(group_sizes.dimensions()));
  const auto od = out->dimensions();
  const auto ot = out->element_type();
  if (ot != ffi::DataType::F32 && ot != ffi::DataType::BF16) return bad("out must be float32 or bfloat16");
  const int64_t cols = glu ? N / 2 : N;
  if (od.size() != 2 || od[0] != M || od[1] != cols)
    return bad("out shape " + DimsToString(od) + " does not match " + (glu ? "[M, N/2]" : "[M, N]") + " = [" +
               std::to_string(M) + ", " + std::to_string(cols) + "]");
  // the CPU handlers decode one weight row (two with glu: a gate row and its up row) into the workspace;
  // prepared weights are read as they lie, and their extra space holds cutlass_fp8's transposed chunk scales
  const int64_t ws_extra = prepared ? PreparedFp8ExtraWorkspaceBytes(M, K) : (glu ? 2 : 1) * K;
  const int64_t ws_bytes = workspace->dimensions()[0];
  if (ws_bytes < CustomCallWorkspaceBytes(G, ws_extra))
    return bad("workspace has " + std::to_string(ws_bytes) + " bytes, needs " +
               std::to_string(CustomCallWorkspaceBytes(G, ws_extra)));
  p->rhs = rhs.typed_data();
  p->rhs_scales = prepared ? nullptr : static_cast<const uint8_t*>(rhs_scales.untyped_data());
  p->alpha = alpha.typed_data();
  p->group_sizes = group_sizes.typed_data();
  p->out = out->untyped_data();
  p->workspace = workspace->typed_data();
  p->workspace_bytes = static_cast<size_t>(ws_bytes);
  p->M = M;
  p->N = N;
  p->K = K;
  p->G = G;
  p->out_f32 = ot == ffi::DataType::F32;
  return ffi::Error::Success();
}

// The exact calls' attributes and operands into *p (device or host pointers alike), without the final
// GroupedGemmCheckParams; glu: the SwiGLU call's shapes (alpha [2G], out [M, N/2]; DecodeGroupedGemmGlu
// checks the rest).
inline ffi::Error DecodeExactOperands(ffi::AnyBuffer lhs, ffi::AnyBuffer lhs_scales, U8Buffer3 rhs,
                                      ffi::AnyBuffer rhs_scales, F32Buffer1 alpha, S32Buffer1 group_sizes,
                                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<U8Buffer1> workspace,
                                      const GemmAttrs& attrs, GroupedGemmParams* p, bool glu) {
  const std::string target = glu ? "jax_nvfp4_grouped_gemm_glu" : "jax_nvfp4_grouped_gemm";
  auto bad = [&target](const std::string& m) { return ffi::Error::InvalidArgument(target + ": " + m); };
  if (ffi::Error err = CheckAttributes(target, attrs); err.failure()) return err;
  if (IsFp8Family(attrs.kernel))  // the SwiGLU call: DecodeGroupedGemm sends the FP8 families elsewhere
    return bad("attributes " + ConfigToString(attrs.config()) +
               " compute the FP8 mode; the SwiGLU epilogue runs the exact kernels 0 (mma), 1 (mma_ws) and 2 (wgmma)");

  const auto rd = rhs.dimensions();
  const int64_t G = rd[0], N = rd[1], K = 2 * rd[2];
  if (G < 1) return bad("rhs_data must have at least one group, got shape " + DimsToString(rd));
  if (K % 32 != 0) return bad("K = 2 * rhs_data.shape[2] must be a multiple of 32, got K = " + std::to_string(K));

  const auto ld = lhs.dimensions();
  if (ld.size() != 2) return bad("lhs must be rank 2, got shape " + DimsToString(ld));
  const int64_t M = ld[0];
  bool a_fp4 = false;
  if (lhs.element_type() == ffi::DataType::BF16) {
    if (ld[1] != K) return bad("bf16 lhs shape " + DimsToString(ld) + " does not match K = " + std::to_string(K));
  } else if (lhs.element_type() == ffi::DataType::U8) {
    a_fp4 = true;
    if (ld[1] != K / 2)
      return bad("packed e2m1 lhs shape " + DimsToString(ld) + " does not match K/2 = " + std::to_string(K / 2));
  } else {
    return bad("lhs must be bf16 (W4A16) or uint8 packed e2m1 (W4A4)");
  }

  if (lhs_scales.element_type() != ffi::DataType::F8E4M3FN) return bad("lhs_scales must be float8_e4m3fn");
  const auto lsd = lhs_scales.dimensions();
  if (a_fp4) {
    if (lsd.size() != 2 || lsd[0] != M || lsd[1] != K / 16)
      return bad("lhs_scales shape " + DimsToString(lsd) + " does not match [M, K/16] = [" +
                         std::to_string(M) + ", " + std::to_string(K / 16) + "]");
  } else if (lsd.size() != 1 || lsd[0] != 0) {
    return bad("for bf16 lhs (W4A16), lhs_scales must have shape [0], got " + DimsToString(lsd));
  }
  if (ffi::Error err = CheckRhsAndOutputs(target, rhs, rhs_scales, alpha, group_sizes, out, workspace, M, p, glu);
      err.failure())
    return err;

  if (attrs.rhs_layout == RhsLayout::kSm90 && (N % 128 != 0 || K % 64 != 0))
    return bad("rhs_data: the sm90 layout (rhs_layout 1) needs N % 128 == 0 and K % 64 == 0, got N = " +
                       std::to_string(N) + ", K = " + std::to_string(K));

  p->lhs = lhs.untyped_data();
  p->lhs_scales = a_fp4 ? static_cast<const uint8_t*>(lhs_scales.untyped_data()) : nullptr;
  p->a_fp4 = a_fp4;
  p->fp8 = false;
  p->rhs_layout = attrs.rhs_layout;
  return ffi::Error::Success();
}


// The SwiGLU call "jax_nvfp4_grouped_gemm_glu": the exact call's operands with gate/up-paired weight
// rows (csrc/gemm_contract.h), alpha f32 [2G], then row_scale f32 [M] or [0] (none); out [M, N/2].
inline ffi::Error DecodeGroupedGemmGlu(ffi::AnyBuffer lhs, ffi::AnyBuffer lhs_scales, U8Buffer3 rhs,
                                       ffi::AnyBuffer rhs_scales, F32Buffer1 alpha, S32Buffer1 group_sizes,
                                       F32Buffer1 row_scale, ffi::Result<ffi::AnyBuffer> out,
                                       ffi::Result<U8Buffer1> workspace, const GluAttrs& attrs, GroupedGemmParams* p) {
  auto bad = [](const std::string& m) { return ffi::Error::InvalidArgument("jax_nvfp4_grouped_gemm_glu: " + m); };
  const int64_t N = rhs.dimensions()[1];
  if (N % 16 != 0)
    return bad("the gate/up-paired weights need N = rhs_data.shape[1] % 16 == 0, got N = " + std::to_string(N));
  if (!(attrs.glu_limit > 0.0f))
    return bad("attribute glu_limit must be > 0 (+inf for no clamp), got " + std::to_string(attrs.glu_limit));
  if (ffi::Error err = DecodeExactOperands(lhs, lhs_scales, rhs, rhs_scales, alpha, group_sizes, out, workspace,
                                           attrs.gemm(), p, /*glu=*/true);
      err.failure())
    return err;
  const int64_t rs = row_scale.dimensions()[0];
  if (rs != 0 && rs != p->M)
    return bad("row_scale must have shape [M] = [" + std::to_string(p->M) + "] or [0] (none), got " +
               DimsToString(row_scale.dimensions()));
  p->glu = true;
  p->glu_limit = attrs.glu_limit;
  p->row_scale = rs ? row_scale.typed_data() : nullptr;
  return CheckParams("jax_nvfp4_grouped_gemm_glu", *p);
}

// The FP8 mode's operands (kernel of an FP8 family): lhs e4m3 [M, K] (kernel k order), lhs_scales f32
// [K/128, M], rhs as for the exact mode with kernel wgmma_fp8, or (rhs_layout 2) e4m3 bytes [G, N, K] in
// the kernel k order with rhs_scales [0] and kernel wgmma_fp8_prepared or cutlass_fp8. Checks the
// buffers and fills *p (CheckAttributes has run).
inline ffi::Error DecodeFp8Operands(ffi::AnyBuffer lhs, ffi::AnyBuffer lhs_scales, U8Buffer3 rhs,
                                    ffi::AnyBuffer rhs_scales, F32Buffer1 alpha, S32Buffer1 group_sizes,
                                    ffi::Result<ffi::AnyBuffer> out, ffi::Result<U8Buffer1> workspace,
                                    const GemmAttrs& attrs, GroupedGemmParams* p) {
  auto bad = [](const std::string& m) { return ffi::Error::InvalidArgument("jax_nvfp4_grouped_gemm (FP8 mode): " + m); };

  const bool prepared = attrs.rhs_layout == RhsLayout::kFp8;
  const auto rd = rhs.dimensions();
  const int64_t G = rd[0], N = rd[1], K = prepared ? rd[2] : 2 * rd[2];
  if (G < 1) return bad("rhs_data must have at least one group, got shape " + DimsToString(rd));
  if (K % 128 != 0)
    return bad(std::string("FP8 mode needs K = ") + (prepared ? "rhs_data.shape[2]" : "2 * rhs_data.shape[2]") +
               " to be a multiple of 128, got K = " + std::to_string(K));
  const auto ld = lhs.dimensions();
  if (lhs.element_type() != ffi::DataType::F8E4M3FN || ld.size() != 2 || ld[1] != K)
    return bad("lhs must be float8_e4m3fn [M, K] with K = " + std::to_string(K) + ", got shape " + DimsToString(ld));
  const int64_t M = ld[0];
  const auto lsd = lhs_scales.dimensions();
  if (lhs_scales.element_type() != ffi::DataType::F32 || lsd.size() != 2 || lsd[0] != K / 128 || lsd[1] != M)
    return bad("lhs_scales must be float32 [K/128, M] = [" + std::to_string(K / 128) + ", " + std::to_string(M) +
               "], got shape " + DimsToString(lsd));

  if (ffi::Error err = CheckRhsAndOutputs("jax_nvfp4_grouped_gemm (FP8 mode)", rhs, rhs_scales, alpha, group_sizes,
                                          out, workspace, M, p, /*glu=*/false, prepared);
      err.failure())
    return err;
  if (attrs.rhs_layout == RhsLayout::kSm90 && N % 128 != 0)
    return bad("rhs_data: the sm90 layout (rhs_layout 1) needs N % 128 == 0, got N = " + std::to_string(N));

  p->lhs = lhs.untyped_data();
  p->lhs_scales = nullptr;
  p->lhs_chunk_scales = static_cast<const float*>(lhs_scales.untyped_data());
  p->a_fp4 = false;
  p->fp8 = true;
  p->rhs_layout = attrs.rhs_layout;
  return ffi::Error::Success();
}

// The grouped GEMM call "jax_nvfp4_grouped_gemm": its kernel attribute's family states the mode, and the
// operands are checked as that mode's (exact: DecodeExactOperands, FP8: DecodeFp8Operands). Checks the
// attributes and buffers and fills *p.
inline ffi::Error DecodeGroupedGemm(ffi::AnyBuffer lhs, ffi::AnyBuffer lhs_scales, U8Buffer3 rhs,
                                    ffi::AnyBuffer rhs_scales, F32Buffer1 alpha, S32Buffer1 group_sizes,
                                    ffi::Result<ffi::AnyBuffer> out, ffi::Result<U8Buffer1> workspace,
                                    const GemmAttrs& attrs, GroupedGemmParams* p) {
  if (!IsFp8Family(attrs.kernel)) {
    if (ffi::Error err = DecodeExactOperands(lhs, lhs_scales, rhs, rhs_scales, alpha, group_sizes, out, workspace,
                                             attrs, p, /*glu=*/false);
        err.failure())
      return err;
    return CheckParams("jax_nvfp4_grouped_gemm", *p);
  }
  if (ffi::Error err = CheckAttributes("jax_nvfp4_grouped_gemm", attrs); err.failure()) return err;
  if (ffi::Error err = DecodeFp8Operands(lhs, lhs_scales, rhs, rhs_scales, alpha, group_sizes, out, workspace,
                                         attrs, p);
      err.failure())
    return err;
  return CheckParams("jax_nvfp4_grouped_gemm (FP8 mode)", *p);
}

}  // namespace jax_nvfp4
