// Video samples on disk: a PNG strip (one row of frames per video), an animated GIF, and a PNG
// sequence. Videos are [N, C, T, H, W] (docs/core.md), float in [-1, 1] or uint8.
//
//   dew::io::save_video_strip("runs/v/samples/step_100.png", videos);   // rows = videos, columns = frames
//   dew::io::save_gif("runs/v/samples/step_100.gif", videos, 8, 10);     // frame t = grid of every video's frame t
//   dew::io::save_png_sequence("runs/v/samples/step_100", videos, 8);    // frame_000.png, frame_001.png, ...
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dew {
namespace io {

/// [N, C, T, H, W] -> one image [C, H', W']: video n's frames left to right on row n (make_grid layout,
/// `padding` pixels between tiles).
at::Tensor video_strip(const at::Tensor& videos, int64_t padding = 2);
/// Writes video_strip(videos) as a PNG.
void save_video_strip(const std::string& path, const at::Tensor& videos, int64_t padding = 2);

/// The frames of a sheet of videos: frame t = make_grid(videos[:, :, t], nrow) -> [T, C, H', W'].
at::Tensor video_frames(const at::Tensor& videos, int64_t nrow = 8, int64_t padding = 2);

/// Encodes frames [T, C, H, W] (C = 1 grey or 3 RGB; float in [-1, 1] or uint8) as an animated GIF89a
/// that loops forever, `delay_cs` hundredths of a second per frame. Grey frames use a 256-level grey
/// palette (exact); RGB frames are quantised to a 6 x 7 x 6 colour cube. LZW with variable code width
/// (up to 12 bits, clear code when the table is full).
std::vector<uint8_t> encode_gif(const at::Tensor& frames, int64_t delay_cs = 10);
/// Writes encode_gif(video_frames(videos, nrow), delay_cs) atomically; errors name the path.
void save_gif(const std::string& path, const at::Tensor& videos, int64_t nrow = 8, int64_t delay_cs = 10);

/// Writes video_frames(videos, nrow) as DIR/frame_000.png, frame_001.png, ... (DIR is created).
void save_png_sequence(const std::string& dir, const at::Tensor& videos, int64_t nrow = 8);

}  // namespace io
}  // namespace dew
