// What cutlass_fp8 keeps in the custom call's workspace past the hand-written kernels' schedules:
// CUTLASS's per-group argument arrays, the buffer of ones and CUTLASS's own workspace. Its launcher
// (csrc/grouped_gemm_cutlass_fp8_sm90.cu) lays them out; the contract's workspace formula
// (csrc/gemm_contract.h) counts them. Plain C++.
#pragma once

#include <cstddef>

#include "csrc/kernel_table.h"

namespace jax_nvfp4 {

// cutlass_fp8 keeps CUTLASS's per-group arguments after the schedules (at most kCutlassFp8ArgsBytesPerGroup per
// group, 14 arrays each 128-byte aligned), a buffer of ones (its weights' unit block scales) and CUTLASS's
// own workspace (per-SM tensor maps: 4 x 128 bytes per SM on the
// configurations compiled; the launcher checks the bound).
inline constexpr size_t kCutlassFp8ArgsBytesPerGroup = 256;
inline constexpr size_t kCutlassFp8OnesBytes = 4 * kCutlassFp8MaxOnes;
inline constexpr size_t kCutlassFp8KernelWorkspaceBytes = 512 * 1024;

}  // namespace jax_nvfp4
