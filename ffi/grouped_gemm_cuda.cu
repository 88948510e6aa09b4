// XLA FFI CUDA handler for "jax_nvfp4_grouped_gemm": validates the buffers and calls the
// sm_90a launchers in csrc/ (v1 grouped_gemm_sm90.cu, v2 grouped_gemm_sm90_wgmma.cu). No allocation, no host sync.
//
// Kernel choice, from the environment variable JAX_NVFP4_KERNEL (read once per process):
//   unset/auto: v2 (WGMMA, csrc/grouped_gemm_sm90_wgmma.cu) where GroupedGemmWgmmaPreferred, else v1
//               (mma.sync, csrc/grouped_gemm_sm90.cu): decode-sized problems, native W4A4, K % 64.
//   wgmma:      v2 wherever it can run (tests use this to exercise it on small shapes).
//   mma:        v1 for everything (jax_nvfp4.grouped_gemm then also keeps W4A4 native instead of
//               dequantizing the activations to bf16 first).
// Weights in the sm90 load-time layout (attribute rhs_layout = 1, jax_nvfp4/layout.py) take the
// same choice: both kernels read them with a bf16 lhs. A packed e2m1 lhs (native W4A4, only sent
// under JAX_NVFP4_KERNEL=mma) with sm90 weights fails with InvalidArgument.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include <cuda_runtime.h>

#include "csrc/grouped_gemm_sm90.h"
#include "csrc/grouped_gemm_sm90_wgmma.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::string DimsToString(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(d[i]);
  }
  return s + "]";
}

enum class KernelChoice { kAuto, kWgmma, kMma };

KernelChoice KernelFromEnv() {
  static const KernelChoice k = [] {
    const char* v = std::getenv("JAX_NVFP4_KERNEL");
    if (v != nullptr && std::strcmp(v, "mma") == 0) return KernelChoice::kMma;
    if (v != nullptr && std::strcmp(v, "wgmma") == 0) return KernelChoice::kWgmma;
    return KernelChoice::kAuto;
  }();
  return k;
}

ffi::Error CudaError(const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string("jax_nvfp4_grouped_gemm: ") + what + ": " + cudaGetErrorName(e) + ": " +
                              cudaGetErrorString(e));
}

ffi::Error GroupedGemmCudaImpl(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer lhs_scales,
                               ffi::Buffer<ffi::U8, 3> rhs, ffi::AnyBuffer rhs_scales, ffi::Buffer<ffi::F32, 1> alpha,
                               ffi::Buffer<ffi::S32, 1> group_sizes, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::Buffer<ffi::U8, 1>> workspace, int64_t rows_hint,
                               int64_t rhs_layout) {
  auto bad = [](const std::string& msg) { return ffi::Error::InvalidArgument("jax_nvfp4_grouped_gemm: " + msg); };

  const auto rd = rhs.dimensions();
  const int64_t G = rd[0], N = rd[1], KH = rd[2];
  const int64_t K = 2 * KH;
  if (G < 1) return bad("rhs_data must have at least one group, got shape " + DimsToString(rd));
  if (K % 32 != 0) return bad("K = 2 * rhs_data.shape[2] must be a multiple of 32, got K = " + std::to_string(K));

  // rhs_scales: F8E4M3FN [G, N, K/16]
  if (rhs_scales.element_type() != ffi::DataType::F8E4M3FN) return bad("rhs_scales must be float8_e4m3fn");
  const auto rsd = rhs_scales.dimensions();
  if (rsd.size() != 3 || rsd[0] != G || rsd[1] != N || rsd[2] != K / 16)
    return bad("rhs_scales shape " + DimsToString(rsd) + " does not match [G, N, K/16] = [" + std::to_string(G) + ", " +
               std::to_string(N) + ", " + std::to_string(K / 16) + "]");

  // lhs: BF16 [M, K] (W4A16) or U8 [M, K/2] (W4A4)
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
      return bad("lhs_scales shape " + DimsToString(lsd) + " does not match [M, K/16] = [" + std::to_string(M) + ", " +
                 std::to_string(K / 16) + "]");
  } else {
    if (lsd.size() != 1 || lsd[0] != 0)
      return bad("for bf16 lhs (W4A16), lhs_scales must have shape [0], got " + DimsToString(lsd));
  }

  if (alpha.dimensions()[0] != G)
    return bad("alpha must have shape [G] = [" + std::to_string(G) + "], got " + DimsToString(alpha.dimensions()));
  if (group_sizes.dimensions()[0] != G)
    return bad("group_sizes must have shape [G] = [" + std::to_string(G) + "], got " +
               DimsToString(group_sizes.dimensions()));

  const auto od = out->dimensions();
  const auto ot = out->element_type();
  if (ot != ffi::DataType::F32 && ot != ffi::DataType::BF16) return bad("out must be float32 or bfloat16");
  if (od.size() != 2 || od[0] != M || od[1] != N)
    return bad("out shape " + DimsToString(od) + " does not match [M, N] = [" + std::to_string(M) + ", " +
               std::to_string(N) + "]");

  const int64_t ws_bytes = workspace->dimensions()[0];
  if (ws_bytes < static_cast<int64_t>(jax_nvfp4::GroupedGemmWorkspaceBytes(G)))
    return bad("workspace has " + std::to_string(ws_bytes) + " bytes, needs 4096 + 16*G = " +
               std::to_string(jax_nvfp4::GroupedGemmWorkspaceBytes(G)));

  if (M == 0 || N == 0) return ffi::Error::Success();

  jax_nvfp4::GroupedGemmParams p;
  p.lhs = lhs.untyped_data();
  p.lhs_scales = a_fp4 ? static_cast<const uint8_t*>(lhs_scales.untyped_data()) : nullptr;
  p.rhs = rhs.typed_data();
  p.rhs_scales = static_cast<const uint8_t*>(rhs_scales.untyped_data());
  p.alpha = alpha.typed_data();
  p.group_sizes = group_sizes.typed_data();
  p.out = out->untyped_data();
  p.workspace = workspace->typed_data();
  p.workspace_bytes = static_cast<size_t>(ws_bytes);
  p.M = M;
  p.N = N;
  p.K = K;
  p.G = G;
  p.a_fp4 = a_fp4;
  p.out_f32 = ot == ffi::DataType::F32;
  if (rows_hint < 0) return bad("rows_hint must be >= 0 (0: unknown), got " + std::to_string(rows_hint));
  p.rows_hint = rows_hint;
  if (rhs_layout != 0 && rhs_layout != 1)
    return bad("rhs_layout must be 0 (checkpoint) or 1 (sm90), got " + std::to_string(rhs_layout));
  p.rhs_layout = static_cast<int>(rhs_layout);
  if (const char* why = jax_nvfp4::GroupedGemmCheckParams(p)) return bad(why);

  const KernelChoice kc = KernelFromEnv();
  if (p.rhs_layout == 1 && a_fp4)
    return bad("rhs_layout 1 (sm90 weights) takes a bf16 lhs only (both kernels read the layout for W4A16), got "
               "packed e2m1 (jax_nvfp4.grouped_gemm dequantizes W4A4 activations to bf16 first on the GPU "
               "unless JAX_NVFP4_KERNEL=mma)");
  const bool v2 = kc == KernelChoice::kWgmma || (kc == KernelChoice::kAuto && jax_nvfp4::GroupedGemmWgmmaPreferred(p));
  cudaError_t e = v2 ? jax_nvfp4::LaunchGroupedGemmSm90Wgmma(p, stream) : jax_nvfp4::LaunchGroupedGemmSm90(p, stream);
  if (e != cudaSuccess) return CudaError("kernel launch failed", e);
  e = cudaGetLastError();
  if (e != cudaSuccess) return CudaError("CUDA error after launch", e);
  return ffi::Error::Success();
}

// Aliases: template commas cannot appear inside the XLA_FFI_DEFINE_HANDLER_SYMBOL macro.
using U8Buffer3 = ffi::Buffer<ffi::U8, 3>;
using F32Buffer1 = ffi::Buffer<ffi::F32, 1>;
using S32Buffer1 = ffi::Buffer<ffi::S32, 1>;
using U8Buffer1 = ffi::Buffer<ffi::U8, 1>;
using CudaStream = ffi::PlatformStream<cudaStream_t>;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4GroupedGemmCuda, GroupedGemmCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<CudaStream>()
                                  .Arg<ffi::AnyBuffer>()           // lhs
                                  .Arg<ffi::AnyBuffer>()           // lhs_scales
                                  .Arg<U8Buffer3>()  // rhs_data
                                  .Arg<ffi::AnyBuffer>()           // rhs_scales
                                  .Arg<F32Buffer1>() // alpha
                                  .Arg<S32Buffer1>() // group_sizes
                                  .Ret<ffi::AnyBuffer>()           // out
                                  .Ret<U8Buffer1>()  // workspace
                                  .Attr<int64_t>("rows_hint")
                                  .Attr<int64_t>("rhs_layout"),  // 0 checkpoint, 1 sm90
                              {xla::ffi::Traits::kCmdBufferCompatible});
