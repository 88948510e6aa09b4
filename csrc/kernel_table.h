// The kernels: the families and what each computes, reads and runs on (kFamilyTable), every compiled
// configuration (kKernelConfigs), and the one heuristic that picks one (ChooseKernelConfig; Python calls
// it at trace time through the extension and passes the result to the handler as typed attributes).
// Plain C++ (no CUDA, no XLA).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "csrc/gemm_attributes.h"

namespace jax_nvfp4 {

// Kernel families (the custom call's `kernel` attribute). What each one is, computes, reads and runs
// on is kFamilyTable below, the one statement of those facts: the functions after it read it, the
// extension hands it to Python (kernel_families(), ffi/module.cc), and the docs are checked against it.
enum class KernelFamily : int32_t {
  kMma = 0,
  kMmaWs = 1,
  kWgmma = 2,
  kWgmmaFp8 = 3,
  kWgmmaFp8Prepared = 4,
  kCutlassFp8 = 5,
};

struct FamilyInfo {
  KernelFamily family;
  const char* name;       // the Python API's name (grouped_gemm(kernel=...), JAX_NVFP4_KERNEL)
  bool fp8;               // computes the FP8 mode (and nothing else); otherwise the exact mode
  uint32_t layouts;       // LayoutBit of each weight layout it reads
  bool needs_sm90a;       // runs on sm_90 only, from the sm_90a image; otherwise on every arch >= 80
  const char* file;       // the kernel's source file
  const char* summary;    // what it is, in a few words
};

inline constexpr FamilyInfo kFamilyTable[] = {
    {KernelFamily::kMma, "mma", false, LayoutBit(RhsLayout::kCheckpoint) | LayoutBit(RhsLayout::kSm90), false,
     "csrc/grouped_gemm_mma.cu", "mma.sync with a cp.async multistage pipeline; the only reader of packed e2m1 activations"},
    {KernelFamily::kMmaWs, "mma_ws", false, LayoutBit(RhsLayout::kSm90), true, "csrc/grouped_gemm_mma.cu",
     "mma's warp-specialized variant (template WS): bulk copies and mbarriers, for decode"},
    {KernelFamily::kWgmma, "wgmma", false, LayoutBit(RhsLayout::kCheckpoint) | LayoutBit(RhsLayout::kSm90), true,
     "csrc/grouped_gemm_wgmma_sm90.cu", "wgmma with the weights as register operand, TMA, persistent"},
    {KernelFamily::kWgmmaFp8, "wgmma_fp8", true, LayoutBit(RhsLayout::kCheckpoint), true,
     "csrc/grouped_gemm_fp8_sm90.cu", "e4m3 wgmma, the NVFP4 weights rounded to e4m3 in registers"},
    {KernelFamily::kWgmmaFp8Prepared, "wgmma_fp8_prepared", true, LayoutBit(RhsLayout::kFp8), true,
     "csrc/grouped_gemm_fp8_prepared_sm90.cu", "e4m3 wgmma on fp8-prepared weights, both operands by TMA"},
    {KernelFamily::kCutlassFp8, "cutlass_fp8", true, LayoutBit(RhsLayout::kFp8), true,
     "csrc/grouped_gemm_cutlass_fp8_sm90.cu",
     "CUTLASS's SM90 grouped GEMM with blockwise scaling on fp8-prepared weights"},
};
inline constexpr int kNumFamilies = static_cast<int>(sizeof(kFamilyTable) / sizeof(kFamilyTable[0]));

// Whether f is a family of the table (the custom call's attribute may hold any int32).
inline constexpr bool IsKnownFamily(KernelFamily f) {
  return static_cast<int>(f) >= 0 && static_cast<int>(f) < kNumFamilies;
}
// The table's row of a known family f (rows are in code order: a static_assert below holds it).
inline constexpr const FamilyInfo& InfoOf(KernelFamily f) { return kFamilyTable[static_cast<int>(f)]; }

inline constexpr bool FamilyTableInCodeOrder() {
  for (int i = 0; i < kNumFamilies; ++i)
    if (static_cast<int>(kFamilyTable[i].family) != i) return false;
  return true;
}
static_assert(FamilyTableInCodeOrder(), "kFamilyTable: one row per KernelFamily, in code order");

struct KernelConfig {
  KernelFamily family = KernelFamily::kMma;
  int32_t token_tile = 16;  // rows of one group per CTA tile
  int32_t stages = 4;       // pipeline depth
  int32_t cluster = 1;      // CTAs per cluster (wgmma 256: pairs multicast the activation tile)
  int32_t raster = 0;       // cutlass_fp8's tile order (its scheduler's raster order): 0 CUTLASS's heuristic,
                            // 1 along M (the token tiles of one weight tile in turn), 2 along N; 0 elsewhere
};

constexpr bool operator==(const KernelConfig& a, const KernelConfig& b) {
  return a.family == b.family && a.token_tile == b.token_tile && a.stages == b.stages && a.cluster == b.cluster &&
         a.raster == b.raster;
}

// Every configuration the kernels are compiled for; the launchers instantiate exactly these.
// Stages: the mma tiles keep ~3 k-tiles in flight per SM at their CTAs per SM; the warp-specialized
// decode tile and the wgmma tiles are as deep as shared memory allows for their token tile (small
// tiles exist for depth: decode streams weights). Measurements: docs/archive/design-measurements.md.
inline constexpr KernelConfig kKernelConfigs[] = {
    {KernelFamily::kMma, 16, 4, 1},   {KernelFamily::kMma, 32, 5, 1},    {KernelFamily::kMma, 64, 4, 1},
    {KernelFamily::kMma, 128, 4, 1},  {KernelFamily::kMmaWs, 16, 8, 1},  {KernelFamily::kWgmma, 32, 20, 1},
    {KernelFamily::kWgmma, 64, 12, 1}, {KernelFamily::kWgmma, 128, 8, 1}, {KernelFamily::kWgmma, 256, 5, 2},
    {KernelFamily::kWgmmaFp8, 32, 15, 1}, {KernelFamily::kWgmmaFp8, 64, 12, 1}, {KernelFamily::kWgmmaFp8, 128, 8, 1},
    {KernelFamily::kWgmmaFp8Prepared, 128, 6, 1},
    {KernelFamily::kCutlassFp8, 128, 5, 1, 1}, {KernelFamily::kCutlassFp8, 128, 5, 2, 1},
    {KernelFamily::kCutlassFp8, 128, 5, 1, 0}, {KernelFamily::kCutlassFp8, 128, 5, 2, 0},
    {KernelFamily::kCutlassFp8, 64, 8, 1, 0},
};
inline constexpr int kNumKernelConfigs = static_cast<int>(sizeof(kKernelConfigs) / sizeof(kKernelConfigs[0]));

inline constexpr bool IsKnownConfig(const KernelConfig& c) {
  for (const KernelConfig& k : kKernelConfigs)
    if (k == c) return true;
  return false;
}

// Calls launch(std::integral_constant<int, I>{}) for the table entry I equal to c and returns its
// result (`none` when c is not in the table): the launchers turn I into that entry's kernel
// instantiation (a `launch_entry<I>` of their own), so every entry is instantiated once per launcher.
template <typename R, typename Launch, int... I>
R WithConfigEntry(const KernelConfig& c, R none, Launch&& launch, std::integer_sequence<int, I...>) {
  R r = none;
  (void)((kKernelConfigs[I] == c ? (r = launch(std::integral_constant<int, I>{}), true) : false) || ...);
  return r;
}
template <typename R, typename Launch>
R WithConfigEntry(const KernelConfig& c, R none, Launch&& launch) {
  return WithConfigEntry(c, none, std::forward<Launch>(launch), std::make_integer_sequence<int, kNumKernelConfigs>{});
}

// Whether `family` computes the FP8 mode (fp8) or the exact mode (kFamilyTable).
inline constexpr bool IsFp8Family(KernelFamily f) { return IsKnownFamily(f) && InfoOf(f).fp8; }
inline constexpr bool FamilyComputesMode(KernelFamily f, bool fp8) { return IsFp8Family(f) == fp8; }

// Whether family f reads weights in `layout` (kFamilyTable).
inline constexpr bool FamilyReadsLayout(KernelFamily f, RhsLayout layout) {
  return IsKnownFamily(f) && (InfoOf(f).layouts & LayoutBit(layout)) != 0;
}
// The FFI layer's check of an FP8 family's `kernel` and `rhs_layout` attributes: fp8-prepared weights
// exactly for the families whose kernels read them. wgmma_fp8's configuration also names the FP8 mode
// on sm90 NVFP4 weights, which the CPU handler computes and no CUDA kernel reads (FamilyHandles).
inline constexpr bool Fp8FamilyReadsLayout(KernelFamily f, RhsLayout layout) {
  return IsFp8Family(f) && FamilyReadsLayout(f, RhsLayout::kFp8) == (layout == RhsLayout::kFp8);
}

// The first configuration of `family` with `token_tile` (the self-test's way to name one).
inline constexpr KernelConfig DefaultConfigFor(KernelFamily family, int32_t token_tile) {
  for (const KernelConfig& k : kKernelConfigs)
    if (k.family == family && k.token_tile == token_tile) return k;
  return KernelConfig{family, 0, 0, 0, 0};
}

inline constexpr const char* FamilyName(KernelFamily f) { return IsKnownFamily(f) ? InfoOf(f).name : "?"; }

// Bit (1 << family) per family, for the set of families a build carries.
inline constexpr uint32_t FamilyBit(KernelFamily f) { return 1u << static_cast<int>(f); }

// Compute capability as 10 * major + minor (90 = sm_90, 0 = no GPU).
inline constexpr bool ArchSupported(int arch) { return arch >= 80; }
// wgmma (both modes) and the warp-specialized mma variant use sm_90a instructions (setmaxnreg, wgmma,
// bulk copies): only an sm_90 device running the sm_90a image has them.
inline constexpr bool FamilyRunsOn(KernelFamily f, int arch) {
  return IsKnownFamily(f) && (InfoOf(f).needs_sm90a ? arch == 90 : ArchSupported(arch));
}

// The families a build can run on a device of compute capability `arch` (FamilyBit mask): mma
// from sm_80 on (sm_80 machine code, and compute_80 PTX the driver compiles for newer devices);
// mma_ws and the wgmma families on sm_90 when the build carries the sm_90a image.
inline constexpr uint32_t RunnableFamilies(int arch, bool built_cuda, bool built_sm90a) {
  uint32_t f = 0;
  for (const FamilyInfo& info : kFamilyTable)
    if ((info.needs_sm90a ? built_sm90a : built_cuda) && FamilyRunsOn(info.family, arch)) f |= FamilyBit(info.family);
  return f;
}

// ---------------------------------------------------------------------------------------------
// The heuristic: the one place that decides which configuration runs.

struct ProblemDesc {
  int arch = 0;            // device compute capability (10 * major + minor), 0 = CPU
  uint32_t families = 0;   // RunnableFamilies on that device with this build
  int64_t M = 0, N = 0, K = 0, G = 1;
  int64_t rows_hint = 0;   // expected rows inside the groups (0: M)
  bool a_fp4 = false;      // packed e2m1 activations (W4A4 native)
  RhsLayout layout = RhsLayout::kCheckpoint;
  bool fp8 = false;        // FP8 mode (the families with kFamilyTable's fp8 compute it)
};

// Average rows per group: rows_hint (or M when 0 or >= M) / G, rounded up.
inline constexpr int64_t AvgRowsPerGroup(const ProblemDesc& d) {
  const int64_t rows = d.rows_hint > 0 && d.rows_hint < d.M ? d.rows_hint : d.M;
  return (rows + d.G - 1) / (d.G > 0 ? d.G : 1);
}

// Shape conditions of the wgmma kernel (its buffer alignment is a precondition: BufferAlignmentError).
inline constexpr bool WgmmaShapeOk(const ProblemDesc& d) {
  if (d.a_fp4 || d.K <= 0 || d.K % 64 != 0) return false;
  if (d.M > INT32_MAX - 256) return false;
  // the linear tile index (token tiles x n-tiles) must fit in int32
  return ((d.M + 63) / 64 + d.G) * ((d.N + 127) / 128) <= INT32_MAX;
}

// Shape conditions of the FP8-mode kernel on prepared weights: fp8-prepared weights, K % 128 == 0 (one
// promotion per 128-wide stage), G * N within the int32 row coordinate of the weights' tensor map, and the
// tile index of its 128-token tiles within int32.
inline constexpr bool WgmmaFp8PreparedShapeOk(const ProblemDesc& d) {
  if (d.K <= 0 || d.K % 128 != 0 || d.layout != RhsLayout::kFp8) return false;
  if (d.M > INT32_MAX - 256 || d.G * d.N > INT32_MAX) return false;
  return ((d.M + 127) / 128 + d.G) * ((d.N + 127) / 128) <= INT32_MAX;
}

// Shape conditions of the CUTLASS FP8 grouped GEMM: fp8-prepared weights, K % 128 == 0 (one promotion per
// 128-wide k tile, 16-byte aligned rows for TMA), N % 8 == 0 (16-byte output rows for the TMA store), the
// weights' unit block scales (one per tile-wide block of weight rows and 128 k, the tile 128 or 192 rows
// wide: counted here per 128) within the buffer of ones (kCutlassFp8MaxOnes) and the chunk scales' offsets within int32.
inline constexpr int64_t kCutlassFp8MaxOnes = 16384;
inline constexpr bool CutlassFp8ShapeOk(const ProblemDesc& d) {
  if (d.K <= 0 || d.K % 128 != 0 || d.N % 8 != 0 || d.layout != RhsLayout::kFp8) return false;
  if ((d.N + 127) / 128 * (d.K / 128) > kCutlassFp8MaxOnes || d.M > INT32_MAX - 256) return false;
  return (d.K / 128) * (d.M + 1) <= INT32_MAX;
}

// Shape conditions of the FP8-mode kernel: K % 128 == 0 (one promotion per 128-wide stage), the
// checkpoint weight layout (a thread reads 16 contiguous code bytes of one row per stage) and
// G * N within the int32 row coordinate of the weights' tensor map.
inline constexpr bool WgmmaFp8ShapeOk(const ProblemDesc& d) {
  if (d.K <= 0 || d.K % 128 != 0 || d.layout != RhsLayout::kCheckpoint) return false;
  if (d.M > INT32_MAX - 256 || d.G * d.N > INT32_MAX) return false;  // G * N: the weight box's TMA row
  return ((d.M + 31) / 32 + d.G) * ((d.N + 127) / 128) <= INT32_MAX;
}

// Whether `family` computes this problem: its mode and the weights' layout (kFamilyTable), then its
// shapes and activation type: wgmma_fp8 K % 128 == 0, wgmma_fp8_prepared K % 128 == 0, cutlass_fp8
// that and N % 8 == 0; wgmma W4A16 with K % 64 == 0, mma_ws bf16 activations, mma everything.
inline constexpr bool FamilyHandles(KernelFamily f, const ProblemDesc& d) {
  if (!FamilyComputesMode(f, d.fp8) || !FamilyReadsLayout(f, d.layout)) return false;
  if (f == KernelFamily::kWgmmaFp8) return WgmmaFp8ShapeOk(d);
  if (f == KernelFamily::kCutlassFp8) return CutlassFp8ShapeOk(d);
  if (f == KernelFamily::kWgmmaFp8Prepared) return WgmmaFp8PreparedShapeOk(d);
  if (f == KernelFamily::kWgmma) return WgmmaShapeOk(d);
  if (f == KernelFamily::kMmaWs) return !d.a_fp4;
  return true;
}

// The token tile (and so the configuration) of `family` for this problem. Measured on the H200
// (docs/archive/design-measurements.md): wgmma with 64-token tiles up to 24 rows per group on average (deeper weight
// pipelines), 128 above, 256 (a 2-CTA cluster, its groups' short last tiles on the 128-token
// kernel) from 128 rows; mma with 16-token tiles up to 12 rows, 32 up to 40, 64 above; mma_ws has
// the 16-token tile only.
inline constexpr KernelConfig ConfigForFamily(KernelFamily f, const ProblemDesc& d) {
  const int64_t avg = AvgRowsPerGroup(d);
  if (f == KernelFamily::kWgmma) return DefaultConfigFor(f, avg >= 128 ? 256 : avg <= 24 ? 64 : 128);
  if (f == KernelFamily::kWgmmaFp8) return DefaultConfigFor(f, avg <= 24 ? 32 : avg <= 64 ? 64 : 128);
  // prepared weights: the 128-token tile at every size measured (its WGMMA N follows a tile's rows, so
  // short tiles cost no MMA work; 32/64-token tiles were no faster at 4 rows per group and 10% slower at
  // 32: docs/archive/fp8-prepared-lab.md)
  if (f == KernelFamily::kWgmmaFp8Prepared) return DefaultConfigFor(f, 128);
  // cutlass_fp8: its first entry, 128-token cooperative tiles, one CTA per cluster, walked along M (the
  // token tiles of one weight tile in turn), the fastest of the sweep from 1536 to 24576 rows (docs/archive/design-measurements.md)
  if (f == KernelFamily::kCutlassFp8) return DefaultConfigFor(f, 128);
  if (f == KernelFamily::kMmaWs) return DefaultConfigFor(f, 16);
  return DefaultConfigFor(f, avg <= 12 ? 16 : avg <= 40 ? 32 : 64);
}

// The heuristic. wgmma from 16 rows per group on average (below that the mma kernels stream the
// weights faster: 0.35 ms against 0.51 ms at 4 rows per group on the H200, while from 32 rows up
// wgmma is 1.3-1.8x faster); the warp-specialized mma variant for 16-token tiles of sm90 weights
// (2-4% faster at decode); otherwise the mma kernel.
// FP8 mode: checkpoint-layout weights run wgmma_fp8; fp8-prepared weights run cutlass_fp8 or
// wgmma_fp8_prepared by the average rows per group (below). The configuration is returned whether or
// not the device runs it (the handler then names the device).
inline constexpr KernelConfig ChooseKernelConfig(const ProblemDesc& d) {
  if (d.fp8) {
    if (d.layout != RhsLayout::kFp8) return ConfigForFamily(KernelFamily::kWgmmaFp8, d);
    // fp8-prepared weights: CUTLASS's grouped GEMM from 64 rows per group on average; below, the hand-written
    // kernel, whose WGMMA N follows a short group's rows (H100, L1: 0.63 against 0.70 ms at 4 rows per group,
    // 0.78 against 0.83 at 32; at 128 CUTLASS leads, 1.03 against 1.12; 64 is the midpoint, not measured)
    const bool cutlass = CutlassFp8ShapeOk(d) && AvgRowsPerGroup(d) >= 64;
    return ConfigForFamily(cutlass ? KernelFamily::kCutlassFp8 : KernelFamily::kWgmmaFp8Prepared, d);
  }
  auto usable = [&d](KernelFamily f) { return (d.families & FamilyBit(f)) && FamilyHandles(f, d); };
  if (usable(KernelFamily::kWgmma) && AvgRowsPerGroup(d) >= 16) return ConfigForFamily(KernelFamily::kWgmma, d);
  const KernelConfig c = ConfigForFamily(KernelFamily::kMma, d);
  if (usable(KernelFamily::kMmaWs) && c.token_tile == 16) return ConfigForFamily(KernelFamily::kMmaWs, d);
  return c;
}

}  // namespace jax_nvfp4
