// libFuzzer target for chat JSONL lines (dew/data/chat.h): one line as read_chat_jsonl reads it, parsed
// into a conversation and rendered with every chat template, with and without a generation prompt.
// SFT, DPO and GRPO data (post_training_data.cpp) read their "messages", "prompt", "chosen" and "rejected"
// values through the same record parser and renderer. Any input must either be refused with a dew::Error
// or render to a text whose assistant spans lie inside it, in order; anything else is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "dew/core/error.h"
#include "dew/data/chat.h"

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string line(reinterpret_cast<const char*>(data), size);
  dew::data::Conversation conv;
  try {
    conv = dew::data::parse_chat_record(line, "fuzz.jsonl:1");
  } catch (const dew::Error&) {
    return 0;
  }
  require(!conv.empty());
  for (dew::data::ChatTemplate t : dew::data::chat_templates()) {
    for (int variant = 0; variant < 2; ++variant) {
      dew::data::ChatRenderOptions o;
      o.add_generation_prompt = variant == 1;
      o.enable_thinking = variant == 0;
      dew::data::ChatRendering r;
      try {
        r = dew::data::render_chat(conv, t, o);
      } catch (const dew::Error&) {
        continue;  // a conversation this template cannot render (e.g. roles out of order) is refused
      }
      int64_t last = 0;
      for (const auto& s : r.assistant_spans) {
        require(s.begin >= last && s.begin <= s.end && s.end <= static_cast<int64_t>(r.text.size()));
        last = s.end;
      }
      require(dew::data::assistant_byte_mask(r).size() == r.text.size());
    }
  }
  return 0;
}
