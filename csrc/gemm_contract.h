// The grouped NVFP4 GEMM's contract, in plain C++ (no CUDA, no XLA): what the CPU handler, the
// CUDA handler, the kernels and the self-test agree on.
//
// out[r, n] = alpha[g] * sum_k A[r, k] * W[g, n, k]   for rows r of group g,
// with W = e2m1(rhs_data) * e4m3(rhs_scales) (one scale per 16 consecutive k), and
// A = lhs (bf16, W4A16) or e2m1(lhs) * e4m3(lhs_scales) (W4A4). Accumulation in f32.
// FP8 mode (params.fp8; the custom call's kernel attribute of an FP8 family): A is e4m3 codes with one
// power-of-two float32 scale per row and 128-wide k chunk, W is rounded to e4m3 as
// e4m3(e2m1 * scale * 2^-3), each chunk's dot is promoted into the float32 accumulator times the
// row's chunk scale, and the epilogue multiplies by alpha * 2^3 (docs/design.md, "FP8 mode").
// With rhs_layout 2 (fp8-prepared weights) W arrives already rounded: e4m3 bytes [G, N, K], the same
// e4m3(e2m1 * scale * 2^-3) values, k in the activations' kernel order inside each 128-wide chunk.
// SwiGLU epilogue (the custom call "jax_nvfp4_grouped_gemm_glu", params.glu): W's rows are gate/up
// paired (row 16b + i holds gate feature 8b + i, row 16b + 8 + i up feature 8b + i, i < 8: every
// kernel's thread holds accumulator rows n and n + 8 for n % 16 < 8), alpha is [G, 2] (gate, up),
// h = acc * alpha[g][n % 16 >= 8] (times row_scale[r] when given), and
// out[r, 8b + i] = silu(min(h_gate, L)) * clamp(h_up, -L, L) with silu(x) = x / (1 + exp(-x)), out [M, N/2].
// Group g covers rows [start_g, end_g): start_g = min(sum_{j<g} max(gs_j, 0), M),
// end_g = min(start_g + max(gs_g, 0), M). Rows past end_{G-1} are written as 0.
//
// Here: the launch parameters, their checks and the workspace formula. It includes what the
// contract builds on: csrc/gemm_attributes.h (the interface version, the weight layouts, the scale
// shifts), csrc/kernel_table.h (the kernel families, configurations and the heuristic),
// csrc/sm90_layout.h (the sm90 weight layout's constants) and csrc/cutlass_fp8_workspace.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "csrc/cutlass_fp8_workspace.h"
#include "csrc/gemm_attributes.h"
#include "csrc/kernel_table.h"
#include "csrc/sm90_layout.h"

namespace jax_nvfp4 {

// ---------------------------------------------------------------------------------------------
// Launch parameters (device pointers) and their checks.

struct GroupedGemmParams {
  const void* lhs = nullptr;            // bf16 [M, K]  or  u8 [M, K/2] packed e2m1 (a_fp4)
  const uint8_t* lhs_scales = nullptr;  // e4m3 [M, K/16] (a_fp4 only)
  const uint8_t* rhs = nullptr;         // u8 [G, N, K/2] in `rhs_layout` (kFp8: e4m3 [G, N, K])
  const uint8_t* rhs_scales = nullptr;  // e4m3 [G, N, K/16] in `rhs_layout` (kFp8: none, null)
  const float* alpha = nullptr;         // f32 [G] ([G, 2] with the SwiGLU epilogue)
  const int32_t* group_sizes = nullptr; // s32 [G], device memory
  void* out = nullptr;                  // bf16 or f32 [M, N] ([M, N/2] with the SwiGLU epilogue)
  void* workspace = nullptr;            // device scratch, >= GroupedGemmWorkspaceBytes(G)
  size_t workspace_bytes = 0;
  int64_t M = 0;
  int64_t N = 0;
  int64_t K = 0;
  int64_t G = 0;
  bool a_fp4 = false;    // W4A4 when true, W4A16 when false
  bool out_f32 = false;  // f32 output when true, bf16 when false
  RhsLayout rhs_layout = RhsLayout::kCheckpoint;
  // FP8 mode: lhs is e4m3 [M, K] in the kernel k order (docs/design.md), lhs_chunk_scales f32
  // [K/128, M] (power-of-two scale of row r's chunk c at c * M + r); lhs_scales unused. The FFI layer
  // sets it from the configuration's family (FamilyComputesMode holds); the launchers dispatch on the
  // family alone.
  bool fp8 = false;
  const float* lhs_chunk_scales = nullptr;
  // SwiGLU epilogue (see the top of this file): alpha is f32 [G, 2], out [M, N/2]; row_scale f32 [M]
  // or null; glu_limit > 0 (+inf: no clamp).
  bool glu = false;
  float glu_limit = 0.0f;
  const float* row_scale = nullptr;
};

// Columns of the output: N, or N / 2 with the SwiGLU epilogue.
inline constexpr int64_t OutputColumns(const GroupedGemmParams& p) { return p.glu ? p.N / 2 : p.N; }

// Bytes of the schedules the hand-written launchers keep in the workspace: 4096 + 32 * G (two schedules of
// prefix sums and group bounds: the 256-token wgmma tile leaves each group's short last tile to the
// 128-token kernel).
inline constexpr size_t GroupedGemmScheduleBytes(int64_t G) { return 4096 + 32 * static_cast<size_t>(G); }
// Bytes of workspace the CUDA launchers need.
inline constexpr size_t GroupedGemmWorkspaceBytes(int64_t G) {
  return GroupedGemmScheduleBytes(G) + 128 + kCutlassFp8ArgsBytesPerGroup * static_cast<size_t>(G) + 14 * 128 +
         kCutlassFp8OnesBytes + kCutlassFp8KernelWorkspaceBytes;
}

// Bytes of the custom call's workspace output: the CUDA launchers', plus `cpu_row_bytes` for the
// CPU handlers' decoded weight rows (K, or 2K with the SwiGLU epilogue). Python sizes the output
// with this function (the extension's `workspace_bytes`), the handlers check it.
// The FP8 mode on fp8-prepared weights needs, past GroupedGemmWorkspaceBytes, room for the activations'
// chunk scales regrouped into cutlass_fp8's per-group compact blocks (4 M K/128 bytes): its `cpu_row_bytes`.
inline constexpr int64_t PreparedFp8ExtraWorkspaceBytes(int64_t M, int64_t K) { return 4 * M * (K / 128); }
inline constexpr int64_t CustomCallWorkspaceBytes(int64_t G, int64_t cpu_row_bytes) {
  return static_cast<int64_t>(GroupedGemmWorkspaceBytes(G)) + cpu_row_bytes;
}

// Checks the scalar parameters (shapes, workspace size, pointers present). Returns nullptr if they
// are fine, otherwise a static message describing the first problem. The FFI layer runs it once per
// call; the launchers take its success as a precondition.
inline const char* GroupedGemmCheckParams(const GroupedGemmParams& p) {
  if (p.M < 0 || p.N < 0 || p.K < 0 || p.G < 0) return "negative dimension";
  if (p.G < 1) return "need at least one group";
  if (p.K % 32 != 0) return "K must be a multiple of 32";
  if (p.M > INT32_MAX - 1 || p.N > INT32_MAX / 2 || p.K > INT32_MAX / 2) return "dimension too large";
  if (p.G > (1 << 20)) return "too many groups";
  if (p.workspace_bytes < GroupedGemmWorkspaceBytes(p.G)) return "workspace too small";
  if (!IsKnownLayout(p.rhs_layout)) return "rhs_layout must be 0 (checkpoint), 1 (sm90) or 2 (fp8)";
  if (p.rhs_layout == RhsLayout::kFp8 && (!p.fp8 || p.glu)) return "fp8-prepared weights (rhs_layout 2) need the FP8 mode";
  if (p.rhs_layout == RhsLayout::kSm90 && (p.N % 128 != 0 || p.K % 64 != 0))
    return "the sm90 layout needs N % 128 == 0 and K % 64 == 0";
  if (p.fp8 && (p.K % 128 != 0 || p.a_fp4)) return "FP8 mode needs K % 128 == 0 and e4m3 activations";
  if (p.glu && (p.fp8 || p.N % 16 != 0 || !(p.glu_limit > 0.0f)))
    return "the SwiGLU epilogue needs the exact mode, N % 16 == 0 and glu_limit > 0";
  if (p.M > 0 && p.N > 0) {
    if (!p.lhs || !p.rhs || !p.alpha || !p.group_sizes || !p.out || !p.workspace) return "null pointer";
    if (!p.rhs_scales && p.rhs_layout != RhsLayout::kFp8) return "null rhs_scales";
    if (p.a_fp4 && !p.lhs_scales) return "null lhs_scales";
    if (p.fp8 && !p.lhs_chunk_scales) return "null lhs_chunk_scales";
  }
  return nullptr;
}

// The problem a launch computes, as the heuristic describes it (arch and families left unset).
inline constexpr ProblemDesc ProblemOf(const GroupedGemmParams& p) {
  ProblemDesc d;
  d.M = p.M;
  d.N = p.N;
  d.K = p.K;
  d.G = p.G;
  d.a_fp4 = p.a_fp4;
  d.layout = p.rhs_layout;
  d.fp8 = p.fp8;
  return d;
}

// XLA allocates every GPU buffer at least this aligned: entry parameters at 16 bytes
// (kEntryParameterAlignBytes), its own temporaries and results at 128 (kXlaAllocatedBufferAlignBytes;
// xla/service/gpu/gpu_constants.h). No kernel needs more, so the alignments below hold for every
// buffer XLA hands the custom call; BufferAlignmentError turns a violation into an error, never
// into another kernel.
inline constexpr uintptr_t kXlaBufferAlignBytes = 16;

// The buffer alignment configuration c reads p with: nullptr when p has it, otherwise a static
// message naming the buffer. All kernels: 16-byte lhs and rhs rows (cp.async / TMA) and workspace.
// mma_ws: 16-byte rhs_scales (bulk copies of the 512-byte scale records); wgmma: 4-byte rhs_scales,
// 16-byte with the sm90 layout (bulk copies); wgmma_fp8: 8-byte rhs_scales and 4-byte lhs_scales
// (cp.async of the block and chunk scales).
inline const char* BufferAlignmentError(const GroupedGemmParams& p, const KernelConfig& c) {
  auto misaligned = [](const void* ptr, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(ptr) & (bytes - 1)) != 0; };
  if (misaligned(p.lhs, 16)) return "lhs must be 16-byte aligned";
  if (misaligned(p.rhs, 16)) return "rhs_data must be 16-byte aligned";
  if (misaligned(p.workspace, 16)) return "workspace must be 16-byte aligned";
  switch (c.family) {
    case KernelFamily::kMma:
      return nullptr;
    case KernelFamily::kMmaWs:
      return misaligned(p.rhs_scales, 16) ? "rhs_scales must be 16-byte aligned for kernel mma_ws" : nullptr;
    case KernelFamily::kWgmma:
      if (p.rhs_layout == RhsLayout::kSm90 && misaligned(p.rhs_scales, 16))
        return "rhs_scales must be 16-byte aligned for kernel wgmma with the sm90 layout";
      return misaligned(p.rhs_scales, 4) ? "rhs_scales must be 4-byte aligned for kernel wgmma" : nullptr;
    case KernelFamily::kWgmmaFp8:
      if (misaligned(p.rhs_scales, 8)) return "rhs_scales must be 8-byte aligned for kernel wgmma_fp8";
      return misaligned(p.lhs_chunk_scales, 4) ? "lhs_scales must be 4-byte aligned for kernel wgmma_fp8" : nullptr;
    case KernelFamily::kWgmmaFp8Prepared:
      return misaligned(p.lhs_chunk_scales, 4) ? "lhs_scales must be 4-byte aligned for kernel wgmma_fp8_prepared"
                                               : nullptr;
    case KernelFamily::kCutlassFp8:
      if (misaligned(p.out, 16)) return "out must be 16-byte aligned for kernel cutlass_fp8";
      if (misaligned(p.alpha, 4)) return "alpha must be 4-byte aligned for kernel cutlass_fp8";
      return misaligned(p.lhs_chunk_scales, 4) ? "lhs_scales must be 4-byte aligned for kernel cutlass_fp8" : nullptr;
  }
  return nullptr;
}

}  // namespace jax_nvfp4
