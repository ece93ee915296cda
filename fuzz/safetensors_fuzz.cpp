// libFuzzer target for the safetensors header parser (scripts/fuzz builds and runs it).
// Any input must either throw dew::Error or yield entries that keep every promise of parse_header;
// a crash, a sanitizer report, another exception type or a broken promise is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "dew/core/error.h"
#include "dew/io/safetensors_header.h"

namespace {

// Stops the run with the input saved: abort() is what libFuzzer records as a crash.
void require(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dew::io::Header h;
  try {
    h = dew::io::parse_header(data, size, "fuzz-input");
  } catch (const dew::Error&) {
    return 0;  // refused with a message: the expected outcome for most inputs
  }
  require(h.data_start >= 8 && h.data_start + h.data_size == size);
  uint64_t expected = 0;
  uint64_t checksum = 0;
  for (const auto& t : h.tensors) {
    // The entries tile the data section in order, and each size is shape x dtype size.
    require(t.begin == expected && t.begin <= t.end && t.end <= h.data_size);
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      require(d >= 0);
      numel *= static_cast<uint64_t>(d);  // cannot wrap: the parser bounded the product
    }
    require(numel * dew::io::dtype_size(t.dtype) == t.end - t.begin);
    // Touch every byte the entry claims, so ASan reports any entry reaching outside the input.
    for (uint64_t i = t.begin; i < t.end; ++i) checksum += data[h.data_start + i];
    expected = t.end;
  }
  require(expected == h.data_size);
  volatile uint64_t sink = checksum;  // keeps the reads from being optimised away
  (void)sink;
  return 0;
}
