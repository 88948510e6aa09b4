// Host-side copies of jax_nvfp4/maths/layout.py's prepare_sm90 and prepare_scales_sm90 (the sm90
// load-time layout of packed e2m1 codes and of their block scales), for the self-test
// (tools/bench/gemm_selftest.cu --layout sm90): rhs uint8 [G, N, K/2] and scales [G, N, K/16] in the
// checkpoint layout -> the same bytes re-laid out (N % 128 == 0, K % 64 == 0).
// tests/test_layout.py compiles it with the host C++ compiler and compares it with layout.py.
#pragma once

#include <cstdint>
#include <vector>

#include "csrc/gemm_contract.h"

namespace jax_nvfp4_tools {

inline std::vector<uint8_t> prepare_sm90_host(const std::vector<uint8_t>& rhs, int64_t G, int64_t N, int64_t K) {
  // (sign, e1, e0, m0) bit of fragment registers a0..a3 in the low half of a word
  const auto& kSlots = jax_nvfp4::kSm90SlotBits;
  const int64_t KH = K / 2;
  std::vector<uint8_t> out(rhs.size());
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t g = 0; g < G; ++g)
    for (int64_t nb = 0; nb < N / 128; ++nb)
      for (int64_t kbk = 0; kbk < K / 64; ++kbk)
        for (int mt = 0; mt < 8; ++mt)
          for (int lane = 0; lane < 32; ++lane)
            for (int kb = 0; kb < 4; ++kb) {
              const int g8 = lane / 4, t = lane % 4;
              uint32_t w = 0;
              for (int hi = 0; hi < 2; ++hi)
                for (int half = 0; half < 2; ++half)
                  for (int par = 0; par < 2; ++par) {
                    const int64_t n = 128 * nb + 16 * mt + 8 * hi + g8;
                    const int64_t k = 64 * kbk + 16 * kb + 8 * half + 2 * t + par;
                    const uint8_t b = rhs[(g * N + n) * KH + k / 2];
                    const uint32_t c = (k & 1) ? (b >> 4) : (b & 15);
                    const int* sl = kSlots[hi + 2 * half];
                    const int off = 16 * par;
                    w |= ((c >> 3) & 1u) << (sl[0] + off) | ((c >> 2) & 1u) << (sl[1] + off) |
                         ((c >> 1) & 1u) << (sl[2] + off) | (c & 1u) << (sl[3] + off);
                  }
              for (int byte = 0; byte < 4; ++byte) {
                const int o = 512 * mt + 16 * lane + 4 * kb + byte;  // offset in the 4096-byte block
                // the 128-row stripe's blocks follow each other
                out[(g * N + 128 * nb) * KH + 4096 * kbk + o] = static_cast<uint8_t>(w >> (8 * byte));
              }
            }
  return out;
}

// Host-side copy of layout.py's prepare_scales_sm90: scales [G, N, K/16] (e4m3 bytes) in the
// checkpoint order -> per 128-row stripe, one [128 rows][4] record of 512 bytes per k-tile.
inline std::vector<uint8_t> prepare_scales_sm90_host(const std::vector<uint8_t>& s, int64_t G, int64_t N, int64_t K) {
  const int64_t KS = K / 16;
  std::vector<uint8_t> out(s.size());
  for (int64_t g = 0; g < G; ++g)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t b = 0; b < KS; ++b)
        out[(g * N + n / 128 * 128) * KS + 512 * (b / 4) + 4 * (n % 128) + b % 4] = s[(g * N + n) * KS + b];
  return out;
}

}  // namespace jax_nvfp4_tools
