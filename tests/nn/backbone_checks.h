// Checks every backbone test applies: a fixed flow-matching batch (image or video), overfitting it,
// gradients reaching every parameter, parameter copies between two builds.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "dew/nn/backbones/backbone.h"
#include "tests/golden_util.h"

namespace dew::test {

inline std::vector<std::pair<std::string, std::vector<int64_t>>> param_shapes(const dew::BackboneImpl& m) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& kv : m.named_parameters()) out.push_back({kv.key(), kv.value().sizes().vec()});
  return out;
}

inline void copy_parameters(dew::BackboneImpl& from, dew::BackboneImpl& to) {
  torch::NoGradGuard no_grad;
  auto src = from.named_parameters();
  for (auto& kv : to.named_parameters()) kv.value().copy_(src[kv.key()]);
}

/// Adds N(0, std^2) noise to every parameter (moves zero-initialised layers off zero).
inline void randomize(dew::BackboneImpl& m, double std) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.add_(torch::randn_like(p) * std);
}

/// A flow-matching problem on one fixed batch: x_t = (1 - t) x0 + t eps, target eps - x0.
struct FixedBatch {
  at::Tensor x_t, t, target;
  dew::Conditioning cond;
};

/// shape: the whole input shape, e.g. {B, C, H, W} or {B, C, T, H, W}.
inline FixedBatch fixed_batch(std::vector<int64_t> shape, uint64_t seed) {
  torch::manual_seed(seed);
  const int64_t B = shape[0];
  at::Tensor x0 = torch::rand(shape) * 2 - 1, eps = torch::randn(shape), t = torch::rand({B});
  std::vector<int64_t> bshape(shape.size(), 1);
  bshape[0] = B;
  at::Tensor tt = t.view(bshape);
  return {(1 - tt) * x0 + tt * eps, t, eps - x0, {}};
}
inline FixedBatch fixed_batch(int64_t B, int64_t C, int64_t H, uint64_t seed) {
  return fixed_batch({B, C, H, H}, seed);
}

/// Adam on the fixed batch; returns (first loss, last loss).
inline std::pair<double, double> overfit(dew::BackboneImpl& model, const FixedBatch& b, int steps, double lr) {
  torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(lr));
  double first = 0, last = 0;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    at::Tensor loss = torch::mse_loss(model.forward(b.x_t, b.t, b.cond), b.target);
    loss.backward();
    opt.step();
    (s == 0 ? first : last) = loss.item<double>();
  }
  return {first, last};
}

/// Names of the parameters whose gradient is missing or exactly zero after one backward of a random
/// projection of the output. Call on a randomized model (zero-initialised layers block gradients).
inline std::vector<std::string> params_without_gradient(dew::BackboneImpl& model, const FixedBatch& b) {
  model.zero_grad();
  at::Tensor y = model.forward(b.x_t, b.t, b.cond);
  (y * torch::randn_like(y)).sum().backward();
  std::vector<std::string> out;
  for (const auto& kv : model.named_parameters()) {
    const at::Tensor& g = kv.value().grad();
    if (!g.defined() || g.abs().max().item<double>() == 0.0) out.push_back(kv.key());
  }
  return out;
}

/// remat must not change the function: a model built with remat true (same weights) gives the same output
/// (1e-6) and the same gradients of the input and every parameter (1e-5) as without. `input`: the input
/// shape, e.g. {2, 3, 8, 8} or {2, 1, 3, 8, 8}.
inline void expect_remat_matches(const std::string& arch, const json& fields, const dew::Conditioning& cond,
                                 const std::vector<int64_t>& input) {
  auto plain = dew::models::build(arch, fields);
  json rf = fields;
  rf["remat"] = true;
  auto re = dew::models::build(arch, rf);
  randomize(*plain, 0.05);  // away from the zero-initialised layers, so every parameter has a gradient
  copy_parameters(*plain, *re);
  EXPECT_EQ(param_shapes(*plain), param_shapes(*re));
  torch::manual_seed(5);
  at::Tensor x = torch::randn(input), t = torch::rand({input[0]}), w;
  std::vector<std::vector<at::Tensor>> grads;
  std::vector<at::Tensor> outs;
  for (auto* m : {plain.get(), re.get()}) {
    m->zero_grad();
    at::Tensor xi = x.clone().requires_grad_();
    at::Tensor y = m->forward(xi, t, cond);
    if (!w.defined()) w = torch::randn(y.sizes());  // the output may have other channels than the input
    (y * w).sum().backward();
    std::vector<at::Tensor> g{xi.grad()};
    for (const auto& p : m->parameters()) g.push_back(p.grad().defined() ? p.grad() : torch::zeros_like(p));
    grads.push_back(g);
    outs.push_back(y.detach());
  }
  EXPECT_LT(max_diff(outs[0], outs[1]), 1e-6) << arch;
  for (size_t i = 0; i < grads[0].size(); ++i)
    EXPECT_LT(max_diff(grads[0][i], grads[1][i]), 1e-5) << arch << " grad " << i;
}

}  // namespace dew::test
