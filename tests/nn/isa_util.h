// The fused kernels' instruction-set variants in tests: which this CPU runs, and a guard restoring the
// selected one.
#pragma once
#include <string>
#include <vector>

#include "dew/nn/fused.h"
#include "tests/test_util.h"

namespace dew::test {

/// The variants this CPU runs (of avx512, avx2, base), widest first.
inline std::vector<std::string> runnable_isas() {
  std::vector<std::string> out;
  for (const char* isa : {"avx512", "avx2", "base"})
    if (error_of([&] { dew::nn::set_fused_kernel_isa(isa); }).empty()) out.push_back(isa);
  return out;
}

/// Restores the variant selected at construction when it leaves scope.
struct IsaGuard {
  std::string saved = dew::nn::fused_kernel_isa();
  ~IsaGuard() { dew::nn::set_fused_kernel_isa(saved); }
};

}  // namespace dew::test
