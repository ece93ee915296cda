// Documents for `dew tokenize`: the fortune splitting rule and which files a folder contributes.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "dew/data/text_corpus.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace {

TEST(TextCorpus, SplitsFortunesAtPercentLines) {
  // Blank fortunes vanish, "%" inside a line is text, CRLF separators count, the last one needs no "%".
  std::string text = "first line\nsecond 100% sure\n%\n%\n  \n%\r\nthird\n%\nlast, no newline";
  auto docs = dew::data::split_fortunes(text);
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(docs[0], "first line\nsecond 100% sure\n");
  EXPECT_EQ(docs[1], "third\n");
  EXPECT_EQ(docs[2], "last, no newline\n");
  EXPECT_TRUE(dew::data::split_fortunes("%\n%\n").empty());
}

TEST(TextCorpus, FolderFilesSkipIndexesLinksAndHidden) {
  dew::test::TempDir dir("corpus");
  fs::create_directories(dir.path / "sub");
  fs::create_directories(dir.path / ".git");
  std::ofstream(dir.file("quotes")) << "a\n%\nb\n";
  std::ofstream(dir.file("quotes.dat"), std::ios::binary) << std::string("\x00\x00\x00\x02", 4);
  fs::create_symlink(dir.file("quotes"), dir.file("quotes.u8"));
  std::ofstream((dir.path / "sub" / "plain.txt").string()) << "one % document\n%\nstill the same one\n";
  std::ofstream((dir.path / "sub" / "more.fortunes").string()) << "x\n%\ny\n";
  std::ofstream((dir.path / ".git" / "config").string()) << "hidden\n";
  std::ofstream(dir.file(".hidden")) << "hidden\n";
  std::ofstream(dir.file("empty.txt")) << "";

  auto files = dew::data::document_files(dir.path.string());
  std::vector<std::string> names;
  for (const auto& f : files) names.push_back(fs::relative(f, dir.path).string());
  EXPECT_EQ(names, (std::vector<std::string>{"empty.txt", "quotes", "sub/more.fortunes", "sub/plain.txt"}));

  auto docs = dew::data::read_documents(dir.path.string());
  EXPECT_EQ(docs, (std::vector<std::string>{"a\n", "b\n", "x\n", "y\n", "one % document\n%\nstill the same one\n"}));
  auto whole = dew::data::read_documents(dir.path.string(), "file");
  EXPECT_EQ(whole.size(), 3u);
  auto forced = dew::data::read_documents(dir.path.string(), "fortune");
  EXPECT_EQ(forced.size(), 6u);
  EXPECT_NE(dew::test::error_of([&] {
              dew::data::read_documents(dir.path.string(), "lines");
            }).find("accepted: auto, fortune, file"),
            std::string::npos);
  EXPECT_NE(dew::test::error_of([&] { dew::data::read_documents(dir.file("missing")); }).find("missing"),
            std::string::npos);
}

TEST(TextCorpus, DebianFortunesWhenInstalled) {
  if (!fs::exists("/usr/share/games/fortunes/computers")) GTEST_SKIP() << "fortunes package not installed";
  auto docs = dew::data::read_documents("/usr/share/games/fortunes/computers");
  // strfile's index says how many fortunes the file holds: a 32-bit big-endian count at offset 4.
  std::ifstream dat("/usr/share/games/fortunes/computers.dat", std::ios::binary);
  unsigned char h[8];
  dat.read(reinterpret_cast<char*>(h), 8);
  uint32_t count = (uint32_t(h[4]) << 24) | (uint32_t(h[5]) << 16) | (uint32_t(h[6]) << 8) | h[7];
  EXPECT_EQ(docs.size(), count);
}

}  // namespace
