// The role types that carry logic: the diagonal Gaussian posterior of an autoencoder.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "dew/nn/roles.h"
#include "tests/test_util.h"

TEST(Roles, DiagonalGaussianByHand) {
  const at::Tensor mean = at::tensor({0.5, -1.0, 0.0, 2.0}, at::kDouble).view({2, 2});
  const at::Tensor logvar = at::tensor({0.0, std::log(4.0), -40.0, 30.0}, at::kDouble).view({2, 2});
  dew::DiagonalGaussian q(mean, logvar);
  // Clamped to [-30, 20] as diffusers does.
  EXPECT_DOUBLE_EQ(q.logvar[1][0].item<double>(), -30.0);
  EXPECT_DOUBLE_EQ(q.logvar[1][1].item<double>(), 20.0);
  EXPECT_DOUBLE_EQ(q.std()[0][1].item<double>(), 2.0);
  // KL per row: 0.5 sum(mean^2 + var - 1 - logvar).
  const double row0 = 0.5 * ((0.25 + 1 - 1 - 0) + (1 + 4 - 1 - std::log(4.0)));
  const double row1 = 0.5 * ((0 + std::exp(-30.0) - 1 + 30) + (4 + std::exp(20.0) - 1 - 20));
  EXPECT_NEAR(q.kl()[0].item<double>(), row0, 1e-12);
  EXPECT_NEAR(q.kl()[1].item<double>(), row1, 1e-12 * row1);
  // sample = mean + std * eps with eps from the generator given.
  auto g1 = at::detail::createCPUGenerator(7), g2 = at::detail::createCPUGenerator(7);
  const at::Tensor eps = at::randn({2, 2}, g2, at::TensorOptions().dtype(at::kDouble));
  EXPECT_TRUE(q.sample(g1).allclose(mean + q.std() * eps, 0, 0));
  EXPECT_NE(dew::test::error_of([] { dew::DiagonalGaussian(at::zeros({2}), at::zeros({3})); }).find("one shape"),
            std::string::npos);
}
