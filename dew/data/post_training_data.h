// Post-training data (docs/post_training.md): the JSON-lines files of SFT, DPO and GRPO turned into token rows for
// one model's tokenizer and chat template.
//   SFT     {"messages": [...]}                                  -> rows with a loss mask on assistant turns
//   DPO     {"prompt": P, "chosen": C, "rejected": R}            -> chosen and rejected rows with completion masks
//   prompts {"prompt": P, ...} (GRPO, evaluation; other keys such as "answer" are kept for the rewards)
// A prompt P is raw text (used as it is) or a list of messages (rendered with the template and its
// generation prompt, as TRL's conversational format). A completion C is text or a list holding one assistant
// message: for a conversational prompt it is rendered as the assistant turn through its end-of-turn marker;
// after a raw-text prompt it is the text followed by the tokenizer's EOS (when it has one).
// Every error names FILE:LINE: a line that is not JSON, a missing or mistyped field, an unknown role, an
// empty completion, a conversation without an assistant turn, or a row longer than the model's context.
//
//   dew::data::ChatFormat fmt{tok, dew::data::ChatTemplate::plain};
//   auto sft = dew::data::sft_rows("chat.jsonl", fmt, /*max_len=*/512);   // tokens, loss_mask [N, S + 1]
//   auto dpo = dew::data::preference_rows("pairs.jsonl", fmt, 512);         // ids, completion_mask [N, 2, L]
//   auto prompts = dew::data::read_prompts("prompts.jsonl", fmt, 512);    // text, ids, record
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "dew/core/options.h"
#include "dew/data/chat.h"
#include "dew/data/dataset.h"
#include "dew/data/tokenizer.h"

namespace dew::data {

/// How text reaches one model: its tokenizer and its chat template.
struct ChatFormat {
  TokenizerPtr tokenizer;
  ChatTemplate templ = ChatTemplate::plain;
  ChatRenderOptions render;  // add_generation_prompt is set where a prompt needs it
  /// What ends a generated turn: the template's end-of-turn marker (the generator's stop string).
  std::string end_of_turn() const { return chat_end_of_turn(templ); }
};

/// Calls fn(record, "FILE:LINE") for each non-blank line of a JSON-lines file; a line that is not a JSON
/// object is a dew::Error "FILE:LINE: ...". An unreadable or empty file is a dew::Error naming it (`what`
/// says what a line holds, e.g. "{\"prompt\", \"chosen\", \"rejected\"}").
void for_each_jsonl(const std::string& path, const std::string& what,
                    const std::function<void(const json& record, const std::string& where)>& fn);

/// A prompt: what the model is given and the record it came from.
struct Prompt {
  std::string text;          // as the model sees it (a conversational prompt rendered, generation prompt included)
  std::vector<int64_t> ids;  // tokenizer.encode(text, add_special = raw text)
  json record;               // the whole line (answer and other fields for the rewards)
  std::string where;         // FILE:LINE
  bool conversational = false;
};

/// The prompt of a record's "prompt" value (string or messages), checked as described at the top.
Prompt make_prompt(const json& prompt, const ChatFormat& fmt, const std::string& where);

/// The prompts of a file; each must leave room for at least one generated token within max_len.
std::vector<Prompt> read_prompts(const std::string& path, const ChatFormat& fmt, int64_t max_len);

/// The token ids of a completion of `prompt` (text or one assistant message), end marker included.
std::vector<int64_t> completion_ids(const Prompt& prompt, const json& completion, const ChatFormat& fmt,
                                    const std::string& field, const std::string& where);

/// SFT rows: {"tokens" int64 [N, S + 1], "loss_mask" bool [N, S + 1]} where S + 1 is the longest
/// conversation (each at most max_len tokens) or `min_len` if that is larger, shorter rows padded (pad id:
/// the tokenizer's pad, else EOS, else 0; padding carries no loss). With `pack`, conversations are laid end to
/// end in rows of max_len ids (none split) and the rows also carry "segment_ids" and "positions"
/// (block-diagonal attention).
Batch sft_rows(const std::string& path, const ChatFormat& fmt, int64_t max_len, bool pack = false, int64_t min_len = 0);

/// DPO rows: {"ids" int64 [N, 2, L], "completion_mask" bool [N, 2, L], "index" int64 [N]}, row 0 the chosen
/// and 1 the rejected prompt + completion, L the longest (each at most max_len), right-padded.
Batch preference_rows(const std::string& path, const ChatFormat& fmt, int64_t max_len);

/// The sums task of the post-training demo: "A+B=" -> "C" for every pair of `digits`-digit numbers, a
/// seeded shuffle holding out `test` of them. Writes into dir (created):
///   sft.jsonl           {"messages": [user "A+B=", assistant "C"]} for each training pair
///   train_prompts.jsonl {"prompt": [user "A+B="], "answer": "C"} for each training pair
///   test_prompts.jsonl  the same for the held-out pairs
/// Returns the number of training pairs.
int64_t write_sums_task(const std::string& dir, int64_t digits = 2, int64_t test = 500, uint64_t seed = 0);

}  // namespace dew::data
