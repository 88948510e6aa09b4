// Text for the handlers' error messages, shared by every custom call's FFI view (ffi/*_ffi.h).
#pragma once

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {

// A buffer's shape as "[d0, d1, ...]".
inline std::string DimsToString(::xla::ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(d[i]);
  }
  return s + "]";
}

}  // namespace jax_nvfp4
