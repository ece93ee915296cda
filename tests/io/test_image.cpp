#include <gtest/gtest.h>

#include "tests/test_util.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <functional>

#include "dew/core/error.h"
#include "dew/io/image.h"

namespace fs = std::filesystem;

namespace {

using dew::test::TempDir;

using dew::test::error_of;

at::Tensor random_u8(std::vector<int64_t> shape, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(0, 256, shape, g, at::TensorOptions().dtype(at::kByte));
}

}  // namespace

TEST(Image, PngRoundTripIsBitExact) {
  TempDir dir("roundtrip");
  for (int64_t c : {1, 3, 4}) {
    auto img = random_u8({c, 17, 23}, uint64_t(c));
    const auto path = dir.file("img" + std::to_string(c) + ".png");
    dew::io::save_png(path, img);
    auto back = dew::io::load_image(path, c);
    EXPECT_EQ(back.scalar_type(), at::kByte);
    ASSERT_EQ(back.sizes(), img.sizes()) << "channels " << c;
    EXPECT_TRUE(at::equal(back, img)) << "channels " << c;
  }
}

TEST(Image, LoadConvertsChannels) {
  TempDir dir("channels");
  auto grey = random_u8({1, 5, 6}, 7);
  dew::io::save_png(dir.file("g.png"), grey);
  auto rgb = dew::io::load_image(dir.file("g.png"), 3);
  ASSERT_EQ(rgb.sizes(), (std::vector<int64_t>{3, 5, 6}));
  for (int64_t c = 0; c < 3; ++c) EXPECT_TRUE(at::equal(rgb[c], grey[0]));  // grey -> RGB replicates
  auto colour = random_u8({3, 5, 6}, 8);
  dew::io::save_png(dir.file("c.png"), colour);
  EXPECT_EQ(dew::io::load_image(dir.file("c.png"), 1).sizes(), (std::vector<int64_t>{1, 5, 6}));
}

TEST(Image, FloatImagesMapFromMinusOneToOne) {
  auto x = at::tensor({-1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 2.0f, -3.0f, NAN}).view({1, 2, 4});
  auto u = dew::io::to_uint8(x);
  // round((x + 1) * 127.5), clamped; NaN is drawn as 0 (mid-grey).
  std::vector<int64_t> want{0, 64, 128, 191, 255, 255, 0, 128};
  auto flat = u.flatten().to(at::kLong);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(flat[int64_t(i)].item<int64_t>(), want[i]) << i;
  TempDir dir("float");
  dew::io::save_png(dir.file("f.png"), x);
  EXPECT_TRUE(at::equal(dew::io::load_image(dir.file("f.png"), 1), u));
}

TEST(Image, SaveRejectsBadInputAndNamesThePath) {
  TempDir dir("badsave");
  auto m1 = error_of([&] { dew::io::save_png(dir.file("a.png"), at::zeros({2, 4, 4}, at::kByte)); });
  EXPECT_NE(m1.find("channels must be 1 (grey), 3 (RGB) or 4 (RGBA), got 2"), std::string::npos) << m1;
  EXPECT_NE(m1.find("a.png"), std::string::npos) << m1;
  auto m2 = error_of([&] { dew::io::save_png(dir.file("b.png"), at::zeros({4, 4}, at::kByte)); });
  EXPECT_NE(m2.find("expected an image [C, H, W]"), std::string::npos) << m2;
  auto m3 = error_of([&] { dew::io::save_png(dir.file("c.png"), at::zeros({1, 4, 4}, at::kInt)); });
  EXPECT_NE(m3.find("expected dtype uint8 or a floating-point type"), std::string::npos) << m3;
  const auto missing = dir.file("no/such/dir/d.png");
  auto m4 = error_of([&] { dew::io::save_png(missing, at::zeros({1, 4, 4}, at::kByte)); });
  EXPECT_NE(m4.find(missing), std::string::npos) << m4;
  EXPECT_NE(m4.find("cannot write"), std::string::npos) << m4;
}

TEST(Image, LoadErrorsNameTheFile) {
  TempDir dir("badload");
  const auto missing = dir.file("missing.png");
  auto m1 = error_of([&] { dew::io::load_image(missing, 3); });
  EXPECT_NE(m1.find("cannot open image \"" + missing + "\""), std::string::npos) << m1;

  const auto garbage = dir.file("garbage.png");
  std::ofstream(garbage, std::ios::binary) << "this is not an image at all";
  auto m2 = error_of([&] { dew::io::load_image(garbage, 3); });
  EXPECT_NE(m2.find("cannot decode image \"" + garbage + "\""), std::string::npos) << m2;

  // A real PNG cut in half: the header parses, the pixel data does not.
  const auto good = dir.file("good.png"), cut = dir.file("cut.png");
  dew::io::save_png(good, random_u8({3, 32, 32}, 3));
  std::ifstream in(good, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::ofstream(cut, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  auto m3 = error_of([&] { dew::io::load_image(cut, 3); });
  EXPECT_NE(m3.find(cut), std::string::npos) << m3;

  const auto empty = dir.file("empty.jpg");
  std::ofstream(empty, std::ios::binary).close();
  auto m4 = error_of([&] { dew::io::load_image(empty, 3); });
  EXPECT_NE(m4.find("the file is empty"), std::string::npos) << m4;

  auto m5 = error_of([&] { dew::io::load_image(good, 2); });
  EXPECT_NE(m5.find("channels must be 1 (grey), 3 (RGB) or 4 (RGBA), got 2"), std::string::npos) << m5;
}

TEST(Image, MakeGridPlacesTilesRowMajor) {
  // Five 2x3 tiles, tile k filled with k + 1; three per row, padding 1 of value 0.
  const int64_t n = 5, h = 2, w = 3, pad = 1, nrow = 3;
  auto tiles = at::arange(1, n + 1, at::kFloat).view({n, 1, 1, 1}).expand({n, 1, h, w}).contiguous();
  auto grid = dew::io::make_grid(tiles, nrow, pad);
  ASSERT_EQ(grid.sizes(), (std::vector<int64_t>{1, 2 * (h + pad) + pad, 3 * (w + pad) + pad}));
  EXPECT_EQ(grid.scalar_type(), at::kFloat);
  auto expected = at::zeros_like(grid);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t y = pad + (k / nrow) * (h + pad), x = pad + (k % nrow) * (w + pad);
    expected.narrow(1, y, h).narrow(2, x, w).fill_(double(k + 1));
  }
  EXPECT_TRUE(at::equal(grid, expected)) << grid;
  // The sixth slot stays padding, and so do the borders.
  EXPECT_EQ(grid.sum().item<double>(), double(h * w * (1 + 2 + 3 + 4 + 5)));

  // Fewer images than nrow: one row as wide as the images; pad_value fills the gaps.
  auto two = dew::io::make_grid(at::ones({2, 3, 4, 4}, at::kByte), 8, 2, 7);
  ASSERT_EQ(two.sizes(), (std::vector<int64_t>{3, 4 + 4, 2 * (4 + 2) + 2}));
  EXPECT_EQ(two.scalar_type(), at::kByte);
  EXPECT_EQ(two[0][0][0].item<int64_t>(), 7);
  EXPECT_EQ(two[0][2][2].item<int64_t>(), 1);
  EXPECT_EQ(two[0][2][6].item<int64_t>(), 7);
  auto bad = error_of([] { dew::io::make_grid(at::zeros({3, 4, 4}), 2, 1); });
  EXPECT_NE(bad.find("expected images [N, C, H, W]"), std::string::npos) << bad;
}

TEST(Image, ResizeKeepsConstantsAndShapes) {
  auto flat = at::full({3, 10, 14}, 77, at::TensorOptions().dtype(at::kByte));
  for (auto hw : std::vector<std::pair<int64_t, int64_t>>{{5, 7}, {20, 28}, {3, 31}}) {
    auto r = dew::io::resize(flat, hw.first, hw.second);
    ASSERT_EQ(r.sizes(), (std::vector<int64_t>{3, hw.first, hw.second}));
    EXPECT_EQ(r.min().item<int64_t>(), 77);
    EXPECT_EQ(r.max().item<int64_t>(), 77);
  }
  // Downsampling by two averages: a left-dark/right-bright image stays dark on the left, bright on the right.
  auto half = at::cat({at::zeros({1, 8, 8}, at::kByte), at::full({1, 8, 8}, 200, at::kByte)}, 2);
  auto small = dew::io::resize(half, 4, 8);
  EXPECT_LT(small[0][2][0].item<int64_t>(), 10);
  EXPECT_GT(small[0][2][7].item<int64_t>(), 190);
  auto same = random_u8({1, 6, 6}, 1);
  EXPECT_TRUE(at::equal(dew::io::resize(same, 6, 6), same));
  auto bad = error_of([] { dew::io::resize(at::zeros({1, 4, 4}, at::kFloat), 2, 2); });
  EXPECT_NE(bad.find("expected a uint8 image [C, H, W]"), std::string::npos) << bad;
  auto bad_size = error_of([] { dew::io::resize(at::zeros({1, 4, 4}, at::kByte), 0, 2); });
  EXPECT_NE(bad_size.find("target size must be in [1, 32768], got 0x2"), std::string::npos) << bad_size;
}
