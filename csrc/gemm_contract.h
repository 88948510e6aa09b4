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
// Also here: the kernel configurations that exist (kKernelConfigs) and the one heuristic that
// picks one (ChooseKernelConfig; Python calls it at trace time through the extension and passes
// the result to the handler as typed attributes), and the sm90 weight layout's constants
// (jax_nvfp4/layout.py is the Python side of the same layout).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

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

inline constexpr uint32_t LayoutBit(RhsLayout l) { return 1u << static_cast<int>(l); }

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
// tiles exist for depth: decode streams weights). Measurements: docs/design.md.
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
// The same, as the FFI layer asks it of an FP8 family.
inline constexpr bool Fp8FamilyReadsLayout(KernelFamily f, RhsLayout layout) { return FamilyReadsLayout(f, layout); }

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
// (docs/design.md): wgmma with 64-token tiles up to 24 rows per group on average (deeper weight
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
  // token tiles of one weight tile in turn), the fastest of the sweep from 1536 to 24576 rows (docs/design.md)
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
// cutlass_fp8 keeps CUTLASS's per-group arguments after them (at most kCutlassFp8ArgsBytesPerGroup per
// group, 14 arrays each 128-byte aligned), a buffer of ones (its weights' unit block scales) and CUTLASS's
// own workspace (per-SM tensor maps: 4 x 128 bytes per SM on the
// configurations compiled; the launcher checks the bound).
inline constexpr size_t kCutlassFp8ArgsBytesPerGroup = 256;
inline constexpr size_t kCutlassFp8OnesBytes = 4 * kCutlassFp8MaxOnes;
inline constexpr size_t kCutlassFp8KernelWorkspaceBytes = 512 * 1024;
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

// ---------------------------------------------------------------------------------------------
// The sm90 load-time weight layout (jax_nvfp4/layout.py holds the Python side): per 128-row
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
