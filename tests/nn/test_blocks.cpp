// Scan orders and (un)patchify, the DiT / Unet building blocks, and remat (gradient checkpointing).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "dew/core/error.h"
#include "dew/nn/blocks.h"
#include "dew/nn/scan.h"
#include "tests/golden_util.h"

namespace {

using at::Tensor;

using dew::test::max_diff;

void randomize(torch::nn::Module& m, double std = 0.2) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.normal_(0.0, std);
}

// ---- scan orders ----

TEST(Scan, EveryOrderIsAPermutationWithAnExactInverse) {
  for (const auto& order : dew::nn::scan_orders()) {
    for (auto [h, w] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 1}, {1, 7}, {4, 4}, {8, 8}, {16, 16}, {6, 10}, {5, 7}, {3, 16}, {9, 2}}) {
      auto s = dew::nn::make_scan(order, h, w);
      ASSERT_EQ(s.perm.numel(), h * w);
      EXPECT_TRUE(torch::equal(std::get<0>(s.perm.sort()), torch::arange(h * w))) << order << " " << h << "x" << w;
      EXPECT_TRUE(torch::equal(s.perm.index_select(0, s.inverse), torch::arange(h * w))) << order;
      EXPECT_TRUE(torch::equal(s.inverse.index_select(0, s.perm), torch::arange(h * w))) << order;
    }
  }
  EXPECT_THROW(dew::nn::make_scan("spiral", 4, 4), dew::Error);
}

// Counts consecutive cells that are not 4-neighbours.
int64_t jumps(const std::vector<std::pair<int64_t, int64_t>>& cells) {
  int64_t n = 0;
  for (size_t i = 1; i < cells.size(); ++i)
    n += std::abs(cells[i].first - cells[i - 1].first) + std::abs(cells[i].second - cells[i - 1].second) != 1;
  return n;
}

TEST(Scan, HilbertAndZigzagAreContinuousCurves) {
  // On power-of-two squares: the Hilbert curve, from a corner to the adjacent corner.
  for (int64_t n : {2, 4, 8, 16, 32}) {
    auto cells = dew::nn::scan_cells("hilbert", n, n);
    EXPECT_EQ(jumps(cells), 0) << n;
    EXPECT_EQ(cells.front(), (std::pair<int64_t, int64_t>{0, 0}));
    const auto last = cells.back();
    EXPECT_TRUE(last == (std::pair<int64_t, int64_t>{0, n - 1}) || last == (std::pair<int64_t, int64_t>{n - 1, 0}));
  }
  // The generalised curve on other rectangles: continuous when a side is even.
  for (auto [h, w] : std::vector<std::pair<int64_t, int64_t>>{{6, 10}, {12, 8}, {4, 14}, {3, 16}, {16, 3}})
    EXPECT_EQ(jumps(dew::nn::scan_cells("hilbert", h, w)), 0) << h << "x" << w;
  EXPECT_LE(jumps(dew::nn::scan_cells("hilbert", 5, 7)), 1);  // odd x odd: at most one diagonal step
  for (auto [h, w] : std::vector<std::pair<int64_t, int64_t>>{{4, 4}, {5, 7}, {1, 9}})
    EXPECT_EQ(jumps(dew::nn::scan_cells("zigzag", h, w)), 0);
  // Raster and zigzag agree on even rows and mirror on odd rows.
  auto z = dew::nn::make_scan("zigzag", 2, 3);
  EXPECT_TRUE(torch::equal(z.perm, torch::tensor({0, 1, 2, 5, 4, 3}, at::kLong)));
}

TEST(Scan, UnpatchifyInvertsPatchifyForEveryOrder) {
  torch::manual_seed(0);
  Tensor x = torch::randn({2, 3, 12, 20});
  for (const auto& order : dew::nn::scan_orders()) {
    auto s = dew::nn::make_scan(order, 3, 5);
    Tensor t = dew::nn::patchify(x, 4, s);
    ASSERT_EQ(t.sizes(), (std::vector<int64_t>{2, 15, 48}));
    EXPECT_TRUE(torch::equal(dew::nn::unpatchify(t, 4, s), x)) << order;
    // Token n holds the patch at grid cell perm[n], laid out (row, col, channel).
    const int64_t n = 7, cell = s.perm[n].item<int64_t>(), r = cell / 5, c = cell % 5;
    Tensor patch = x[1].narrow(1, r * 4, 4).narrow(2, c * 4, 4).permute({1, 2, 0}).reshape({-1});
    EXPECT_TRUE(torch::equal(t[1][n], patch)) << order;
  }
  EXPECT_THROW(dew::nn::patchify(x, 4, dew::nn::make_scan("raster", 4, 5)), dew::Error);
}

// ---- blocks ----

TEST(Blocks, DiTBlockIsTheIdentityAndFinalLayerZeroAtInit) {
  dew::nn::DiTBlock block(dew::nn::DiTBlockOptions(32, 4).qk_norm(true));
  Tensor x = torch::randn({2, 9, 32}), c = torch::randn({2, 32});
  EXPECT_TRUE(torch::equal(block(x, c, dew::nn::rope_1d(torch::arange(9), 8)), x));
  dew::nn::FinalLayer final_layer(dew::nn::FinalLayerOptions(32, 12));
  Tensor y = final_layer(x, c);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 9, 12}));
  EXPECT_EQ(y.abs().max().item<double>(), 0.0);
  std::set<std::string> names;
  for (const auto& kv : block->named_parameters()) names.insert(kv.key());
  for (const char* n : {"adaLN_modulation.weight", "attn.qkv.weight", "attn.proj.bias", "attn.q_norm.weight",
                        "mlp.fc1.weight", "mlp.fc2.bias"})
    EXPECT_TRUE(names.count(n)) << n;
  EXPECT_THROW(dew::nn::DiTBlock(dew::nn::DiTBlockOptions(32, 4).mlp_ratio(0)), dew::Error);
}

TEST(Blocks, DiTBlockUnderBfloat16KeepsFp32Parameters) {
  dew::nn::DiTBlock block(dew::nn::DiTBlockOptions(32, 4));
  randomize(*block, 0.05);
  Tensor x = torch::randn({2, 5, 32}), c = torch::randn({2, 32});
  Tensor ref = block(x, c);
  Tensor lo = block(x.to(at::kBFloat16), c);
  EXPECT_EQ(lo.scalar_type(), at::kBFloat16);
  EXPECT_LT(max_diff(lo, ref), 0.1);
  lo.to(at::kFloat).sum().backward();
  for (const auto& p : block->parameters()) {
    EXPECT_EQ(p.scalar_type(), at::kFloat);
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
  }
}

TEST(Blocks, ResBlockInjectsTimeAndStartsAsItsSkipPath) {
  dew::nn::ResBlock same(dew::nn::ResBlockOptions(16, 16, 8).norm_groups(4));
  Tensor x = torch::randn({2, 16, 6, 6}), temb = torch::randn({2, 8});
  EXPECT_TRUE(torch::equal(same(x, temb), x));  // conv2 starts at zero
  EXPECT_TRUE(same->conv_shortcut.is_empty());
  dew::nn::ResBlock grow(dew::nn::ResBlockOptions(16, 32, 8).norm_groups(4));
  EXPECT_FALSE(grow->conv_shortcut.is_empty());
  randomize(*grow, 0.1);
  Tensor y = grow(x, temb);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 32, 6, 6}));
  EXPECT_GT(max_diff(grow(x, temb * 2), y), 1e-4);  // the time embedding matters
  EXPECT_THROW(dew::nn::ResBlock(dew::nn::ResBlockOptions(12, 16, 8).norm_groups(8)), dew::Error);
  EXPECT_THROW(dew::nn::ResBlock(dew::nn::ResBlockOptions(16, 16, 8).activation("tanhh")), dew::Error);
}

TEST(Blocks, MaskedMeanAndModulate) {
  Tensor x = torch::arange(12, at::kFloat).view({2, 3, 2});
  Tensor mask = torch::tensor({1, 0, 1, 0, 0, 0}, at::kLong).view({2, 3}).to(at::kBool);
  Tensor m = dew::nn::masked_mean(x, mask);
  EXPECT_TRUE(torch::allclose(m[0], torch::tensor({2.0f, 3.0f})));
  EXPECT_TRUE(torch::equal(m[1], torch::zeros({2})));  // no token: zeros, not NaN
  EXPECT_TRUE(torch::allclose(dew::nn::masked_mean(x, {}), x.mean(1)));
  Tensor shift = torch::randn({2, 2}), scale = torch::randn({2, 2});
  EXPECT_LT(max_diff(dew::nn::modulate(x, shift, scale), x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)), 1e-5);
}

// ---- remat ----

struct Grads {
  Tensor y;
  std::vector<Tensor> inputs, params;
};

// Runs f on fresh leaf copies of `inputs`, back-propagates <y, w> and collects every gradient.
Grads grads_of(torch::nn::Module& m, const std::vector<Tensor>& inputs, const Tensor& w,
               const std::function<Tensor(const std::vector<Tensor>&)>& f, bool use_remat) {
  m.zero_grad();
  std::vector<Tensor> in;
  for (const auto& t : inputs) in.push_back(t.clone().requires_grad_(true));
  Tensor y = use_remat ? dew::nn::remat(m, f, in) : f(in);
  (y * w).sum().backward();
  Grads g{y.detach(), {}, {}};
  for (const auto& t : in) g.inputs.push_back(t.grad().clone());
  for (const auto& p : m.parameters()) g.params.push_back(p.grad().defined() ? p.grad().clone() : Tensor());
  return g;
}

void expect_same(const Grads& a, const Grads& b, double tol) {
  EXPECT_LT(max_diff(a.y, b.y), tol);
  ASSERT_EQ(a.inputs.size(), b.inputs.size());
  for (size_t i = 0; i < a.inputs.size(); ++i) EXPECT_LT(max_diff(a.inputs[i], b.inputs[i]), tol) << "input " << i;
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    ASSERT_EQ(a.params[i].defined(), b.params[i].defined()) << "param " << i;
    if (a.params[i].defined()) {
      EXPECT_LT(max_diff(a.params[i], b.params[i]), tol) << "param " << i;
    }
  }
}

TEST(Remat, DiTBlockGradientsMatchWithoutRemat) {
  torch::manual_seed(1);
  dew::nn::DiTBlock block(dew::nn::DiTBlockOptions(32, 4).qk_norm(true));
  randomize(*block, 0.1);  // away from adaLN-Zero, so every parameter gets a gradient
  Tensor x = torch::randn({2, 9, 32}), c = torch::randn({2, 32}), w = torch::randn({2, 9, 32});
  auto rope = dew::nn::rope_1d(torch::arange(9), 8);
  auto f = [&](const std::vector<Tensor>& in) { return block(in[0], in[1], rope); };
  Grads plain = grads_of(*block, {x, c}, w, f, false), re = grads_of(*block, {x, c}, w, f, true);
  expect_same(plain, re, 1e-6);
  for (const auto& g : re.params) EXPECT_TRUE(g.defined() && g.abs().sum().item<double>() > 0);
  // The remat path was taken: one recomputing node, not the block's own graph.
  Tensor y = dew::nn::remat(*block, f, {x.clone().requires_grad_(), c});
  ASSERT_TRUE(y.grad_fn() != nullptr);
  EXPECT_EQ(y.grad_fn()->name(), "dew::nn::RematBackward");
}

TEST(Remat, ResBlockGradientsMatchAndAccumulate) {
  torch::manual_seed(2);
  dew::nn::ResBlock block(dew::nn::ResBlockOptions(8, 16, 12).norm_groups(4));
  randomize(*block, 0.1);
  Tensor x = torch::randn({2, 8, 5, 5}), t = torch::randn({2, 12}), w = torch::randn({2, 16, 5, 5});
  auto f = [&](const std::vector<Tensor>& in) { return block(in[0], in[1]); };
  Grads plain = grads_of(*block, {x, t}, w, f, false), re = grads_of(*block, {x, t}, w, f, true);
  expect_same(plain, re, 1e-6);
  // Two remat'd calls in one graph: parameter gradients add up as without remat.
  block->zero_grad();
  Tensor a = x.clone().requires_grad_();
  (dew::nn::remat(*block, f, {a, t}) * w).sum().backward();
  (dew::nn::remat(*block, f, {a, t}) * w).sum().backward();
  EXPECT_LT(max_diff(block->parameters()[0].grad(), 2 * plain.params[0]), 1e-5);
  EXPECT_LT(max_diff(a.grad(), 2 * plain.inputs[0]), 1e-5);
}

TEST(Remat, ParametersGetGradientsWhenNoInputRequiresGrad) {
  dew::nn::DiTBlock block(dew::nn::DiTBlockOptions(16, 2));
  randomize(*block, 0.1);
  Tensor x = torch::randn({1, 4, 16}), c = torch::randn({1, 16});
  block->zero_grad();
  dew::nn::remat(*block, [&](const std::vector<Tensor>& in) { return block(in[0], in[1]); }, {x, c}).sum().backward();
  std::vector<Tensor> re;
  for (const auto& p : block->parameters()) re.push_back(p.grad().clone());
  block->zero_grad();
  block(x, c).sum().backward();
  auto params = block->parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_LT(max_diff(re[i], params[i].grad()), 1e-6) << i;
}

TEST(Remat, DropoutMasksAreReplayedInTheRecomputation) {
  dew::nn::DiTBlock block(dew::nn::DiTBlockOptions(32, 4).dropout(0.3));
  randomize(*block, 0.1);
  block->train();
  Tensor x = torch::randn({2, 6, 32}), c = torch::randn({2, 32}), w = torch::randn({2, 6, 32});
  auto f = [&](const std::vector<Tensor>& in) { return block(in[0], in[1]); };
  torch::manual_seed(11);
  Grads plain = grads_of(*block, {x, c}, w, f, false);
  torch::manual_seed(11);
  Grads re = grads_of(*block, {x, c}, w, f, true);
  expect_same(plain, re, 1e-6);
}

TEST(Remat, WithoutGradModeItIsAPlainCall) {
  dew::nn::DiTBlock block(dew::nn::DiTBlockOptions(16, 2));
  Tensor x = torch::randn({1, 4, 16}), c = torch::randn({1, 16});
  torch::NoGradGuard no_grad;
  Tensor y = dew::nn::remat(*block, [&](const std::vector<Tensor>& in) { return block(in[0], in[1]); }, {x, c});
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(torch::equal(y, x));
}

}  // namespace
