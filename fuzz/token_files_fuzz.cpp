// libFuzzer target for token directories (dew/data/token_files.cpp: TokenFiles, what `dew train lm --data DIR`
// maps): the input up to its first NUL byte is meta.json, the rest is split in two halves, train.bin and val.bin,
// all written to a scratch directory that is then opened with the id scan on. Any input must either be refused
// with a dew::Error or give a directory whose counts match its files and whose every id lies in
// [0, vocab_size); a crash, a sanitizer report or a huge allocation is a bug.
#include <ATen/core/Tensor.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "dew/core/error.h"
#include "dew/data/token_files.h"

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

// One directory per fuzzing process (libFuzzer's -jobs run several), rewritten for each input.
const std::string& scratch_dir() {
  static const std::string dir = [] {
    const std::string d = "/tmp/dew-fuzz-token-files-" + std::to_string(getpid());
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

void write(const std::string& name, const char* data, size_t size) {
  std::ofstream f(scratch_dir() + "/" + name, std::ios::binary | std::ios::trunc);
  f.write(data, static_cast<std::streamsize>(size));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* bytes = reinterpret_cast<const char*>(data);
  const size_t meta = std::find(bytes, bytes + size, '\0') - bytes;
  const size_t rest = meta < size ? size - meta - 1 : 0, half = rest / 2;
  write("meta.json", bytes, meta);
  write("train.bin", bytes + std::min(size, meta + 1), half);
  write("val.bin", bytes + std::min(size, meta + 1) + half, rest - half);
  try {
    dew::data::TokenFiles tf(scratch_dir(), /*check_ids=*/true);
    const auto& m = tf.meta();
    require(m.vocab_size > 0 && m.train_tokens >= 0 && m.val_tokens >= 0);
    for (bool val : {false, true}) {
      const int64_t n = tf.size(val);
      if (n == 0) continue;
      const at::Tensor ids = tf.ids(val, 0, n);
      require(ids.numel() == n);
      require(ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < m.vocab_size);
      try {
        tf.ids(val, n, 1);  // past the end: refused
        require(false);
      } catch (const dew::Error&) {}
    }
  } catch (const dew::Error&) {}
  return 0;
}
