// Internals shared by the dataset sources (dataset.cpp) and the loader (loader.cpp): the text their errors
// quote. Not part of the public API.
#pragma once
#include <ATen/ATen.h>

#include <sstream>
#include <string>

#include "dew/data/dataset.h"

namespace dew {
namespace data {
namespace detail {

/// A tensor's shape as ATen prints it, e.g. "[60000, 1, 28, 28]".
inline std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

/// A batch's field names, comma-separated.
inline std::string field_list(const Batch& b) {
  std::string out;
  for (const auto& kv : b) out += (out.empty() ? "" : ", ") + kv.first;
  return out;
}

}  // namespace detail
}  // namespace data
}  // namespace dew
