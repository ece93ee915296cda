// The TensorBoard event writer (dew/io/tensorboard.h): CRC-32C against RFC 3720's published vectors, records
// byte for byte against what TensorBoard's own protobuf classes and RecordWriter produce (the hex below was
// printed by tensorboard 2.21's event_pb2 + tensorboard.summary.writer.record_writer.RecordWriter), torn
// records, and the cut back to a step on resume. tests/training/test_tensorboard_run.cpp reads a real run's
// files with TensorBoard's reader.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include "dew/io/files.h"
#include "dew/io/tensorboard.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace tb_io_test {

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out += char(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

// A 3 x 2 RGB PNG header (signature + IHDR); the pixel data does not matter to the encoder.
std::string tiny_png_header() {
  return from_hex("89504e470d0a1a0a0000000d49484452000000030000000208020000000000000000");
}

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// (step, first tag) of every non-file_version event in a file.
std::vector<std::pair<int64_t, std::string>> steps_of(const std::string& path) {
  std::vector<std::pair<int64_t, std::string>> out;
  for (const auto& p : dew::io::read_tfrecords(dew::io::read_file(path, "events"))) {
    const auto info = dew::io::tb::parse_event(p);
    if (!info.file_version) out.emplace_back(info.step, info.tags.empty() ? "" : info.tags[0]);
  }
  return out;
}

}  // namespace tb_io_test

TEST(TensorBoard, Crc32cMatchesRfc3720Vectors) {
  std::string zeros(32, '\0'), ones(32, '\xff'), ascending, descending;
  for (int i = 0; i < 32; ++i) ascending += char(i), descending += char(31 - i);
  EXPECT_EQ(dew::io::crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(dew::io::crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(dew::io::crc32c(ascending.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(dew::io::crc32c(descending.data(), 32), 0x113FDB5Cu);
  // Continuing a CRC over a split buffer gives the CRC of the whole.
  EXPECT_EQ(dew::io::crc32c(ascending.data() + 10, 22, dew::io::crc32c(ascending.data(), 10)), 0x46DD794Eu);
  EXPECT_EQ(dew::io::crc32c("123456789", 9), 0xE3069283u);  // the CRC catalogue's check value
}

TEST(TensorBoard, RecordsMatchTensorBoardsOwnWriterByteForByte) {
  using namespace dew::io;
  EXPECT_EQ(tfrecord(tb::file_version_event(2.0)),
            tb_io_test::from_hex("1800000000000000a37f4b220900000000000000401a0d627261696e2e4576656e743a32ff2ee0e7"));
  // step 300 is a two-byte varint (ac 02).
  EXPECT_EQ(
      tfrecord(tb::scalar_event(1.5, 300, "train/loss", 0.25f)),
      tb_io_test::from_hex("2100000000000000017becf609000000000000f83f10ac022a130a110a0a747261696e2f6c6f7373150000"
                           "803e6557981f"));
  // height 2, width 3, colorspace 3 (RGB) from the PNG's header.
  EXPECT_EQ(
      tfrecord(tb::image_event(4.0, 9, "samples", tb_io_test::tiny_png_header())),
      tb_io_test::from_hex("440000000000000043592e9a09000000000000104010092a370a350a0773616d706c6573222a080210031803"
                           "222289504e470d0a1a0a0000000d49484452000000030000000208020000000000000000f56ab6df"));
  EXPECT_EQ(tfrecord(tb::text_event(3.0, 7, "recipe", "hi")),
            tb_io_test::from_hex("2b00000000000000861bc34b09000000000000084010072a1e0a1c0a06726563697065420808071200420"
                                 "268694a080a060a04746578741448b80e"));
}

TEST(TensorBoard, EventsParseBackAndImagesTakeTheirSizeFromThePng) {
  using namespace dew::io;
  const auto s = tb::parse_event(tb::scalar_event(1.0, 123456789012, "val/loss", 1.0f));
  EXPECT_FALSE(s.file_version);
  EXPECT_EQ(s.step, 123456789012);
  ASSERT_EQ(s.tags.size(), 1u);
  EXPECT_EQ(s.tags[0], "val/loss");
  EXPECT_TRUE(tb::parse_event(tb::file_version_event(1.0)).file_version);
  const auto h = tb::png_header(tb_io_test::tiny_png_header());
  EXPECT_EQ(h.width, 3);
  EXPECT_EQ(h.height, 2);
  EXPECT_EQ(h.channels, 3);
  const auto img = tb::parse_event(tb::image_event(1.0, 5, "samples", tb_io_test::tiny_png_header()));
  EXPECT_EQ(img.step, 5);
  EXPECT_EQ(img.tags, std::vector<std::string>{"samples"});
  const std::string err = dew::test::error_of([] { tb::image_event(1.0, 5, "samples", "GIF89a not a png"); });
  EXPECT_NE(err.find("PNG"), std::string::npos) << err;
  EXPECT_NE(dew::test::error_of([] { tb::parse_event(std::string("\x0a\x7f", 2)); }), "");
}

TEST(TensorBoard, ReadingStopsAtATornOrCorruptRecord) {
  using namespace dew::io;
  const std::string a = tfrecord(tb::scalar_event(1.0, 1, "x", 1.0f)),
                    b = tfrecord(tb::scalar_event(1.0, 2, "x", 2.0f));
  bool clean = false;
  EXPECT_EQ(read_tfrecords(a + b, &clean).size(), 2u);
  EXPECT_TRUE(clean);
  for (size_t cut = 1; cut < b.size(); ++cut) {
    EXPECT_EQ(read_tfrecords(a + b.substr(0, cut), &clean).size(), 1u) << cut;
    EXPECT_FALSE(clean) << cut;
  }
  std::string flipped = a + b;
  flipped[a.size() + 14] ^= 1;  // a payload byte of the second record
  EXPECT_EQ(read_tfrecords(flipped, &clean).size(), 1u);
  EXPECT_FALSE(clean);
}

TEST(TensorBoard, FilesAreCutBackToTheResumedStepAndNamesSortByStart) {
  using namespace dew::io;
  dew::test::TempDir tmp("tensorboard_cut");
  const std::string dir = tmp.file("tb");
  std::string first;
  {
    EventWriter w(dir);
    first = w.path();
    EXPECT_EQ(fs::path(first).filename().string().rfind("events.out.tfevents.", 0), 0u) << first;
    w.add_text("recipe", 0, "r0");
    for (int s = 1; s <= 6; ++s) w.add_scalar("train/loss", s, s);
  }
  // A start at step 4: the first file keeps steps <= 4; the recipe at 0 stays (it is not at the step).
  truncate_event_files(dir, 4, {"recipe"});
  std::string second;
  {
    EventWriter w(dir);
    second = w.path();
    w.add_text("recipe", 4, "r4");
    w.add_scalar("train/loss", 5, 50);
  }
  EXPECT_LT(fs::path(first).filename().string(), fs::path(second).filename().string());
  using Steps = std::vector<std::pair<int64_t, std::string>>;
  EXPECT_EQ(tb_io_test::steps_of(first),
            (Steps{{0, "recipe"}, {1, "train/loss"}, {2, "train/loss"}, {3, "train/loss"}, {4, "train/loss"}}));
  // A kill tore the second file's last record; a start again at step 4 drops it and the recipe at 4.
  {
    std::string bytes = read_file(second, "events");
    write_file_atomic(second, bytes + tfrecord(tb::scalar_event(1.0, 6, "train/loss", 6.0f)).substr(0, 9));
  }
  truncate_event_files(dir, 4, {"recipe"});
  // Nothing but its file_version is left in the second file: it is removed.
  EXPECT_FALSE(fs::exists(second));
  EXPECT_EQ(tb_io_test::event_files(dir), std::vector<std::string>{fs::path(first).filename().string()});
  // Step 0 (a fresh start) removes every event file.
  truncate_event_files(dir, 0, {"recipe"});
  EXPECT_TRUE(tb_io_test::event_files(dir).empty());
  // A missing directory stays missing.
  truncate_event_files(tmp.file("none"), 3);
  EXPECT_FALSE(fs::exists(tmp.file("none")));
}
