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
// alpha * 2^kFp8WeightShift. Python: jax_nvfp4.ops.reference.WEIGHT_PRESCALE,
// jax_nvfp4.maths.formats.FP8_WEIGHT_SHIFT (the extension's weight_shifts(), checked by a test).
inline constexpr int kExactWeightShift = 7;
inline constexpr int kFp8WeightShift = 3;

// 2^e as a float (exact for the exponents of normal floats); constexpr, so that the kernels'
// power-of-two factors below are compile-time constants.
constexpr float Pow2f(int e) {
  float r = 1.0f;
  for (; e > 0; --e) r *= 2.0f;
  for (; e < 0; ++e) r *= 0.5f;
  return r;
}
// The exact kernels read an e2m1 code as the bf16 e2m1 * 2^-126 and multiply it by the bf16 block
// scale * 2^kExactScaleExponent (448 * 2^119 < the bf16 maximum): e2m1 * scale * 2^-kExactWeightShift.
inline constexpr int kExactScaleExponent = 126 - kExactWeightShift;
// That factor as bf16x2 bits (both halves), and the epilogue's undoing of the shift per fp4 operand.
inline constexpr uint32_t kExactScaleUpBf16x2 = static_cast<uint32_t>((kExactScaleExponent + 127) << 7) * 0x10001u;
inline constexpr float kExactWeightUndo = Pow2f(kExactWeightShift);
// The FP8 mode's weight prescale 2^-kFp8WeightShift and its undoing in the epilogue.
inline constexpr float kFp8WeightPrescale = Pow2f(-kFp8WeightShift);
inline constexpr float kFp8WeightUndo = Pow2f(kFp8WeightShift);

// ---------------------------------------------------------------------------------------------
// Attributes of the custom call (enum values are the attribute's int32 value).

// Byte layout of rhs_data and rhs_scales.
enum class RhsLayout : int32_t {
  kCheckpoint = 0,  // [G, N, K/2] rows, element 2j in the low nibble of byte j; scales [G, N, K/16]
  kSm90 = 1,        // the load-time layout of jax_nvfp4/maths/layout.py (N % 128 == 0, K % 64 == 0)
  kFp8 = 2,         // FP8 mode only: e4m3 [G, N, K], e4m3(e2m1 * scale * 2^-3) in the kernel k order of each
                    // 128-chunk (jax_nvfp4.prepare_weights(w, "fp8")); no scales (rhs_scales [0])
};

inline constexpr bool IsKnownLayout(RhsLayout l) {
  return l == RhsLayout::kCheckpoint || l == RhsLayout::kSm90 || l == RhsLayout::kFp8;
}

// The layout's name in the Python API (jax_nvfp4.config.options.WEIGHT_LAYOUTS; the extension hands Python the
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
