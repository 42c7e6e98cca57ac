// Shapes in the kernels' FFI error messages. Handlers build these strings only when a check
// fails: a decode step makes ~200 kernel calls, and a few string allocations per call add
// up to a measurable part of a small call's cost.
#pragma once

#include <string>

#include "xla/ffi/api/ffi.h"

namespace xlm {

// "[d0, d1, ...]"
inline std::string shape_str(const xla::ffi::AnyBuffer::Dimensions& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

}  // namespace xlm
