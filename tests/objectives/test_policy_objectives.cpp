// The DPO and GRPO objectives on a tiny byte model: closed forms at the start (policy = reference), the
// frozen reference after the policy moves, the rollout buffer's advantages against the GRPO formula, and
// the buffer as checkpoint state.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <fstream>

#include "dew/core/rng.h"
#include "dew/objectives/dpo.h"
#include "dew/objectives/grpo.h"
#include "dew/objectives/post_training.h"
#include "dew/training/optim.h"
#include "tests/test_util.h"

namespace {

dew::nn::CausalTransformer tiny_model(uint64_t seed = 1) {
  dew::rng::DefaultGeneratorScope init(seed, 0, "init");
  dew::nn::CausalTransformerOptions o;
  o.vocab_size(257).emb_features(32).num_layers(2).num_heads(2).max_seq_len(64);
  return dew::nn::CausalTransformer(o);
}

dew::data::ChatFormat byte_plain_chat() {
  return {dew::data::load_tokenizer("byte"), dew::data::ChatTemplate::plain, {}};
}

dew::training::NamedTensors trainable(torch::nn::Module& m) {
  dew::training::NamedTensors out;
  for (const auto& kv : m.named_parameters()) out.emplace_back(kv.key(), kv.value());
  return out;
}

const char* kPairs = R"({"prompt":[{"role":"user","content":"2+2="}],"chosen":"4","rejected":"5"})"
                     "\n"
                     R"({"prompt":[{"role":"user","content":"10+7="}],"chosen":"17","rejected":"71"})"
                     "\n"
                     R"({"prompt":"x","chosen":"long answer","rejected":"no"})"
                     "\n";

}  // namespace

TEST(DpoObjective, AtTheStartTheLossIsLog2AndItsGradientTheClosedForm) {
  dew::test::TempDir d("dpo_obj");
  auto rows = dew::data::preference_rows(d.write("p.jsonl", kPairs), byte_plain_chat(), 64);
  auto model = tiny_model();
  auto obj = std::make_shared<dew::DPOObjective>(model, dew::DPOObjectiveOptions{}, rows, nullptr);
  const auto params = trainable(*model);
  dew::training::EMA ema(params, obj->ema());
  obj->bind_ema(ema.averages());
  auto out = obj->loss(rows, 0, dew::rng::generator(0, 0, "t"));
  // Policy = reference: every implicit reward is 0, so the loss is -log sigmoid(0) = log 2.
  EXPECT_NEAR(out.loss.item<double>(), std::log(2.0), 1e-6);
  EXPECT_NEAR(out.metrics.at("rewards/margins"), 0.0, 1e-6);
  EXPECT_NEAR(out.metrics.at("rewards/chosen"), 0.0, 1e-6);
  out.loss.backward();
  // d loss / d theta = -(beta / 2) mean_b grad(logp_chosen - logp_rejected) at D = 0 (sigmoid(0) = 1/2).
  std::vector<at::Tensor> got;
  for (const auto& [n, p] : params) got.push_back(p.grad().clone());
  model->zero_grad();
  const at::Tensor ids = rows.at("ids"), mask = rows.at("completion_mask");
  const int64_t b = ids.size(0), l = ids.size(2);
  at::Tensor lp =
      dew::post_training::sequence_logps(model->forward_tokens(ids.view({2 * b, l})).view({b, 2, l, -1}), ids, mask);
  (-(0.1 / 2.0) * (lp.select(1, 0) - lp.select(1, 1)).mean()).backward();
  double worst = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor want = params[i].second.grad();
    worst = std::max(worst, (got[i] - want).abs().max().item<double>() / (want.abs().max().item<double>() + 1e-12));
  }
  EXPECT_LT(worst, 1e-4) << "largest relative gradient difference";
}

TEST(DpoObjective, TheSftTermAddsTheChosenTokensMeanNegativeLogLikelihood) {
  dew::test::TempDir d("dpo_sft");
  auto rows = dew::data::preference_rows(d.write("p.jsonl", kPairs), byte_plain_chat(), 64);
  auto model = tiny_model();
  dew::DPOObjectiveOptions o;
  o.sft_weight = 0.5;
  auto obj = std::make_shared<dew::DPOObjective>(model, o, rows, nullptr);
  dew::training::EMA ema(trainable(*model), obj->ema());
  obj->bind_ema(ema.averages());
  auto out = obj->loss(rows, 0, dew::rng::generator(0, 0, "t"));
  // The chosen rows' completion tokens: their mean -log p, from per-token log-probs.
  at::NoGradGuard ng;
  const at::Tensor chosen = rows.at("ids").select(1, 0), mask = rows.at("completion_mask").select(1, 0);
  const at::Tensor lp = dew::post_training::token_logps(*model, chosen);
  const double nll =
      -(lp * mask.to(at::kFloat)).sum().item<double>() / mask.narrow(1, 1, mask.size(1) - 1).sum().item<double>();
  EXPECT_NEAR(out.metrics.at("sft_loss"), nll, 1e-5);
  EXPECT_NEAR(out.loss.item<double>(), std::log(2.0) + 0.5 * nll, 1e-5);
}

TEST(DpoObjective, TheReferenceStaysFrozenAndPrecomputingGivesTheSameLoss) {
  dew::test::TempDir d("dpo_ref");
  auto rows = dew::data::preference_rows(d.write("p.jsonl", kPairs), byte_plain_chat(), 64);
  for (const char* mode : {"batch", "precompute"}) {
    auto model = tiny_model();
    dew::DPOObjectiveOptions o;
    o.reference_logps = mode;
    o.beta = 0.5;
    auto obj = std::make_shared<dew::DPOObjective>(model, o, rows, nullptr);
    dew::training::EMA ema(trainable(*model), obj->ema());
    obj->bind_ema(ema.averages());
    // The reference: the starting weights, as the EMA holds them; then the policy moves.
    auto ref = tiny_model();
    {
      at::NoGradGuard ng;
      for (auto& p : model->parameters()) p.add_(at::randn(p.sizes(), dew::rng::generator(3, 0, "perturb")) * 0.05);
    }
    const at::Tensor ids = rows.at("ids"), mask = rows.at("completion_mask");
    const int64_t b = ids.size(0), l = ids.size(2);
    at::NoGradGuard ng;
    auto logps = [&](dew::nn::CausalTransformer& m) {
      return dew::post_training::sequence_logps(m->forward_tokens(ids.view({2 * b, l})).view({b, 2, l, -1}), ids, mask);
    };
    const at::Tensor pi = logps(model), rf = logps(ref);
    const at::Tensor margin = 0.5 * ((pi.select(1, 0) - rf.select(1, 0)) - (pi.select(1, 1) - rf.select(1, 1)));
    const double want = -at::log_sigmoid(margin).mean().item<double>();
    const double got = obj->loss(rows, 0, dew::rng::generator(0, 0, "t")).loss.item<double>();
    EXPECT_NEAR(got, want, 1e-5) << mode;
    EXPECT_GT(std::abs(got - std::log(2.0)), 1e-3) << mode << ": the policy moved, the loss must too";
  }
}

TEST(GrpoObjective, RolloutAdvantagesFollowTheGroupFormulaAndTheFirstUpdateIsOnPolicy) {
  dew::test::TempDir d("grpo_obj");
  auto fmt = byte_plain_chat();
  auto prompts =
      dew::data::read_prompts(d.write("q.jsonl", R"({"prompt":[{"role":"user","content":"1+1="}],"answer":"2"})"
                                                 "\n"
                                                 R"({"prompt":[{"role":"user","content":"3+4="}],"answer":"7"})"
                                                 "\n"),
                              fmt, 64);
  dew::post_training::RewardOptions ro;
  ro.format = "[\\s\\S]*[a-m][\\s\\S]*";  // a random model's completions hold one of a-m about a quarter of the time
  auto model = tiny_model();
  dew::GRPOObjectiveOptions o;
  o.group_size = 4;
  o.max_new_tokens = 6;
  o.mini_batches = 2;
  auto obj = std::make_shared<dew::GRPOObjective>(model, o, fmt, prompts,
                                                  dew::post_training::make_rewards("format", "", ro), nullptr);
  dew::training::EMA ema(trainable(*model), obj->ema());
  obj->bind_ema(ema.averages());
  obj->begin(0, d.path.string());
  dew::data::Batch batch = {{"index", at::arange(2, at::kLong)}};
  auto out = obj->loss(batch, 0, dew::rng::generator(0, 0, "objective"));
  // The first mini-batch is the rollout's own policy: ratio 1, nothing clipped, no KL to the reference.
  EXPECT_NEAR(out.metrics.at("ppo_kl"), 0.0, 1e-5);
  EXPECT_EQ(out.metrics.at("pg_clipfrac"), 0.0);
  EXPECT_NEAR(out.metrics.at("kl"), 0.0, 1e-5);
  // rollouts.jsonl: 8 lines; per group advantage = (r - mean) / (std (ddof 1) + 1e-6).
  std::ifstream f(d.file("rollouts.jsonl"));
  std::vector<dew::json> lines;
  for (std::string s; std::getline(f, s);) lines.push_back(dew::json::parse(s));
  ASSERT_EQ(lines.size(), 8u);
  for (int g = 0; g < 2; ++g) {
    double mean = 0, var = 0;
    for (int k = 0; k < 4; ++k) mean += lines[g * 4 + k]["reward"].get<double>() / 4;
    for (int k = 0; k < 4; ++k) var += std::pow(lines[g * 4 + k]["reward"].get<double>() - mean, 2) / 3;
    for (int k = 0; k < 4; ++k) {
      const auto& l = lines[g * 4 + k];
      EXPECT_EQ(l["step"], 1);
      const std::string c = l["completion"];
      bool hit = false;
      for (char ch : c) hit = hit || (ch >= 'a' && ch <= 'm');
      EXPECT_EQ(l["reward"].get<double>(), hit ? 1.0 : 0.0) << l.dump();
      EXPECT_NEAR(l["advantage"].get<double>(), (l["reward"].get<double>() - mean) / (std::sqrt(var) + 1e-6), 1e-4);
    }
  }
  EXPECT_NEAR(
      out.metrics.at("reward/format"),
      [&] {
        double s = 0;
        for (const auto& l : lines) s += l["reward"].get<double>();
        return s / 8;
      }(),
      1e-9);

  // The buffer is the checkpoint state: a fresh objective given it takes the same second update.
  const auto state = obj->state();
  ASSERT_TRUE(state.count("old_logp") && state.count("advantages") && state.count("ref_logp"));
  auto again = obj->loss(batch, 1, dew::rng::generator(0, 1, "objective"));
  auto obj2 = std::make_shared<dew::GRPOObjective>(model, o, fmt, prompts,
                                                   dew::post_training::make_rewards("format", "", ro), nullptr);
  obj2->bind_ema(ema.averages());
  obj2->load_state(state);
  auto resumed = obj2->loss(batch, 1, dew::rng::generator(0, 1, "objective"));
  EXPECT_EQ(again.loss.item<double>(), resumed.loss.item<double>());
  // Step 2 starts the next rollout (epochs 1 x mini_batches 2).
  EXPECT_EQ(obj->updates_per_rollout(), 2);
}
