// Post-training losses against goldens from the real reference code (tests/golden/post_training_reference.py
// runs TRL's DPOTrainer and verl's core_algos on these tensors): DPO loss, rewards, metrics and gradients
// w.r.t. the policy logits; GRPO / RLOO / mean advantages; the PPO-clip policy loss with its statistics and
// gradients w.r.t. log pi; k3 and its aggregations. Every comparison prints its max difference. Then the
// errors for bad inputs.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>

#include "dew/io/safetensors.h"
#include "dew/objectives/post_training.h"
#include "tests/test_util.h"

namespace pt = dew::post_training;
using at::Tensor;

namespace {

using GoldenTensors = std::map<std::string, Tensor>;

GoldenTensors post_training_golden(const std::string& name) {
  return dew::io::load_safetensors(std::string(DEW_SOURCE_DIR) + "/tests/golden/post_training/" + name +
                                   ".safetensors");
}

const Tensor& at_key(const GoldenTensors& g, const std::string& key) {
  auto it = g.find(key);
  if (it == g.end()) throw std::runtime_error("golden has no tensor " + key);
  return it->second;
}

double scalar(const GoldenTensors& g, const std::string& key) { return at_key(g, key).item<double>(); }

// A fresh leaf copy of a golden input (never the golden tensor itself) in `dtype`, requiring grad.
Tensor leaf(const Tensor& t, at::ScalarType dtype = at::kDouble) {
  return t.detach().to(dtype).clone().set_requires_grad(true);
}

// |got - want| <= atol + rtol |want| elementwise, in float64; prints the max absolute and relative (to
// max |want|) difference.
void expect_close(const std::string& what, const Tensor& got, const Tensor& want, double atol, double rtol) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const Tensor g = got.detach().to(at::kDouble), w = want.to(at::kDouble);
  const double diff = (g - w).abs().max().item<double>();
  const double scale = w.abs().max().item<double>();
  std::cout << "  " << what << ": max |diff| " << diff << " (relative to max |want| " << scale << ": "
            << (scale > 0 ? diff / scale : diff) << ")\n";
  const bool ok = ((g - w).abs() <= atol + rtol * w.abs()).all().item<bool>();
  EXPECT_TRUE(ok) << what << ": max |diff| " << diff << " exceeds " << atol << " + " << rtol << " |want|";
}

void expect_close(const std::string& what, double got, double want, double atol, double rtol) {
  expect_close(what, torch::tensor(got, torch::kDouble), torch::tensor(want, torch::kDouble), atol, rtol);
}

// Gradients: exact to float64 rounding, measured against the largest entry.
void expect_grad(const std::string& what, const Tensor& got, const Tensor& want, double rel = 1e-12) {
  expect_close(what, got, want, rel * want.abs().max().item<double>(), rel);
}

constexpr double kValueTol = 1e-6;

void check_dpo(const std::string& file, bool has_per_pair, bool has_f32) {
  const GoldenTensors g = post_training_golden(file);
  const double beta = scalar(g, "beta"), ls = scalar(g, "label_smoothing");
  std::cout << file << " (beta " << beta << ", label_smoothing " << ls << ")\n";
  std::vector<at::ScalarType> dtypes{at::kDouble};
  if (has_f32) dtypes.push_back(at::kFloat);
  for (auto dtype : dtypes) {
    const std::string sfx = dtype == at::kFloat ? "_f32" : "";
    Tensor policy = leaf(at_key(g, "policy_logits"), dtype);
    const Tensor reference = at_key(g, "reference_logits").to(dtype);
    auto out = pt::dpo_loss(policy, reference, at_key(g, "ids"), at_key(g, "completion_mask"), beta, ls);
    EXPECT_EQ(out.loss.scalar_type(), dtype);
    out.loss.backward();
    const double tol = dtype == at::kFloat ? 1e-5 : kValueTol;
    expect_close("loss" + sfx, out.loss, at_key(g, "loss" + sfx), tol, tol);
    expect_grad("grad policy_logits" + sfx, policy.grad(), at_key(g, "grad_policy_logits" + sfx),
                dtype == at::kFloat ? 1e-5 : 1e-12);
    if (dtype == at::kFloat) continue;
    if (has_per_pair) {
      expect_close("chosen_rewards", out.chosen_rewards, at_key(g, "chosen_rewards"), kValueTol, kValueTol);
      expect_close("rejected_rewards", out.rejected_rewards, at_key(g, "rejected_rewards"), kValueTol, kValueTol);
      expect_close("chosen_logps", out.chosen_logps, at_key(g, "chosen_logps"), kValueTol, kValueTol);
      expect_close("rejected_logps", out.rejected_logps, at_key(g, "rejected_logps"), kValueTol, kValueTol);
    }
    for (const std::string m : {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                                "logps/chosen", "logps/rejected"}) {
      std::string key = "metric." + m;
      std::replace(key.begin(), key.end(), '/', '.');
      ASSERT_TRUE(out.metrics.count(m)) << m;
      expect_close(m, out.metrics.at(m), scalar(g, key), kValueTol, kValueTol);
    }
  }
}

}  // namespace

TEST(PostTrainingDpo, SigmoidLossMatchesTrlDpoTrainer) { check_dpo("dpo_sigmoid", true, true); }

TEST(PostTrainingDpo, LabelSmoothingMatchesTrlV028ConservativeDpo) { check_dpo("dpo_label_smoothing", false, false); }

TEST(PostTrainingDpo, SequenceLogpsShiftAndMask) {
  // Uniform logits: every counted token has log-prob -log V. mask[..., 0] is never read (no logits predict
  // the first token); masked tokens do not count.
  const int64_t V = 5;
  Tensor logits = torch::zeros({2, 4, V}, torch::kDouble);
  Tensor ids = torch::tensor({{1, 2, 3, 4}, {0, 0, 1, 1}}, torch::kLong);
  Tensor mask = torch::tensor({{1, 1, 0, 1}, {0, 0, 0, 0}}, torch::kLong);
  Tensor lp = pt::sequence_logps(logits, ids, mask);
  EXPECT_NEAR(lp[0].item<double>(), -2 * std::log(double(V)), 1e-15);
  EXPECT_EQ(lp[1].item<double>(), 0.0);
  // A peaked logit on the target raises exactly that token's log-prob.
  logits[0][1][3] = 2.0;  // predicts ids[0][2] = 3, which is masked out: no change
  EXPECT_NEAR(pt::sequence_logps(logits, ids, mask)[0].item<double>(), -2 * std::log(double(V)), 1e-15);
  logits[0][0][2] = 2.0;  // predicts ids[0][1] = 2, counted
  const double want = 2.0 - std::log(std::exp(2.0) + V - 1) - std::log(double(V));
  EXPECT_NEAR(pt::sequence_logps(logits, ids, mask.to(torch::kBool))[0].item<double>(), want, 1e-15);
}

TEST(PostTrainingDpo, PrecomputedReferenceLogpsGiveTheSameLoss) {
  const GoldenTensors g = post_training_golden("dpo_sigmoid");
  const Tensor ids = at_key(g, "ids"), mask = at_key(g, "completion_mask");
  Tensor policy = leaf(at_key(g, "policy_logits"));
  const Tensor ref_logps = pt::sequence_logps(at_key(g, "reference_logits"), ids, mask);
  auto a = pt::dpo_loss_from_logps(pt::sequence_logps(policy, ids, mask), ref_logps, scalar(g, "beta"));
  a.loss.backward();
  expect_close("loss from logps", a.loss, at_key(g, "loss"), kValueTol, kValueTol);
  expect_grad("grad from logps", policy.grad(), at_key(g, "grad_policy_logits"));
}

TEST(PostTrainingAdvantages, GrpoRlooAndMeanMatchVerl) {
  const GoldenTensors g = post_training_golden("advantages");
  const Tensor scores = at_key(g, "scores"), ids = at_key(g, "group_ids"), mask = at_key(g, "response_mask");
  std::cout << "advantages (groups of 4, 4, 1 and 3 equal scores)\n";
  // The group of one: verl divides by torch.tensor(1.0) + 1e-6 in float32, i.e. 1 + 9.54e-7; here
  // 1 + 1e-6 in the scores' dtype, a relative difference of 4.6e-8.
  expect_close("grpo", pt::grpo_advantages(scores, ids, mask), at_key(g, "grpo"), kValueTol, kValueTol);
  expect_close("grpo without std", pt::grpo_advantages(scores, ids, mask, false), at_key(g, "grpo_no_std"), kValueTol,
               kValueTol);
  expect_close("mean", pt::mean_advantages(scores, ids, mask), at_key(g, "grpo_no_std"), kValueTol, kValueTol);
  expect_close("rloo", pt::rloo_advantages(scores, ids, mask), at_key(g, "rloo"), kValueTol, kValueTol);
  const Tensor f32 = pt::grpo_advantages(scores.to(at::kFloat), ids, mask.to(at::kBool));
  EXPECT_EQ(f32.scalar_type(), at::kFloat);
  expect_close("grpo float32", f32, at_key(g, "grpo_f32"), 1e-6, 1e-6);
  // No gradient flows into the scores.
  Tensor s = leaf(scores);
  EXPECT_FALSE(pt::grpo_advantages(s, ids, mask).requires_grad());
}

TEST(PostTrainingPolicyLoss, PpoClipWithDualClipMatchesVerl) {
  const GoldenTensors g = post_training_golden("policy_loss");
  const Tensor old = at_key(g, "old_log_prob"), adv = at_key(g, "advantages"), mask = at_key(g, "response_mask");
  const std::vector<std::pair<std::string, std::string>> cases{
      {"token_mean", "token-mean"}, {"seq_mean_token_mean", "seq-mean-token-mean"}, {"token_mean_sym", "token-mean"}};
  for (const auto& [tag, mode] : cases) {
    const double lo = scalar(g, tag + ".eps_low"), hi = scalar(g, tag + ".eps_high");
    std::cout << "policy loss " << tag << " (" << mode << ", eps " << lo << " / " << hi << ", dual clip 3)\n";
    for (auto dtype : {at::kDouble, at::kFloat}) {
      const std::string sfx = dtype == at::kFloat ? "_f32" : "";
      Tensor logp = leaf(at_key(g, "log_prob"), dtype);
      auto out = pt::policy_loss(old.to(dtype), logp, adv.to(dtype), mask, lo, hi, 3.0, mode);
      EXPECT_EQ(out.loss.scalar_type(), dtype);
      out.loss.backward();
      const double tol = dtype == at::kFloat ? 1e-5 : kValueTol;
      expect_close(tag + ".loss" + sfx, out.loss, at_key(g, tag + ".loss" + sfx), tol, tol);
      expect_grad(tag + ".grad log_prob" + sfx, logp.grad(), at_key(g, tag + ".grad_log_prob" + sfx),
                  dtype == at::kFloat ? 1e-6 : 1e-12);
      if (dtype == at::kFloat) continue;
      expect_close(tag + ".clipfrac", out.clipfrac, at_key(g, tag + ".clipfrac"), kValueTol, kValueTol);
      expect_close(tag + ".clipfrac_lower", out.clipfrac_lower, at_key(g, tag + ".clipfrac_lower"), kValueTol,
                   kValueTol);
      expect_close(tag + ".ppo_kl", out.ppo_kl, at_key(g, tag + ".ppo_kl"), kValueTol, kValueTol);
      EXPECT_FALSE(out.clipfrac.requires_grad() || out.ppo_kl.requires_grad());
    }
  }
}

TEST(PostTrainingKl, K3AndItsAggregationsMatchVerl) {
  const GoldenTensors g = post_training_golden("kl");
  const Tensor mask = at_key(g, "response_mask");
  std::cout << "k3 (low_var_kl)\n";
  Tensor logp = leaf(at_key(g, "log_prob"));
  Tensor ref = leaf(at_key(g, "ref_log_prob"));
  Tensor k3 = pt::k3_kl(logp, ref);
  (k3 * at_key(g, "weight")).sum().backward();
  expect_close("k3", k3, at_key(g, "k3"), kValueTol, kValueTol);
  expect_grad("grad log_prob", logp.grad(), at_key(g, "grad_log_prob"));
  expect_grad("grad ref_log_prob", ref.grad(), at_key(g, "grad_ref_log_prob"));
  for (const auto& [tag, mode] :
       std::vector<std::pair<std::string, std::string>>{{"token_mean", "token-mean"},
                                                        {"seq_mean_token_mean", "seq-mean-token-mean"},
                                                        {"seq_mean_token_sum", "seq-mean-token-sum"}}) {
    Tensor lp = leaf(at_key(g, "log_prob"));
    Tensor loss = pt::agg_loss(pt::k3_kl(lp, at_key(g, "ref_log_prob")), mask, mode);
    loss.backward();
    expect_close("kl_loss " + mode, loss, at_key(g, "kl_loss." + tag), kValueTol, kValueTol);
    expect_grad("kl_loss " + mode + " grad", lp.grad(), at_key(g, "kl_loss." + tag + ".grad_log_prob"));
  }
}

TEST(PostTrainingAggLoss, EmptyMaskGivesZeroNotNaN) {
  Tensor loss = torch::randn({3, 4}, torch::kDouble);
  Tensor none = torch::zeros({3, 4}, torch::kBool);
  for (const auto& mode : pt::agg_modes()) EXPECT_EQ(pt::agg_loss(loss, none, mode).item<double>(), 0.0) << mode;
  EXPECT_EQ(pt::masked_mean(loss, none).item<double>(), 0.0);
  // Values outside the mask never leak in, not even inf or NaN.
  Tensor bad = loss.clone();
  bad[0][3] = std::numeric_limits<double>::quiet_NaN();
  bad[1][0] = std::numeric_limits<double>::infinity();
  Tensor mask = torch::ones({3, 4}, torch::kBool);
  mask[0][3] = false;
  mask[1][0] = false;
  for (const auto& mode : pt::agg_modes()) {
    EXPECT_EQ(pt::agg_loss(bad, mask, mode).item<double>(), pt::agg_loss(loss, mask, mode).item<double>()) << mode;
  }
}

TEST(PostTrainingErrors, BadInputsNameTheField) {
  using dew::test::error_of;
  auto has = [](const std::string& msg, const std::string& part) {
    return msg.find(part) != std::string::npos
               ? ::testing::AssertionSuccess()
               : ::testing::AssertionFailure() << "\"" << msg << "\" lacks \"" << part << "\"";
  };
  const Tensor logits = torch::randn({2, 2, 5, 7}, torch::kDouble);
  const Tensor ids = torch::randint(0, 7, {2, 2, 5}, torch::kLong);
  const Tensor mask = torch::ones({2, 2, 5}, torch::kLong);
  EXPECT_TRUE(has(error_of([&] { pt::dpo_loss(logits, logits, ids, mask, 0.0); }), "beta must be > 0, got 0"));
  EXPECT_TRUE(has(error_of([&] { pt::dpo_loss(logits, logits, ids, mask, -1.0); }), "beta must be > 0, got -1"));
  EXPECT_TRUE(has(error_of([&] { pt::dpo_loss(logits, logits, ids, mask, 0.1, 0.5); }),
                  "label_smoothing must be in [0, 0.5), got 0.5"));
  EXPECT_TRUE(has(error_of([&] { pt::dpo_loss(logits, logits.narrow(2, 0, 4), ids, mask); }),
                  "reference_logits [2, 2, 4, 7] must have the shape of policy_logits [2, 2, 5, 7]"));
  EXPECT_TRUE(has(error_of([&] { pt::dpo_loss(logits.select(1, 0), logits.select(1, 0), ids, mask); }),
                  "policy_logits [2, 5, 7] must be [B, 2, S, V]"));
  EXPECT_TRUE(has(error_of([&] { pt::dpo_loss(logits, logits, ids.narrow(2, 0, 4), mask); }),
                  "ids [2, 2, 4] must be [B, 2, S] = [2, 2, 5]"));
  EXPECT_TRUE(has(error_of([&] { pt::dpo_loss(logits, logits, ids, mask.narrow(0, 0, 1)); }),
                  "completion_mask [1, 2, 5] must have the shape of ids [2, 2, 5]"));
  EXPECT_TRUE(has(error_of([&] { pt::dpo_loss(logits, logits, ids + 7, mask); }), "ids must be in [0, 7)"));
  EXPECT_TRUE(has(error_of([&] { pt::dpo_loss(logits, logits, ids.to(torch::kInt), mask); }), "ids must be int64"));
  EXPECT_TRUE(has(error_of([&] { pt::dpo_loss_from_logps(torch::zeros({3}), torch::zeros({3})); }),
                  "policy_logps [3] must be [B, 2]"));

  const Tensor scores = torch::randn({4}, torch::kDouble);
  const Tensor groups = torch::tensor({0, 0, 1, 1}, torch::kLong);
  const Tensor rmask = torch::ones({4, 3}, torch::kLong);
  EXPECT_TRUE(has(error_of([&] { pt::grpo_advantages(scores, groups.narrow(0, 0, 3), rmask); }),
                  "grpo_advantages: group_ids [3] must be [4] like scores"));
  EXPECT_TRUE(has(error_of([&] { pt::rloo_advantages(scores, groups.to(torch::kDouble), rmask); }),
                  "rloo_advantages: group_ids must be an integer tensor, got Double"));
  EXPECT_TRUE(has(error_of([&] { pt::mean_advantages(scores, groups, rmask.narrow(0, 0, 2)); }),
                  "mean_advantages: response_mask [2, 3] must be [4, T] like scores"));
  EXPECT_TRUE(has(error_of([&] { pt::grpo_advantages(scores, groups, rmask, true, 0.0); }), "eps must be > 0, got 0"));

  const Tensor lp = torch::randn({4, 3}, torch::kDouble);
  EXPECT_TRUE(has(error_of([&] { pt::policy_loss(lp, lp, lp, rmask, 0.2, 0.2, 3.0, "seq-mean"); }),
                  "policy_loss: agg: got \"seq-mean\", accepted: token-mean, seq-mean-token-mean, seq-mean-token-sum"));
  EXPECT_TRUE(has(error_of([&] { pt::policy_loss(lp, lp, lp.narrow(1, 0, 2), rmask); }),
                  "policy_loss: advantages [4, 2] must have the shape of logp [4, 3]"));
  EXPECT_TRUE(has(error_of([&] { pt::policy_loss(lp.narrow(0, 0, 2), lp, lp, rmask); }),
                  "policy_loss: old_logp [2, 3] must have the shape of logp [4, 3]"));
  EXPECT_TRUE(has(error_of([&] { pt::policy_loss(lp, lp, lp, rmask.narrow(1, 0, 1)); }),
                  "policy_loss: response_mask [4, 1] must have the shape of logp [4, 3]"));
  EXPECT_TRUE(has(error_of([&] { pt::policy_loss(lp, lp, lp, rmask, 1.0); }), "eps_low must be in [0, 1), got 1"));
  EXPECT_TRUE(has(error_of([&] { pt::policy_loss(lp, lp, lp, rmask, 0.2, -0.1); }), "eps_high must be >= 0, got -0.1"));
  EXPECT_TRUE(
      has(error_of([&] { pt::policy_loss(lp, lp, lp, rmask, 0.2, 0.2, 1.0); }), "dual_clip must be > 1, got 1"));
  EXPECT_TRUE(has(error_of([&] { pt::policy_loss(lp, lp.to(torch::kLong), lp, rmask); }),
                  "policy_loss: logp must be a floating tensor, got Long"));
  EXPECT_TRUE(has(error_of([&] { pt::agg_loss(lp, rmask, "mean"); }), "agg_loss: mode: got \"mean\""));
  EXPECT_TRUE(has(error_of([&] { pt::k3_kl(lp, lp.narrow(1, 0, 2)); }),
                  "k3_kl: ref_logp [4, 2] must have the shape of logp [4, 3]"));
}
