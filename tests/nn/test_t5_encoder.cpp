// t5_encoder: what the shared suites (test_all_backbones: tiny build, shapes, gradients, own checkpoint;
// test_reference_parity: tests/golden/text_encoders/t5_v1_0, t5_v1_1 against transformers) do not reach —
// the SentencePiece tokenization against transformers' T5Tokenizer ids, relative position buckets, the config
// translation's refusals, the tied-embedding key map, padding and the pooled mean.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

#include "dew/io/weights.h"
#include "dew/nn/t5_encoder.h"
#include "dew/training/trainer.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

using dew::json;
using dew::nn::T5Encoder;
using dew::nn::T5EncoderOptions;
using dew::test::error_of;

namespace {

const std::string kT5Golden = std::string(DEW_SOURCE_DIR) + "/tests/golden/text_encoders/";

T5EncoderOptions tiny_t5() {
  return T5EncoderOptions()
      .vocab_size(64)
      .d_model(16)
      .d_kv(8)
      .d_ff(32)
      .num_layers(2)
      .num_heads(2)
      .relative_attention_num_buckets(8)
      .relative_attention_max_distance(16)
      .feed_forward_proj("gated-gelu")
      .max_length(12);
}

json read_t5_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

}  // namespace

TEST(T5Encoder, TokenizeMatchesTransformersT5Tokenizer) {
  // tokens.json: transformers' T5Tokenizer(texts, padding="max_length", truncation=True) on a tiny spiece.model.
  const json g = read_t5_json(kT5Golden + "t5_tokenizer/tokens.json");
  T5Encoder t5(tiny_t5().tokenizer(kT5Golden + "t5_tokenizer").max_length(g.at("max_length").get<int64_t>()));
  ASSERT_NE(t5->sentencepiece(), nullptr);
  EXPECT_EQ(t5->sentencepiece()->vocab_size(), g.at("vocab_size").get<int64_t>());
  const auto texts = g.at("texts").get<std::vector<std::string>>();
  const auto [ids, mask] = t5->tokenize(texts);
  ASSERT_EQ(ids.size(0), static_cast<int64_t>(texts.size()));
  for (size_t i = 0; i < texts.size(); ++i) {
    SCOPED_TRACE(texts[i]);
    const auto want_ids = g.at("input_ids")[i].get<std::vector<int64_t>>();
    const auto want_mask = g.at("attention_mask")[i].get<std::vector<int64_t>>();
    for (size_t j = 0; j < want_ids.size(); ++j) {
      EXPECT_EQ(ids[int64_t(i)][int64_t(j)].item<int64_t>(), want_ids[j]) << "position " << j;
      EXPECT_EQ(mask[int64_t(i)][int64_t(j)].item<bool>(), want_mask[j] != 0) << "position " << j;
    }
  }
  // The file itself also serves as the tokenizer field.
  T5Encoder by_file(tiny_t5().tokenizer(kT5Golden + "t5_tokenizer/spiece.model"));
  EXPECT_NE(by_file->sentencepiece(), nullptr);
}

TEST(T5Encoder, TokenizerThatIsNotSentencePieceIsRefusedWithThePath) {
  const std::string not_sp = kT5Golden + "t5_v1_0/config.json";
  const std::string e = error_of([&] { T5Encoder(tiny_t5().tokenizer(not_sp)); });
  EXPECT_NE(e.find(not_sp), std::string::npos) << e;
  EXPECT_NE(e.find("SentencePiece"), std::string::npos) << e;
  const std::string folder = kT5Golden + "t5_v1_0";  // a folder without spiece.model
  const std::string e2 = error_of([&] { T5Encoder(tiny_t5().tokenizer(folder)); });
  EXPECT_NE(e2.find("spiece.model"), std::string::npos) << e2;
  // eos_token_id must be the tokenizer's </s>.
  const std::string e3 = error_of([&] { T5Encoder(tiny_t5().eos_token_id(5).tokenizer(kT5Golden + "t5_tokenizer")); });
  EXPECT_NE(e3.find("eos_token_id"), std::string::npos) << e3;
  EXPECT_NE(error_of([&] { T5Encoder(tiny_t5())->tokenize({"a"}); }).find("tokenizer"), std::string::npos);
}

TEST(T5Encoder, RelativePositionBucketsAsTransformers) {
  // transformers' T5Attention._relative_position_bucket(r, bidirectional=True, ...) on these positions.
  const auto r =
      torch::tensor({-200, -128, -50, -20, -9, -8, -7, -1, 0, 1, 2, 7, 8, 9, 20, 50, 127, 128, 1000}, torch::kLong);
  const std::vector<int64_t> want_32_128{15, 15, 13, 10, 8, 8, 7, 1, 0, 17, 18, 23, 24, 24, 26, 29, 31, 31, 31};
  const std::vector<int64_t> want_8_16{3, 3, 3, 3, 3, 3, 3, 1, 0, 5, 6, 7, 7, 7, 7, 7, 7, 7, 7};
  const auto a = dew::nn::t5_relative_position_bucket(r, 32, 128), b = dew::nn::t5_relative_position_bucket(r, 8, 16);
  for (int64_t i = 0; i < r.size(0); ++i) {
    EXPECT_EQ(a[i].item<int64_t>(), want_32_128[size_t(i)]) << r[i].item<int64_t>();
    EXPECT_EQ(b[i].item<int64_t>(), want_8_16[size_t(i)]) << r[i].item<int64_t>();
  }
}

TEST(T5Encoder, ConfigTranslationRefusesUnsupportedSettingsByName) {
  const json config = read_t5_json(kT5Golden + "t5_v1_1/config.json");
  const auto o = dew::nn::t5_encoder_options_from_hf(config);
  EXPECT_EQ(o.d_model(), 16);
  EXPECT_EQ(o.feed_forward_proj(), "gated-gelu");
  EXPECT_EQ(o.relative_attention_max_distance(), 16);
  auto with = [&](const std::string& key, const json& value) {
    json c = config;
    c[key] = value;
    return error_of([&] { dew::nn::t5_encoder_options_from_hf(c); });
  };
  const std::string dec = with("is_decoder", true);
  EXPECT_NE(dec.find("is_decoder"), std::string::npos) << dec;
  const std::string ff = with("feed_forward_proj", "gated-swish2");
  EXPECT_NE(ff.find("feed_forward_proj"), std::string::npos) << ff;
  EXPECT_NE(ff.find("gated-swish2"), std::string::npos) << ff;
  const std::string type = with("model_type", "umt5");
  EXPECT_NE(type.find("umt5"), std::string::npos) << type;
  const std::string buckets = error_of([&] { T5Encoder(tiny_t5().relative_attention_num_buckets(2)); });
  EXPECT_NE(buckets.find("relative_attention_num_buckets"), std::string::npos) << buckets;
}

TEST(T5Encoder, ParameterNamesAreTransformersAndEitherTiedNameLoads) {
  torch::manual_seed(3);
  T5Encoder a(tiny_t5().feed_forward_proj("relu"));
  const auto names = a->named_parameters();
  for (const char* n : {"shared.weight", "encoder.block.0.layer.0.SelfAttention.q.weight",
                        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                        "encoder.block.1.layer.0.layer_norm.weight", "encoder.block.1.layer.1.DenseReluDense.wi.weight",
                        "encoder.block.1.layer.1.DenseReluDense.wo.weight", "encoder.final_layer_norm.weight"})
    EXPECT_TRUE(names.contains(n)) << n;
  EXPECT_FALSE(names.contains("encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"));
  // A checkpoint naming the embedding encoder.embed_tokens (older exports), with a decoder beside: loads the
  // same tensors; a checkpoint with both tied names reads shared.weight.
  auto state = dew::training::module_state(*a);
  std::map<std::string, at::Tensor> renamed = state;
  renamed["encoder.embed_tokens.weight"] = renamed.at("shared.weight");
  renamed.erase("shared.weight");
  renamed["decoder.block.0.layer.0.SelfAttention.q.weight"] = torch::zeros({16, 16});
  renamed["lm_head.weight"] = torch::zeros({64, 16});
  T5Encoder b(tiny_t5().feed_forward_proj("relu"));
  dew::io::load_weights(*b, dew::io::WeightSource::of_tensors(renamed, "renamed"), dew::nn::t5_encoder_key_map(false));
  EXPECT_TRUE(b->shared->weight.equal(a->shared->weight));
  std::map<std::string, at::Tensor> both = state;
  both["encoder.embed_tokens.weight"] = state.at("shared.weight");
  T5Encoder c(tiny_t5().feed_forward_proj("relu"));
  dew::io::load_weights(*c, dew::io::WeightSource::of_tensors(both, "both"), dew::nn::t5_encoder_key_map(true));
  EXPECT_TRUE(c->shared->weight.equal(a->shared->weight));
}

TEST(T5Encoder, PaddingLeavesRealTokensAndPooledIsTheirMean) {
  torch::manual_seed(5);
  T5Encoder t5(tiny_t5());
  {
    torch::NoGradGuard g;
    for (auto& p : t5->parameters()) p.add_(torch::randn_like(p) * 0.2);
  }
  torch::NoGradGuard g;
  const auto ids = torch::randint(3, 64, {1, 5}, torch::kLong);
  const auto alone = t5->forward(ids, torch::ones({1, 5}, torch::kBool));
  const auto padded_ids = torch::cat({ids, torch::zeros({1, 4}, torch::kLong)}, 1);
  auto mask = torch::zeros({1, 9}, torch::kBool);
  mask.slice(1, 0, 5).fill_(true);
  const auto padded = t5->forward(padded_ids, mask);
  EXPECT_LT(dew::test::max_diff(padded.context.slice(1, 0, 5), alone.context), 1e-5);
  EXPECT_LT(dew::test::max_diff(padded.pooled, alone.context.mean(1)), 1e-5);
  EXPECT_LT(dew::test::max_diff(alone.pooled, alone.context.mean(1)), 1e-6);
}

TEST(T5Encoder, AttentionImplsAndReducedPrecisionAgree) {
  torch::manual_seed(7);
  T5Encoder ref(tiny_t5().attention_impl("reference"));
  {
    torch::NoGradGuard g;
    for (auto& p : ref->parameters()) p.add_(torch::randn_like(p) * 0.2);
  }
  const auto state = dew::training::module_state(*ref);
  const auto ids = torch::randint(3, 64, {2, 12}, torch::kLong);
  auto mask = torch::ones({2, 12}, torch::kBool);
  mask[1].slice(0, 7).fill_(false);
  torch::NoGradGuard g;
  const auto want = ref->forward(ids, mask).context;
  dew::nn::AttentionChunkRowsScope rows(5);
  for (const char* dtype : {"float32", "bfloat16", "float16"})
    for (const char* impl : {"sdpa", "chunked", "auto"}) {
      SCOPED_TRACE(std::string(dtype) + " " + impl);
      T5Encoder m(tiny_t5().attention_impl(impl).dtype(dtype));
      dew::io::load_weights(*m, dew::io::WeightSource::of_tensors(state, "ref"));
      const auto got = m->forward(ids, mask).context;
      EXPECT_EQ(got.scalar_type(), torch::kFloat);
      EXPECT_TRUE(torch::isfinite(got).all().item<bool>());
      EXPECT_LT(dew::test::max_diff(got, want), std::string(dtype) == "float32" ? 1e-5 : 0.15);
    }
}
