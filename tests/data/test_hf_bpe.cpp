// Hugging Face tokenizer.json byte-level BPE on small hand-written files whose expected ids were worked
// out by hand (each expectation's comment shows the merges that produce it).
//
// Vocabulary: ids 0..255 are the 256 byte stand-ins (id b = GPT-2's unicode character of byte b, so
// ' ' -> "Ġ" = 32), then the merges' results in rank order:
//   rank 0 Ġ t -> 256 "Ġt"    rank 1 h e -> 257 "he"    rank 2 Ġt he -> 258 "Ġthe"   rank 3 l o -> 259 "lo"
//   rank 4 lo w -> 260 "low"  rank 5 e r -> 261 "er"    rank 6 l l -> 262 "ll"       rank 7 t ' -> 263 "t'"
//   rank 8 Ġ Ġ -> 264 "ĠĠ"    rank 9 3 4 -> 265 "34"
// Added tokens: 266 "<|endoftext|>" (special), 267 "<|user|>" (not special), 268 "<|begin_of_text|>".
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "dew/data/tokenizer.h"
#include "dew/data/tokenizer_detail.h"
#include "tests/test_util.h"

namespace {

using dew::json;
using Ids = std::vector<int64_t>;

const std::vector<std::pair<std::string, std::string>> kMerges = {{"Ġ", "t"},  {"h", "e"}, {"Ġt", "he"}, {"l", "o"},
                                                                  {"lo", "w"}, {"e", "r"}, {"l", "l"},   {"t", "'"},
                                                                  {"Ġ", "Ġ"},  {"3", "4"}};

const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

json added(int64_t id, const std::string& content, bool special) {
  return {{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", false}, {"special", special}};
}

/// style "gpt2": ByteLevel pre-tokenizer with its own regex, merges as "a b" strings.
/// style "llama3": Split(Llama-3 regex) + ByteLevel(use_regex false), merges as [a, b] pairs, and a
/// TemplateProcessing post-processor that prepends <|begin_of_text|>.
std::string write_tokenizer(const dew::test::TempDir& dir, const std::string& style) {
  json vocab = json::object();
  const auto& b2u = dew::data::detail::byte_to_unicode();
  for (int b = 0; b < 256; ++b) vocab[b2u[b]] = b;
  json merges = json::array();
  int64_t next = 256;
  for (const auto& [a, b] : kMerges) {
    vocab[a + b] = next++;
    if (style == "gpt2") merges.push_back(a + " " + b);
    else merges.push_back(json::array({a, b}));
  }
  json file;
  file["version"] = "1.0";
  file["added_tokens"] = json::array(
      {added(266, "<|endoftext|>", true), added(267, "<|user|>", false), added(268, "<|begin_of_text|>", true)});
  file["normalizer"] = nullptr;
  json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  if (style == "gpt2") {
    file["pre_tokenizer"] = byte_level;
    file["post_processor"] = nullptr;
  } else {
    json no_regex = byte_level;
    no_regex["use_regex"] = false;
    file["pre_tokenizer"] = {{"type", "Sequence"},
                             {"pretokenizers", json::array({{{"type", "Split"},
                                                             {"pattern", {{"Regex", kLlama3Pattern}}},
                                                             {"behavior", "Isolated"},
                                                             {"invert", false}},
                                                            no_regex})}};
    file["post_processor"] = {
        {"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"special_tokens",
         {{"<|begin_of_text|>", {{"id", "<|begin_of_text|>"}, {"ids", {268}}, {"tokens", {"<|begin_of_text|>"}}}}}}};
  }
  file["decoder"] = byte_level;
  file["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}, {"unk_token", nullptr}};
  std::string path = dir.file(style + ".json");
  std::ofstream(path) << file.dump(1);
  return path;
}

TEST(TokenizerHfBpe, ByteToUnicodeMapIsGpt2s) {
  const auto& t = dew::data::detail::byte_to_unicode();
  EXPECT_EQ(t['a'], "a");
  EXPECT_EQ(t[' '], "\xC4\xA0");   // U+0120 "Ġ": byte 32 is the 33rd unprintable byte -> 256 + 32
  EXPECT_EQ(t['\n'], "\xC4\x8A");  // U+010A "Ċ"
  EXPECT_EQ(t[0x7F], "\xC4\xA1");  // U+0121: after the 33 bytes 0..32
  EXPECT_EQ(t[0xAD], "\xC5\x83");  // U+0143 "Ń": 33 + 34 (0x7F..0xA0) = 67 -> 256 + 67
  EXPECT_EQ(t[0xE9], "\xC3\xA9");  // printable Latin-1 keeps its code point: "é"
}

TEST(TokenizerHfBpe, Gpt2StyleMergesByRank) {
  dew::test::TempDir dir("hf_gpt2");
  auto tok = dew::data::load_tokenizer(write_tokenizer(dir, "gpt2"));
  EXPECT_EQ(tok->name(), "hf_bpe");
  EXPECT_EQ(tok->vocab_size(), 269);
  // "hello": h e l l o -> (h,e) rank 1 -> he l l o -> (l,o) rank 3 beats (l,l) rank 6 -> he l lo; done.
  // " the": Ġ t h e -> Ġt h e -> Ġt he -> Ġthe.   " world": no listed pair, one id per byte.
  EXPECT_EQ(tok->encode("hello the world"), (Ids{257, 108, 259, 258, 32, 119, 111, 114, 108, 100}));
  // "lower": l o w e r -> lo w e r -> low e r -> low er.
  EXPECT_EQ(tok->encode("lower"), (Ids{260, 261}));
  // The regex cuts "it's  12345!!" into "it" "'s" " " " 12345" "!!": (t,') and (Ġ,Ġ) never meet;
  // "12345" stays one word, so (3,4) merges.
  EXPECT_EQ(tok->encode("it's  12345!!"), (Ids{105, 116, 39, 115, 32, 32, 49, 50, 265, 53, 33, 33}));
  // Without the regex the same text would merge across words: check that the pairs do exist.
  EXPECT_EQ(tok->piece_to_id("t'"), 263);
  EXPECT_EQ(tok->piece_to_id("\xC4\xA0\xC4\xA0"), 264);
  // Newline and non-ASCII bytes map through the byte stand-ins; decode inverts exactly.
  std::string text = "caf\xC3\xA9\n\tthe\xF0\x9F\x99\x82";
  EXPECT_EQ(tok->encode(text), (Ids{99, 97, 102, 0xC3, 0xA9, 10, 9, 116, 257, 0xF0, 0x9F, 0x99, 0x82}));
  EXPECT_EQ(tok->decode(tok->encode(text)), text);
  EXPECT_EQ(tok->id_to_piece(258), "\xC4\xA0the");
  EXPECT_EQ(tok->decode({258}), " the");
}

TEST(TokenizerHfBpe, AddedTokensAreSplitOutFirst) {
  dew::test::TempDir dir("hf_added");
  auto tok = dew::data::load_tokenizer(write_tokenizer(dir, "gpt2"));
  // "hi" | <|endoftext|> | "the" (t he: (t,he) is not a merge) | <|user|> | " the"
  EXPECT_EQ(tok->encode("hi<|endoftext|>the<|user|> the"), (Ids{104, 105, 266, 116, 257, 267, 258}));
  // A partial special token is plain text.
  EXPECT_EQ(tok->encode("<|end"), (Ids{60, 124, 101, 110, 100}));
  EXPECT_EQ(tok->decode({104, 105, 266, 267, 258}), "hi<|user|> the");
  EXPECT_EQ(tok->decode({104, 105, 266, 267, 258}, false), "hi<|endoftext|><|user|> the");
  EXPECT_EQ(tok->eos_id(), 266);
  EXPECT_EQ(tok->bos_id(), 268);
  EXPECT_FALSE(dew::test::error_of([&] { tok->decode({269}); }).empty());
}

TEST(TokenizerHfBpe, Llama3StyleSplitRegexPairMergesAndBos) {
  dew::test::TempDir dir("hf_llama3");
  auto tok = dew::data::load_tokenizer(write_tokenizer(dir, "llama3"));
  // Digits go in groups of at most three ("123" "45"), so (3,4) cannot merge; "IT'S" splits as "IT" "'S"
  // (case-insensitive contractions); " the" is one word (optional non-letter + letters).
  EXPECT_EQ(tok->encode("12345 IT'S the"), (Ids{49, 50, 51, 52, 53, 32, 73, 84, 39, 83, 258}));
  EXPECT_EQ(tok->encode("hello", true), (Ids{268, 257, 108, 259}));
  EXPECT_EQ(tok->decode({268, 257, 108, 259}), "hello");
}

TEST(TokenizerHfBpe, IgnoreMergesAndPrefixSpace) {
  // A whole-word entry no merge path reaches: with ignore_merges (Llama 3) the word maps to it
  // directly; without, the word is merged from its characters as usual. add_prefix_space turns
  // "world" into " world".
  dew::test::TempDir dir("hf_ignore");
  json file = json::parse(std::ifstream(write_tokenizer(dir, "gpt2")));
  file["model"]["vocab"]["\xC4\xA0world"] = 269;  // "Ġworld"
  file["model"]["ignore_merges"] = true;
  file["pre_tokenizer"]["add_prefix_space"] = true;
  std::ofstream(dir.file("ignore.json")) << file.dump();
  auto tok = dew::data::load_tokenizer(dir.file("ignore.json"));
  EXPECT_EQ(tok->encode("world"), (Ids{269}));
  EXPECT_EQ(tok->encode("the world"), (Ids{258, 269}));  // prefix space: " the" -> Ġthe
  file["model"]["ignore_merges"] = false;
  std::ofstream(dir.file("merges.json")) << file.dump();
  auto plain = dew::data::load_tokenizer(dir.file("merges.json"));
  EXPECT_EQ(plain->encode("world"), (Ids{32, 119, 111, 114, 108, 100}));
}

TEST(TokenizerHfBpe, MalformedFilesAreErrors) {
  dew::test::TempDir dir("hf_bad");
  auto write = [&](const std::string& name, const json& j) {
    std::ofstream(dir.file(name)) << j.dump();
    return dir.file(name);
  };
  std::string msg = dew::test::error_of([&] {
    dew::data::load_tokenizer(write("wp.json", {{"model", {{"type", "WordPiece"}, {"vocab", json::object()}}}}));
  });
  EXPECT_NE(msg.find("WordPiece"), std::string::npos) << msg;
  msg = dew::test::error_of([&] {
    dew::data::load_tokenizer(
        write("m.json", {{"model", {{"type", "BPE"}, {"vocab", {{"a", 0}, {"b", 1}}}, {"merges", {"a b"}}}}}));
  });
  EXPECT_NE(msg.find("\"ab\", which is not in model.vocab"), std::string::npos) << msg;
  msg = dew::test::error_of([&] {
    dew::data::load_tokenizer(write("r.json", {{"pre_tokenizer", {{"type", "Split"}, {"pattern", {{"Regex", "(("}}}}},
                                               {"model", {{"type", "BPE"}, {"vocab", {{"a", 0}}}}}}));
  });
  EXPECT_NE(msg.find("does not compile"), std::string::npos) << msg;
  std::ofstream(dir.file("junk.json")) << "{ not json";
  msg = dew::test::error_of([&] { dew::data::load_tokenizer(dir.file("junk.json")); });
  EXPECT_NE(msg.find("junk.json"), std::string::npos) << msg;
}

}  // namespace
