// Video files: the GIF encoder against stb_image's independent GIF decoder, strips and PNG sequences.
#include <gtest/gtest.h>
#include <stb_image.h>
#include <torch/torch.h>

#include <filesystem>

#include "dew/io/image.h"
#include "dew/io/video.h"
#include "tests/test_util.h"

namespace {

// Decodes an animated GIF with stb_image: frames [T, H, W, 4] uint8 (RGBA).
at::Tensor decode_gif(const std::vector<uint8_t>& bytes) {
  int* delays = nullptr;
  int w = 0, h = 0, frames = 0, comp = 0;
  stbi_uc* px = stbi_load_gif_from_memory(bytes.data(), int(bytes.size()), &delays, &w, &h, &frames, &comp, 4);
  if (!px) return {};
  auto out = torch::from_blob(px, {frames, h, w, 4}, at::kByte).clone();
  stbi_image_free(px);
  stbi_image_free(delays);
  return out;
}

TEST(Video, GreyGifDecodesExactlyWithAnIndependentDecoder) {
  // 200 x 200 random pixels: far more than 4096 LZW codes, so the table fills and is cleared mid-frame.
  torch::manual_seed(0);
  auto frames = torch::randint(0, 256, {3, 1, 200, 200}, at::kByte);
  frames[1].fill_(7);  // a constant frame: long runs, the widest codes
  auto gif = dew::io::encode_gif(frames, 5);
  auto dec = decode_gif(gif);
  ASSERT_TRUE(dec.defined()) << stbi_failure_reason();
  ASSERT_EQ(dec.sizes(), (std::vector<int64_t>{3, 200, 200, 4}));
  for (int c = 0; c < 3; ++c) EXPECT_TRUE(dec.select(3, c).equal(frames.squeeze(1))) << "channel " << c;
}

TEST(Video, RgbGifUsesTheNearestColourCubeEntry) {
  torch::manual_seed(1);
  auto frames = torch::randint(0, 256, {2, 3, 9, 11}, at::kByte);
  auto dec = decode_gif(dew::io::encode_gif(frames));
  ASSERT_TRUE(dec.defined()) << stbi_failure_reason();
  // Expected by hand: red and blue take 6 levels (multiples of 51), green 7 levels (round(k * 255 / 6)).
  auto f = frames.to(at::kDouble);
  auto r = (f.select(1, 0) / 51).round() * 51;
  auto g = ((f.select(1, 1) * 6 / 255).round() * 255 / 6).round();
  auto b = (f.select(1, 2) / 51).round() * 51;
  EXPECT_TRUE(dec.select(3, 0).to(at::kDouble).equal(r));
  EXPECT_LE((dec.select(3, 1).to(at::kDouble) - g).abs().max().item<double>(), 1.0);
  EXPECT_TRUE(dec.select(3, 2).to(at::kDouble).equal(b));
}

TEST(Video, StripPutsEachVideoOnItsOwnRow) {
  // Pixel value = 10 n + t identifies (video, frame).
  auto v = torch::zeros({2, 1, 3, 4, 4}, at::kByte);
  for (int n = 0; n < 2; ++n)
    for (int t = 0; t < 3; ++t) v[n][0][t].fill_(10 * n + t + 1);
  auto strip = dew::io::video_strip(v, 1);
  ASSERT_EQ(strip.sizes(), (std::vector<int64_t>{1, 2 * 5 + 1, 3 * 5 + 1}));
  for (int n = 0; n < 2; ++n)
    for (int t = 0; t < 3; ++t) EXPECT_EQ(strip[0][1 + 5 * n][1 + 5 * t].item<int>(), 10 * n + t + 1);
  auto frames = dew::io::video_frames(v, 2, 1);  // frame t: both videos side by side
  ASSERT_EQ(frames.sizes(), (std::vector<int64_t>{3, 1, 6, 11}));
  EXPECT_EQ(frames[2][0][1][6].item<int>(), 13);
}

TEST(Video, FilesAreWrittenAndBadShapesAreErrors) {
  dew::test::TempDir dir("video");
  auto v = torch::rand({2, 1, 4, 8, 8}) * 2 - 1;
  dew::io::save_gif(dir.file("a.gif"), v, 2, 10);
  dew::io::save_png_sequence(dir.file("seq"), v, 2);
  dew::io::save_video_strip(dir.file("strip.png"), v);
  EXPECT_TRUE(std::filesystem::exists(dir.file("a.gif")));
  EXPECT_TRUE(std::filesystem::exists(dir.file("seq/frame_003.png")));
  EXPECT_EQ(dew::io::load_image(dir.file("strip.png"), 1).size(1), 2 * 10 + 2);
  EXPECT_NE(dew::test::error_of([&] {
              dew::io::video_strip(torch::zeros({2, 1, 8, 8}), 2);
            }).find("[N, C, T, H, W]"),
            std::string::npos);
  EXPECT_NE(dew::test::error_of([&] {
              dew::io::encode_gif(torch::zeros({2, 2, 8, 8}));
            }).find("C = 1 or 3"),
            std::string::npos);
}

}  // namespace
