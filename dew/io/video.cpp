#include "dew/io/video.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <unordered_map>

#include "dew/core/error.h"
#include "dew/io/files.h"
#include "dew/io/image.h"

namespace dew::io {

namespace {

void check_videos(const at::Tensor& v, const char* where) {
  DEW_CHECK(v.defined() && v.dim() == 5, where, ": expected videos [N, C, T, H, W], got ",
            v.defined() ? c10::str(v.sizes()) : std::string("undefined"));
  DEW_CHECK(v.size(0) >= 1 && v.size(2) >= 1, where, ": need at least one video and one frame, got ", v.sizes());
}

// Variable-width LZW codes packed little-endian into bytes, as GIF wants.
struct BitWriter {
  std::vector<uint8_t> bytes;
  uint32_t acc = 0;
  int nbits = 0;
  void put(uint32_t code, int width) {
    acc |= code << nbits;
    nbits += width;
    while (nbits >= 8) {
      bytes.push_back(uint8_t(acc & 0xff));
      acc >>= 8;
      nbits -= 8;
    }
  }
  void flush() {
    if (nbits > 0) bytes.push_back(uint8_t(acc & 0xff));
    acc = 0;
    nbits = 0;
  }
};

// GIF LZW over 8-bit indices (minimum code size 8): clear = 256, end = 257, codes up to 12 bits.
std::vector<uint8_t> lzw(const std::vector<uint8_t>& idx) {
  const uint32_t clear = 256, end = 257;
  BitWriter w;
  std::unordered_map<uint32_t, uint32_t> table;  // (prefix code << 8 | byte) -> code
  table.reserve(8192);
  uint32_t next = 258;
  int width = 9;
  w.put(clear, width);
  if (idx.empty()) {
    w.put(end, width);
    w.flush();
    return w.bytes;
  }
  uint32_t prefix = idx[0];
  for (size_t i = 1; i < idx.size(); ++i) {
    const uint32_t key = (prefix << 8) | idx[i];
    auto it = table.find(key);
    if (it != table.end()) {
      prefix = it->second;
      continue;
    }
    w.put(prefix, width);
    if (next < 4096) {
      table.emplace(key, next);
      // The decoder widens one code later than the encoder adds the entry that needs it.
      if (next == (1u << width) && width < 12) ++width;
      ++next;
    } else {
      w.put(clear, width);
      table.clear();
      next = 258;
      width = 9;
    }
    prefix = idx[i];
  }
  w.put(prefix, width);
  w.put(end, width);
  w.flush();
  return w.bytes;
}

void put16(std::vector<uint8_t>& out, int64_t v) {
  out.push_back(uint8_t(v & 0xff));
  out.push_back(uint8_t((v >> 8) & 0xff));
}

}  // namespace

at::Tensor video_strip(const at::Tensor& videos, int64_t padding) {
  check_videos(videos, "video_strip");
  const int64_t N = videos.size(0), T = videos.size(2);
  // [N, C, T, H, W] -> [N T, C, H, W] in row-major (video, frame) order: one row per video.
  at::Tensor tiles = videos.permute({0, 2, 1, 3, 4}).reshape({N * T, videos.size(1), videos.size(3), videos.size(4)});
  return make_grid(tiles, T, padding);
}

void save_video_strip(const std::string& path, const at::Tensor& videos, int64_t padding) {
  save_png(path, video_strip(videos, padding));
}

at::Tensor video_frames(const at::Tensor& videos, int64_t nrow, int64_t padding) {
  check_videos(videos, "video_frames");
  std::vector<at::Tensor> frames;
  for (int64_t t = 0; t < videos.size(2); ++t) frames.push_back(make_grid(videos.select(2, t), nrow, padding));
  return at::stack(frames);
}

std::vector<uint8_t> encode_gif(const at::Tensor& frames_in, int64_t delay_cs) {
  DEW_CHECK(frames_in.defined() && frames_in.dim() == 4 && (frames_in.size(1) == 1 || frames_in.size(1) == 3),
            "encode_gif: expected frames [T, C, H, W] with C = 1 or 3, got ",
            frames_in.defined() ? c10::str(frames_in.sizes()) : std::string("undefined"));
  DEW_CHECK(frames_in.size(0) >= 1 && frames_in.size(2) >= 1 && frames_in.size(3) >= 1 && frames_in.size(2) <= 65535 &&
                frames_in.size(3) <= 65535,
            "encode_gif: frame sides must be in [1, 65535] and T >= 1, got ", frames_in.sizes());
  DEW_CHECK(delay_cs >= 0 && delay_cs <= 65535, "encode_gif: delay_cs must be in [0, 65535], got ", delay_cs);
  at::Tensor frames = (frames_in.scalar_type() == at::kByte ? frames_in : to_uint8(frames_in)).contiguous();
  const int64_t T = frames.size(0), C = frames.size(1), H = frames.size(2), W = frames.size(3);
  const bool grey = C == 1;

  std::vector<uint8_t> out = {'G', 'I', 'F', '8', '9', 'a'};
  put16(out, W);
  put16(out, H);
  out.push_back(0xF7);  // global colour table, 8 bits per primary, 256 entries
  out.push_back(0);     // background colour index
  out.push_back(0);     // no aspect ratio
  for (int i = 0; i < 256; ++i) {
    if (grey) {
      out.insert(out.end(), {uint8_t(i), uint8_t(i), uint8_t(i)});
    } else if (i < 252) {  // 6 x 7 x 6 cube: r major, then g, then b
      const int r = i / 42, g = (i / 6) % 7, b = i % 6;
      out.insert(out.end(), {uint8_t(r * 51), uint8_t((g * 255 + 3) / 6), uint8_t(b * 51)});
    } else {
      out.insert(out.end(), {0, 0, 0});
    }
  }
  // NETSCAPE2.0 application extension: loop forever.
  out.insert(out.end(),
             {0x21, 0xFF, 0x0B, 'N', 'E', 'T', 'S', 'C', 'A', 'P', 'E', '2', '.', '0', 0x03, 0x01, 0x00, 0x00, 0x00});
  const uint8_t* px = frames.data_ptr<uint8_t>();
  std::vector<uint8_t> idx(size_t(H * W));
  for (int64_t t = 0; t < T; ++t) {
    const uint8_t* f = px + t * C * H * W;
    for (int64_t p = 0; p < H * W; ++p) {
      if (grey) {
        idx[size_t(p)] = f[p];
      } else {
        const int r = (f[p] * 5 + 127) / 255, g = (f[H * W + p] * 6 + 127) / 255,
                  b = (f[2 * H * W + p] * 5 + 127) / 255;
        idx[size_t(p)] = uint8_t(r * 42 + g * 6 + b);
      }
    }
    out.insert(out.end(), {0x21, 0xF9, 0x04, 0x04});  // graphic control: dispose = leave in place
    put16(out, delay_cs);
    out.insert(out.end(), {0x00, 0x00});
    out.push_back(0x2C);  // image descriptor: whole canvas, no local table
    put16(out, 0);
    put16(out, 0);
    put16(out, W);
    put16(out, H);
    out.push_back(0x00);
    out.push_back(8);  // LZW minimum code size
    const auto data = lzw(idx);
    for (size_t i = 0; i < data.size(); i += 255) {
      const size_t n = std::min<size_t>(255, data.size() - i);
      out.push_back(uint8_t(n));
      out.insert(out.end(), data.begin() + long(i), data.begin() + long(i + n));
    }
    out.push_back(0x00);  // block terminator
  }
  out.push_back(0x3B);  // trailer
  return out;
}

void save_gif(const std::string& path, const at::Tensor& videos, int64_t nrow, int64_t delay_cs) {
  const auto bytes = encode_gif(video_frames(videos, nrow), delay_cs);
  write_file_atomic(path, std::string(bytes.begin(), bytes.end()));
}

void save_png_sequence(const std::string& dir, const at::Tensor& videos, int64_t nrow) {
  namespace fs = std::filesystem;
  at::Tensor frames = video_frames(videos, nrow);
  std::error_code ec;
  fs::create_directories(dir, ec);
  DEW_CHECK(!ec, "save_png_sequence: cannot create ", dir, ": ", ec.message());
  for (int64_t t = 0; t < frames.size(0); ++t) {
    char name[32];
    std::snprintf(name, sizeof(name), "frame_%03lld.png", static_cast<long long>(t));
    save_png((fs::path(dir) / name).string(), frames[t]);
  }
}

}  // namespace dew::io
