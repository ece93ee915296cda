// Chat JSON lines and the native renderers of the chat templates (dew/data/chat.h). Each renderer follows
// its Jinja template statement by statement; the comments quote what they reproduce. The Jinja texts and
// their recognition are in chat_templates.cpp.
#include "dew/data/chat.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <utility>

#include "dew/core/error.h"
#include "dew/core/strings.h"
#include "dew/data/tokenizer.h"
#include "dew/io/files.h"

namespace dew {
namespace data {
namespace {

using nlohmann::json;

const char* const kRoleNames[] = {"system", "user", "assistant", "tool", "developer"};
const char* const kRoleList = "system, user, assistant, tool, developer";

// ---- the Python string operations the templates call ----

/// Python's str.isspace() for one code point (what str.strip() and Jinja's `trim` remove).
bool py_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

/// The code point of the UTF-8 sequence at s[i] and its length; an invalid sequence is one unit of length
/// 1 with no code point (0xFFFFFFFF, never whitespace).
std::pair<uint32_t, size_t> utf8_at(const std::string& s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return {c, 1};
  size_t n = c >= 0xF0 && c < 0xF8 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 && c < 0xE0 ? 2 : 0;
  if (c >= 0xF8) n = 0;
  if (n == 0 || i + n > s.size()) return {0xFFFFFFFFu, 1};
  uint32_t cp = c & (n == 2 ? 0x1F : n == 3 ? 0x0F : 0x07);
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xC0) != 0x80) return {0xFFFFFFFFu, 1};
    cp = (cp << 6) | (b(i + k) & 0x3F);
  }
  return {cp, n};
}

/// Python's s.strip() (Jinja's `| trim`): Unicode whitespace removed at both ends.
std::string py_strip(const std::string& s) {
  size_t begin = s.size(), end = 0;
  for (size_t i = 0; i < s.size();) {
    auto [cp, n] = utf8_at(s, i);
    if (!py_space(cp)) {
      if (begin == s.size()) begin = i;
      end = i + n;
    }
    i += n;
  }
  return begin >= end ? std::string() : s.substr(begin, end - begin);
}

std::string lstrip_newlines(const std::string& s) {  // s.lstrip('\n')
  const size_t b = s.find_first_not_of('\n');
  return b == std::string::npos ? std::string() : s.substr(b);
}

std::string rstrip_newlines(const std::string& s) {  // s.rstrip('\n')
  const size_t e = s.find_last_not_of('\n');
  return e == std::string::npos ? std::string() : s.substr(0, e + 1);
}

std::string strip_newlines(const std::string& s) { return lstrip_newlines(rstrip_newlines(s)); }  // s.strip('\n')

/// json.dumps(s, ensure_ascii=False): transformers' `tojson` filter on a string.
std::string py_json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

// ---- rendering ----

/// The output of a renderer: text plus the spans of the assistant turns.
struct Out {
  ChatRendering r;
  int64_t open = -1;
  void add(const std::string& s) { r.text += s; }
  void begin_assistant() { open = static_cast<int64_t>(r.text.size()); }
  void end_assistant() {  // after the end-of-turn marker
    r.assistant_spans.push_back({open, static_cast<int64_t>(r.text.size())});
    open = -1;
  }
};

bool is(const ChatMessage& m, ChatRole r) { return m.role == r; }
std::string role(const ChatMessage& m) { return chat_role_name(m.role); }

// Meta-Llama-3-8B-Instruct:
//   {% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] +
//   '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content
//   = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{
//   '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}
void render_llama3(const Conversation& conv, const ChatRenderOptions& o, Out& out) {
  for (size_t i = 0; i < conv.size(); ++i) {
    if (i == 0) out.add("<|begin_of_text|>");
    out.add("<|start_header_id|>" + role(conv[i]) + "<|end_header_id|>\n\n");
    if (is(conv[i], ChatRole::assistant)) out.begin_assistant();
    out.add(py_strip(conv[i].content) + "<|eot_id|>");
    if (is(conv[i], ChatRole::assistant)) out.end_assistant();
  }
  if (o.add_generation_prompt) out.add("<|start_header_id|>assistant<|end_header_id|>\n\n");
}

// Llama-3.1-8B-Instruct without tools: bos; the first system message trimmed goes into a system header
// after "Cutting Knowledge Date: December 2023\nToday Date: " + date_string + "\n\n" (always written);
// tool (and ipython) messages are "<|start_header_id|>ipython<|end_header_id|>\n\n" + content | tojson
// (a string "is iterable" in Jinja, so it is written as a JSON string) + "<|eot_id|>"; the others as Llama 3.
void render_llama3_1(const Conversation& conv, const ChatRenderOptions& o, Out& out) {
  size_t first = 0;
  std::string system;
  if (is(conv[0], ChatRole::system)) {
    system = py_strip(conv[0].content);
    first = 1;
  }
  out.add("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n");
  out.add("Cutting Knowledge Date: December 2023\nToday Date: " + o.date_string + "\n\n");
  out.add(system + "<|eot_id|>");
  for (size_t i = first; i < conv.size(); ++i) {
    const ChatMessage& m = conv[i];
    if (is(m, ChatRole::tool)) {
      out.add("<|start_header_id|>ipython<|end_header_id|>\n\n" + py_json_string(m.content) + "<|eot_id|>");
      continue;
    }
    out.add("<|start_header_id|>" + role(m) + "<|end_header_id|>\n\n");
    if (is(m, ChatRole::assistant)) out.begin_assistant();
    out.add(py_strip(m.content) + "<|eot_id|>");
    if (is(m, ChatRole::assistant)) out.end_assistant();
  }
  if (o.add_generation_prompt) out.add("<|start_header_id|>assistant<|end_header_id|>\n\n");
}

// Qwen's tool branch (both templates): consecutive tool messages share one user turn.
//   {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
//   {{- '\n<tool_response>\n' }}{{- content }}{{- '\n</tool_response>' }}
//   {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
void qwen_tool(const Conversation& conv, size_t i, Out& out) {
  if (i == 0 || !is(conv[i - 1], ChatRole::tool)) out.add("<|im_start|>user");
  out.add("\n<tool_response>\n" + conv[i].content + "\n</tool_response>");
  if (i + 1 == conv.size() || !is(conv[i + 1], ChatRole::tool)) out.add("<|im_end|>\n");
}

// Qwen2.5-7B-Instruct without tools: the first message's system turn, or the default one; user, later
// system and assistant messages as '<|im_start|>' + role + '\n' + content + '<|im_end|>\n'; tool as above.
void render_qwen2_5(const Conversation& conv, const ChatRenderOptions& o, Out& out) {
  if (is(conv[0], ChatRole::system)) out.add("<|im_start|>system\n" + conv[0].content + "<|im_end|>\n");
  else out.add("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n");
  for (size_t i = 0; i < conv.size(); ++i) {
    const ChatMessage& m = conv[i];
    if (is(m, ChatRole::tool)) {
      qwen_tool(conv, i, out);
    } else if (is(m, ChatRole::user) || (is(m, ChatRole::system) && i > 0) || is(m, ChatRole::assistant)) {
      out.add("<|im_start|>" + role(m) + "\n");
      if (is(m, ChatRole::assistant)) out.begin_assistant();
      out.add(m.content + "<|im_end|>");
      if (is(m, ChatRole::assistant)) out.end_assistant();
      out.add("\n");
    }
  }
  if (o.add_generation_prompt) out.add("<|im_start|>assistant\n");
}

// Qwen3 without tools. The last "query" is the last user message that is not a bare
// <tool_response>...</tool_response>. An assistant content holding "</think>" splits into
//   reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
//   content   = content.split('</think>')[-1].lstrip('\n')
// An assistant turn after the last query that is the last message or has reasoning is written
//   '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n')
// any other as '<|im_start|>assistant\n' + content (its reasoning dropped); then '<|im_end|>\n'.
// The generation prompt is '<|im_start|>assistant\n', + '<think>\n\n</think>\n\n' when enable_thinking is false.
void render_qwen3(const Conversation& conv, const ChatRenderOptions& o, Out& out) {
  if (is(conv[0], ChatRole::system)) out.add("<|im_start|>system\n" + conv[0].content + "<|im_end|>\n");
  const size_t n = conv.size();
  size_t last_query = n - 1;
  for (size_t k = n; k-- > 0;) {
    const std::string& c = conv[k].content;
    if (is(conv[k], ChatRole::user) && !(starts_with(c, "<tool_response>") && ends_with(c, "</tool_response>"))) {
      last_query = k;
      break;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const ChatMessage& m = conv[i];
    if (is(m, ChatRole::user) || (is(m, ChatRole::system) && i > 0)) {
      out.add("<|im_start|>" + role(m) + "\n" + m.content + "<|im_end|>\n");
    } else if (is(m, ChatRole::assistant)) {
      std::string content = m.content, reasoning;
      const size_t close = content.find("</think>");
      if (close != std::string::npos) {
        std::string before = rstrip_newlines(content.substr(0, close));
        const size_t open = before.rfind("<think>");
        reasoning = lstrip_newlines(open == std::string::npos ? before : before.substr(open + 7));
        content = lstrip_newlines(content.substr(content.rfind("</think>") + 8));
      }
      out.add("<|im_start|>assistant\n");
      out.begin_assistant();
      if (i > last_query && (i + 1 == n || !reasoning.empty()))
        out.add("<think>\n" + strip_newlines(reasoning) + "\n</think>\n\n" + lstrip_newlines(content));
      else out.add(content);
      out.add("<|im_end|>");
      out.end_assistant();
      out.add("\n");
    } else if (is(m, ChatRole::tool)) {
      qwen_tool(conv, i, out);
    }
  }
  if (o.add_generation_prompt) {
    out.add("<|im_start|>assistant\n");
    if (!o.enable_thinking) out.add("<think>\n\n</think>\n\n");
  }
}

// gemma-3-*-it with string contents: bos; a first system message becomes content + '\n\n' in front of the
// first turn's text; the rest must alternate user/assistant starting with user; each turn is
// '<start_of_turn>' + (assistant -> 'model', else the role) + '\n' + content | trim + '<end_of_turn>\n'.
void render_gemma3(const Conversation& conv, const ChatRenderOptions& o, Out& out) {
  out.add("<bos>");
  size_t first = 0;
  std::string prefix;
  if (is(conv[0], ChatRole::system)) {
    prefix = conv[0].content + "\n\n";
    first = 1;
  }
  for (size_t i = first; i < conv.size(); ++i) {
    const ChatMessage& m = conv[i];
    const size_t k = i - first;
    DEW_CHECK(is(m, ChatRole::user) == (k % 2 == 0), "gemma3 chat template: message ", i, " is ", role(m),
              ": conversation roles must alternate user/assistant/user/assistant/... (after an optional system "
              "message), as the template requires");
    const bool assistant = is(m, ChatRole::assistant);
    out.add("<start_of_turn>" + (assistant ? std::string("model") : role(m)) + "\n" + (k == 0 ? prefix : ""));
    if (assistant) out.begin_assistant();
    out.add(py_strip(m.content) + "<end_of_turn>");
    if (assistant) out.end_assistant();
    out.add("\n");
  }
  if (o.add_generation_prompt) out.add("<start_of_turn>model\n");
}

// Dew's plain template: '<|' + role + '|>\n' + content + '<|end|>\n' per message.
void render_plain(const Conversation& conv, const ChatRenderOptions& o, Out& out) {
  for (const ChatMessage& m : conv) {
    out.add("<|" + role(m) + "|>\n");
    if (is(m, ChatRole::assistant)) out.begin_assistant();
    out.add(m.content + "<|end|>");
    if (is(m, ChatRole::assistant)) out.end_assistant();
    out.add("\n");
  }
  if (o.add_generation_prompt) out.add("<|assistant|>\n");
}

}  // namespace

const char* chat_role_name(ChatRole r) { return kRoleNames[static_cast<int>(r)]; }

ChatRole parse_chat_role(const std::string& name) {
  for (int i = 0; i < 5; ++i)
    if (name == kRoleNames[i]) return static_cast<ChatRole>(i);
  fail("unknown chat role \"", name, "\" (accepted: ", kRoleList, ")");
}

Conversation parse_chat_record(const std::string& json_text, const std::string& where) {
  json j;
  io::check_json_depth(json_text, where);
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    fail(where, ": not a JSON object (", e.what(), ")");
  }
  DEW_CHECK(j.is_object(), where, ": expected a JSON object {\"messages\": [...]}, got ", j.type_name());
  auto it = j.find("messages");
  DEW_CHECK(it != j.end(), where,
            ": no \"messages\" key (expected {\"messages\": [{\"role\": ..., \"content\": ...}]})");
  return parse_chat_messages(*it, where);
}

Conversation parse_chat_messages(const nlohmann::json& messages, const std::string& where) {
  DEW_CHECK(messages.is_array(), where, ": \"messages\" must be an array, got ", messages.type_name());
  DEW_CHECK(!messages.empty(), where, ": \"messages\" is empty (a conversation needs at least one message)");
  Conversation conv;
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    DEW_CHECK(m.is_object(), where, ": messages[", i, "] must be an object {\"role\", \"content\"}, got ",
              m.type_name());
    auto r = m.find("role");
    DEW_CHECK(r != m.end() && r->is_string(), where, ": messages[", i, "] needs a string \"role\" (one of ", kRoleList,
              ")");
    const std::string name = r->get<std::string>();
    bool known = false;
    for (const char* k : kRoleNames) known = known || name == k;
    DEW_CHECK(known, where, ": messages[", i, "].role \"", name, "\" is not a chat role (accepted: ", kRoleList, ")");
    auto c = m.find("content");
    DEW_CHECK(c != m.end(), where, ": messages[", i, "] (", name, ") has no \"content\"");
    DEW_CHECK(c->is_string(), where, ": messages[", i, "].content must be a string, got ", c->type_name());
    conv.push_back({parse_chat_role(name), c->get<std::string>()});
  }
  return conv;
}

std::vector<Conversation> read_chat_jsonl(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DEW_CHECK(f.good(), "chat data: cannot read \"", path, "\"");
  std::vector<Conversation> out;
  std::string line;
  for (int64_t number = 1; std::getline(f, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    out.push_back(parse_chat_record(line, path + ":" + std::to_string(number)));
  }
  DEW_CHECK(!out.empty(), path, ": no conversations (expected one {\"messages\": [...]} object per line)");
  return out;
}

const char* chat_template_name(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::llama3: return "llama3";
    case ChatTemplate::llama3_1: return "llama3.1";
    case ChatTemplate::qwen2_5: return "qwen2.5";
    case ChatTemplate::qwen3: return "qwen3";
    case ChatTemplate::gemma3: return "gemma3";
    case ChatTemplate::plain: return "plain";
  }
  fail("unknown chat template id ", static_cast<int>(t));
}

const std::vector<ChatTemplate>& chat_templates() {
  static const std::vector<ChatTemplate> all = {ChatTemplate::llama3, ChatTemplate::llama3_1, ChatTemplate::qwen2_5,
                                                ChatTemplate::qwen3,  ChatTemplate::gemma3,   ChatTemplate::plain};
  return all;
}

ChatTemplate parse_chat_template(const std::string& name) {
  std::string names;
  for (ChatTemplate t : chat_templates()) {
    if (name == chat_template_name(t)) return t;
    names += (names.empty() ? "" : ", ") + std::string(chat_template_name(t));
  }
  fail("unknown chat template \"", name, "\" (accepted: ", names, ")");
}

const char* chat_end_of_turn(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::llama3:
    case ChatTemplate::llama3_1: return "<|eot_id|>";
    case ChatTemplate::qwen2_5:
    case ChatTemplate::qwen3: return "<|im_end|>";
    case ChatTemplate::gemma3: return "<end_of_turn>";
    case ChatTemplate::plain: return "<|end|>";
  }
  fail("unknown chat template id ", static_cast<int>(t));
}

ChatRendering render_chat(const Conversation& conv, ChatTemplate t, const ChatRenderOptions& o) {
  DEW_CHECK(!conv.empty(), chat_template_name(t), " chat template: the conversation is empty");
  if (t == ChatTemplate::qwen2_5 || t == ChatTemplate::qwen3)
    for (size_t i = 0; i < conv.size(); ++i)
      DEW_CHECK(!is(conv[i], ChatRole::developer), chat_template_name(t), " chat template: message ", i,
                " has role developer, which this template has no place for (its Jinja drops such a message "
                "silently); use system or user");
  Out out;
  switch (t) {
    case ChatTemplate::llama3: render_llama3(conv, o, out); break;
    case ChatTemplate::llama3_1: render_llama3_1(conv, o, out); break;
    case ChatTemplate::qwen2_5: render_qwen2_5(conv, o, out); break;
    case ChatTemplate::qwen3: render_qwen3(conv, o, out); break;
    case ChatTemplate::gemma3: render_gemma3(conv, o, out); break;
    case ChatTemplate::plain: render_plain(conv, o, out); break;
  }
  return std::move(out.r);
}

std::vector<uint8_t> assistant_byte_mask(const ChatRendering& r) {
  std::vector<uint8_t> mask(r.text.size(), 0);
  for (const ChatSpan& s : r.assistant_spans) {
    DEW_CHECK(0 <= s.begin && s.begin <= s.end && s.end <= static_cast<int64_t>(r.text.size()), "assistant span [",
              s.begin, ", ", s.end, ") is outside the rendered text of ", r.text.size(), " bytes");
    for (int64_t i = s.begin; i < s.end; ++i) mask[i] = 1;
  }
  return mask;
}

ChatTokens tokenize_chat(const Tokenizer& tok, const ChatRendering& r) {
  const std::vector<uint8_t> bytes = assistant_byte_mask(r);
  std::vector<int64_t> masked_before(bytes.size() + 1, 0);  // masked bytes in [0, i)
  for (size_t i = 0; i < bytes.size(); ++i) masked_before[i + 1] = masked_before[i] + bytes[i];
  ChatTokens out;
  out.ids = tok.encode(r.text, false);
  out.mask.reserve(out.ids.size());
  size_t pos = 0;
  for (size_t k = 0; k < out.ids.size(); ++k) {
    const std::string piece = tok.decode({out.ids[k]}, false);
    DEW_CHECK(r.text.compare(pos, piece.size(), piece) == 0, "tokenize_chat: the ", tok.name(), " tokenizer's token ",
              k, " (id ", out.ids[k], ") does not spell the text at byte ", pos,
              " when decoded alone, so its byte offsets are unknown; assistant masks need the byte tokenizer or a "
              "byte-level BPE tokenizer.json");
    out.mask.push_back(masked_before[pos + piece.size()] > masked_before[pos] ? 1 : 0);
    pos += piece.size();
  }
  DEW_CHECK(pos == r.text.size(), "tokenize_chat: the ", tok.name(), " tokenizer's tokens spell ", pos,
            " of the text's ", r.text.size(),
            " bytes; assistant masks need the byte tokenizer or a byte-level BPE tokenizer.json");
  return out;
}

}  // namespace data
}  // namespace dew
