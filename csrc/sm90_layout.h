// The sm90 load-time weight layout's constants, in plain C++.
#pragma once

namespace jax_nvfp4 {

// The sm90 load-time weight layout (jax_nvfp4/maths/layout.py holds the Python side): per 128-row
// stripe of one expert, the K/64 blocks of 128 rows x 64 k (4096 bytes) follow each other; in a
// block, m16 tile mt's 512 bytes hold, for lane (g8, t) = (lane / 4, lane % 4), 16 bytes: one
// 32-bit word per k16 block kb whose bits are the four mma A-fragment registers' e2m1 codes
// (row 16 mt + 8 hi + g8, k 16 kb + 8 half + 2 t + parity) at kSm90SlotBits[hi + 2 half] + 16
// parity (sign, e1, e0, m0). Scales: per stripe, one 512-byte [128 rows][4] record per k-tile.
inline constexpr int kSm90StripeRows = 128;
inline constexpr int kSm90BlockK = 64;
inline constexpr int kSm90BlockBytes = kSm90StripeRows * kSm90BlockK / 2;  // 4096
inline constexpr int kSm90ScaleRecordBytes = kSm90StripeRows * 4;           // 512
inline constexpr int kSm90SlotBits[4][4] = {{15, 8, 7, 6}, {12, 5, 4, 3}, {9, 2, 1, 0}, {14, 13, 11, 10}};

}  // namespace jax_nvfp4
