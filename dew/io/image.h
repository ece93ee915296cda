// Image files on the LibTorch side (README.md, docs/training.md#data-dewdata): PNG writing for preview grids, png/jpg
// reading for image-folder datasets, resizing, and the grid layout of sample sheets. Images are
// channel-first [C, H, W]; files are decoded and encoded with stb (libstb-dev).
//
// Example:
//   at::Tensor img = dew::io::load_image("cat.jpg", 3);            // uint8 [3, H, W]
//   at::Tensor small = dew::io::resize(img, 64, 64);               // uint8 [3, 64, 64]
//   at::Tensor grid = dew::io::make_grid(samples, 8, 2);           // samples: [N, C, H, W] -> [C, H', W']
//   dew::io::save_png("runs/x/samples/step_100.png", grid);        // float in [-1, 1] or uint8
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace dew {
namespace io {

/// Maps a floating-point image in [-1, 1] to uint8 [0, 255]: round((x + 1) * 127.5), clamped; NaN -> 128.
at::Tensor to_uint8(const at::Tensor& image);

/// Writes `image` [C, H, W] (C = 1 grey, 3 RGB or 4 RGBA) as a PNG file. uint8 is written as is, a
/// floating-point image is read as [-1, 1] (to_uint8). Bad shapes/dtypes and unwritable paths are a
/// dew::Error naming the path.
void save_png(const std::string& path, const at::Tensor& image);

/// Tiles `images` [N, C, H, W] into one image [C, rows (H + padding) + padding, cols (W + padding) + padding]
/// with cols = min(nrow, N) images per row and `padding` pixels of `pad_value` around and between
/// tiles (torchvision's make_grid layout). Keeps the input dtype.
at::Tensor make_grid(const at::Tensor& images, int64_t nrow = 8, int64_t padding = 2, double pad_value = 0.0);

/// Reads a png/jpg/bmp/gif/tga/psd file as uint8 [channels, H, W]; channels = 1 (grey), 3 (RGB) or 4
/// (RGBA), converted from whatever the file holds. Missing, unreadable or undecodable files are a
/// dew::Error naming the path and stb's reason.
at::Tensor load_image(const std::string& path, int64_t channels = 3);

/// Resamples a uint8 image [C, H, W] to [C, height, width] with stb_image_resize's default filters
/// (Catmull-Rom up, Mitchell down); an image already of that size is returned as is.
at::Tensor resize(const at::Tensor& image, int64_t height, int64_t width);

}  // namespace io
}  // namespace dew
