// The grouped GEMM custom call's vocabulary, in plain C++ (no CUDA, no XLA): the interface version,
// the weight layouts (the `rhs_layout` attribute) and the weights' scale shifts. csrc/gemm_contract.h
// (the contract every handler shares) and csrc/kernel_table.h (the kernels and the heuristic) build on it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jax_nvfp4 {

// The version of the custom calls' interface (operands, attributes, what they compute): the suffix
// "_v<N>" of every registered target name (ffi/module.cc builds the names from it; Python's
// jax_nvfp4._extension.ABI_VERSION must equal it, tests/test_kernel_config.py checks). Bump it on
// any such change.
inline constexpr int kInterfaceVersion = 3;

// The weights' power-of-two prescales, exact in every format they pass through: the exact mode's
// kernels read a weight as e2m1 * scale * 2^-kExactWeightShift (a normal bf16 in [2^-17, 21]) and
// their epilogue multiplies by alpha * 2^kExactWeightShift; the FP8 mode's weights are
// e4m3(e2m1 * scale * 2^-kFp8WeightShift) (|w| <= 336 < 448) and its epilogue multiplies by
// alpha * 2^kFp8WeightShift. Python: jax_nvfp4.reference.WEIGHT_PRESCALE,
// jax_nvfp4.formats.FP8_WEIGHT_SHIFT (the extension's weight_shifts(), checked by a test).
inline constexpr int kExactWeightShift = 7;
inline constexpr int kFp8WeightShift = 3;

// ---------------------------------------------------------------------------------------------
// Attributes of the custom call (enum values are the attribute's int32 value).

// Byte layout of rhs_data and rhs_scales.
enum class RhsLayout : int32_t {
  kCheckpoint = 0,  // [G, N, K/2] rows, element 2j in the low nibble of byte j; scales [G, N, K/16]
  kSm90 = 1,        // the load-time layout of jax_nvfp4/layout.py (N % 128 == 0, K % 64 == 0)
  kFp8 = 2,         // FP8 mode only: e4m3 [G, N, K], e4m3(e2m1 * scale * 2^-3) in the kernel k order of each
                    // 128-chunk (jax_nvfp4.prepare_weights(w, "fp8")); no scales (rhs_scales [0])
};

inline constexpr bool IsKnownLayout(RhsLayout l) {
  return l == RhsLayout::kCheckpoint || l == RhsLayout::kSm90 || l == RhsLayout::kFp8;
}

// The layout's name in the Python API (jax_nvfp4.options.WEIGHT_LAYOUTS; the extension hands Python the
// name -> code map, ffi/module.cc).
inline const char* LayoutName(RhsLayout l) {
  switch (l) {
    case RhsLayout::kCheckpoint: return "checkpoint";
    case RhsLayout::kSm90: return "sm90";
    case RhsLayout::kFp8: return "fp8";
  }
  return "?";
}

// Bit (1 << layout) per layout, for the set of layouts a kernel family reads.
inline constexpr uint32_t LayoutBit(RhsLayout l) { return 1u << static_cast<int>(l); }

}  // namespace jax_nvfp4
