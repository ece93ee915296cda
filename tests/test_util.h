// Helpers shared by the test files.
#pragma once
#include <functional>
#include <string>

#include "dew/core/error.h"

namespace dew::test {

/// The message of the dew::Error that f throws, or "" if it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const dew::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace dew::test
