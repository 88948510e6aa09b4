// Grouped NVFP4 GEMM for Hopper (sm_90a): plain C++ launcher, no XLA dependency.
//
// out[r, n] = alpha[g] * sum_k A[r, k] * W[g, n, k]   for rows r of group g,
// with W = e2m1(rhs_data) * e4m3(rhs_scales) (one scale per 16 consecutive k), and
// A = lhs (bf16, W4A16) or e2m1(lhs) * e4m3(lhs_scales) (W4A4). Accumulation in f32.
// Group g covers rows [start_g, end_g): start_g = min(sum_{j<g} max(gs_j, 0), M),
// end_g = min(start_g + max(gs_g, 0), M). Rows past end_{G-1} are written as 0.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace jax_nvfp4 {

struct GroupedGemmParams {
  const void* lhs = nullptr;            // bf16 [M, K]  or  u8 [M, K/2] packed e2m1 (a_fp4)
  const uint8_t* lhs_scales = nullptr;  // e4m3 [M, K/16] (a_fp4 only)
  const uint8_t* rhs = nullptr;         // u8 [G, N, K/2] packed e2m1, element 2j in the low nibble
  const uint8_t* rhs_scales = nullptr;  // e4m3 [G, N, K/16]
  const float* alpha = nullptr;         // f32 [G]
  const int32_t* group_sizes = nullptr; // s32 [G], device memory
  void* out = nullptr;                  // bf16 or f32 [M, N]
  void* workspace = nullptr;            // device scratch, >= GroupedGemmWorkspaceBytes(G)
  size_t workspace_bytes = 0;
  int64_t M = 0;
  int64_t N = 0;
  int64_t K = 0;
  int64_t G = 0;
  bool a_fp4 = false;    // W4A4 when true, W4A16 when false
  bool out_f32 = false;  // f32 output when true, bf16 when false
  int force_token_tile = 0;  // 0: automatic; 16/32/64/128 (v2 also 256) force a token tile (tools, tuning)
  // Byte layout of rhs: 0 the checkpoint layout; 1 the sm90 load-time layout of
  // jax_nvfp4/layout.py (needs N % 128 == 0 and K % 64 == 0; bf16 activations only: both kernels
  // read it for W4A16, v1 returns cudaErrorNotSupported for W4A4 with it).
  int rhs_layout = 0;
  // Expected rows inside the groups (0: unknown, M is used). Only steers the kernel and token-tile
  // choice: under expert parallelism M counts every routed row but the groups hold the local ones.
  int64_t rows_hint = 0;
};

// Average rows per group the tile heuristics use: rows_hint (or M when 0) / G, rounded up.
inline int64_t GroupedGemmAvgRows(const GroupedGemmParams& p) {
  const int64_t rows = p.rows_hint > 0 && p.rows_hint < p.M ? p.rows_hint : p.M;
  return (rows + p.G - 1) / (p.G > 0 ? p.G : 1);
}

// Bytes of workspace the launcher needs (the FFI contract sizes it as 4096 + 16*G).
inline size_t GroupedGemmWorkspaceBytes(int64_t G) { return 4096 + 16 * static_cast<size_t>(G); }

// Checks the scalar parameters (shapes, alignment, workspace size). Returns nullptr if they are
// fine, otherwise a static message describing the first problem.
const char* GroupedGemmCheckParams(const GroupedGemmParams& p);

// Enqueues the grouped GEMM on `stream`: no allocation, no host synchronisation, no device-to-host
// copy (CUDA-graph capturable). Returns the first CUDA error (launch errors included), or
// cudaErrorInvalidValue when GroupedGemmCheckParams rejects the parameters.
cudaError_t LaunchGroupedGemmSm90(const GroupedGemmParams& p, cudaStream_t stream);

// For tools: which token tile the launcher picks (16, 32, 64 or 128 rows).
int GroupedGemmTokenTile(const GroupedGemmParams& p);

}  // namespace jax_nvfp4
