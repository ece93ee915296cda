#include "dew/io/tensorboard.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "dew/core/error.h"
#include "dew/io/files.h"

namespace dew::io {

namespace fs = std::filesystem;

namespace {

// The byte-at-a-time table of the reflected Castagnoli polynomial.
const std::array<uint32_t, 256>& crc32c_byte_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

void pb_put_le(std::string& out, uint64_t x, int bytes) {
  for (int i = 0; i < bytes; ++i) out += char((x >> (8 * i)) & 0xff);
}

uint64_t pb_get_le(const char* p, int bytes) {
  uint64_t x = 0;
  for (int i = 0; i < bytes; ++i) x |= uint64_t(uint8_t(p[i])) << (8 * i);
  return x;
}

// Protocol buffer wire format: a field key is (number << 3) | wire type; 0 varint, 1 fixed64, 2
// length-delimited, 5 fixed32.
void pb_put_varint(std::string& out, uint64_t x) {
  while (x >= 0x80) {
    out += char((x & 0x7f) | 0x80);
    x >>= 7;
  }
  out += char(x);
}
void pb_put_key(std::string& out, int field, int wire) { pb_put_varint(out, uint64_t(field) << 3 | uint64_t(wire)); }
void pb_put_bytes(std::string& out, int field, const std::string& bytes) {
  pb_put_key(out, field, 2);
  pb_put_varint(out, bytes.size());
  out += bytes;
}
void pb_put_uint(std::string& out, int field, uint64_t x) {
  pb_put_key(out, field, 0);
  pb_put_varint(out, x);
}

// Event{wall_time = 1 (double), step = 2 (int64), summary = 5} around one Summary.Value.
std::string event_with_value(double wall_time, int64_t step, const std::string& value) {
  std::string summary, ev;
  pb_put_bytes(summary, 1, value);  // Summary.value
  uint64_t bits;
  std::memcpy(&bits, &wall_time, 8);
  pb_put_key(ev, 1, 1);
  pb_put_le(ev, bits, 8);
  if (step != 0) pb_put_uint(ev, 2, uint64_t(step));  // proto3 leaves a zero out, as protobuf does
  pb_put_bytes(ev, 5, summary);
  return ev;
}

// A cursor over one message's bytes; malformed input is a dew::Error.
struct PbReader {
  const std::string& s;
  size_t pos = 0;
  size_t end;
  PbReader(const std::string& bytes, size_t begin, size_t stop) : s(bytes), pos(begin), end(stop) {}
  bool done() const { return pos >= end; }
  uint64_t varint() {
    uint64_t x = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      DEW_CHECK(pos < end, "TensorBoard event: truncated varint");
      const uint8_t b = uint8_t(s[pos++]);
      x |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return x;
    }
    fail("TensorBoard event: varint longer than 10 bytes");
  }
  // Reads a key; returns the field number and sets the wire type; for a length-delimited field, the range of
  // its bytes.
  int field(int& wire, size_t& begin, size_t& stop) {
    const uint64_t key = varint();
    wire = int(key & 7);
    begin = stop = pos;
    if (wire == 0) {
      begin = pos;
      varint();
      stop = pos;
    } else if (wire == 1 || wire == 5) {
      const size_t n = wire == 1 ? 8 : 4;
      DEW_CHECK(end - pos >= n, "TensorBoard event: truncated fixed-width field");
      begin = pos;
      pos += n;
      stop = pos;
    } else if (wire == 2) {
      const uint64_t n = varint();
      DEW_CHECK(n <= end - pos, "TensorBoard event: length-delimited field past the end");
      begin = pos;
      pos += size_t(n);
      stop = pos;
    } else {
      fail("TensorBoard event: unsupported wire type ", wire);
    }
    return int(key >> 3);
  }
};

std::string event_host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof buf - 1) != 0 || !buf[0]) return "localhost";
  return buf;
}

double event_wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

constexpr const char* kEventFilePrefix = "events.out.tfevents.";
// The temporary name truncate_event_files rewrites through: without "tfevents", so TensorBoard never reads
// a half-written copy (or a complete one left by a kill before the rename).
constexpr const char* kRewriteTmp = "tb_rewrite.tmp";

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto& t = crc32c_byte_table();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = t[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord(const std::string& payload) {
  std::string out;
  pb_put_le(out, payload.size(), 8);
  const uint32_t len_crc = masked_crc32c(out.data(), 8);
  pb_put_le(out, len_crc, 4);
  out += payload;
  pb_put_le(out, masked_crc32c(payload.data(), payload.size()), 4);
  return out;
}

std::vector<std::string> read_tfrecords(const std::string& bytes, bool* clean) {
  std::vector<std::string> out;
  size_t pos = 0;
  bool ok = true;
  while (pos < bytes.size()) {
    if (bytes.size() - pos < 12 ||
        uint32_t(pb_get_le(bytes.data() + pos + 8, 4)) != masked_crc32c(bytes.data() + pos, 8)) {
      ok = false;
      break;
    }
    const uint64_t n = pb_get_le(bytes.data() + pos, 8);
    if (n > bytes.size() - pos - 12 || bytes.size() - pos - 12 - n < 4) {
      ok = false;
      break;
    }
    const char* data = bytes.data() + pos + 12;
    if (uint32_t(pb_get_le(data + n, 4)) != masked_crc32c(data, size_t(n))) {
      ok = false;
      break;
    }
    out.emplace_back(data, size_t(n));
    pos += 12 + size_t(n) + 4;
  }
  if (clean) *clean = ok;
  return out;
}

namespace tb {

std::string file_version_event(double wall_time) {
  std::string ev;
  uint64_t bits;
  std::memcpy(&bits, &wall_time, 8);
  pb_put_key(ev, 1, 1);
  pb_put_le(ev, bits, 8);
  pb_put_bytes(ev, 3, "brain.Event:2");
  return ev;
}

std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value) {
  std::string v;
  pb_put_bytes(v, 1, tag);  // Value.tag
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  pb_put_key(v, 2, 5);  // Value.simple_value (float)
  pb_put_le(v, bits, 4);
  return event_with_value(wall_time, step, v);
}

PngHeader png_header(const std::string& png) {
  static const char kSignature[8] = {'\x89', 'P', 'N', 'G', '\r', '\n', '\x1a', '\n'};
  DEW_CHECK(png.size() >= 33 && std::memcmp(png.data(), kSignature, 8) == 0 && png.compare(12, 4, "IHDR") == 0,
            "TensorBoard image: expected the bytes of a PNG file (signature and IHDR chunk), got ", png.size(),
            " bytes that are not");
  auto be32 = [&](size_t at) {
    uint32_t x = 0;
    for (size_t i = 0; i < 4; ++i) x = x << 8 | uint8_t(png[at + i]);
    return x;
  };
  PngHeader h;
  h.width = be32(16);
  h.height = be32(20);
  const int colour = uint8_t(png[25]);
  h.channels = colour == 0 ? 1 : colour == 4 ? 2 : colour == 6 ? 4 : 3;  // 2 RGB, 3 palette -> RGB
  return h;
}

std::string image_event(double wall_time, int64_t step, const std::string& tag, const std::string& png) {
  const PngHeader h = png_header(png);
  std::string image, v;
  pb_put_uint(image, 1, uint64_t(h.height));    // Image.height
  pb_put_uint(image, 2, uint64_t(h.width));     // Image.width
  pb_put_uint(image, 3, uint64_t(h.channels));  // Image.colorspace: 1 grey, 2 grey+alpha, 3 RGB, 4 RGBA
  pb_put_bytes(image, 4, png);                  // Image.encoded_image_string
  pb_put_bytes(v, 1, tag);
  pb_put_bytes(v, 4, image);  // Value.image
  return event_with_value(wall_time, step, v);
}

std::string text_event(double wall_time, int64_t step, const std::string& tag, const std::string& text) {
  std::string plugin, metadata, tensor, v;
  pb_put_bytes(plugin, 1, "text");    // PluginData.plugin_name (content empty: TextPluginData version 0)
  pb_put_bytes(metadata, 1, plugin);  // SummaryMetadata.plugin_data
  pb_put_uint(tensor, 1, 7);          // TensorProto.dtype = DT_STRING
  pb_put_bytes(tensor, 2, "");        // TensorProto.tensor_shape: no dims, a scalar
  pb_put_bytes(tensor, 8, text);      // TensorProto.string_val
  pb_put_bytes(v, 1, tag);
  pb_put_bytes(v, 8, tensor);    // Value.tensor
  pb_put_bytes(v, 9, metadata);  // Value.metadata
  return event_with_value(wall_time, step, v);
}

EventInfo parse_event(const std::string& payload) {
  EventInfo info;
  PbReader ev(payload, 0, payload.size());
  int wire;
  size_t b, e;
  while (!ev.done()) {
    const int f = ev.field(wire, b, e);
    if (f == 2 && wire == 0) {
      PbReader r(payload, b, e);
      info.step = int64_t(r.varint());
    } else if (f == 3 && wire == 2) {
      info.file_version = true;
    } else if (f == 5 && wire == 2) {
      PbReader summary(payload, b, e);
      while (!summary.done()) {
        size_t vb, ve;
        if (summary.field(wire, vb, ve) != 1 || wire != 2) continue;
        PbReader value(payload, vb, ve);
        while (!value.done()) {
          size_t tag_begin, tag_end;
          if (value.field(wire, tag_begin, tag_end) == 1 && wire == 2)
            info.tags.push_back(payload.substr(tag_begin, tag_end - tag_begin));
        }
      }
    }
  }
  return info;
}

}  // namespace tb

bool is_event_file(const std::string& name) { return name.find("tfevents") != std::string::npos; }

EventWriter::EventWriter(const std::string& dir) {
  fs::create_directories(dir);
  // The newest start's time in the names present: this file's name must sort after every one of them.
  int64_t t = int64_t(event_wall_time());
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kEventFilePrefix, 0) != 0) continue;
    const std::string rest = name.substr(std::strlen(kEventFilePrefix));
    const size_t dot = rest.find('.');
    try {
      t = std::max(t, int64_t(std::stoll(rest.substr(0, dot))) + 1);
    } catch (const std::exception&) {
      // Not a number: a name another tool chose; it does not take part in the order.
    }
  }
  static std::atomic<int64_t> counter{0};
  path_ = (fs::path(dir) / (kEventFilePrefix + std::to_string(t) + "." + event_host_name() + "." +
                            std::to_string(getpid()) + "." + std::to_string(counter++)))
              .string();
  out_.open(path_, std::ios::binary | std::ios::app);
  DEW_CHECK(out_.good(), "TensorBoard: cannot create the event file ", path_, ": ", std::strerror(errno));
  write(tb::file_version_event(event_wall_time()));
}

void EventWriter::write(const std::string& event) {
  const std::string record = tfrecord(event);
  out_.write(record.data(), std::streamsize(record.size()));
  out_.flush();
  DEW_CHECK(out_.good(), "TensorBoard: cannot write to ", path_, ": ", std::strerror(errno));
}

void EventWriter::add_scalar(const std::string& tag, int64_t step, double value) {
  write(tb::scalar_event(event_wall_time(), step, tag, float(value)));
}

void EventWriter::add_image_png(const std::string& tag, int64_t step, const std::string& png) {
  write(tb::image_event(event_wall_time(), step, tag, png));
}

void EventWriter::add_text(const std::string& tag, int64_t step, const std::string& markdown) {
  write(tb::text_event(event_wall_time(), step, tag, markdown));
}

void truncate_event_files(const std::string& dir, int64_t step, const std::set<std::string>& redo_at_step) {
  if (!fs::is_directory(dir)) return;
  // What a kill in the middle of an earlier rewrite left behind.
  for (const char* leftover : {"tb_rewrite.tmp", "tb_rewrite.tmp.tmp"}) fs::remove(fs::path(dir) / leftover);
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.is_regular_file() && is_event_file(entry.path().filename().string()))
      names.push_back(entry.path().string());
  std::sort(names.begin(), names.end());
  bool changed_any = false;
  for (const auto& path : names) {
    bool clean = true;
    const auto records = read_tfrecords(read_file(path, "TensorBoard event file"), &clean);
    std::string kept;
    bool changed = !clean, has_events = false;
    for (const auto& payload : records) {
      tb::EventInfo info;
      try {
        info = tb::parse_event(payload);
      } catch (const Error&) {
        changed = true;  // not an Event: dropped, as a torn record is
        continue;
      }
      bool keep = info.file_version || info.step < step;
      if (!info.file_version && info.step == step) {
        keep = true;
        for (const auto& tag : info.tags)
          if (redo_at_step.count(tag)) keep = false;
      }
      if (!keep) {
        changed = true;
        continue;
      }
      has_events = has_events || !info.file_version;
      kept += tfrecord(payload);
    }
    if (!changed) continue;
    changed_any = true;
    if (!has_events) {
      fs::remove(path);
      continue;
    }
    const std::string tmp = (fs::path(dir) / kRewriteTmp).string();
    write_file_atomic(tmp, kept);
    fs::rename(tmp, path);
  }
  if (changed_any) fsync_path(dir);
}

}  // namespace dew::io
