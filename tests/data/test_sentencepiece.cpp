// SentencePiece tokenizer.model files read through libsentencepiece must encode and decode exactly as
// Debian's python3-sentencepiece does; both run the same library, so this checks dew's wrapping (special
// ids, BOS, control pieces, errors). The models and the expected ids were produced once by
// tests/data/fixtures/make_sentencepiece_fixtures.py (unigram and BPE, with and without byte fallback,
// a user-defined symbol, unknown characters, repeated and leading spaces).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "dew/data/tokenizer.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace {

const std::string kFixtures = std::string(DEW_SOURCE_DIR) + "/tests/data/fixtures/";

dew::json expected() {
  std::ifstream f(kFixtures + "sentencepiece_expected.json");
  return dew::json::parse(f);
}

void check_model(const std::string& name) {
  auto all = expected();
  ASSERT_TRUE(all.contains(name));
  const auto& e = all[name];
  auto tok = dew::data::load_tokenizer(kFixtures + name + ".model");
  EXPECT_EQ(tok->name(), "sentencepiece");
  EXPECT_EQ(tok->vocab_size(), e["vocab_size"].get<int64_t>());
  EXPECT_EQ(tok->bos_id(), e["bos_id"].get<int64_t>());
  EXPECT_EQ(tok->eos_id(), e["eos_id"].get<int64_t>());
  EXPECT_EQ(tok->unk_id(), e["unk_id"].get<int64_t>());
  EXPECT_EQ(tok->pad_id(), e["pad_id"].get<int64_t>());
  for (const auto& c : e["cases"]) {
    std::string text = c["text"];
    auto ids = c["ids"].get<std::vector<int64_t>>();
    EXPECT_EQ(tok->encode(text), ids) << name << " encoding \"" << text << "\"";
    EXPECT_EQ(tok->decode(ids), c["decoded"].get<std::string>()) << name << " decoding \"" << text << "\"";
  }
}

TEST(TokenizerSentencePiece, UnigramMatchesSentencePiece) { check_model("sp_unigram"); }
TEST(TokenizerSentencePiece, UnigramByteFallbackMatchesSentencePiece) { check_model("sp_unigram_bytes"); }
TEST(TokenizerSentencePiece, BpeByteFallbackMatchesSentencePiece) { check_model("sp_bpe"); }
TEST(TokenizerSentencePiece, BpeMatchesSentencePiece) { check_model("sp_bpe_nobytes"); }

TEST(TokenizerSentencePiece, SpecialsPiecesAndSave) {
  auto tok = dew::data::load_tokenizer(kFixtures + "sp_bpe.model");
  EXPECT_EQ(tok->id_to_piece(tok->bos_id()), "<s>");
  EXPECT_EQ(tok->id_to_piece(tok->eos_id()), "</s>");
  EXPECT_EQ(tok->piece_to_id("<0x41>"), tok->piece_to_id("<0x40>") + 1);
  auto ids = tok->encode("the fox", true);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], tok->bos_id());
  EXPECT_EQ(tok->decode(ids), "the fox");
  ids.push_back(tok->eos_id());
  EXPECT_EQ(tok->decode(ids, false), "<s>the fox</s>");

  dew::test::TempDir dir("sp_save");
  tok->save(dir.path.string());
  auto again = dew::data::load_tokenizer(dir.path.string());  // the folder: finds tokenizer.model
  EXPECT_EQ(again->encode("watermelon 12"), tok->encode("watermelon 12"));
  auto config = dew::json::parse(std::ifstream(dir.file("tokenizer_config.json")));
  EXPECT_EQ(config["eos_token"], "</s>");
  auto rebuilt = dew::data::load_tokenizer(tok->spec());
  EXPECT_EQ(rebuilt->vocab_size(), tok->vocab_size());
}

TEST(TokenizerSentencePiece, MalformedFilesAreErrors) {
  dew::test::TempDir dir("sp_bad");
  std::string good;
  {
    std::ifstream f(kFixtures + "sp_unigram.model", std::ios::binary);
    good.assign(std::istreambuf_iterator<char>(f), {});
  }
  std::ofstream(dir.file("trunc.model"), std::ios::binary) << good.substr(0, good.size() / 2);
  std::string msg = dew::test::error_of([&] { dew::data::load_tokenizer(dir.file("trunc.model")); });
  EXPECT_NE(msg.find("trunc.model"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  std::ofstream(dir.file("text.model")) << "not a model at all";
  msg = dew::test::error_of([&] { dew::data::load_tokenizer(dir.file("text.model")); });
  EXPECT_NE(msg.find("text.model"), std::string::npos) << msg;
  EXPECT_NE(
      dew::test::error_of([&] { dew::data::load_tokenizer(kFixtures + "sp_bpe.model")->decode({400}); }).find("400"),
      std::string::npos);
}

}  // namespace
