// TensorBoard event files (docs/tensorboard.md), written without TensorFlow: the TFRecord framing
// (uint64 length, masked CRC-32C of the length, the payload, masked CRC-32C of the payload) around Event
// protocol buffers encoded here by hand (tensorflow/core/util/event.proto, summary.proto). What is written
// is what the installed TensorBoard reads as scalars (Summary.Value.simple_value), images (Summary.Image
// with PNG bytes) and text (a string tensor with the "text" plugin's metadata); tests read the files back
// with TensorBoard's own reader.
//
// A run keeps its event files in RUN/tensorboard/, one file per start of the command; a resumed run first
// cuts every older file back to the step it resumes from (truncate_event_files), as metrics.jsonl is.
//
// Example:
//   dew::io::EventWriter tb("runs/x/tensorboard");    // events.out.tfevents.<time>.<host>.<pid>.<n>
//   tb.add_scalar("train/loss", 100, 0.25);
//   tb.add_image_png("samples", 100, dew::io::read_file("runs/x/samples/step_100.png", "sample grid"));
//   tb.add_text("recipe", 0, "    {\"seed\": 0}");     // markdown: indented = code block
#pragma once
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <set>
#include <string>
#include <vector>

namespace dew::io {

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `n` bytes, continuing from `crc` (0 to start):
/// the checksum of iSCSI (RFC 3720) and of TFRecord.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

/// TFRecord's masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8 of crc32c(data).
uint32_t masked_crc32c(const void* data, size_t n);

/// One TFRecord: [uint64 length][masked crc of the 8 length bytes][payload][masked crc of the payload],
/// integers little-endian.
std::string tfrecord(const std::string& payload);

/// The payloads of the whole records at the start of `bytes`. Reading stops at the first torn record or
/// checksum mismatch (what a kill in the middle of a write leaves); *clean (when given) says whether every
/// byte was read.
std::vector<std::string> read_tfrecords(const std::string& bytes, bool* clean = nullptr);

namespace tb {

/// Event{wall_time, file_version: "brain.Event:2"}: the first record of every event file.
std::string file_version_event(double wall_time);
/// Event{wall_time, step, summary{value{tag, simple_value}}}: one point of a scalar chart (float32).
std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value);
/// Event{..., summary{value{tag, image{height, width, colorspace, encoded_image_string}}}}; `png` is a PNG
/// file's bytes, its size and colour type are read from its header (dew::Error when it is not a PNG).
std::string image_event(double wall_time, int64_t step, const std::string& tag, const std::string& png);
/// Event{..., summary{value{tag, metadata{plugin_data{plugin_name: "text"}}, tensor{DT_STRING, shape [],
/// string_val}}}}: a markdown text for the text dashboard.
std::string text_event(double wall_time, int64_t step, const std::string& tag, const std::string& text);

/// What truncate_event_files needs to know of an Event payload.
struct EventInfo {
  bool file_version = false;      // the file's first event (no step)
  int64_t step = 0;               // Event.step (0 when absent)
  std::vector<std::string> tags;  // the tags of its summary values
};
/// Decodes the fields above from an Event payload; malformed bytes are a dew::Error.
EventInfo parse_event(const std::string& payload);

/// Width and height of a PNG from its IHDR chunk, and its channel count (1 grey, 2 grey + alpha, 3 RGB,
/// 4 RGBA; palette images count as 3); a dew::Error when `png` is not a PNG.
struct PngHeader {
  int64_t width = 0, height = 0, channels = 0;
};
PngHeader png_header(const std::string& png);

}  // namespace tb

/// Appends events to a new file in `dir` (created if missing) named events.out.tfevents.<time>.<host>.<pid>.<n>
/// as TensorFlow names them. <time> is the start's wall time in seconds, raised past the newest file already
/// in `dir` so that names sort in the order of the starts (TensorBoard reads a directory's files in name
/// order). Every event is flushed as it is written, so a kill leaves at most one torn record at the end.
class EventWriter {
 public:
  explicit EventWriter(const std::string& dir);
  void add_scalar(const std::string& tag, int64_t step, double value);
  /// `png`: the bytes of a PNG file (a sample grid).
  void add_image_png(const std::string& tag, int64_t step, const std::string& png);
  void add_text(const std::string& tag, int64_t step, const std::string& markdown);
  /// The file written.
  const std::string& path() const { return path_; }

 private:
  void write(const std::string& event);
  std::string path_;
  std::ofstream out_;
};

/// Whether `name` (a file name, no directory) is an event file TensorBoard reads: it contains "tfevents".
bool is_event_file(const std::string& name);

/// Cuts the event files of `dir` back to `step`, as truncate_jsonl does metrics.jsonl: each file keeps its
/// file_version event and the events with step <= `step`, less those at exactly `step` whose tag is in
/// `redo_at_step` (what the resumed start logs again at its first step, e.g. the recipe). A file with
/// nothing else left is removed, one that changed is rewritten atomically (through a temporary name
/// TensorBoard does not read, then a rename), and a torn last record is dropped. A missing `dir` is left
/// missing. A kill at any point leaves every file either as it was or cut; the next start cuts again.
void truncate_event_files(const std::string& dir, int64_t step, const std::set<std::string>& redo_at_step = {});

}  // namespace dew::io
