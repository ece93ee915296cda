// `dew tokenize` end to end: a small folder of fortune and plain files -> token files whose meta.json
// and ids are checked against the byte tokenizer's definition; bad flags exit 2 with one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "dew/core/options.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace {

using Result = dew::test::CliResult;
using dew::test::run_dew;

std::string read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST(TokenizeCli, WritesPackedByteTokenFiles) {
  dew::test::TempDir dir("tokenize_cli");
  fs::create_directories(dir.path / "in");
  std::ofstream(dir.file("in/a.fortunes")) << "Hi\n%\nyo\n%\n";
  std::ofstream(dir.file("in/b.txt")) << "whole file\n";
  auto r = run_dew("tokenize --input " + dir.file("in") + " --out " + dir.file("out") +
                   " --tokenizer byte --val-fraction 0.2 --pack");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("3 documents"), std::string::npos) << r.output;
  auto meta = dew::json::parse(read(dir.file("out/meta.json")));
  // Documents in order: "Hi\n" <eos> | "yo\n" <eos> | "whole file\n" <eos>: 4 + 4 + 12 = 20 tokens. The
  // head of the stream takes documents until val holds >= 0.2 * 20 = 4 tokens: the first document.
  EXPECT_EQ(meta["vocab_size"], 257);
  EXPECT_EQ(meta["eos_id"], 256);
  EXPECT_EQ(meta["dtype"], "uint16");
  EXPECT_EQ(meta["packed"], true);
  EXPECT_EQ(meta["val_tokens"], 4);
  EXPECT_EQ(meta["train_tokens"], 16);
  EXPECT_EQ(meta["tokenizer"], (dew::json{{"name", "byte"}, {"eos", true}}));
  auto u16 = [](const std::string& bytes) {
    std::vector<int64_t> ids;
    for (size_t i = 0; i + 1 < bytes.size(); i += 2)
      ids.push_back(static_cast<unsigned char>(bytes[i]) | (static_cast<unsigned char>(bytes[i + 1]) << 8));
    return ids;
  };
  EXPECT_EQ(u16(read(dir.file("out/val.bin"))), (std::vector<int64_t>{'H', 'i', '\n', 256}));
  std::vector<int64_t> train = {'y', 'o', '\n', 256};
  for (char c : std::string("whole file\n")) train.push_back(static_cast<unsigned char>(c));
  train.push_back(256);
  EXPECT_EQ(u16(read(dir.file("out/train.bin"))), train);
}

TEST(TokenizeCli, UnpackedBytesAreUint8) {
  dew::test::TempDir dir("tokenize_cli_u8");
  std::ofstream(dir.file("t.txt")) << "abc\xff";
  auto r = run_dew("tokenize --input " + dir.file("t.txt") + " --out " + dir.file("out") +
                   " --tokenizer '{\"name\":\"byte\",\"eos\":false}' --val-fraction 0");
  ASSERT_EQ(r.code, 0) << r.output;
  auto meta = dew::json::parse(read(dir.file("out/meta.json")));
  EXPECT_EQ(meta["dtype"], "uint8");
  EXPECT_EQ(meta["packed"], false);
  EXPECT_EQ(read(dir.file("out/train.bin")), "abc\xff");
  EXPECT_EQ(read(dir.file("out/val.bin")), "");
}

TEST(TokenizeCli, ErrorsExit2WithOneLine) {
  dew::test::TempDir dir("tokenize_cli_err");
  std::ofstream(dir.file("t.txt")) << "abc";
  auto expect_error = [&](const std::string& args, const std::string& needle) {
    auto r = run_dew("tokenize " + args);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
  };
  std::string io = " --input " + dir.file("t.txt") + " --out " + dir.file("out");
  expect_error("--out " + dir.file("out"), "--input");
  expect_error(io + " --val-fraction 1.5", "--val-fraction");
  expect_error(io + " --tokenizer nowhere.model", "nowhere.model");
  expect_error(io + " --tokenizer '{\"name\":\"byte\",\"eos\":false}' --pack", "no EOS");
  expect_error(io + " --bogus 1", "unknown flag --bogus");
  expect_error("--input " + dir.file("missing") + " --out " + dir.file("out"), "missing");
  EXPECT_FALSE(fs::exists(dir.file("out")));
}

}  // namespace
