#include "dew/io/image.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <vector>

#include "dew/core/error.h"
#include "dew/io/files.h"
#include "dew/io/image_decode.h"

// The stb writer and resizer implementations live in this translation unit only (one definition per
// program; the decoder is in image_decode.cpp). They are third-party C code: silence the warnings the
// project's -Wall -Wextra would raise in them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wall"
#pragma GCC diagnostic ignored "-Wextra"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wunused-but-set-variable"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#pragma GCC diagnostic ignored "-Wdouble-promotion"
#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_RESIZE_IMPLEMENTATION
#include <stb_image_resize.h>
#include <stb_image_write.h>
#pragma GCC diagnostic pop

namespace dew {
namespace io {

namespace {

constexpr int64_t kMaxSide = kMaxImageSide;

void check_channels(int64_t c, const std::string& where) {
  DEW_CHECK(c == 1 || c == 3 || c == 4, where, ": channels must be 1 (grey), 3 (RGB) or 4 (RGBA), got ", c);
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

// [C, H, W] uint8 -> contiguous interleaved [H, W, C], the layout stb reads and writes.
at::Tensor to_hwc(const at::Tensor& chw) { return chw.permute({1, 2, 0}).contiguous(); }

std::vector<unsigned char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open image \"", path, "\": ", std::strerror(errno));
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) fail("cannot read image \"", path, "\": ", std::strerror(errno));
  return bytes;
}

}  // namespace

at::Tensor to_uint8(const at::Tensor& image) {
  DEW_CHECK(image.is_floating_point(), "to_uint8: expected a floating-point image in [-1, 1], got dtype ",
            image.scalar_type());
  // Round half up in float32 so 0.0 maps to 128, matching (x + 1) * 127.5 + 0.5 truncated.
  auto x = image.detach().to(at::kCPU, at::kFloat).nan_to_num(0.0, 1.0, -1.0);
  return ((x + 1.0) * 127.5 + 0.5).floor().clamp(0, 255).to(at::kByte);
}

void save_png(const std::string& path, const at::Tensor& image) {
  const std::string where = "save_png(\"" + path + "\")";
  DEW_CHECK(image.defined(), where, ": the image tensor is undefined");
  DEW_CHECK(image.dim() == 3, where, ": expected an image [C, H, W], got shape ", shape_of(image));
  check_channels(image.size(0), where);
  DEW_CHECK(image.size(1) > 0 && image.size(2) > 0 && image.size(1) <= kMaxSide && image.size(2) <= kMaxSide, where,
            ": height and width must be in [1, ", kMaxSide, "], got shape ", shape_of(image));
  at::Tensor u8;
  if (image.scalar_type() == at::kByte) {
    u8 = image.detach().to(at::kCPU);
  } else if (image.is_floating_point()) {
    u8 = to_uint8(image);
  } else {
    fail(where, ": expected dtype uint8 or a floating-point type in [-1, 1], got ", image.scalar_type());
  }
  auto hwc = to_hwc(u8);
  const int h = int(hwc.size(0)), w = int(hwc.size(1)), c = int(hwc.size(2));
  // Encode in memory, then write with checked stream errors: stbi_write_png only reports "failed".
  std::vector<unsigned char> png;
  auto append = [](void* ctx, void* data, int size) {
    auto* out = static_cast<std::vector<unsigned char>*>(ctx);
    auto* p = static_cast<unsigned char*>(data);
    out->insert(out->end(), p, p + size);
  };
  if (!stbi_write_png_to_func(append, &png, w, h, c, hwc.data_ptr<uint8_t>(), w * c))
    fail(where, ": PNG encoding failed");
  try {
    write_file_atomic(path, std::string(png.begin(), png.end()));  // a stopped command leaves no torn PNG
  } catch (const Error& e) {
    fail(where, ": ", e.what());
  }
}

at::Tensor make_grid(const at::Tensor& images, int64_t nrow, int64_t padding, double pad_value) {
  DEW_CHECK(images.defined() && images.dim() == 4, "make_grid: expected images [N, C, H, W], got shape ",
            images.defined() ? shape_of(images) : std::string("undefined"));
  DEW_CHECK(images.size(0) > 0, "make_grid: expected at least one image, got shape ", shape_of(images));
  DEW_CHECK(nrow > 0, "make_grid: nrow must be > 0, got ", nrow);
  DEW_CHECK(padding >= 0, "make_grid: padding must be >= 0, got ", padding);
  const int64_t n = images.size(0), c = images.size(1), h = images.size(2), w = images.size(3);
  const int64_t cols = std::min(nrow, n);
  const int64_t rows = (n + cols - 1) / cols;
  const int64_t th = h + padding, tw = w + padding;  // a tile with its leading padding
  auto grid = at::full({c, rows * th + padding, cols * tw + padding}, pad_value, images.options());
  for (int64_t k = 0; k < n; ++k) {
    const int64_t y = (k / cols) * th + padding, x = (k % cols) * tw + padding;
    grid.narrow(1, y, h).narrow(2, x, w).copy_(images[k]);
  }
  return grid;
}

at::Tensor load_image(const std::string& path, int64_t channels) {
  check_channels(channels, "load_image(\"" + path + "\")");
  // Read the bytes ourselves so a missing file and an undecodable one give different messages.
  auto bytes = read_file(path);
  DecodedImage img = decode_image(bytes.data(), bytes.size(), channels, path);
  auto hwc = at::from_blob(img.pixels.get(), {img.height, img.width, channels}, at::TensorOptions().dtype(at::kByte));
  // clone, not contiguous(): for one channel the permuted view is already contiguous and would keep
  // pointing into stb's buffer, which is freed on return.
  return hwc.permute({2, 0, 1}).clone(at::MemoryFormat::Contiguous);
}

at::Tensor resize(const at::Tensor& image, int64_t height, int64_t width) {
  DEW_CHECK(image.defined() && image.dim() == 3 && image.scalar_type() == at::kByte,
            "resize: expected a uint8 image [C, H, W], got ",
            image.defined() ? shape_of(image) + " " + std::string(c10::toString(image.scalar_type()))
                            : std::string("undefined"));
  DEW_CHECK(image.size(1) > 0 && image.size(2) > 0, "resize: the input image is empty, shape ", shape_of(image));
  DEW_CHECK(height > 0 && width > 0 && height <= kMaxSide && width <= kMaxSide, "resize: target size must be in [1, ",
            kMaxSide, "], got ", height, "x", width);
  const int64_t c = image.size(0);
  DEW_CHECK(c >= 1 && c <= 64, "resize: channels must be in [1, 64], got ", c);
  if (image.size(1) == height && image.size(2) == width) return image.contiguous();
  auto in = to_hwc(image.to(at::kCPU));
  auto out = at::empty({height, width, c}, in.options());
  const int ih = int(in.size(0)), iw = int(in.size(1));
  if (!stbir_resize_uint8(in.data_ptr<uint8_t>(), iw, ih, 0, out.data_ptr<uint8_t>(), int(width), int(height), 0,
                          int(c)))
    fail("resize: stb_image_resize failed for ", iw, "x", ih, " -> ", width, "x", height);
  return out.permute({2, 0, 1}).contiguous();
}

}  // namespace io
}  // namespace dew
