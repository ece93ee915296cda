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
#include "fuzz/fuzz_util.h"

namespace {

const std::filesystem::path& scratch_dir() {
  static const auto dir = dew_fuzz::make_scratch_dir("token-files");
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto [meta, bins] = dew_fuzz::split_at_nul(data, size);
  dew_fuzz::write_file(scratch_dir() / "meta.json", meta);
  dew_fuzz::write_file(scratch_dir() / "train.bin", bins.substr(0, bins.size() / 2));
  dew_fuzz::write_file(scratch_dir() / "val.bin", bins.substr(bins.size() / 2));
  try {
    dew::data::TokenFiles tf(scratch_dir().string(), /*check_ids=*/true);
    const auto& m = tf.meta();
    FUZZ_REQUIRE(m.vocab_size > 0 && m.train_tokens >= 0 && m.val_tokens >= 0);
    for (bool val : {false, true}) {
      const int64_t n = tf.size(val);
      if (n == 0) continue;
      const at::Tensor ids = tf.ids(val, 0, n);
      FUZZ_REQUIRE(ids.numel() == n);
      FUZZ_REQUIRE(ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < m.vocab_size);
      try {
        tf.ids(val, n, 1);  // past the end: refused
        FUZZ_REQUIRE(!"a window past the end was read");
      } catch (const dew::Error&) {}
    }
  } catch (const dew::Error&) {}
  return 0;
}
