// Winograd F(2x2, 3x3) convolutions (dew/nn/winograd.h) against ATen's convolution in float64 (the truth)
// and in float32 (its rounding error sets the bar: rms(ours - f64) <= 2 rms(ATen f32 - f64)), forward and
// every gradient, for every instruction-set variant this CPU runs and the awkward sizes: odd heights and
// widths (a half tile at the edge), one pixel, channel counts that leave a vector tail, batch 1.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include <string>
#include <vector>

#include "dew/nn/blocks.h"
#include "dew/nn/fused.h"
#include "dew/nn/winograd.h"
#include "tests/golden_util.h"
#include "tests/nn/isa_util.h"
#include "tests/test_util.h"

namespace {

using at::Tensor;
using dew::test::error_of;
using dew::test::expect_golden;
using dew::test::IsaGuard;
using dew::test::max_diff;
using dew::test::runnable_isas;

struct ThreadsGuard {
  int saved = at::get_num_threads();
  ~ThreadsGuard() { at::set_num_threads(saved); }
};

Tensor channels_last(const Tensor& t) { return t.contiguous(at::MemoryFormat::ChannelsLast); }

// y, dx, dw, db of at::conv2d(x, w, b, 1, 1) against the output gradient g, in x's dtype.
std::vector<Tensor> aten_conv(const Tensor& x0, const Tensor& w0, const Tensor& b0, const Tensor& g) {
  Tensor x = x0.detach().clone().requires_grad_(), w = w0.detach().clone().requires_grad_(),
         b = b0.detach().clone().requires_grad_();
  Tensor y = at::conv2d(x, w, b, 1, 1);
  y.backward(g.to(y.scalar_type()));
  return {y.detach(), x.grad(), w.grad(), b.grad()};
}

std::vector<Tensor> winograd_conv(const Tensor& x0, const Tensor& w0, const Tensor& b0, const Tensor& g) {
  Tensor x = channels_last(x0.detach()).requires_grad_(), w = w0.detach().clone().requires_grad_(),
         b = b0.detach().clone().requires_grad_();
  Tensor y = dew::nn::conv3x3_winograd(x, w, b);
  y.backward(g);
  return {y.detach(), x.grad(), w.grad(), b.grad()};
}

struct Shape {
  int64_t N, C, O, H, W;
};

TEST(Winograd, MatchesTheConvolutionForwardAndBackwardOnEveryIsa) {
  IsaGuard guard;
  const auto isas = runnable_isas();
  ASSERT_FALSE(isas.empty());
  // unet's 32 -> 32 at 28 x 28 (batch 4 here), a 14 x 14 level, odd sizes, one pixel, channel tails.
  const std::vector<Shape> shapes{{4, 32, 32, 28, 28}, {2, 64, 16, 14, 14}, {3, 8, 24, 7, 5},
                                  {1, 16, 8, 1, 1},    {2, 40, 48, 9, 6},   {1, 24, 8, 2, 3}};
  for (const auto& isa : isas) {
    dew::nn::set_fused_kernel_isa(isa);
    for (const auto& s : shapes) {
      torch::manual_seed(s.C * 131 + s.H);
      const Tensor x = torch::randn({s.N, s.C, s.H, s.W}, dew::test::kF64);
      const Tensor w = torch::randn({s.O, s.C, 3, 3}, dew::test::kF64) / std::sqrt(9.0 * s.C);
      const Tensor b = torch::randn({s.O}, dew::test::kF64);
      const Tensor g = torch::randn({s.N, s.O, s.H, s.W}, dew::test::kF64);
      const auto truth = aten_conv(x, w, b, g);
      const auto f32 = aten_conv(x.to(at::kFloat), w.to(at::kFloat), b.to(at::kFloat), g.to(at::kFloat));
      const auto ours = winograd_conv(x.to(at::kFloat), w.to(at::kFloat), b.to(at::kFloat), g.to(at::kFloat));
      const std::string tag = isa + " N" + std::to_string(s.N) + " C" + std::to_string(s.C) + " O" +
                              std::to_string(s.O) + " " + std::to_string(s.H) + "x" + std::to_string(s.W);
      EXPECT_TRUE(ours[0].is_contiguous(at::MemoryFormat::ChannelsLast)) << tag;
      const char* names[] = {"y", "dx", "dw", "db"};
      for (int i = 0; i < 4; ++i) expect_golden(tag + " " + names[i], ours[i], f32[i], truth[i]);
    }
  }
}

TEST(Winograd, SameBitsAtAnyThreadCount) {
  ThreadsGuard threads;
  torch::manual_seed(5);
  // Enough tiles (8 x 196) for every gradient range and several blocks per thread.
  const Tensor x = torch::randn({8, 16, 28, 28}), w = torch::randn({16, 16, 3, 3}) * 0.1, b = torch::randn({16});
  const Tensor g = torch::randn({8, 16, 28, 28});
  at::set_num_threads(1);
  const auto one = winograd_conv(x, w, b, g);
  at::set_num_threads(2);
  const auto two = winograd_conv(x, w, b, g);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(torch::equal(one[i], two[i])) << "output " << i;
}

TEST(Winograd, SecondOrderGradientsFollowTheConvolution) {
  // A create_graph backward goes through ATen's convolution, so a gradient penalty differentiates.
  torch::manual_seed(9);
  const Tensor x0 = torch::randn({2, 8, 6, 6}), w0 = torch::randn({8, 8, 3, 3}) * 0.2, b0 = torch::randn({8});
  auto penalty_grads = [&](bool winograd) {
    Tensor x = channels_last(x0).requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
    Tensor y = winograd ? dew::nn::conv3x3_winograd(x, w, b) : at::conv2d(x, w, b, 1, 1);
    Tensor gx = torch::autograd::grad({y.pow(2).sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    gx.pow(2).sum().backward();
    return std::vector<Tensor>{w.grad(), b.grad()};
  };
  const auto ours = penalty_grads(true), theirs = penalty_grads(false);
  for (int i = 0; i < 2; ++i)
    EXPECT_LT(max_diff(ours[i], theirs[i]), 1e-3 * (1 + theirs[i].abs().max().item<double>()));
}

TEST(Winograd, AppliesOnlyWhereItComputesTheSameConvolution) {
  const Tensor x = channels_last(torch::randn({2, 16, 8, 8})), w = torch::randn({8, 16, 3, 3}), b = torch::randn({8});
  EXPECT_TRUE(dew::nn::winograd_conv_applies(x, w, b));
  EXPECT_TRUE(dew::nn::winograd_conv_applies(x, w, Tensor()));
  EXPECT_FALSE(dew::nn::winograd_conv_applies(x.contiguous(), w, b));                                     // NCHW memory
  EXPECT_FALSE(dew::nn::winograd_conv_applies(x.to(at::kDouble), w.to(at::kDouble), b.to(at::kDouble)));  // float64
  EXPECT_FALSE(dew::nn::winograd_conv_applies(x, torch::randn({8, 16, 5, 5}), b));                        // 5 x 5
  EXPECT_FALSE(dew::nn::winograd_conv_applies(x, torch::randn({6, 16, 3, 3}), torch::randn({6})));        // O % 8
  EXPECT_FALSE(
      dew::nn::winograd_conv_applies(channels_last(torch::randn({2, 12, 8, 8})), torch::randn({8, 12, 3, 3}), b));
  EXPECT_FALSE(dew::nn::winograd_conv_applies(x, w, torch::randn({4})));  // bias size
  const std::string err = error_of([&] { dew::nn::conv3x3_winograd(x.contiguous(), w, b); });
  EXPECT_NE(err.find("channels-last"), std::string::npos) << err;
  {
    // Under CPU autocast the convolution is autocast's to run (in bfloat16).
    at::autocast::set_autocast_enabled(at::kCPU, true);
    EXPECT_FALSE(dew::nn::winograd_conv_applies(x, w, b));
    at::autocast::set_autocast_enabled(at::kCPU, false);
  }
}

TEST(Winograd, ConvTakesItForSamePaddedThreeByThreeOnly) {
  // dew::nn::conv() on a channels-last float32 input: padding 1 and "same" agree with ATen; other
  // convolutions (padding 0, stride 2) are ATen's own, bit for bit.
  IsaGuard guard;
  torch::manual_seed(2);
  const Tensor x = channels_last(torch::randn({2, 16, 10, 10}));
  for (const auto& isa : runnable_isas()) {
    dew::nn::set_fused_kernel_isa(isa);
    torch::nn::Conv2d pad1(torch::nn::Conv2dOptions(16, 8, 3).padding(1));
    torch::nn::Conv2d same(torch::nn::Conv2dOptions(16, 8, 3).padding(torch::kSame));
    torch::nn::Conv2d valid(torch::nn::Conv2dOptions(16, 8, 3).padding(0));
    torch::nn::Conv2d stride2(torch::nn::Conv2dOptions(16, 8, 3).padding(1).stride(2));
    for (auto* m : {&pad1, &same}) {
      const Tensor ref = at::conv2d(x, (*m)->weight, (*m)->bias, 1, 1);
      EXPECT_LT(max_diff(dew::nn::conv(x, *m), ref), 1e-5) << isa;
    }
    EXPECT_TRUE(
        torch::equal(dew::nn::conv(x, valid), at::conv2d(x, valid->weight, valid->bias, 1, at::IntArrayRef{0, 0})))
        << isa;
    EXPECT_TRUE(torch::equal(dew::nn::conv(x, stride2), at::conv2d(x, stride2->weight, stride2->bias, 2, 1))) << isa;
    // conv() runs the Winograd kernel on every instruction set: its exact bits.
    EXPECT_TRUE(torch::equal(dew::nn::conv(x, pad1), dew::nn::conv3x3_winograd(x, pad1->weight, pad1->bias))) << isa;
  }
}

}  // namespace
