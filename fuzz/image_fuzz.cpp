// libFuzzer target for the image decoders of the image-folder dataset (dew/io/image_decode.cpp, stb_image:
// png, jpg, bmp, gif, tga, psd, pnm): the input is a file's bytes, decoded as load_image decodes it, to
// 1, 3 and 4 channels. Any input must either be refused with a dew::Error or give width x height x
// channels pixels that can all be read; a crash, a sanitizer report or an allocation beyond
// -malloc_limit_mb (a header that claims gigabytes) is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "dew/core/error.h"
#include "dew/io/image_decode.h"

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (int64_t channels : {1, 3, 4}) {
    dew::io::DecodedImage img;
    try {
      img = dew::io::decode_image(data, size, channels, "fuzz-input");
    } catch (const dew::Error&) {
      return 0;
    }
    require(img.width > 0 && img.height > 0 && img.width <= dew::io::kMaxImageSide &&
            img.height <= dew::io::kMaxImageSide && img.channels == channels && img.pixels);
    // Touch every pixel, so ASan reports a buffer smaller than the size stb reported.
    const size_t n = size_t(img.width) * size_t(img.height) * size_t(channels);
    unsigned sum = 0;
    for (size_t i = 0; i < n; ++i) sum += img.pixels.get()[i];
    volatile unsigned sink = sum;
    (void)sink;
  }
  return 0;
}
