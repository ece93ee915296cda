// Image decoding without LibTorch (stb_image): the part of load_image (dew/io/image.h) that reads
// untrusted bytes, kept free of ATen so that scripts/fuzz can build it alone (fuzz/image_fuzz.cpp).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace dew {
namespace io {

/// Images larger than this per side are refused before any allocation: stb's int arithmetic and the
/// tensors built from them assume sizes well below 2^31 bytes.
constexpr int kMaxImageSide = 1 << 15;
/// And more than this many pixels (8192 x 8192; a 48-megapixel photo fits): a header claiming gigabytes
/// is refused before stb allocates them (stb's GIF decoder needs about 9 bytes per pixel).
constexpr int64_t kMaxImagePixels = int64_t(1) << 26;

/// Pixels decoded by stb: interleaved [height, width, channels] uint8, row-major.
struct DecodedImage {
  int width = 0;
  int height = 0;
  int channels = 0;
  std::shared_ptr<unsigned char> pixels;  // freed with stbi_image_free
};

/// Decodes an image file's bytes (png, jpg, bmp, gif, tga, psd, pnm) into `channels` (1, 3 or 4)
/// channels. Undecodable bytes, an empty image, a side above kMaxImageSide or more than kMaxImagePixels
/// pixels are a dew::Error naming `path` and the reason, checked before stb allocates the pixels.
DecodedImage decode_image(const unsigned char* bytes, size_t size, int64_t channels, const std::string& path);

}  // namespace io
}  // namespace dew
