// Grouped NVFP4 GEMM for Hopper (sm_90a), version 2: WGMMA mainloop (csrc/grouped_gemm_sm90_wgmma.cu).
// Same contract and semantics as LaunchGroupedGemmSm90 (csrc/grouped_gemm_sm90.h).
#pragma once

#include "csrc/grouped_gemm_sm90.h"

namespace jax_nvfp4 {

// True when the WGMMA kernel handles these parameters itself; otherwise
// LaunchGroupedGemmSm90Wgmma forwards to LaunchGroupedGemmSm90 (v1). Not handled (v1 fallback):
//   - W4A4 (a_fp4): the activations would have to be dequantized on the way into shared memory;
//     not written yet.
//   - K % 64 != 0 or K == 0: the scale bytes of a 64-wide k-tile are fetched as one 4-byte
//     cp.async, which needs K/16 % 4 == 0 (4-byte aligned rows of rhs_scales).
//   - rhs_scales not 4-byte aligned, or rhs not 16-byte aligned.
//   - the driver entry point cuTensorMapEncodeTiled is unavailable.
bool GroupedGemmWgmmaHandles(const GroupedGemmParams& p);

// True when v2 is expected to beat v1 on these parameters: GroupedGemmWgmmaHandles(p) and not
// decode-sized (at least 16 rows per group on average, GroupedGemmAvgRows). Measured on the H200 (docs/perf-notes.md):
// at 4 rows per expert v1 takes 0.35 ms where v2 takes 0.51 ms; from 32 rows per expert up v2 is
// 1.3-1.8x faster.
bool GroupedGemmWgmmaPreferred(const GroupedGemmParams& p);

// Enqueues the grouped GEMM on `stream` (no allocation, no host sync, graph capturable), using the
// WGMMA kernel when GroupedGemmWgmmaHandles(p), else the v1 kernel. Returns the first CUDA error,
// or cudaErrorInvalidValue when GroupedGemmCheckParams rejects the parameters. rhs_layout == 1
// (sm90 layout) is read by both kernels for W4A16; v1 returns cudaErrorNotSupported for W4A4 with it.
cudaError_t LaunchGroupedGemmSm90Wgmma(const GroupedGemmParams& p, cudaStream_t stream);

// For tools: the largest token tile (32, 64, 128 or 256) the WGMMA launcher picks; up to 128 every
// tile then runs the smallest WGMMA N in {32, 64, 128} that covers its rows, a 256-token tile always
// N = 256. force_token_tile 32/64/128/256 forces one (16 means 32; 256 means 128 in builds with
// JAX_NVFP4_V2_BT256=0). Returns 0 when the v1 fallback would run.
int GroupedGemmWgmmaTokenTile(const GroupedGemmParams& p);

#if defined(JAX_NVFP4_V2_DIAG) && JAX_NVFP4_V2_DIAG == 3
// Diagnostic builds only: device buffer [SMs][256 tiles][8] of clock64 stamps (see the kernel).
cudaError_t GroupedGemmWgmmaSetTrace(unsigned long long* trace);
#endif

}  // namespace jax_nvfp4
