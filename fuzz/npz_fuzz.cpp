// libFuzzer target for NumPy .npz / .npy (dew/io/npz.cpp: parse_npz, what `dew eval --fid-ref FILE.npz` reads):
// the input is parsed as an .npz and as a bare .npy. Any input must either be refused with a dew::Error or give
// contiguous CPU tensors whose every element can be read and whose byte count matches shape x dtype; a crash, a
// sanitizer report or an allocation beyond -malloc_limit_mb (a header that claims gigabytes) is a bug.
#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "dew/core/error.h"
#include "dew/io/npz.h"
#include "fuzz/fuzz_util.h"

namespace {

void check(const at::Tensor& t) {
  FUZZ_REQUIRE(t.defined() && t.is_contiguous() && t.device().is_cpu());
  FUZZ_REQUIRE(t.nbytes() == size_t(t.numel()) * t.element_size());
  // every element read once (a tensor whose storage is shorter than its shape would fault here)
  (void)t.to(at::kDouble).sum().item<double>();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    for (const auto& [name, t] : dew::io::parse_npz(bytes, "fuzz.npz")) {
      FUZZ_REQUIRE(!name.empty());
      check(t);
    }
  } catch (const dew::Error&) {}
  try {
    check(dew::io::parse_npy(bytes, "fuzz.npy"));
  } catch (const dew::Error&) {}
  return 0;
}
