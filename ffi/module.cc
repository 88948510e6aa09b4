// nanobind module: hands the XLA FFI handlers to Python as capsules.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

// The CUDA architectures the handler was compiled for (a comma list set by CMakeLists.txt).
#ifndef JAX_NVFP4_CUDA_ARCHS
#define JAX_NVFP4_CUDA_ARCHS ""
#endif

extern "C" XLA_FFI_Error* JaxNvfp4GroupedGemmCpu(XLA_FFI_CallFrame* call_frame);
#ifdef JAX_NVFP4_WITH_CUDA
extern "C" XLA_FFI_Error* JaxNvfp4GroupedGemmCuda(XLA_FFI_CallFrame* call_frame);
#endif

template <typename Fn>
static nb::capsule EncapsulateFfiHandler(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(_jax_nvfp4, m) {
  m.def("cpu_registrations", []() {
    nb::dict d;
    d["jax_nvfp4_grouped_gemm"] = EncapsulateFfiHandler(JaxNvfp4GroupedGemmCpu);
    return d;
  });
  m.def("cuda_registrations", []() {
    nb::dict d;
#ifdef JAX_NVFP4_WITH_CUDA
    d["jax_nvfp4_grouped_gemm"] = EncapsulateFfiHandler(JaxNvfp4GroupedGemmCuda);
#endif
    return d;
  });
  m.def("built_with_cuda", []() {
#ifdef JAX_NVFP4_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
  m.def("cuda_archs", []() { return std::string(JAX_NVFP4_CUDA_ARCHS); });
}
