// The autoencoder objective's loss against a hand computation (reconstruction + kl_weight * per-image KL
// sum / C H W), the reconstruction scores (per-image PSNR, SSIM) on images whose values are known, the
// padding of Fashion-MNIST, and LDM's scale_by_std.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <vector>

#include "dew/core/rng.h"
#include "dew/data/dataset.h"
#include "dew/metrics/metrics.h"
#include "dew/objectives/autoencoder.h"
#include "dew/objectives/latent.h"
#include "tests/test_util.h"

namespace {

using dew::test::error_of;

// An "autoencoder" with a known map: the posterior mean is the image, the log-variance `logvar`, and the
// decoder multiplies by `gain`.
class GainAutoencoder : public dew::AutoencoderImpl {
 public:
  GainAutoencoder(double gain, double logvar) : gain_(gain), logvar_(logvar) {
    w_ = register_parameter("w", at::ones({1}));
  }
  dew::DiagonalGaussian encode(const at::Tensor& x) override { return {x * w_, at::full_like(x, logvar_)}; }
  at::Tensor decode(const at::Tensor& z) override { return z * gain_; }
  double scaling_factor() const override { return 1.0; }

 private:
  double gain_, logvar_;
  at::Tensor w_;
};

}  // namespace

TEST(AutoencoderObjective, LossIsReconstructionPlusWeightedKlPerImageElement) {
  // x, x_hat: [2, 1, 2, 3]; the posterior over [2, 2, 1, 1] latents.
  const std::vector<double> xs = {0.1, -0.4, 0.9, 0.0, -1.0, 0.3, 0.5, 0.5, -0.2, 0.8, -0.6, 0.25};
  const std::vector<double> hs = {0.2, -0.1, 0.7, 0.1, -0.9, 0.0, 0.4, 0.9, -0.2, 0.6, -0.5, 0.0};
  const std::vector<double> ms = {0.5, -1.5, 2.0, 0.25};
  const std::vector<double> lvs = {0.0, -1.0, 0.5, -2.0};
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor x = at::tensor(xs, f64).view({2, 1, 2, 3});
  const at::Tensor x_hat = at::tensor(hs, f64).view({2, 1, 2, 3});
  const dew::DiagonalGaussian q(at::tensor(ms, f64).view({2, 2, 1, 1}), at::tensor(lvs, f64).view({2, 2, 1, 1}));
  double l1 = 0, l2 = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    l1 += std::abs(hs[i] - xs[i]) / 12.0;
    l2 += (hs[i] - xs[i]) * (hs[i] - xs[i]) / 12.0;
  }
  double kl_rows[2] = {0, 0};
  for (size_t i = 0; i < ms.size(); ++i) kl_rows[i / 2] += 0.5 * (ms[i] * ms[i] + std::exp(lvs[i]) - 1.0 - lvs[i]);
  const double kl = (kl_rows[0] + kl_rows[1]) / 2;  // the per-image sum, mean over the batch
  const double weight = 0.01;
  for (const char* rec : {"l1", "mse"}) {
    const auto out = dew::autoencoder_loss(x, x_hat, q, rec, weight);
    const double r = std::string(rec) == "l1" ? l1 : l2;
    EXPECT_NEAR(out.reconstruction.item<double>(), r, 1e-7) << rec;
    EXPECT_NEAR(out.kl.item<double>(), kl, 1e-7) << rec;
    // kl_weight multiplies the per-image KL over the image's 6 elements: LDM's loss / (C H W)
    EXPECT_NEAR(out.loss.item<double>(), r + weight * kl / 6.0, 1e-7) << rec;
    std::printf("%s: loss %.9f, hand %.9f\n", rec, out.loss.item<double>(), r + weight * kl / 6.0);
  }
  EXPECT_NE(error_of([&] { dew::autoencoder_loss(x, x_hat, q, "huber", weight); }).find("accepted: l1, mse"),
            std::string::npos);
  EXPECT_NE(error_of([&] { dew::autoencoder_loss(x, x_hat.slice(3, 0, 2), q, "l1", weight); }).find("shape"),
            std::string::npos);
}

TEST(AutoencoderObjective, ReconstructionScoresOfKnownImages) {
  // Two constant 12 x 12 images, x = 0.2 and x = v / 127.5 - 1 for v = 64; the decoder scales by 1.1, so image i
  // comes back with error 0.1 x_i everywhere: PSNR_i = 10 log10(4 / (0.1 x_i)^2), and SSIM of constant images is
  // (2 mu_x mu_y + c1) / (mu_x^2 + mu_y^2 + c1).
  at::Tensor images = at::empty({2, 1, 12, 12}, at::TensorOptions().dtype(at::kByte));
  images[0].fill_(153);
  images[1].fill_(64);
  const double xs[2] = {153 / 127.5 - 1, 64 / 127.5 - 1};
  auto ae = std::make_shared<GainAutoencoder>(1.1, -1.0);
  const auto s = dew::score_reconstructions(*ae, images, /*batch=*/1);
  const double c1 = (0.01 * 2) * (0.01 * 2);
  double psnr = 0, ssim = 0;
  for (double x : xs) {
    const double y = 1.1 * x, e = y - x;
    psnr += 10 * std::log10(4 / (e * e)) / 2;
    ssim += (2 * x * y + c1) / (x * x + y * y + c1) / 2;
  }
  EXPECT_EQ(s.items, 2);
  EXPECT_NEAR(s.psnr, psnr, 1e-5);  // the mean of per-image PSNR (the pooled MSE would give another number)
  EXPECT_NEAR(s.ssim, ssim, 1e-6);
  EXPECT_NEAR(s.l1, (0.1 * std::abs(xs[0]) + 0.1 * std::abs(xs[1])) / 2, 1e-6);
  // KL per image: 144 elements of (x^2 + e^-1 - 1 + 1) / 2
  double kl = 0;
  for (double x : xs) kl += 144 * 0.5 * (x * x + std::exp(-1.0)) / 2;
  EXPECT_NEAR(s.kl, kl, 1e-3);
  std::printf("psnr %.6f (hand %.6f), ssim %.8f (hand %.8f)\n", s.psnr, psnr, s.ssim, ssim);
  // Batching does not change the scores; the identity reconstruction scores SSIM 1.
  const auto batched = dew::score_reconstructions(*ae, images, 250);
  EXPECT_NEAR(batched.psnr, s.psnr, 1e-9);
  EXPECT_NEAR(batched.ssim, s.ssim, 1e-9);
  auto identity = std::make_shared<GainAutoencoder>(1.0, 0.0);
  EXPECT_NEAR(dew::score_reconstructions(*identity, images).ssim, 1.0, 1e-12);
  EXPECT_TRUE(std::isinf(dew::score_reconstructions(*identity, images).psnr));
}

TEST(AutoencoderObjective, ObjectiveLossAndValidationScores) {
  auto ae = std::make_shared<GainAutoencoder>(1.1, -1.0);
  dew::AutoencoderObjectiveOptions o;
  o.posterior = "mean";
  o.kl_weight = 0.5;
  o.preview_count = 0;
  auto held_out = std::make_shared<dew::data::TensorDataset>(
      dew::data::Batch{{"image", at::full({3, 1, 12, 12}, 153, at::TensorOptions().dtype(at::kByte))}});
  dew::AutoencoderObjective obj(ae, o, held_out);
  dew::data::Batch batch = {{"image", held_out->field("image")}};
  const auto out = obj.loss(batch, 0, dew::rng::generator(0, 0, "t"));
  const double x = 153 / 127.5 - 1;
  const double kl_image = 144 * 0.5 * (x * x + std::exp(-1.0));
  EXPECT_NEAR(out.loss.item<double>(), 0.1 * x + 0.5 * kl_image / 144, 1e-6);
  EXPECT_NEAR(out.metrics.at("kl"), kl_image, 1e-3);
  const auto v = obj.validate(0, "");
  EXPECT_NEAR(v.at("val/psnr"), 10 * std::log10(4 / (0.01 * x * x)), 1e-4);
  EXPECT_TRUE(v.count("val/ssim"));
  EXPECT_EQ(v.at("val/images"), 3.0);  // the scores name what they were computed on
  // A posterior sample differs from the mean and comes from the generator.
  o.posterior = "sample";
  dew::AutoencoderObjective sampled(ae, o);
  const double a = sampled.loss(batch, 0, dew::rng::generator(0, 0, "t")).loss.item<double>();
  const double b = sampled.loss(batch, 0, dew::rng::generator(0, 0, "t")).loss.item<double>();
  EXPECT_EQ(a, b);
  EXPECT_NE(a, out.loss.item<double>());
  o.kl_weight = -1;
  EXPECT_NE(error_of([&] { dew::AutoencoderObjective(ae, o); }).find("objective.kl_weight"), std::string::npos);
}

TEST(LatentSpace, ScaleByStdAndTheFrozenAutoencoder) {
  auto ae = std::make_shared<GainAutoencoder>(1.0, 0.0);
  const at::Tensor z = at::randn({4, 2, 3, 3}, dew::rng::generator(1, 0, "z"));
  const auto s = dew::scaling_by_std(z);
  EXPECT_EQ(s.source, "std");
  EXPECT_NEAR(s.scaling_factor, 1.0 / z.to(at::kDouble).flatten().std().item<double>(), 1e-12);
  EXPECT_EQ(s.shift_factor, 0.0);
  EXPECT_EQ(dew::LatentScaling::from_json(s.to_json(), "x").scaling_factor, s.scaling_factor);
  dew::LatentSpace space(ae, dew::LatentOptions{}, s);
  for (const auto& p : ae->parameters()) EXPECT_FALSE(p.requires_grad());
  EXPECT_FALSE(ae->is_training());
  // to_latent and from_latent are inverses; scaled latents have unit std
  EXPECT_TRUE(at::allclose(space.from_latent(space.to_latent(z)), z, 1e-6, 1e-6));
  EXPECT_NEAR(space.to_latent(z).std().item<double>(), 1.0, 1e-5);
  EXPECT_NE(error_of([] { dew::scaling_by_std(at::zeros({4, 2, 3, 3})); }).find("latent.scale"), std::string::npos);
  dew::LatentOptions bad;
  bad.scale_items = 0;
  EXPECT_NE(error_of([&] { dew::validate(bad); }).find("latent.scale_items"), std::string::npos);
}

TEST(FashionMnist, PadsTo32x32) {
  auto plain = dew::data::datasets().build({{"name", "fashion_mnist"}, {"split", "test"}});
  auto padded = dew::data::datasets().build({{"name", "fashion_mnist"}, {"split", "test"}, {"pad", 2}});
  const at::Tensor& a = plain->field("image");
  const at::Tensor& b = padded->field("image");
  ASSERT_EQ(b.sizes(), at::IntArrayRef({10000, 1, 32, 32}));
  EXPECT_TRUE(at::equal(b.narrow(2, 2, 28).narrow(3, 2, 28), a));
  EXPECT_EQ(b.narrow(2, 0, 2).max().item<int64_t>(), 0);
  EXPECT_EQ(b.narrow(3, 30, 2).max().item<int64_t>(), 0);
  EXPECT_TRUE(at::equal(padded->field("label"), plain->field("label")));
  EXPECT_EQ(padded->class_names(), plain->class_names());
  EXPECT_EQ(padded->spec()["pad"], 2);
  EXPECT_NE(error_of([] {
              dew::data::datasets().build({{"name", "fashion_mnist"}, {"split", "test"}, {"pad", -1}});
            }).find("pad"),
            std::string::npos);
}
