// Token files (round trip, dtype by vocabulary, corrupt files) and LM windows (packing, determinism,
// resume, the fortunes corpus).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "dew/data/lm_data.h"
#include "dew/data/token_files.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;
using dew::json;
using dew::test::error_of;

namespace {

std::vector<int64_t> iota(int64_t n, int64_t mod, int64_t offset = 0) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = (i * 7 + offset) % mod;
  return v;
}

dew::data::TokenMeta meta_of(int64_t vocab, int64_t eos = -1) {
  dew::data::TokenMeta m;
  m.tokenizer = {{"name", "byte"}};
  m.vocab_size = vocab;
  m.eos_id = eos;
  return m;
}

}  // namespace

TEST(TokenFiles, RoundTripAtEveryWidth) {
  dew::test::TempDir dir("token_files");
  for (auto [vocab, dtype, width] : std::vector<std::tuple<int64_t, std::string, int64_t>>{
           {200, "uint8", 1}, {300, "uint16", 2}, {65536, "uint16", 2}, {70000, "uint32", 4}}) {
    auto train = iota(1001, vocab), val = iota(77, vocab, 3);
    train.back() = vocab - 1;  // the largest id survives
    const std::string d = dir.file("v" + std::to_string(vocab));
    dew::data::write_token_files(d, train, val, meta_of(vocab));
    EXPECT_EQ(fs::file_size(fs::path(d) / "train.bin"), uint64_t(1001 * width));
    dew::data::TokenFiles tf(d);
    EXPECT_EQ(tf.meta().dtype, dtype);
    EXPECT_EQ(tf.meta().train_tokens, 1001);
    EXPECT_EQ(tf.meta().val_tokens, 77);
    auto back = tf.ids(false, 0, 1001);
    EXPECT_EQ(std::vector<int64_t>(back.data_ptr<int64_t>(), back.data_ptr<int64_t>() + 1001), train) << vocab;
    auto v = tf.ids(true, 10, 5);
    EXPECT_EQ(v[0].item<int64_t>(), val[10]);
  }
  // Little-endian on disk: id 0x0102 is bytes 02 01.
  dew::data::write_token_files(dir.file("le"), {0x0102}, {}, meta_of(1000));
  std::ifstream f(dir.file("le") + "/train.bin", std::ios::binary);
  char b[2];
  f.read(b, 2);
  EXPECT_EQ(b[0], 0x02);
  EXPECT_EQ(b[1], 0x01);
}

TEST(TokenFiles, CorruptFilesAreErrorsNamingTheFile) {
  dew::test::TempDir dir("token_files_bad");
  const std::string d = dir.file("t");
  EXPECT_NE(error_of([&] {
              dew::data::write_token_files(d, {1, 2, 300}, {}, meta_of(300));
            }).find("index 2"),
            std::string::npos);
  dew::data::write_token_files(d, iota(100, 300), iota(10, 300), meta_of(300));
  // truncated train.bin
  fs::resize_file(fs::path(d) / "train.bin", 199);
  auto e = error_of([&] { dew::data::TokenFiles tf(d); });
  EXPECT_NE(e.find("train.bin"), std::string::npos) << e;
  EXPECT_NE(e.find("199 bytes"), std::string::npos) << e;
  // an id >= vocab_size in val.bin
  dew::data::write_token_files(d, iota(100, 300), iota(10, 300), meta_of(300));
  {
    std::fstream f(fs::path(d) / "val.bin", std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(6);
    const char big[2] = {char(0xff), char(0x7f)};
    f.write(big, 2);
  }
  e = error_of([&] { dew::data::TokenFiles tf(d); });
  EXPECT_NE(e.find("val.bin"), std::string::npos) << e;
  EXPECT_NE(e.find("index 3"), std::string::npos) << e;
  // dtype that does not match the vocabulary; missing field; bad JSON
  dew::data::write_token_files(d, iota(100, 300), iota(10, 300), meta_of(300));
  json m = json::parse(std::ifstream(fs::path(d) / "meta.json"));
  m["dtype"] = "uint8";
  std::ofstream(fs::path(d) / "meta.json") << m.dump();
  e = error_of([&] { dew::data::TokenFiles tf(d); });
  EXPECT_NE(e.find("meta.json"), std::string::npos) << e;
  EXPECT_NE(e.find("uint16"), std::string::npos) << e;
  m.erase("vocab_size");
  std::ofstream(fs::path(d) / "meta.json") << m.dump();
  EXPECT_NE(error_of([&] { dew::data::TokenFiles tf(d); }).find("vocab_size"), std::string::npos);
  std::ofstream(fs::path(d) / "meta.json") << "{";
  EXPECT_NE(error_of([&] { dew::data::TokenFiles tf(d); }).find("invalid JSON"), std::string::npos);
  EXPECT_NE(error_of([&] { dew::data::TokenFiles tf(dir.file("missing")); }).find("missing"), std::string::npos);
}

TEST(LMData, PackedBatchesCarrySegmentsAndPositions) {
  // documents [5 6 EOS] [7 EOS] [8 ...: EOS = 9
  at::Tensor t = torch::tensor({5, 6, 9, 7, 9, 8}, torch::kLong).view({1, 6});
  auto b = dew::data::lm_batch(t, 9, true);
  EXPECT_TRUE(b["segment_ids"].equal(torch::tensor({0, 0, 0, 1, 1, 2}, torch::kLong).view({1, 6})));
  EXPECT_TRUE(b["positions"].equal(torch::tensor({0, 1, 2, 0, 1, 0}, torch::kLong).view({1, 6})));
  EXPECT_EQ(dew::data::lm_batch(t, 9, false).count("segment_ids"), 0u);
}

TEST(LMData, WindowsAreDeterministicAndResumable) {
  dew::test::TempDir dir("lm_windows");
  auto train = iota(1000, 50), val = iota(100, 50);
  auto meta = meta_of(50, 0);
  dew::data::write_token_files(dir.file("t"), train, val, meta);
  auto lm = dew::data::lm_datasets().build(json{{"name", "tokens"}, {"dir", dir.file("t")}}, 16);
  EXPECT_EQ(lm->windows->size(), (1000 - 1) / 16);
  EXPECT_EQ(lm->vocab_size, 50);
  dew::data::LoaderOptions lo;
  lo.batch_size = 4;
  lo.seed = 3;
  lo.num_workers = 2;
  dew::data::DataLoader a(lm->windows, lo, lm->transform);
  auto b0 = a.next();
  const at::Tensor& tok = b0.at("tokens");
  ASSERT_EQ(tok.sizes(), (std::vector<int64_t>{4, 17}));
  // every row is a window [k 16, k 16 + 17) of the stream
  for (int64_t r = 0; r < 4; ++r) {
    int64_t k = -1;
    for (int64_t s = 0; s + 17 <= 1000; s += 16)
      if (tok[r][0].item<int64_t>() == train[size_t(s)] && tok[r][16].item<int64_t>() == train[size_t(s + 16)] &&
          tok[r][5].item<int64_t>() == train[size_t(s + 5)])
        k = s;
    EXPECT_GE(k, 0) << "row " << r;
  }
  a.next();
  auto state = a.state();
  auto want = a.next();
  lo.num_workers = 0;
  dew::data::DataLoader c(lm->windows, lo, lm->transform);
  c.load_state(state);
  EXPECT_TRUE(c.next().at("tokens").equal(want.at("tokens")));
  // validation: the first windows of val.bin, fixed
  auto v = lm->validation(2);
  EXPECT_EQ(v.at("tokens").sizes(), (std::vector<int64_t>{2, 17}));
  EXPECT_EQ(v.at("tokens")[1][0].item<int64_t>(), val[16]);
  EXPECT_NE(error_of([&] {
              dew::data::lm_datasets().build(json{{"name", "tokens"}, {"dir", dir.file("t")}}, 1000);
            }).find("fewer than one window"),
            std::string::npos);
}

TEST(LMData, FortunesCorpusIsBytesWithEosAndAFixedSplit) {
  if (!fs::exists(dew::data::kFortunesDir)) GTEST_SKIP() << "fortunes package not installed";
  auto lm = dew::data::lm_datasets().build(json{{"name", "fortunes"}}, 128);
  EXPECT_EQ(lm->vocab_size, 257);
  EXPECT_EQ(lm->eos_id, 256);
  EXPECT_TRUE(lm->packed);
  EXPECT_GT(lm->train_tokens, 1000000);
  // about 1/20 of the documents are validation
  EXPECT_GT(lm->val_tokens * 30, lm->train_tokens);
  EXPECT_LT(lm->val_tokens * 10, lm->train_tokens);
  auto v1 = lm->validation(4), v2 = lm->validation(4);
  EXPECT_TRUE(v1.at("tokens").equal(v2.at("tokens")));
  EXPECT_LE(v1.at("tokens").max().item<int64_t>(), 256);
  EXPECT_EQ(v1.count("segment_ids"), 1u);
  // the stream ends each document with EOS
  EXPECT_EQ(lm->read(false, lm->train_tokens - 1, 1)[0].item<int64_t>(), 256);
}
