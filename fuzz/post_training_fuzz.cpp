// libFuzzer target for the JSON-lines files of post-training (dew/data/post_training_data.cpp: sft_rows, packed
// or not, preference_rows and read_prompts, what `dew train sft|dpo|grpo` and `dew eval` read), with the byte
// tokenizer under the plain and the Qwen 2.5 chat templates. The input is written as a .jsonl file. Any input
// must either be refused with a dew::Error or give rows whose tensors agree in shape, whose masks lie on real
// tokens and whose ids are in the vocabulary; a crash, a sanitizer report or a huge allocation is a bug.
#include <ATen/ATen.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "dew/core/error.h"
#include "dew/data/post_training_data.h"
#include "fuzz/fuzz_util.h"

namespace {

const std::filesystem::path& scratch_path() {
  static const auto path = dew_fuzz::make_scratch_dir("post-training") / "data.jsonl";
  return path;
}

void check_ids(const at::Tensor& ids, int64_t vocab) {
  if (ids.numel() == 0) return;
  FUZZ_REQUIRE(ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < vocab);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dew_fuzz::write_file(scratch_path(), std::string_view(reinterpret_cast<const char*>(data), size));
  const std::string path = scratch_path().string();
  static const dew::data::TokenizerPtr tok = dew::data::load_tokenizer("byte");
  const int64_t vocab = tok->vocab_size(), max_len = 96;
  for (auto templ : {dew::data::ChatTemplate::plain, dew::data::ChatTemplate::qwen2_5}) {
    const dew::data::ChatFormat fmt{tok, templ};
    for (bool pack : {false, true}) {
      try {
        const auto rows = dew::data::sft_rows(path, fmt, max_len, pack);
        const at::Tensor& t = rows.at("tokens");
        const at::Tensor& m = rows.at("loss_mask");
        FUZZ_REQUIRE(t.dim() == 2 && t.sizes() == m.sizes() && t.size(1) <= max_len + 1);
        FUZZ_REQUIRE(m.any().item<bool>());  // every conversation has an assistant turn
        check_ids(t, vocab);
        if (pack)
          FUZZ_REQUIRE(rows.at("segment_ids").sizes() == t.sizes() && rows.at("positions").sizes() == t.sizes());
      } catch (const dew::Error&) {}
    }
    try {
      const auto rows = dew::data::preference_rows(path, fmt, max_len);
      const at::Tensor& ids = rows.at("ids");
      FUZZ_REQUIRE(ids.dim() == 3 && ids.size(1) == 2 && ids.sizes() == rows.at("completion_mask").sizes());
      FUZZ_REQUIRE(rows.at("index").numel() == ids.size(0) && ids.size(2) <= max_len);
      check_ids(ids, vocab);
    } catch (const dew::Error&) {}
    try {
      for (const auto& p : dew::data::read_prompts(path, fmt, max_len)) {
        FUZZ_REQUIRE(!p.ids.empty() && int64_t(p.ids.size()) < max_len && p.record.is_object());
        for (int64_t id : p.ids) FUZZ_REQUIRE(id >= 0 && id < vocab);
      }
    } catch (const dew::Error&) {}
  }
  return 0;
}
