// causal_transformer: RoPE against hand-computed values, KV-cache decoding = the full forward (full and
// sliding-window layers, GQA), packed documents = each alone, parameter names, and overfitting a batch.
#include <gtest/gtest.h>
#include <torch/optim/adam.h>

#include <cmath>

#include "dew/nn/backbones/causal_transformer.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

using dew::nn::CausalTransformer;
using dew::nn::CausalTransformerOptions;

namespace {

// Every feature at once: GQA, partial rotary, sliding and full layers with their own theta, Gemma norms.
CausalTransformerOptions featureful() {
  return CausalTransformerOptions()
      .vocab_size(23)
      .emb_features(32)
      .num_layers(3)
      .num_heads(4)
      .num_kv_heads(2)
      .head_dim(8)
      .mlp("geglu")
      .mlp_features(48)
      .max_seq_len(64)
      .partial_rotary_factor(0.5)
      .layer_types({"sliding_attention", "full_attention", "sliding_attention"})
      .sliding_window(3)
      .sliding_rope_theta(100.0)
      .scale_offset(1.0)
      .sandwich_norms(true)
      .attention_bias(true)
      .embedding_scale(std::sqrt(32.0))
      .final_logit_softcap(5.0)
      .tie_embeddings(false);
}

CausalTransformerOptions plain() {
  return CausalTransformerOptions().vocab_size(19).emb_features(32).num_layers(2).num_heads(4).max_seq_len(64);
}

// Perturbs every parameter so norms with zero-initialised (Gemma) weights matter.
void randomise(CausalTransformer& m, uint64_t seed) {
  torch::manual_seed(seed);
  torch::NoGradGuard ng;
  for (auto& p : m->parameters()) p.add_(torch::randn_like(p) * 0.1);
}

using dew::test::max_diff;

}  // namespace

TEST(CausalTransformer, RopeMatchesHandComputedValues) {
  // Full rotation of [a, b, c, d] at position 2, theta 1e4: frequencies 1 and 1e4^(-1/2) = 0.01.
  at::Tensor x = torch::tensor({1.0f, 2.0f, 3.0f, 4.0f}).view({1, 1, 1, 4});
  at::Tensor pos = torch::tensor({2}, torch::kLong).view({1, 1});
  auto y = dew::nn::apply_partial_rope(x, pos, 4, 1e4).view({4});
  const double a = 1, b = 2, c = 3, d = 4, t0 = 2.0, t1 = 0.02;
  std::vector<double> want{a * std::cos(t0) - c * std::sin(t0), b * std::cos(t1) - d * std::sin(t1),
                           c * std::cos(t0) + a * std::sin(t0), d * std::cos(t1) + b * std::sin(t1)};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(y[i].item<double>(), want[size_t(i)], 1e-6) << i;
  // Partial: only the first 2 dims rotate (one frequency, 1), the last 2 pass through.
  pos = torch::tensor({1}, torch::kLong).view({1, 1});
  y = dew::nn::apply_partial_rope(x, pos, 2, 1e4).view({4});
  EXPECT_NEAR(y[0].item<double>(), a * std::cos(1.0) - b * std::sin(1.0), 1e-6);
  EXPECT_NEAR(y[1].item<double>(), b * std::cos(1.0) + a * std::sin(1.0), 1e-6);
  EXPECT_EQ(y[2].item<double>(), 3.0);
  EXPECT_EQ(y[3].item<double>(), 4.0);
  EXPECT_EQ(featureful().rotary_dim(), 4);
}

TEST(CausalTransformer, RmsNormMatchesFormula) {
  at::Tensor x = torch::tensor({3.0f, 4.0f}).view({1, 2});
  at::Tensor w = torch::tensor({0.5f, -1.0f});
  // rms = sqrt((9 + 16) / 2 + eps); Gemma offset 1 scales by (1 + w).
  const double r = std::sqrt(12.5 + 1e-5);
  auto y = dew::nn::rms_norm(x, w, 1e-5, 1.0);
  EXPECT_NEAR(y[0][0].item<double>(), 3 / r * 1.5, 1e-6);
  EXPECT_NEAR(y[0][1].item<double>(), 4 / r * 0.0, 1e-6);
}

TEST(CausalTransformer, ParameterNamesFollowHuggingFace) {
  CausalTransformer m(featureful());
  auto named = m->named_parameters();
  for (const char* k :
       {"embed_tokens.weight", "layers.0.input_layernorm.weight", "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.q_proj.bias", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.o_proj.weight", "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight",
        "layers.0.post_attention_layernorm.weight", "layers.0.pre_feedforward_layernorm.weight",
        "layers.0.post_feedforward_layernorm.weight", "layers.2.mlp.gate_proj.weight", "layers.2.mlp.up_proj.weight",
        "layers.2.mlp.down_proj.weight", "norm.weight", "lm_head.weight"})
    EXPECT_TRUE(named.contains(k)) << k;
  EXPECT_EQ(named["layers.1.self_attn.k_proj.weight"].sizes(), (std::vector<int64_t>{16, 32}));  // 2 kv heads x 8
  CausalTransformer tied(plain());
  EXPECT_FALSE(tied->named_parameters().contains("lm_head.weight"));
  EXPECT_FALSE(tied->named_parameters().contains("layers.0.pre_feedforward_layernorm.weight"));
  // embed_tokens, norm + per layer: 2 layer norms, 4 projections, 2 qk norms, 3 MLP projections
  EXPECT_EQ(tied->named_parameters().size(), 2u + 2u * 11u);
}

TEST(CausalTransformer, KVCacheDecodingEqualsFullForward) {
  for (auto opts : {featureful(), plain()}) {
    CausalTransformer m(opts);
    randomise(m, 1);
    m->eval();
    torch::NoGradGuard ng;
    at::Tensor ids = torch::randint(0, opts.vocab_size(), {2, 11}, torch::kLong);
    at::Tensor full = m->forward_tokens(ids);  // [2, 11, V]
    dew::nn::KVCache cache;
    at::Tensor first = m->forward_tokens(ids.narrow(1, 0, 4), {}, {}, {}, &cache);
    EXPECT_LT(max_diff(first, full.narrow(1, 0, 4)), 1e-5);
    for (int64_t t = 4; t < 11; ++t) {
      at::Tensor step = m->forward_tokens(ids.narrow(1, t, 1), {}, {}, {}, &cache);
      EXPECT_LT(max_diff(step, full.narrow(1, t, 1)), 1e-5) << "token " << t;
    }
    EXPECT_EQ(cache.length(), 11);
  }
}

TEST(CausalTransformer, PaddedCacheDecodingEqualsEachRowAlone) {
  // Row 0 is left-padded by 3: its prefill carries an attention mask, so every later step (none of which
  // passes a mask) must still hide the padded keys and count positions from its real tokens.
  for (auto opts : {featureful(), plain()}) {
    CausalTransformer m(opts);
    randomise(m, 3);
    m->eval();
    torch::NoGradGuard ng;
    at::Tensor ids = torch::randint(0, opts.vocab_size(), {2, 9}, torch::kLong);
    at::Tensor mask = torch::ones({2, 6}, torch::kBool);
    mask[0].narrow(0, 0, 3).fill_(false);
    dew::nn::KVCache cache;
    at::Tensor first = m->forward_tokens(ids.narrow(1, 0, 6), {}, {}, mask, &cache);
    EXPECT_TRUE(cache.padded);
    at::Tensor alone0 = m->forward_tokens(ids[0].narrow(0, 3, 6).view({1, 6}));  // row 0 without its padding
    at::Tensor alone1 = m->forward_tokens(ids[1].view({1, 9}));
    EXPECT_LT(max_diff(first[0].narrow(0, 3, 3), alone0[0].narrow(0, 0, 3)), 1e-5);
    EXPECT_LT(max_diff(first[1], alone1[0].narrow(0, 0, 6)), 1e-5);
    for (int64_t t = 6; t < 9; ++t) {
      at::Tensor step = m->forward_tokens(ids.narrow(1, t, 1), {}, {}, {}, &cache);
      EXPECT_LT(max_diff(step[0][0], alone0[0][t - 3]), 1e-5) << "token " << t;
      EXPECT_LT(max_diff(step[1][0], alone1[0][t]), 1e-5) << "token " << t;
    }
  }
}

TEST(CausalTransformer, SlidingWindowLimitsWhatATokenSees) {
  // One sliding layer with window 3: the logits at position 7 do not depend on tokens 0..4.
  auto o = plain().num_layers(1).layer_types({"sliding_attention"}).sliding_window(3);
  CausalTransformer m(o);
  m->eval();
  torch::NoGradGuard ng;
  at::Tensor a = torch::randint(0, 19, {1, 8}, torch::kLong);
  at::Tensor b = a.clone();
  b.narrow(1, 0, 5).copy_((a.narrow(1, 0, 5) + 1) % 19);
  EXPECT_LT(max_diff(m->forward_tokens(a).select(1, 7), m->forward_tokens(b).select(1, 7)), 1e-6);
  EXPECT_GT(max_diff(m->forward_tokens(a).select(1, 4), m->forward_tokens(b).select(1, 4)), 1e-4);
}

TEST(CausalTransformer, PackedDocumentsGetTheirOwnLogits) {
  CausalTransformer m(featureful());
  randomise(m, 2);
  m->eval();
  torch::NoGradGuard ng;
  at::Tensor d1 = torch::randint(0, 23, {1, 5}, torch::kLong), d2 = torch::randint(0, 23, {1, 4}, torch::kLong);
  at::Tensor packed = torch::cat({d1, d2}, 1);
  at::Tensor seg = torch::tensor({0, 0, 0, 0, 0, 1, 1, 1, 1}, torch::kLong).view({1, 9});
  at::Tensor pos = torch::tensor({0, 1, 2, 3, 4, 0, 1, 2, 3}, torch::kLong).view({1, 9});
  at::Tensor out = m->forward_tokens(packed, pos, seg);
  EXPECT_LT(max_diff(out.narrow(1, 0, 5), m->forward_tokens(d1)), 1e-5);
  EXPECT_LT(max_diff(out.narrow(1, 5, 4), m->forward_tokens(d2)), 1e-5);
}

TEST(CausalTransformer, OverfitsOneBatch) {
  torch::manual_seed(0);
  CausalTransformer m(plain().num_layers(2).emb_features(32));
  at::Tensor ids = torch::randint(0, 19, {4, 17}, torch::kLong);
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
  double first = 0, last = 0;
  for (int i = 0; i < 150; ++i) {
    opt.zero_grad();
    at::Tensor logits = m->forward_tokens(ids.narrow(1, 0, 16));
    at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, 19}), ids.narrow(1, 1, 16).reshape({-1}));
    loss.backward();
    opt.step();
    if (i == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  EXPECT_NEAR(first, std::log(19.0), 0.3);  // starts near uniform
  EXPECT_LT(last, 0.05);
}

TEST(CausalTransformer, RematGivesTheSameGradients) {
  auto o = featureful();
  CausalTransformer a(o), b(o.remat(true));
  {
    torch::NoGradGuard ng;
    auto pa = a->parameters(), pb = b->parameters();
    for (size_t i = 0; i < pa.size(); ++i) pb[i].copy_(pa[i]);
  }
  at::Tensor ids = torch::randint(0, 23, {2, 9}, torch::kLong);
  a->forward_tokens(ids).pow(2).mean().backward();
  b->forward_tokens(ids).pow(2).mean().backward();
  auto pa = a->named_parameters(), pb = b->named_parameters();
  for (const auto& kv : pa) EXPECT_LT(max_diff(kv.value().grad(), pb[kv.key()].grad()), 1e-6) << kv.key();
}

TEST(CausalTransformer, BadOptionsAndInputsNameTheField) {
  using dew::test::error_of;
  EXPECT_NE(error_of([] { CausalTransformer(plain().num_kv_heads(3)); }).find("num_kv_heads"), std::string::npos);
  EXPECT_NE(error_of([] { CausalTransformer(plain().layer_types({"full_attention"})); }).find("layer_types"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              CausalTransformer(plain().layer_types({"full_attention", "local"}));
            }).find("local"),
            std::string::npos);
  CausalTransformer m(plain());
  EXPECT_NE(error_of([&] {
              m->forward_tokens(torch::full({1, 3}, 19, torch::kLong));
            }).find("[0, 19)"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              m->forward_tokens(torch::zeros({1, 65}, torch::kLong));
            }).find("max_seq_len"),
            std::string::npos);
  auto built = dew::models::build_language_model(
      {{"architecture", "causal_transformer"},
       {"fields", {{"vocab_size", 11}, {"num_layers", 1}, {"emb_features", 16}, {"num_heads", 2}}}});
  EXPECT_EQ(built->config()["fields"]["vocab_size"], 11);
  // A language model is no denoiser: it is not in the denoiser registry at all.
  EXPECT_NE(error_of([] { dew::models::build("causal_transformer", {}); }).find("unknown model \"causal_transformer\""),
            std::string::npos);
  EXPECT_NE(
      error_of([] {
        dew::models::build_language_model({{"architecture", "causal_transformer"}, {"fields", {{"rope_thta", 1}}}});
      }).find("rope_theta"),
      std::string::npos);
}
