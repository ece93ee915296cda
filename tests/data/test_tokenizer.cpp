// Tokenizers: the byte tokenizer's exact round trip, registry and spec round trips, load_tokenizer's
// dispatch and errors, and the byte tokenizer's Hugging Face export read back by our tokenizer.json
// reader.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "dew/data/tokenizer.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;
using dew::data::load_tokenizer;

namespace {

TEST(TokenizerByte, RoundTripsArbitraryBytesIncludingInvalidUtf8) {
  auto tok = load_tokenizer("byte");
  EXPECT_EQ(tok->vocab_size(), 257);
  EXPECT_EQ(tok->eos_id(), 256);
  EXPECT_EQ(tok->bos_id(), -1);
  EXPECT_EQ(tok->pad_id(), -1);
  // "é" is C3 A9, "€" is E2 82 AC: ids are the bytes themselves, not code points.
  std::string text = "a\xC3\xA9\xE2\x82\xAC";
  EXPECT_EQ(tok->encode(text), (std::vector<int64_t>{97, 0xC3, 0xA9, 0xE2, 0x82, 0xAC}));
  // Invalid UTF-8: a lone continuation byte, a truncated sequence, an overlong NUL, 0xFF, embedded NUL.
  std::string bad("\x80x\xE2\x82\xC0\x80\xFF\x00z", 9);
  auto ids = tok->encode(bad);
  ASSERT_EQ(ids.size(), 9u);
  EXPECT_EQ(ids[0], 0x80);
  EXPECT_EQ(ids[7], 0);
  EXPECT_EQ(tok->decode(ids), bad);
  std::mt19937 gen(7);
  std::string random(4096, '\0');
  for (auto& c : random) c = static_cast<char>(gen() & 0xFF);
  EXPECT_EQ(tok->decode(tok->encode(random)), random);
}

TEST(TokenizerByte, SpecialIdsPiecesAndErrors) {
  auto tok = load_tokenizer("byte");
  EXPECT_EQ(tok->decode({104, 105, 256}), "hi");
  EXPECT_EQ(tok->decode({104, 105, 256}, false), "hi<eos>");
  EXPECT_EQ(tok->id_to_piece(10), "<0x0A>");
  EXPECT_EQ(tok->id_to_piece(256), "<eos>");
  EXPECT_EQ(tok->piece_to_id("<0xFF>"), 255);
  EXPECT_EQ(tok->piece_to_id("<eos>"), 256);
  EXPECT_EQ(tok->piece_to_id("x"), -1);
  EXPECT_NE(dew::test::error_of([&] { tok->decode({257}); }).find("257"), std::string::npos);
  EXPECT_NE(dew::test::error_of([&] { tok->id_to_piece(-1); }).find("-1"), std::string::npos);

  auto plain = dew::data::tokenizers().build("byte", {{"eos", false}});
  EXPECT_EQ(plain->vocab_size(), 256);
  EXPECT_EQ(plain->eos_id(), -1);
  EXPECT_FALSE(dew::test::error_of([&] { plain->decode({256}); }).empty());
}

TEST(TokenizerRegistry, SpecRebuildsTheSameTokenizer) {
  auto tok = dew::data::tokenizers().build("byte", {{"eos", false}});
  dew::json spec = tok->spec();
  EXPECT_EQ(spec, (dew::json{{"name", "byte"}, {"eos", false}}));
  auto again = load_tokenizer(spec);
  EXPECT_EQ(again->vocab_size(), 256);
  auto from_text = load_tokenizer(spec.dump());
  EXPECT_EQ(from_text->vocab_size(), 256);
  auto names = dew::data::tokenizers().names();
  EXPECT_EQ(names, (std::vector<std::string>{"byte", "hf_bpe", "sentencepiece"}));
}

TEST(TokenizerRegistry, BadSpecsNameWhatIsAccepted) {
  dew::test::TempDir dir("tok_bad");
  std::string msg = dew::test::error_of([&] { load_tokenizer("no/such/tokenizer.model"); });
  EXPECT_NE(msg.find("no/such/tokenizer.model"), std::string::npos) << msg;
  EXPECT_NE(msg.find("byte"), std::string::npos) << msg;
  msg = dew::test::error_of([&] { load_tokenizer(dir.path.string()); });
  EXPECT_NE(msg.find("neither tokenizer.json nor tokenizer.model"), std::string::npos) << msg;
  msg = dew::test::error_of([&] { dew::data::tokenizers().build("byte", {{"eos", 1}}); });
  EXPECT_NE(msg.find("eos"), std::string::npos) << msg;
  msg = dew::test::error_of([&] { dew::data::tokenizers().build("byte", {{"vocab", 3}}); });
  EXPECT_NE(msg.find("unknown field \"vocab\""), std::string::npos) << msg;
}

TEST(TokenizerByte, HfExportGivesTheSameIds) {
  dew::test::TempDir dir("tok_byte_save");
  auto tok = load_tokenizer("byte");
  tok->save(dir.path.string());
  ASSERT_TRUE(fs::exists(dir.file("tokenizer_config.json")));
  ASSERT_TRUE(fs::exists(dir.file("special_tokens_map.json")));
  auto hf = load_tokenizer(dir.path.string());  // the folder: picks tokenizer.json
  EXPECT_EQ(hf->name(), "hf_bpe");
  EXPECT_EQ(hf->vocab_size(), 257);
  EXPECT_EQ(hf->eos_id(), 256);
  // "<eos>" inside the text is the special token for the HF file (split out before the BPE model).
  std::string before = "Hello, world!\n  tabs\tand \xC3\xA9 and ", after = " \x80\xFF";
  auto expected = tok->encode(before);
  expected.push_back(256);
  for (auto id : tok->encode(after)) expected.push_back(id);
  EXPECT_EQ(hf->encode(before + "<eos>" + after), expected);
  EXPECT_EQ(hf->decode(tok->encode("caf\xC3\xA9 \x80")), "caf\xC3\xA9 \x80");
}

}  // namespace
