// nanobind module: hands the XLA FFI handlers to Python as capsules, and exposes the kernel
// configurations, the heuristic that picks one (csrc/gemm_contract.h) and what this build carries.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>

#include "csrc/gemm_contract.h"
#include "jax_nvfp4_build.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" XLA_FFI_Error* JaxNvfp4GroupedGemmCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxNvfp4GroupedGemmGluCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxNvfp4DispatchRowsCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxNvfp4QuantizeFp8Cpu(XLA_FFI_CallFrame* call_frame);
#ifdef JAX_NVFP4_WITH_CUDA
extern "C" XLA_FFI_Error* JaxNvfp4GroupedGemmCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxNvfp4GroupedGemmGluCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxNvfp4DispatchRowsCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxNvfp4QuantizeFp8Cuda(XLA_FFI_CallFrame* call_frame);
#endif

template <typename Fn>
static nb::capsule EncapsulateFfiHandler(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

using ConfigTuple = std::tuple<std::string, int, int, int, int>;  // (family, token_tile, stages, cluster, raster)

static constexpr jax_nvfp4::KernelFamily kFamilies[] = {
    jax_nvfp4::KernelFamily::kMma, jax_nvfp4::KernelFamily::kMmaWs, jax_nvfp4::KernelFamily::kWgmma,
    jax_nvfp4::KernelFamily::kWgmmaFp8, jax_nvfp4::KernelFamily::kWgmmaFp8Prepared,
    jax_nvfp4::KernelFamily::kCutlassFp8};

static constexpr jax_nvfp4::RhsLayout kLayouts[] = {jax_nvfp4::RhsLayout::kCheckpoint, jax_nvfp4::RhsLayout::kSm90,
                                                    jax_nvfp4::RhsLayout::kFp8};

// "0 (checkpoint), 1 (sm90), 2 (fp8)": the codes and names, for error messages.
template <typename E, size_t N, typename Name>
static std::string CodeList(const E (&values)[N], Name name) {
  std::string s;
  for (size_t i = 0; i < N; ++i)
    s += (i ? ", " : "") + std::to_string(static_cast<int>(values[i])) + " (" + name(values[i]) + ")";
  return s;
}

static ConfigTuple ToTuple(const jax_nvfp4::KernelConfig& c) {
  return {jax_nvfp4::FamilyName(c.family), c.token_tile, c.stages, c.cluster, c.raster};
}

// The problem the heuristic sees, from the Python-side arguments.
// rhs_layout: the custom call's attribute code (0 checkpoint, 1 sm90, 2 fp8-prepared).
static jax_nvfp4::ProblemDesc Problem(int64_t m, int64_t n, int64_t k, int64_t g, int64_t rows_hint, bool a_fp4,
                                      int rhs_layout, bool fp8) {
  const auto layout = static_cast<jax_nvfp4::RhsLayout>(rhs_layout);
  if (!jax_nvfp4::IsKnownLayout(layout))
    throw nb::value_error(("rhs_layout: expected one of " + CodeList(kLayouts, jax_nvfp4::LayoutName) + ", got " +
                           std::to_string(rhs_layout)).c_str());
  jax_nvfp4::ProblemDesc d;
  d.M = m;
  d.N = n;
  d.K = k;
  d.G = g;
  d.rows_hint = rows_hint;
  d.a_fp4 = a_fp4;
  d.layout = layout;
  d.fp8 = fp8;
  return d;
}

// The registered name of custom call `base`: "grouped_gemm" -> "jax_nvfp4_grouped_gemm_v3".
static std::string TargetName(const char* base) {
  return std::string("jax_nvfp4_") + base + "_v" + std::to_string(jax_nvfp4::kInterfaceVersion);
}

NB_MODULE(_jax_nvfp4, m) {
  m.def("cpu_registrations", []() {
    nb::dict d;
    d[TargetName("grouped_gemm").c_str()] = EncapsulateFfiHandler(JaxNvfp4GroupedGemmCpu);
    d[TargetName("grouped_gemm_glu").c_str()] = EncapsulateFfiHandler(JaxNvfp4GroupedGemmGluCpu);
    d[TargetName("dispatch_rows").c_str()] = EncapsulateFfiHandler(JaxNvfp4DispatchRowsCpu);
    d[TargetName("quantize_fp8").c_str()] = EncapsulateFfiHandler(JaxNvfp4QuantizeFp8Cpu);
    return d;
  });
  m.def("cuda_registrations", []() {
    nb::dict d;
#ifdef JAX_NVFP4_WITH_CUDA
    d[TargetName("grouped_gemm").c_str()] = EncapsulateFfiHandler(JaxNvfp4GroupedGemmCuda);
    d[TargetName("grouped_gemm_glu").c_str()] = EncapsulateFfiHandler(JaxNvfp4GroupedGemmGluCuda);
    d[TargetName("dispatch_rows").c_str()] = EncapsulateFfiHandler(JaxNvfp4DispatchRowsCuda);
    d[TargetName("quantize_fp8").c_str()] = EncapsulateFfiHandler(JaxNvfp4QuantizeFp8Cuda);
#endif
    return d;
  });
  // The custom call's enum codes (csrc/gemm_contract.h), which jax_nvfp4.config.options takes from here.
  m.def("family_codes", []() {
    nb::dict d;
    for (auto f : kFamilies) d[jax_nvfp4::FamilyName(f)] = static_cast<int>(f);
    return d;
  }, "The kernel families as {name: the custom call's `kernel` attribute code} (the KernelFamily enum).");
  m.def("fp8_families", []() {
    nb::list l;
    for (auto f : kFamilies)
      if (jax_nvfp4::IsFp8Family(f)) l.append(std::string(jax_nvfp4::FamilyName(f)));
    return l;
  }, "The families that compute the FP8 mode (IsFp8Family), in code order.");
  m.def("layout_codes", []() {
    nb::dict d;
    for (auto l : kLayouts) d[jax_nvfp4::LayoutName(l)] = static_cast<int>(l);
    return d;
  }, "The weight layouts as {name: the custom call's `rhs_layout` attribute code} (the RhsLayout enum).");
  m.def("kernel_families", []() {
    nb::list l;
    for (const jax_nvfp4::FamilyInfo& f : jax_nvfp4::kFamilyTable) {
      nb::list layouts;
      for (auto lay : kLayouts)
        if (f.layouts & jax_nvfp4::LayoutBit(lay)) layouts.append(std::string(jax_nvfp4::LayoutName(lay)));
      nb::list tiles;  // in table order, each once
      int seen[jax_nvfp4::kNumKernelConfigs] = {};
      int n_seen = 0;
      for (const jax_nvfp4::KernelConfig& c : jax_nvfp4::kKernelConfigs) {
        if (c.family != f.family || std::find(seen, seen + n_seen, c.token_tile) != seen + n_seen) continue;
        seen[n_seen++] = c.token_tile;
        tiles.append(c.token_tile);
      }
      nb::dict d;
      d["name"] = std::string(f.name);
      d["code"] = static_cast<int>(f.family);
      d["mode"] = std::string(f.fp8 ? "fp8" : "exact");
      d["layouts"] = nb::tuple(layouts);
      d["archs"] = std::string(f.needs_sm90a ? "sm_90 (sm_90a image)" : "sm_80 and newer");
      d["file"] = std::string(f.file);
      d["token_tiles"] = nb::tuple(tiles);
      d["summary"] = std::string(f.summary);
      l.append(d);
    }
    return l;
  }, "The kernel families (kFamilyTable), in code order: dicts of name, code, mode ('exact' or 'fp8'), layouts "
     "(the weight layouts read), archs, file, token_tiles (of kKernelConfigs), summary.");
  m.def("weight_shifts", []() {
    nb::dict d;
    d["exact"] = jax_nvfp4::kExactWeightShift;
    d["fp8"] = jax_nvfp4::kFp8WeightShift;
    return d;
  }, "The weights' power-of-two prescale exponents: {'exact': 7, 'fp8': 3} (weights enter as w * 2^-shift).");
  m.def("interface_version", []() { return jax_nvfp4::kInterfaceVersion; },
        "The custom calls' interface version, the _v<N> suffix of every target name.");
  m.def("built_with_cuda", []() { return jax_nvfp4::kBuiltCuda; });
  // The XLA FFI API version of the headers the handlers were compiled against: an XLA accepts
  // handlers of its own version and older ones (same major), never newer ones.
  m.def("cuda_off_reason", []() { return std::string(jax_nvfp4::kCudaOffReason); },
        "Why the CUDA handler was left out of this build (empty when it was built).");
  m.def("source_dir", []() { return std::string(jax_nvfp4::kSourceDir); }, "The source folder that was built.");
  m.def("cuda_compiler_source", []() { return std::string(jax_nvfp4::kCudaCompilerSource); },
        "Where the build's nvcc came from: 'path', 'wheels' (NVIDIA's wheels), '' without CUDA.");
  m.def("built_against_jaxlib", []() { return std::string(jax_nvfp4::kJaxlibVersion); },
        "The jaxlib whose XLA FFI headers the handlers were compiled against.");
  m.def("xla_ffi_api_version", []() { return std::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); },
        "(major, minor) of the XLA FFI API the handlers declare.");
  m.def("cuda_targets", []() { return std::string(jax_nvfp4::kBuiltCudaTargets); },
        "The CUDA images in this build, e.g. 'sm_80 sm_90a compute_80' (empty without CUDA).");
  m.def("workspace_bytes", [](int64_t g, int64_t cpu_row_bytes) {
    return jax_nvfp4::CustomCallWorkspaceBytes(g, cpu_row_bytes);
  }, nb::arg("g"), nb::arg("cpu_row_bytes"),
        "Bytes of a grouped GEMM call's workspace output for g groups and the CPU handlers' decoded rows.");
  m.def("kernel_configs", []() {
    nb::list l;
    for (const jax_nvfp4::KernelConfig& c : jax_nvfp4::kKernelConfigs) l.append(ToTuple(c));
    return l;
  }, "Every compiled kernel configuration as (family, token_tile, stages, cluster, raster).");
  m.def("runnable_families", [](int arch) {
    const uint32_t f = jax_nvfp4::RunnableFamilies(arch, jax_nvfp4::kBuiltCuda, jax_nvfp4::kBuiltSm90a);
    nb::list l;
    for (auto fam : kFamilies)
      if (f & jax_nvfp4::FamilyBit(fam)) l.append(std::string(jax_nvfp4::FamilyName(fam)));
    return l;
  }, nb::arg("arch"), "The kernel families this build runs on compute capability arch (10 * major + minor).");
  m.def(
      "config_for_family",
      [](const std::string& family, int64_t m, int64_t n, int64_t k, int64_t g, int64_t rows_hint, bool a_fp4,
         int rhs_layout, bool fp8) -> nb::object {
        jax_nvfp4::ProblemDesc d = Problem(m, n, k, g, rows_hint, a_fp4, rhs_layout, fp8);
        for (auto fam : kFamilies)
          if (family == jax_nvfp4::FamilyName(fam)) {
            if (!jax_nvfp4::FamilyHandles(fam, d)) return nb::none();
            return nb::cast(ToTuple(jax_nvfp4::ConfigForFamily(fam, d)));
          }
        throw nb::value_error(("kernel: unknown family '" + family + "' (expected one of " +
                               CodeList(kFamilies, jax_nvfp4::FamilyName) + ")").c_str());
      },
      nb::arg("family"), nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("g"), nb::arg("rows_hint"),
      nb::arg("a_fp4"), nb::arg("rhs_layout"), nb::arg("fp8") = false,
      "The configuration of one family for this problem (its token-tile rule), or None where the family does not "
      "handle it.");
  m.def(
      "choose_kernel",
      [](int arch, int64_t m, int64_t n, int64_t k, int64_t g, int64_t rows_hint, bool a_fp4, int rhs_layout,
         int64_t families, bool fp8) {
        jax_nvfp4::ProblemDesc d = Problem(m, n, k, g, rows_hint, a_fp4, rhs_layout, fp8);
        d.arch = arch;
        d.families = families >= 0 ? static_cast<uint32_t>(families)
                                   : jax_nvfp4::RunnableFamilies(arch, jax_nvfp4::kBuiltCuda, jax_nvfp4::kBuiltSm90a);
        return ToTuple(jax_nvfp4::ChooseKernelConfig(d));
      },
      nb::arg("arch"), nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("g"), nb::arg("rows_hint"),
      nb::arg("a_fp4"), nb::arg("rhs_layout"), nb::arg("families") = -1, nb::arg("fp8") = false,
      "The kernel configuration ChooseKernelConfig picks, as (family, token_tile, stages, cluster, raster). rhs_layout: 0 "
      "checkpoint, 1 sm90, 2 fp8-prepared. families: a mask of 1 << family (0 mma, 1 mma_ws, 2 wgmma, 3 wgmma_fp8, "
      "4 wgmma_fp8_prepared, 5 cutlass_fp8) the device can run; -1: this build's on arch. fp8: the FP8 mode (the "
      "FP8 families).");
}
