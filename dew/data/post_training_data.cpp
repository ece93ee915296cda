#include "dew/data/post_training_data.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>

#include "dew/core/error.h"
#include "dew/core/rng.h"
#include "dew/io/files.h"

namespace fs = std::filesystem;

namespace dew::data {

namespace {

// Bounded: a JSONL line can nest lists hundreds of thousands deep, and json::dump() recurses per level.
std::string brief(const json& j) { return options_detail::describe(j); }

// The messages of a "prompt" value: every element {"role", "content"} as chat files have them.
Conversation messages_of(const json& value, const std::string& where, const std::string& field) {
  DEW_CHECK(value.is_array() && !value.empty(), where, ": \"", field,
            "\" must be a text or a non-empty list of {\"role\", \"content\"} messages, got ", brief(value));
  return parse_chat_messages(value, where);  // not re-rendered as text: a deep value would recurse
}

int64_t pad_of(const Tokenizer& tok) {
  if (tok.pad_id() >= 0) return tok.pad_id();
  if (tok.eos_id() >= 0) return tok.eos_id();
  return 0;
}

// Rows of different lengths right-padded into [N, L] tensors (ids with `pad`, masks with 0).
at::Tensor pad_rows(const std::vector<std::vector<int64_t>>& rows, int64_t length, int64_t pad) {
  at::Tensor out = at::full({int64_t(rows.size()), length}, pad, at::kLong);
  auto a = out.accessor<int64_t, 2>();
  for (size_t i = 0; i < rows.size(); ++i)
    for (size_t t = 0; t < rows[i].size(); ++t) a[int64_t(i)][int64_t(t)] = rows[i][t];
  return out;
}

size_t longest(const std::vector<std::vector<int64_t>>& rows) {
  size_t n = 0;
  for (const auto& r : rows) n = std::max(n, r.size());
  return n;
}

void write_lines(const fs::path& path, const std::vector<json>& lines) {
  std::ofstream f(path, std::ios::binary);
  DEW_CHECK(f.good(), "cannot write ", path.string());
  for (const auto& l : lines) f << l.dump() << "\n";
  DEW_CHECK(f.good(), "cannot write ", path.string());
}

}  // namespace

void for_each_jsonl(const std::string& path, const std::string& what,
                    const std::function<void(const json& record, const std::string& where)>& fn) {
  std::ifstream f(path, std::ios::binary);
  DEW_CHECK(f.good(), "cannot read \"", path, "\" (expected JSON lines of ", what, ")");
  std::string line;
  int64_t count = 0;
  for (int64_t number = 1; std::getline(f, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(number);
    // Bounded before parsing: records are copied and rendered per level of nesting (a line nested 10^5 deep
    // overflowed the stack).
    io::check_json_depth(line, where);
    json record;
    try {
      record = json::parse(line);
    } catch (const std::exception&) {
      fail(where, ": not JSON (expected one object ", what, " per line)");
    }
    DEW_CHECK(record.is_object(), where, ": expected a JSON object ", what, ", got ", brief(record));
    fn(record, where);
    ++count;
  }
  DEW_CHECK(count > 0, path, ": no records (expected one JSON object ", what, " per line)");
}

Prompt make_prompt(const json& prompt, const ChatFormat& fmt, const std::string& where) {
  DEW_CHECK(fmt.tokenizer, "make_prompt: no tokenizer");
  Prompt p;
  p.where = where;
  if (prompt.is_string()) {
    p.text = prompt.get<std::string>();
    DEW_CHECK(!p.text.empty(), where, ": \"prompt\" is empty");
    p.ids = fmt.tokenizer->encode(p.text, /*add_special=*/true);
  } else {
    Conversation conv = messages_of(prompt, where, "prompt");
    DEW_CHECK(conv.back().role != ChatRole::assistant, where,
              ": the prompt's messages end with an assistant turn; the completion is what the model writes");
    ChatRenderOptions o = fmt.render;
    o.add_generation_prompt = true;
    try {
      p.text = render_chat(conv, fmt.templ, o).text;
    } catch (const Error& e) {
      fail(where, ": ", e.what());
    }
    p.ids = fmt.tokenizer->encode(p.text, false);
    p.conversational = true;
  }
  DEW_CHECK(!p.ids.empty(), where, ": the prompt has no tokens");
  return p;
}

std::vector<int64_t> completion_ids(const Prompt& prompt, const json& completion, const ChatFormat& fmt,
                                    const std::string& field, const std::string& where) {
  std::string text;
  if (completion.is_string()) {
    text = completion.get<std::string>();
  } else {
    Conversation c = messages_of(completion, where, field);
    DEW_CHECK(c.size() == 1 && c[0].role == ChatRole::assistant, where, ": \"", field,
              "\" must be a text or one assistant message, got ", brief(completion));
    text = c[0].content;
  }
  DEW_CHECK(text.find_first_not_of(" \t\r\n") != std::string::npos, where, ": \"", field, "\" is an empty completion");
  std::vector<int64_t> ids;
  if (prompt.conversational) {
    // The assistant turn as the template renders it after this prompt, through its end-of-turn marker.
    Conversation conv = messages_of(prompt.record.at("prompt"), where, "prompt");
    conv.push_back({ChatRole::assistant, text});
    ChatRendering r;
    try {
      r = render_chat(conv, fmt.templ, fmt.render);
    } catch (const Error& e) {
      fail(where, ": ", e.what());
    }
    const ChatSpan last = r.assistant_spans.back();
    DEW_CHECK(r.text.compare(0, prompt.text.size(), prompt.text) == 0 && last.end > int64_t(prompt.text.size()), where,
              ": the ", chat_template_name(fmt.templ),
              " template does not render this conversation as the prompt followed by the completion");
    ids = fmt.tokenizer->encode(r.text.substr(prompt.text.size(), size_t(last.end) - prompt.text.size()), false);
  } else {
    ids = fmt.tokenizer->encode(text, false);
    if (fmt.tokenizer->eos_id() >= 0) ids.push_back(fmt.tokenizer->eos_id());
  }
  DEW_CHECK(!ids.empty(), where, ": \"", field, "\" has no tokens");
  return ids;
}

std::vector<Prompt> read_prompts(const std::string& path, const ChatFormat& fmt, int64_t max_len) {
  std::vector<Prompt> out;
  for_each_jsonl(path, "{\"prompt\": text or messages, ...}", [&](const json& r, const std::string& where) {
    DEW_CHECK(r.contains("prompt"), where, ": no \"prompt\" (text or messages)");
    Prompt p = make_prompt(r["prompt"], fmt, where);
    p.record = r;
    DEW_CHECK(int64_t(p.ids.size()) < max_len, where, ": the prompt is ", p.ids.size(),
              " tokens, which leaves no room to generate within the model's context of ", max_len);
    out.push_back(std::move(p));
  });
  return out;
}

Batch sft_rows(const std::string& path, const ChatFormat& fmt, int64_t max_len, bool pack, int64_t min_len) {
  DEW_CHECK(max_len >= 2, "sft_rows: max_len must be >= 2, got ", max_len);
  std::vector<std::vector<int64_t>> ids, masks;
  for_each_jsonl(
      path, "{\"messages\": [...]} or {\"prompt\", \"completion\"}", [&](const json& r, const std::string& where) {
        std::vector<int64_t> row, mask;
        if (r.contains("messages")) {
          Conversation conv = parse_chat_messages(r["messages"], where);  // in place: no copy of the record
          bool any = false;
          for (const auto& m : conv) any = any || m.role == ChatRole::assistant;
          DEW_CHECK(any, where, ": no assistant message (nothing to learn)");
          for (const auto& m : conv)
            DEW_CHECK(m.role != ChatRole::assistant || m.content.find_first_not_of(" \t\r\n") != std::string::npos,
                      where, ": an empty assistant message");
          ChatTokens t;
          try {
            t = tokenize_chat(*fmt.tokenizer, render_chat(conv, fmt.templ, fmt.render));
          } catch (const Error& e) {
            fail(where, ": ", e.what());
          }
          row = t.ids;
          mask.assign(t.mask.begin(), t.mask.end());
        } else {
          DEW_CHECK(r.contains("prompt") && r.contains("completion"), where,
                    ": expected \"messages\" or \"prompt\" and \"completion\"");
          Prompt p = make_prompt(r["prompt"], fmt, where);
          p.record = r;
          auto c = completion_ids(p, r["completion"], fmt, "completion", where);
          row = p.ids;
          row.insert(row.end(), c.begin(), c.end());
          mask.assign(p.ids.size(), 0);
          mask.insert(mask.end(), c.size(), 1);
        }
        DEW_CHECK(int64_t(row.size()) <= max_len, where, ": the conversation is ", row.size(),
                  " tokens, longer than the model's context of ", max_len);
        DEW_CHECK(row.size() >= 2, where, ": the conversation has ", row.size(), " token (at least 2 are needed)");
        ids.push_back(std::move(row));
        masks.push_back(std::move(mask));
      });
  const int64_t pad = pad_of(*fmt.tokenizer);
  Batch b;
  if (!pack) {
    const int64_t len = std::max(int64_t(longest(ids)), std::min(min_len, max_len));
    b["tokens"] = pad_rows(ids, len, pad);
    b["loss_mask"] = pad_rows(masks, len, 0).to(at::kBool);
    return b;
  }
  // First fit in file order: each conversation goes into the current row if it fits, else starts a new one.
  std::vector<std::vector<int64_t>> rows, row_masks, segs, poss;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (rows.empty() || rows.back().size() + ids[i].size() > size_t(max_len)) {
      rows.emplace_back();
      row_masks.emplace_back();
      segs.emplace_back();
      poss.emplace_back();
    }
    const int64_t seg = segs.back().empty() ? 0 : segs.back().back() + 1;
    for (size_t t = 0; t < ids[i].size(); ++t) {
      rows.back().push_back(ids[i][t]);
      row_masks.back().push_back(masks[i][t]);
      segs.back().push_back(seg);
      poss.back().push_back(int64_t(t));
    }
  }
  for (size_t r = 0; r < rows.size(); ++r) {  // the tail: its own segment, no loss
    const int64_t seg = segs[r].back() + 1;
    for (int64_t t = 0; int64_t(rows[r].size()) < max_len; ++t) {
      rows[r].push_back(pad);
      row_masks[r].push_back(0);
      segs[r].push_back(seg);
      poss[r].push_back(t);
    }
  }
  b["tokens"] = pad_rows(rows, max_len, pad);
  b["loss_mask"] = pad_rows(row_masks, max_len, 0).to(at::kBool);
  b["segment_ids"] = pad_rows(segs, max_len, 0);
  b["positions"] = pad_rows(poss, max_len, 0);
  return b;
}

Batch preference_rows(const std::string& path, const ChatFormat& fmt, int64_t max_len) {
  std::vector<std::vector<int64_t>> ids, masks;
  for_each_jsonl(path, "{\"prompt\", \"chosen\", \"rejected\"}", [&](const json& r, const std::string& where) {
    for (const char* k : {"prompt", "chosen", "rejected"}) DEW_CHECK(r.contains(k), where, ": no \"", k, "\"");
    Prompt p = make_prompt(r["prompt"], fmt, where);
    p.record = r;
    for (const char* k : {"chosen", "rejected"}) {
      auto c = completion_ids(p, r[k], fmt, k, where);
      std::vector<int64_t> row = p.ids, mask(p.ids.size(), 0);
      row.insert(row.end(), c.begin(), c.end());
      mask.insert(mask.end(), c.size(), 1);
      DEW_CHECK(int64_t(row.size()) <= max_len, where, ": prompt and ", k, " are ", row.size(),
                " tokens, longer than the model's context of ", max_len);
      ids.push_back(std::move(row));
      masks.push_back(std::move(mask));
    }
  });
  const int64_t n = int64_t(ids.size()) / 2, len = int64_t(longest(ids));
  Batch b;
  b["ids"] = pad_rows(ids, len, pad_of(*fmt.tokenizer)).view({n, 2, len});
  b["completion_mask"] = pad_rows(masks, len, 0).to(at::kBool).view({n, 2, len});
  b["index"] = at::arange(n, at::kLong);
  return b;
}

int64_t write_sums_task(const std::string& dir, int64_t digits, int64_t test, uint64_t seed) {
  DEW_CHECK(digits >= 1 && digits <= 4, "sums task: digits must be in [1, 4], got ", digits);
  int64_t lo = 1;
  for (int64_t i = 1; i < digits; ++i) lo *= 10;
  const int64_t hi = lo * 10 - 1, span = hi - (digits == 1 ? 0 : lo) + 1, first = digits == 1 ? 0 : lo;
  const int64_t total = span * span;
  DEW_CHECK(test >= 1 && test < total, "sums task: test must be in [1, ", total - 1, "], got ", test);
  at::Tensor order = at::randperm(total, rng::generator(seed, 0, "sums_task"), at::kLong);
  auto o = order.accessor<int64_t, 1>();
  std::vector<json> sft, train, held;
  for (int64_t k = 0; k < total; ++k) {
    const int64_t a = first + o[k] / span, b = first + o[k] % span;
    const std::string q = std::to_string(a) + "+" + std::to_string(b) + "=", ans = std::to_string(a + b);
    const json user = {{"role", "user"}, {"content", q}};
    json prompt = {{"prompt", json::array({user})}, {"answer", ans}};
    if (k < test) {
      held.push_back(prompt);
    } else {
      train.push_back(prompt);
      sft.push_back({{"messages", json::array({user, {{"role", "assistant"}, {"content", ans}}})}});
    }
  }
  fs::create_directories(dir);
  write_lines(fs::path(dir) / "sft.jsonl", sft);
  write_lines(fs::path(dir) / "train_prompts.jsonl", train);
  write_lines(fs::path(dir) / "test_prompts.jsonl", held);
  return int64_t(train.size());
}

}  // namespace dew::data
