// Chat data and templates (dew/data/chat.h): the native renderers against the real Jinja renderings in
// tests/golden/chat/renderings.json (tests/golden/chat_reference.py), the assistant spans, the recognition
// of the committed template texts, and the errors of bad JSON-lines files.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "dew/data/chat.h"
#include "dew/data/tokenizer.h"
#include "dew/data/tokenizer_detail.h"
#include "tests/test_util.h"

namespace {

namespace fs = std::filesystem;
using dew::data::ChatRole;
using dew::data::ChatTemplate;
using dew::data::Conversation;
using nlohmann::json;

const std::string kGoldenDir = std::string(DEW_SOURCE_DIR) + "/tests/golden/chat";

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

const json& golden() {
  static const json g = json::parse(slurp(kGoldenDir + "/renderings.json"));
  return g;
}

/// "qwen3@2504" renders as qwen3.
ChatTemplate template_of(const std::string& variant) {
  return dew::data::parse_chat_template(variant.substr(0, variant.find('@')));
}

Conversation conversation_of(const json& messages) {
  Conversation c;
  for (const auto& m : messages)
    c.push_back({dew::data::parse_chat_role(m["role"].get<std::string>()), m["content"].get<std::string>()});
  return c;
}

dew::data::ChatRenderOptions options_of(const json& tc) {
  dew::data::ChatRenderOptions o;
  o.add_generation_prompt = tc["add_generation_prompt"].get<bool>();
  const json& kw = tc["kwargs"];
  if (kw.contains("enable_thinking")) o.enable_thinking = kw["enable_thinking"].get<bool>();
  if (kw.contains("date_string")) o.date_string = kw["date_string"].get<std::string>();
  return o;
}

std::string label(const json& tc) { return tc["name"].get<std::string>() + " / " + tc["template"].get<std::string>(); }

TEST(ChatGolden, EveryRenderingIsByteExact) {
  int rendered = 0, raised = 0;
  for (const auto& tc : golden()["cases"]) {
    const Conversation conv = conversation_of(tc["messages"]);
    const ChatTemplate t = template_of(tc["template"].get<std::string>());
    if (tc.contains("error")) {
      // The template raises (Gemma 3's alternation rule): Dew refuses the same conversations.
      const std::string err = dew::test::error_of([&] { dew::data::render_chat(conv, t, options_of(tc)); });
      EXPECT_NE(err.find("must alternate user/assistant/user/assistant/..."), std::string::npos)
          << label(tc) << ": " << err;
      ++raised;
      continue;
    }
    const auto r = dew::data::render_chat(conv, t, options_of(tc));
    EXPECT_EQ(r.text, tc["expected"].get<std::string>()) << label(tc);
    ++rendered;
  }
  std::printf("  %d renderings byte-exact, %d refused as the template refuses them\n", rendered, raised);
  EXPECT_GE(rendered, 80);
  EXPECT_EQ(raised, 3);
}

TEST(ChatGolden, CoversEveryTemplateAndOption) {
  std::set<std::string> variants, thinking;
  bool prompt = false, no_prompt = false, non_ascii = false;
  for (const auto& tc : golden()["cases"]) {
    variants.insert(tc["template"].get<std::string>());
    prompt = prompt || tc["add_generation_prompt"].get<bool>();
    no_prompt = no_prompt || !tc["add_generation_prompt"].get<bool>();
    if (tc["kwargs"].contains("enable_thinking")) thinking.insert(tc["kwargs"]["enable_thinking"].dump());
    non_ascii = non_ascii || tc["messages"].dump(-1, ' ', false).find("日本語") != std::string::npos;
  }
  EXPECT_EQ(variants,
            (std::set<std::string>{"llama3", "llama3.1", "qwen2.5", "qwen3", "qwen3@2504", "gemma3", "plain"}));
  EXPECT_EQ(thinking, (std::set<std::string>{"true", "false"}));
  EXPECT_TRUE(prompt && no_prompt && non_ascii);
}

/// Python's str.isspace for the ASCII whitespace the goldens' assistant contents use.
bool ascii_space(const std::string& s) { return s.find_first_not_of(" \t\n\r\f\v") == std::string::npos; }

TEST(ChatSpans, CoverEachAssistantContentAndItsEndMarker) {
  int spans = 0;
  for (const auto& tc : golden()["cases"]) {
    if (tc.contains("error")) continue;
    const Conversation conv = conversation_of(tc["messages"]);
    const ChatTemplate t = template_of(tc["template"].get<std::string>());
    const auto r = dew::data::render_chat(conv, t, options_of(tc));
    const std::string marker = dew::data::chat_end_of_turn(t);
    const std::string header = t == ChatTemplate::llama3 || t == ChatTemplate::llama3_1
                                   ? "<|start_header_id|>assistant<|end_header_id|>\n\n"
                               : t == ChatTemplate::gemma3 ? "<start_of_turn>model\n"
                               : t == ChatTemplate::plain  ? "<|assistant|>\n"
                                                           : "<|im_start|>assistant\n";
    std::vector<const dew::data::ChatMessage*> assistants;
    for (const auto& m : conv)
      if (m.role == ChatRole::assistant) assistants.push_back(&m);
    ASSERT_EQ(r.assistant_spans.size(), assistants.size()) << label(tc);
    int64_t previous_end = 0;
    for (size_t k = 0; k < assistants.size(); ++k) {
      const auto s = r.assistant_spans[k];
      ASSERT_LE(previous_end, s.begin - static_cast<int64_t>(header.size())) << label(tc);
      ASSERT_LE(s.begin + static_cast<int64_t>(marker.size()), s.end) << label(tc);
      ASSERT_LE(s.end, static_cast<int64_t>(r.text.size())) << label(tc);
      previous_end = s.end;
      // The span starts right after the assistant header and ends with the end-of-turn marker.
      EXPECT_EQ(r.text.substr(s.begin - header.size(), header.size()), header) << label(tc) << " span " << k;
      const std::string inside = r.text.substr(s.begin, s.end - s.begin);
      ASSERT_EQ(inside.substr(inside.size() - marker.size()), marker) << label(tc) << " span " << k;
      const std::string body = inside.substr(0, inside.size() - marker.size());
      const std::string& content = assistants[k]->content;
      if (t == ChatTemplate::qwen3 &&
          (body.rfind("<think>\n", 0) == 0 || content.find("</think>") != std::string::npos)) {
        // Qwen3 rewrites a turn's reasoning: what follows the last </think> ends the body.
        const std::string tail =
            content.substr(content.find("</think>") == std::string::npos ? 0 : content.rfind("</think>") + 8);
        const size_t cut = tail.find_first_not_of('\n');
        const std::string answer = cut == std::string::npos ? "" : tail.substr(cut);
        ASSERT_GE(body.size(), answer.size()) << label(tc);
        EXPECT_EQ(body.substr(body.size() - answer.size()), answer) << label(tc) << " span " << k;
        if (body.rfind("<think>\n", 0) == 0) {
          EXPECT_NE(body.find("\n</think>\n\n"), std::string::npos) << label(tc);
        }
      } else if (t == ChatTemplate::llama3 || t == ChatTemplate::llama3_1 || t == ChatTemplate::gemma3) {
        // Trimmed: the body is the content less its whitespace at both ends.
        const size_t at = content.find(body);
        ASSERT_NE(at, std::string::npos) << label(tc) << " span " << k;
        EXPECT_TRUE(ascii_space(content.substr(0, at)) && ascii_space(content.substr(at + body.size()))) << label(tc);
        EXPECT_TRUE(body.empty() || (!ascii_space(body.substr(0, 1)) && !ascii_space(body.substr(body.size() - 1))));
      } else {
        EXPECT_EQ(body, content) << label(tc) << " span " << k;  // written as it is
      }
      ++spans;
    }
  }
  std::printf("  %d assistant spans checked\n", spans);
  EXPECT_GE(spans, 90);
}

TEST(ChatSpans, ByteMaskAndByteTokenizerMask) {
  Conversation conv = {{ChatRole::user, "2+2?"}, {ChatRole::assistant, "4 🙂"}, {ChatRole::user, "ok"}};
  const auto r = dew::data::render_chat(conv, ChatTemplate::plain);
  EXPECT_EQ(r.text, "<|user|>\n2+2?<|end|>\n<|assistant|>\n4 🙂<|end|>\n<|user|>\nok<|end|>\n");
  const auto mask = dew::data::assistant_byte_mask(r);
  ASSERT_EQ(mask.size(), r.text.size());
  std::string masked;
  for (size_t i = 0; i < mask.size(); ++i)
    if (mask[i]) masked += r.text[i];
  EXPECT_EQ(masked, "4 🙂<|end|>");
  // The byte tokenizer: one id per byte, so the token mask is the byte mask.
  auto tok = dew::data::load_tokenizer("byte");
  const auto t = dew::data::tokenize_chat(*tok, r);
  ASSERT_EQ(t.ids.size(), r.text.size());
  for (size_t i = 0; i < t.ids.size(); ++i) EXPECT_EQ(t.ids[i], static_cast<unsigned char>(r.text[i]));
  EXPECT_EQ(t.mask, mask);
}

TEST(ChatSpans, ByteLevelBpeTokenMask) {
  // A byte-level tokenizer.json with no merges and ChatML's markers as added tokens.
  dew::test::TempDir dir("chat_bpe");
  json vocab = json::object();
  const auto& b2u = dew::data::detail::byte_to_unicode();
  for (int b = 0; b < 256; ++b) vocab[b2u[b]] = b;
  auto added = [](int64_t id, const std::string& s) {
    return json{{"id", id},        {"content", s},        {"single_word", false}, {"lstrip", false},
                {"rstrip", false}, {"normalized", false}, {"special", true}};
  };
  json bl = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  json file = {{"version", "1.0"},
               {"added_tokens", json::array({added(256, "<|im_start|>"), added(257, "<|im_end|>")})},
               {"normalizer", nullptr},
               {"pre_tokenizer", bl},
               {"post_processor", nullptr},
               {"decoder", bl},
               {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}, {"unk_token", nullptr}}}};
  std::ofstream(dir.file("tokenizer.json")) << file.dump();
  auto tok = dew::data::load_tokenizer(dir.file("tokenizer.json"));

  Conversation conv = {{ChatRole::system, "sys"}, {ChatRole::user, "hi"}, {ChatRole::assistant, "yo é"}};
  const auto r = dew::data::render_chat(conv, ChatTemplate::qwen2_5);
  const auto t = dew::data::tokenize_chat(*tok, r);
  EXPECT_EQ(t.ids, tok->encode(r.text));
  std::vector<int64_t> masked;
  for (size_t i = 0; i < t.ids.size(); ++i)
    if (t.mask[i]) masked.push_back(t.ids[i]);
  std::vector<int64_t> want = tok->encode("yo é");
  want.push_back(257);  // <|im_end|>
  EXPECT_EQ(masked, want);
  // Three <|im_end|> in the text, only the assistant's is in the mask.
  EXPECT_EQ(std::count(t.ids.begin(), t.ids.end(), 257), 3);
}

TEST(ChatSpans, TokenizerWithoutByteOffsetsIsRefused) {
  const std::string model = std::string(DEW_SOURCE_DIR) + "/tests/data/fixtures/sp_bpe.model";
  auto tok = dew::data::load_tokenizer(model);
  const auto r = dew::data::render_chat({{ChatRole::user, "hello world"}, {ChatRole::assistant, "the end of it"}},
                                        ChatTemplate::plain);
  const std::string err = dew::test::error_of([&] { dew::data::tokenize_chat(*tok, r); });
  EXPECT_NE(err.find("byte-level"), std::string::npos) << err;
}

TEST(ChatRender, Errors) {
  using dew::test::error_of;
  EXPECT_NE(error_of([] { dew::data::render_chat({}, ChatTemplate::llama3); }).find("empty"), std::string::npos);
  const Conversation dev = {{ChatRole::developer, "rules"}, {ChatRole::user, "q"}};
  for (ChatTemplate t : {ChatTemplate::qwen2_5, ChatTemplate::qwen3}) {
    const std::string err = error_of([&] { dew::data::render_chat(dev, t); });
    EXPECT_NE(err.find("developer"), std::string::npos) << err;
  }
  EXPECT_NO_THROW(dew::data::render_chat(dev, ChatTemplate::llama3_1));
  const std::string g = error_of([] {
    dew::data::render_chat({{ChatRole::system, "s"}, {ChatRole::assistant, "a"}}, ChatTemplate::gemma3);
  });
  EXPECT_NE(g.find("message 1 is assistant"), std::string::npos) << g;
}

TEST(ChatRender, NamesAndMarkers) {
  for (ChatTemplate t : dew::data::chat_templates())
    EXPECT_EQ(dew::data::parse_chat_template(dew::data::chat_template_name(t)), t);
  EXPECT_NE(dew::test::error_of([] { dew::data::parse_chat_template("chatml"); }).find("llama3, llama3.1, qwen2.5"),
            std::string::npos);
  EXPECT_STREQ(dew::data::chat_end_of_turn(ChatTemplate::qwen3), "<|im_end|>");
  EXPECT_STREQ(dew::data::chat_end_of_turn(ChatTemplate::gemma3), "<end_of_turn>");
  EXPECT_STREQ(dew::data::chat_role_name(ChatRole::developer), "developer");
  EXPECT_NE(
      dew::test::error_of([] { dew::data::parse_chat_role("bot"); }).find("system, user, assistant, tool, developer"),
      std::string::npos);
}

// ---- recognition ----

std::string committed(const std::string& variant) {
  return slurp(kGoldenDir + "/" + golden()["templates"][variant]["file"].get<std::string>());
}

TEST(ChatRecognise, EmbeddedTextsAreTheCommittedFiles) {
  const auto& known = dew::data::known_chat_templates();
  EXPECT_EQ(known.size(), golden()["templates"].size());
  for (const auto& k : known) {
    ASSERT_TRUE(golden()["templates"].contains(k.variant)) << k.variant;
    EXPECT_EQ(k.text, committed(k.variant)) << k.variant;
    EXPECT_EQ(k.templ, template_of(k.variant));
  }
  EXPECT_EQ(dew::data::chat_template_jinja(ChatTemplate::qwen3), committed("qwen3"));  // the current one
}

TEST(ChatRecognise, EachCommittedTemplateFromAModelFolder) {
  dew::test::TempDir dir("chat_recognise");
  for (const auto& [variant, info] : golden()["templates"].items()) {
    const std::string text = committed(variant);
    const ChatTemplate want = template_of(variant);
    // As tokenizer_config.json holds it: a string.
    std::ofstream(dir.file("tokenizer_config.json")) << json{{"chat_template", text}, {"eos_token", "x"}}.dump(2);
    EXPECT_EQ(dew::data::recognise_chat_template(dir.path.string()), want) << variant;
    EXPECT_EQ(dew::data::recognise_chat_template(dir.file("tokenizer_config.json")), want) << variant;
    // A list of named templates: "default" is taken.
    json list =
        json::array({{{"name", "tool_use"}, {"template", "{{ nope }}"}}, {{"name", "default"}, {"template", text}}});
    std::ofstream(dir.file("tokenizer_config.json")) << json{{"chat_template", list}}.dump();
    EXPECT_EQ(dew::data::recognise_chat_template(dir.path.string()), want) << variant;
    // Jinja's own normalisations: CRLF line ends, a final newline more or less.
    std::string crlf;
    for (char c : text) crlf += c == '\n' ? std::string("\r\n") : std::string(1, c);
    EXPECT_EQ(dew::data::recognise_chat_template_text(crlf, "crlf"), want) << variant;
    const bool ends_nl = !text.empty() && text.back() == '\n';
    EXPECT_EQ(dew::data::recognise_chat_template_text(ends_nl ? text.substr(0, text.size() - 1) : text + "\n", "nl"),
              want)
        << variant;
  }
  // chat_template.jinja beside tokenizer_config.json wins, as in transformers.
  std::ofstream(dir.file("chat_template.jinja")) << committed("gemma3");
  EXPECT_EQ(dew::data::recognise_chat_template(dir.path.string()), ChatTemplate::gemma3);
}

TEST(ChatRecognise, ModifiedOrUnknownTemplatesAreRefused) {
  dew::test::TempDir dir("chat_refuse");
  const std::string folder = dir.path.string();
  auto refuse = [&](const std::string& text) {
    std::ofstream(dir.file("tokenizer_config.json")) << json{{"chat_template", text}}.dump();
    const std::string err = dew::test::error_of([&] { dew::data::recognise_chat_template(folder); });
    EXPECT_EQ(err.rfind(folder + ":", 0), 0u) << err;     // names the folder
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;  // one line
    return err;
  };
  std::string changed = committed("llama3.1");
  changed.replace(changed.find("December 2023"), 13, "December 2024");
  EXPECT_NE(refuse(changed).find("is not a template Dew renders (known: llama3, llama3.1"), std::string::npos);
  std::string spaced = committed("qwen2.5");
  spaced.insert(spaced.find("{%- for message in messages %}"), "  \n");
  const std::string ws = refuse(spaced);
  EXPECT_NE(ws.find("only in whitespace"), std::string::npos) << ws;
  EXPECT_NE(ws.find("qwen2.5"), std::string::npos) << ws;
  refuse("{% for m in messages %}{{ m.content }}{% endfor %}");
  refuse(committed("gemma3") + "\n\n");  // a second final newline renders

  std::ofstream(dir.file("tokenizer_config.json")) << R"({"eos_token": "</s>"})";
  EXPECT_NE(dew::test::error_of([&] { dew::data::recognise_chat_template(folder); }).find("has no chat_template"),
            std::string::npos);
  std::ofstream(dir.file("tokenizer_config.json")) << R"({"chat_template": [{"name": "rag", "template": "x"}]})";
  EXPECT_NE(dew::test::error_of([&] {
              dew::data::recognise_chat_template(folder);
            }).find("without a \"default\" entry (names: rag)"),
            std::string::npos);
  EXPECT_NE(dew::test::error_of([&] { dew::data::recognise_chat_template(dir.file("missing")); }).find("missing"),
            std::string::npos);
}

// ---- JSON lines ----

TEST(ChatData, ReadsJsonLines) {
  dew::test::TempDir dir("chat_jsonl");
  std::ofstream(dir.file("chat.jsonl"))
      << R"({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "naïve 日本語 🙂"}, {"role": "assistant", "content": " a \n"}], "id": 7})"
      << "\n\n"
      << R"({"messages": [{"role": "developer", "content": ""}, {"role": "tool", "content": "{}"}]})"
      << "\r\n";
  auto convs = dew::data::read_chat_jsonl(dir.file("chat.jsonl"));
  ASSERT_EQ(convs.size(), 2u);
  ASSERT_EQ(convs[0].size(), 3u);
  EXPECT_EQ(convs[0][1].content, "naïve 日本語 🙂");
  EXPECT_EQ(convs[0][2].role, ChatRole::assistant);
  EXPECT_EQ(convs[0][2].content, " a \n");
  EXPECT_EQ(convs[1][0].role, ChatRole::developer);
  EXPECT_EQ(convs[1][1].role, ChatRole::tool);
}

TEST(ChatData, BadLinesNameFileAndLine) {
  dew::test::TempDir dir("chat_bad");
  const std::string good = R"({"messages": [{"role": "user", "content": "hi"}]})";
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{\"messages\": [", "not a JSON object"},
      {R"(["user", "hi"])", "expected a JSON object"},
      {R"({"conversation": []})", "no \"messages\" key"},
      {R"({"messages": {"role": "user"}})", "\"messages\" must be an array"},
      {R"({"messages": []})", "\"messages\" is empty"},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]})",
       "messages[1].role \"bot\" is not a chat role (accepted: system, user, assistant, tool, developer)"},
      {R"({"messages": [{"content": "a"}]})", "messages[0] needs a string \"role\""},
      {R"({"messages": [{"role": "assistant", "content": null}]})", "messages[0].content must be a string, got null"},
      {R"({"messages": [{"role": "user", "content": ["a"]}]})", "messages[0].content must be a string, got array"},
      {R"({"messages": [{"role": "user"}]})", "messages[0] (user) has no \"content\""},
      {R"({"messages": ["hi"]})", "messages[0] must be an object"},
  };
  for (const auto& [line, what] : bad) {
    const std::string path = dir.file("bad.jsonl");
    std::ofstream(path) << good << "\n\n" << good << "\n" << line << "\n" << good << "\n";
    const std::string err = dew::test::error_of([&] { dew::data::read_chat_jsonl(path); });
    EXPECT_EQ(err.rfind(path + ":4: ", 0), 0u) << err;
    EXPECT_NE(err.find(what), std::string::npos) << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
  }
  std::ofstream(dir.file("empty.jsonl")) << "\n  \n";
  EXPECT_NE(dew::test::error_of([&] { dew::data::read_chat_jsonl(dir.file("empty.jsonl")); }).find("no conversations"),
            std::string::npos);
  EXPECT_NE(dew::test::error_of([&] { dew::data::read_chat_jsonl(dir.file("nope.jsonl")); }).find("nope.jsonl"),
            std::string::npos);
}

}  // namespace
