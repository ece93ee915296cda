// libFuzzer target for CLIP's vocab.json + merges.txt (dew/data/clip_tokenizer.cpp: ClipTokenizer, what the
// CLIP text encoders of SD / SDXL / SD3 / Flux folders and the CLIP score read): the input up to its first NUL
// byte is vocab.json, the rest merges.txt, written beside each other in a scratch folder; a tokenizer read from
// them then encodes a fixed caption and one made of the input's own bytes. Any input must either be refused with
// a dew::Error or give ids in [0, vocab_size) and batches of the asked shape with bos and eos in place; a crash,
// a sanitizer report or a huge allocation is a bug.
#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "dew/core/error.h"
#include "dew/data/clip_tokenizer.h"
#include "fuzz/fuzz_util.h"

namespace {

const std::filesystem::path& scratch_dir() {
  static const auto dir = dew_fuzz::make_scratch_dir("clip-vocab");
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto [vocab, merges] = dew_fuzz::split_at_nul(data, size);
  dew_fuzz::write_file(scratch_dir() / "vocab.json", vocab);
  dew_fuzz::write_file(scratch_dir() / "merges.txt", merges);
  try {
    const dew::data::ClipTokenizer tok((scratch_dir() / "vocab.json").string());
    const int64_t n = tok.vocab_size();
    FUZZ_REQUIRE(n > 0 && tok.bos_id() >= 0 && tok.bos_id() < n && tok.eos_id() >= 0 && tok.eos_id() < n);
    FUZZ_REQUIRE(tok.pad_id() >= 0 && tok.pad_id() < n);
    const std::string own(reinterpret_cast<const char*>(data), std::min<size_t>(size, 200));
    for (const std::string& text : {std::string("a photo of a cat, 2 dogs's   ball!"), own}) {
      for (int64_t id : tok.encode(text)) FUZZ_REQUIRE(id >= 0 && id < n);
      const auto [ids, mask] = tok.batch({text}, 16);
      FUZZ_REQUIRE(ids.sizes() == at::IntArrayRef({1, 16}) && mask.sizes() == ids.sizes());
      FUZZ_REQUIRE(ids[0][0].item<int64_t>() == tok.bos_id() && mask[0][0].item<bool>());
      FUZZ_REQUIRE(ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < n);
    }
  } catch (const dew::Error&) {}
  return 0;
}
