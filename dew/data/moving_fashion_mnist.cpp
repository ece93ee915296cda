// Moving Fashion-MNIST (docs/training.md#data-dewdata): a deterministic synthetic video set for the video backbones.
#include <ATen/ATen.h>

#include <cmath>

#include "dew/core/error.h"
#include "dew/core/rng.h"
#include "dew/data/dataset.h"

namespace dew::data {

namespace {

// Position after moving `dist` pixels inside [0, span], reflecting off both ends (a triangle wave).
double bounce(double dist, double span) {
  if (span <= 0) return 0;
  double m = std::fmod(dist, 2 * span);
  if (m < 0) m += 2 * span;
  return m > span ? 2 * span - m : m;
}

}  // namespace

TensorDataset moving_fashion_mnist(const MovingFashionMnistOptions& o) {
  DEW_CHECK(o.split == "train" || o.split == "test", "moving_fashion_mnist.split: got \"", o.split,
            "\", accepted: train, test");
  return moving_fashion_mnist(o, load_fashion_mnist(o.split, o.dir));
}

TensorDataset moving_fashion_mnist(const MovingFashionMnistOptions& o, const TensorDataset& source) {
  const std::string w = "moving_fashion_mnist";
  DEW_CHECK(o.count >= 1, w, ".count: must be >= 1, got ", o.count);
  DEW_CHECK(o.frames >= 1 && o.frames <= 256, w, ".frames: must be in [1, 256], got ", o.frames);
  DEW_CHECK(o.item_size >= 4 && o.item_size <= 28, w, ".item_size: must be in [4, 28], got ", o.item_size);
  DEW_CHECK(o.size >= o.item_size && o.size <= 64, w, ".size: must be in [item_size = ", o.item_size, ", 64], got ",
            o.size);
  DEW_CHECK(o.items >= 1 && o.items <= 8, w, ".items: must be in [1, 8], got ", o.items);
  // The videos are held whole, count x frames x size x size bytes: at most 4 GiB.
  const int64_t max_count = (int64_t(1) << 32) / (o.frames * o.size * o.size);
  DEW_CHECK(o.count <= max_count, w, ".count: ", o.count, " videos of ", o.frames, " x ", o.size, " x ", o.size,
            " bytes exceed the 4 GiB a generated set may hold; accepted: at most ", max_count, " at this size");
  DEW_CHECK(o.min_speed >= 0 && o.max_speed >= o.min_speed, w,
            ".min_speed/max_speed: need 0 <= min_speed <= max_speed, got ", o.min_speed, " and ", o.max_speed);
  const at::Tensor& src = source.field("image");
  DEW_CHECK(src.dim() == 4 && src.size(1) == 1 && src.scalar_type() == at::kByte, w,
            ": source images must be uint8 [N, 1, H, W], got ", src.sizes());
  const at::Tensor& src_labels = source.field("label");

  auto gen = rng::generator(uint64_t(o.seed), 0, "data/moving_fashion_mnist");
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const int64_t N = o.count, K = o.items, T = o.frames, S = o.size, I = o.item_size;
  auto which = at::randint(0, src.size(0), {N, K}, gen, at::TensorOptions().dtype(at::kLong));
  auto start = at::rand({N, K, 2}, gen, f64) * double(S - I);
  auto angle = at::rand({N, K}, gen, f64) * (2 * M_PI);
  auto speed = at::rand({N, K}, gen, f64) * (o.max_speed - o.min_speed) + o.min_speed;

  // The items, resized once: area averaging (adaptive average pooling) keeps thin strokes visible.
  at::Tensor items = src.index_select(0, which.flatten()).to(at::kFloat);  // [N K, 1, 28, 28]
  if (items.size(2) != I || items.size(3) != I) items = at::adaptive_avg_pool2d(items, {I, I});
  items = items.round().clamp(0, 255).to(at::kByte).view({N, K, I, I}).contiguous();

  at::Tensor video = at::zeros({N, 1, T, S, S}, at::TensorOptions().dtype(at::kByte));
  const uint8_t* it = items.data_ptr<uint8_t>();
  uint8_t* out = video.data_ptr<uint8_t>();
  const double* st = start.data_ptr<double>();
  const double* an = angle.data_ptr<double>();
  const double* sp = speed.data_ptr<double>();
  const double span = double(S - I);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t nk = n * K + k;
      const double vy = sp[nk] * std::sin(an[nk]), vx = sp[nk] * std::cos(an[nk]);
      const uint8_t* item = it + nk * I * I;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t y0 = std::lround(bounce(st[2 * nk] + vy * double(t), span));
        const int64_t x0 = std::lround(bounce(st[2 * nk + 1] + vx * double(t), span));
        uint8_t* frame = out + (n * T + t) * S * S;
        for (int64_t r = 0; r < I; ++r)
          for (int64_t c = 0; c < I; ++c) {
            uint8_t& px = frame[(y0 + r) * S + x0 + c];
            px = std::max(px, item[r * I + c]);
          }
      }
    }
  }
  at::Tensor labels = src_labels.index_select(0, which.select(1, 0).contiguous()).to(at::kLong);
  TensorDataset ds({{"image", video}, {"label", labels}}, "moving_fashion_mnist");
  ds.set_class_names(source.class_names());
  return ds;
}

}  // namespace dew::data
