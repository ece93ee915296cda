// Metrics against closed forms.
#include <gtest/gtest.h>

#include <cmath>

#include "dew/core/rng.h"
#include "dew/metrics/metrics.h"
#include "tests/golden_util.h"

using namespace dew;
using namespace dew::metrics;

namespace {
using dew::test::kF64;
}

TEST(Metrics, FrechetDistanceClosedForms) {
  // diagonal covariances: |mu1 - mu2|^2 + sum (sqrt(a_i) - sqrt(b_i))^2 = 2 + 1 + 1
  auto d = frechet_distance(at::zeros({2}, kF64), at::diag(at::tensor({1.0, 4.0}, kF64)), at::ones({2}, kF64),
                            at::diag(at::tensor({4.0, 9.0}, kF64)));
  EXPECT_NEAR(d, 4.0, 1e-10);
  // non-diagonal against the identity: sum over eigenvalues (3, 1) of (sqrt(l) - 1)^2
  auto c = at::tensor({2.0, 1.0, 1.0, 2.0}, kF64).view({2, 2});
  EXPECT_NEAR(frechet_distance(at::zeros({2}, kF64), c, at::zeros({2}, kF64), at::eye(2, kF64)),
              std::pow(std::sqrt(3.0) - 1, 2), 1e-10);
  // symmetric in its arguments
  EXPECT_NEAR(frechet_distance(at::zeros({2}, kF64), at::eye(2, kF64), at::zeros({2}, kF64), c),
              std::pow(std::sqrt(3.0) - 1, 2), 1e-10);
}

TEST(Metrics, FrechetDistanceOfSamples) {
  auto gen = rng::generator(0, 0, "fd");
  auto a = at::randn({20000, 3}, gen, kF64);
  auto b = at::randn({20000, 3}, gen, kF64) * 2 + 1;
  // N(0, I) vs N(1, 4 I) in 3-D: 3 * 1 + 3 * (1 - 2)^2 = 6
  EXPECT_NEAR(frechet_distance(a, b), 6.0, 0.15);
  EXPECT_NEAR(frechet_distance(a, a), 0.0, 1e-9);
  EXPECT_THROW(frechet_distance(a.slice(0, 0, 1), b), dew::Error);
}

TEST(Metrics, PsnrAndSsimByHand) {
  auto a = at::zeros({1, 1, 16, 16}, kF64);
  EXPECT_NEAR(psnr(a, a + 0.1), 10 * std::log10(4 / 0.01), 1e-9);
  EXPECT_EQ(ssim(a, a), 1.0);
  // constant images: the structure terms vanish, SSIM = (2 m1 m2 + C1)/(m1^2 + m2^2 + C1)
  const double c1 = std::pow(0.02, 2);
  EXPECT_NEAR(ssim(a + 0.5, a - 0.25), (2 * 0.5 * -0.25 + c1) / (0.25 + 0.0625 + c1), 1e-12);
  auto noisy = at::randn({2, 3, 16, 16}, rng::generator(1, 0, "x"), kF64);
  double s = ssim(noisy, noisy + 0.3 * at::randn({2, 3, 16, 16}, rng::generator(2, 0, "x"), kF64));
  EXPECT_GT(s, 0.0);
  EXPECT_LT(s, 1.0);
  EXPECT_THROW(ssim(a.slice(2, 0, 8), a.slice(2, 0, 8)), dew::Error);
  auto m = registry().build("psnr", json::object());
  EXPECT_NEAR((*m)(a, a + 0.1), 10 * std::log10(400.0), 1e-9);
}

TEST(Metrics, SsimMatchesScikitImage) {
  // scikit-image's structural_similarity on closed-form image pairs (tests/golden/ssim_skimage.py builds
  // the same pixels and printed these values).
  const double skimage[3] = {0.74008835124759287, 0.75277900111973495, 0.78973320422556226};
  const int64_t C = 3, H = 20, W = 24;
  auto grid = at::arange(H, kF64).view({H, 1}).expand({H, W});
  auto xs = at::arange(W, kF64).view({1, W}).expand({H, W});
  for (int k = 0; k < 3; ++k) {
    std::vector<at::Tensor> ca, cb;
    for (int c = 0; c < C; ++c) {
      auto a = at::sin(0.31 * xs + 0.17 * grid + double(c)) * at::cos(0.05 * xs * grid / double(k + 1));
      ca.push_back(a);
      cb.push_back(0.8 * a + 0.15 * at::cos(0.7 * xs - 0.4 * grid + double(2 * c + k)) - 0.05);
    }
    const double ours = ssim(at::stack(ca).unsqueeze(0), at::stack(cb).unsqueeze(0));
    std::printf("pair %d: ssim %.17g, scikit-image %.17g, |diff| %.3g\n", k, ours, skimage[k],
                std::abs(ours - skimage[k]));
    EXPECT_NEAR(ours, skimage[k], 1e-10) << "pair " << k;
  }
}
