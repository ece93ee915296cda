// libFuzzer target for Fashion-MNIST IDX files (dew/data/idx.cpp, read by read_idx): the input is written
// to a file, plain or gzipped as it comes (zlib reads both), and read as an image file (magic 2051) and
// as a label file (2049). Any input must either be refused with a dew::Error or give dimensions whose
// product is the number of bytes read; a crash, a sanitizer report or an allocation beyond
// -malloc_limit_mb (a header that claims gigabytes) is a bug.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "dew/core/error.h"
#include "dew/data/idx.h"

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

// One file per fuzzing process (libFuzzer's -jobs run several), rewritten for each input.
const std::string& scratch_path() {
  static const std::string path = "/tmp/dew-fuzz-idx-" + std::to_string(getpid()) + ".gz";
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    std::ofstream f(scratch_path(), std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  for (int32_t magic : {2051, 2049}) {
    dew::data::IdxBytes idx;
    try {
      idx = dew::data::read_idx_bytes(scratch_path(), magic);
    } catch (const dew::Error&) {
      continue;
    }
    require(idx.dims.size() == size_t(magic & 0xff));
    uint64_t total = 1;
    for (int64_t d : idx.dims) {
      require(d > 0);
      total *= uint64_t(d);
    }
    require(total == idx.data.size());
  }
  return 0;
}
