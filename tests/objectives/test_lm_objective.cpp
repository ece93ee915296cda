// LMObjective: chunked cross entropy = plain cross entropy (values and gradients), masking by pad_id and
// loss_mask, metrics, and validation writing a sampled text.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "dew/data/token_files.h"
#include "dew/objectives/lm.h"
#include "dew/objectives/registry.h"
#include "tests/test_util.h"

using dew::json;

TEST(LMObjective, ChunkedCrossEntropyEqualsPlainWithGradients) {
  torch::manual_seed(0);
  for (double softcap : {0.0, 3.0}) {
    for (int64_t chunk : {int64_t(0), int64_t(7), int64_t(16), int64_t(50)}) {
      at::Tensor h = torch::randn({37, 8}, torch::requires_grad());
      at::Tensor w = torch::randn({50, 8}, torch::requires_grad());
      at::Tensor t = torch::randint(0, 50, {37}, torch::kLong);
      // The objective's loss: the mean over target tokens.
      auto ce = dew::chunked_cross_entropy(h, w, t, softcap, chunk);
      at::Tensor mean = ce.loss_sum / 37.0;
      auto [gh, gw] = [&] {
        auto g = torch::autograd::grad({mean}, {h, w});
        return std::make_pair(g[0], g[1]);
      }();
      at::Tensor logits = at::linear(h, w);
      if (softcap > 0) logits = at::tanh(logits / softcap) * softcap;
      at::Tensor ref = at::cross_entropy_loss(logits, t);
      auto g = torch::autograd::grad({ref}, {h, w});
      EXPECT_NEAR(mean.item<double>(), ref.item<double>(), 1e-6) << "chunk " << chunk << " softcap " << softcap;
      EXPECT_LT((gh - g[0]).abs().max().item<double>(), 1e-6) << chunk;
      EXPECT_LT((gw - g[1]).abs().max().item<double>(), 1e-6) << chunk;
      EXPECT_EQ(ce.correct.item<int64_t>(), (logits.argmax(-1) == t).sum().item<int64_t>());
    }
  }
}

TEST(LMObjective, LossMatchesHandComputedCrossEntropyWithPadding) {
  dew::nn::CausalTransformer m(
      dew::nn::CausalTransformerOptions().vocab_size(13).emb_features(16).num_layers(1).num_heads(2).max_seq_len(32));
  dew::LMObjectiveOptions o;
  o.seq_len = 6;
  o.pad_id = 0;
  o.vocab_chunk = 5;
  dew::LMObjective obj(m, nullptr, o);
  at::Tensor tokens = torch::tensor({{3, 4, 5, 6, 7, 8, 9}, {1, 2, 3, 0, 0, 0, 0}}, torch::kLong);
  auto out = obj.loss({{"tokens", tokens}}, 0, at::Generator());
  // Reference: full logits, CE over the targets that are not pad.
  at::Tensor logits = m->forward_tokens(tokens.narrow(1, 0, 6)).reshape({-1, 13});
  at::Tensor targets = tokens.narrow(1, 1, 6).reshape({-1});
  at::Tensor keep = targets != 0;
  at::Tensor ref = at::cross_entropy_loss(logits.index({keep}), targets.index({keep}));
  EXPECT_NEAR(out.loss.item<double>(), ref.item<double>(), 1e-6);
  EXPECT_EQ(out.metrics.at("tokens"), 8.0);  // 6 + 2 real targets
  EXPECT_NEAR(out.metrics.at("perplexity"), std::exp(ref.item<double>()), 1e-4);
  // loss_mask: only the marked targets count
  o.loss_role = "loss_mask";
  o.pad_id = -1;
  dew::LMObjective masked(m, nullptr, o);
  at::Tensor lm = torch::zeros({2, 7}, torch::kBool);
  lm[0][3] = true;  // target index 2 of row 0 (token 6)
  auto one = masked.loss({{"tokens", tokens}, {"loss_mask", lm}}, 0, at::Generator());
  at::Tensor l3 = m->forward_tokens(tokens.narrow(1, 0, 6))[0][2];
  EXPECT_NEAR(one.loss.item<double>(), (at::logsumexp(l3, 0) - l3[6]).item<double>(), 1e-5);
  EXPECT_NE(dew::test::error_of([&] {
              masked.loss({{"tokens", tokens}}, 0, at::Generator());
            }).find("loss_mask"),
            std::string::npos);
}

TEST(LMObjective, ValidationReportsPerplexityAndWritesASample) {
  dew::test::TempDir dir("lm_objective");
  std::vector<int64_t> train, val;
  for (int i = 0; i < 400; ++i) train.push_back(i % 5 == 4 ? 256 : 'a' + i % 5);
  for (int i = 0; i < 100; ++i) val.push_back(i % 5 == 4 ? 256 : 'a' + i % 5);
  dew::data::TokenMeta meta;
  meta.tokenizer = {{"name", "byte"}};
  meta.vocab_size = 257;
  meta.eos_id = 256;
  meta.packed = true;
  dew::data::write_token_files(dir.file("tok"), train, val, meta);
  auto lm = dew::data::lm_datasets().build(json{{"name", "tokens"}, {"dir", dir.file("tok")}}, 8);
  dew::nn::CausalTransformer model(
      dew::nn::CausalTransformerOptions().vocab_size(257).emb_features(16).num_layers(1).num_heads(2));
  dew::ObjectiveContext ctx;
  ctx.language_model = model;
  ctx.lm_data = lm;
  auto obj = dew::objectives().build("lm", json{{"seq_len", 8}, {"sample_tokens", 5}, {"val_batch", 3}}, ctx);
  EXPECT_EQ(obj->batch_fields(), (std::vector<std::string>{"tokens", "segment_ids", "positions"}));
  auto v = obj->validate(7, dir.path.string());
  EXPECT_EQ(v.at("val/tokens"), 12.0 * 8);  // (100 - 1) / 8 = 12 windows
  EXPECT_NEAR(v.at("val/perplexity"), std::exp(v.at("val/ce")), 1e-9);
  EXPECT_NEAR(v.at("val/ce"), std::log(257.0), 0.5);  // an untrained model is near uniform
  EXPECT_TRUE(std::filesystem::exists(dir.path / "samples" / "step_7.txt"));
  auto diffusion_model =
      dew::models::build("simple_dit", {{"patch_size", 2}, {"emb_features", 16}, {"num_layers", 1}, {"num_heads", 2}});
  ctx.model = diffusion_model;  // a denoiser is no language model
  ctx.language_model = nullptr;
  EXPECT_NE(dew::test::error_of([&] {
              dew::objectives().build("lm", json{{"seq_len", 8}}, ctx);
            }).find("causal_transformer"),
            std::string::npos);
}
