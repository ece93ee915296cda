// sd3_transformer beside its goldens: the translation of diffusers' SD3Transformer2DModel configs, unsupported
// settings refused by name, the checkpoint's names and position table, and the inputs it needs. The golden
// folders under tests/golden/sd3/ (tests/golden/sd3_reference.py, the installed diffusers with every weight
// moved off its initialisation) run in the reference-parity suite, tests/nn/test_reference_parity.cpp; the
// tiny configuration and its variants in the shared family suite.
#include <gtest/gtest.h>

#include <algorithm>

#include "dew/io/weights.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/sd3_transformer.h"
#include "tests/test_util.h"

using dew::json;
using dew::test::error_of;

namespace {

const std::string kSd3Golden = std::string(DEW_SOURCE_DIR) + "/tests/golden/sd3/";

json sd3_fields(const json& config) { return dew::models::fields_from_reference_config("sd3_transformer", config); }

// A small model's fields (width 16, two blocks), as the golden transformer_sd3's.
json small_fields() {
  return {{"sample_size", 8},         {"patch_size", 2},        {"in_channels", 4},
          {"output_channels", 4},     {"num_layers", 2},        {"attention_head_dim", 8},
          {"num_attention_heads", 2}, {"context_features", 12}, {"pooled_projection_dim", 10},
          {"pos_embed_max_size", 8}};
}

dew::Conditioning text(int64_t B, int64_t L, int64_t width, int64_t pooled) {
  dew::Conditioning c;
  c.context = torch::randn({B, L, width});
  c.pooled = torch::randn({B, pooled});
  return c;
}

}  // namespace

TEST(SD3Transformer, SD35MediumStyleConfigGivesItsFields) {
  // The keys of an SD3.5-medium transformer/config.json (24 layers, 24 heads of 64, dual attention in the
  // first 13 blocks, qk rms_norm).
  const json config = json::parse(R"({
    "_class_name": "SD3Transformer2DModel", "_diffusers_version": "0.31.0.dev0", "attention_head_dim": 64,
    "caption_projection_dim": 1536, "dual_attention_layers": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    "in_channels": 16, "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 24,
    "out_channels": 16, "patch_size": 2, "pooled_projection_dim": 2048, "pos_embed_max_size": 384,
    "qk_norm": "rms_norm", "sample_size": 128})");
  const auto o = dew::from_json<dew::nn::SD3TransformerOptions>(sd3_fields(config));
  EXPECT_EQ(o.num_layers(), 24);
  EXPECT_EQ(o.num_attention_heads(), 24);
  EXPECT_EQ(o.attention_head_dim(), 64);
  EXPECT_EQ(o.context_features(), 4096);
  EXPECT_EQ(o.pooled_projection_dim(), 2048);
  EXPECT_EQ(o.pos_embed_max_size(), 384);
  EXPECT_EQ(o.dual_attention_layers().size(), 13u);
  EXPECT_EQ(o.qk_norm(), "rms_norm");
  EXPECT_EQ(o.output_channels(), 16);
  // SD3-medium's: no dual attention, qk_norm null; out_channels null means in_channels.
  const auto sd3 = dew::from_json<dew::nn::SD3TransformerOptions>(sd3_fields({{"num_layers", 24},
                                                                              {"num_attention_heads", 24},
                                                                              {"caption_projection_dim", 1536},
                                                                              {"qk_norm", nullptr},
                                                                              {"dual_attention_layers", json::array()},
                                                                              {"out_channels", nullptr},
                                                                              {"in_channels", 16}}));
  EXPECT_EQ(sd3.qk_norm(), "none");
  EXPECT_TRUE(sd3.dual_attention_layers().empty());
  EXPECT_EQ(sd3.output_channels(), 16);
}

TEST(SD3Transformer, UnsupportedSettingsAreRefusedByName) {
  EXPECT_NE(error_of([] {
              sd3_fields({{"qk_norm", "l2"}});
            }).find("qk_norm = \"l2\" is not supported (accepted: null, "),
            std::string::npos);
  EXPECT_NE(error_of([] {
              sd3_fields({{"caption_projection_dim", 1536}});
            })
                .find("caption_projection_dim = 1536 is not supported (accepted: num_attention_heads x "
                      "attention_head_dim = 1152)"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              sd3_fields({{"use_pos_embed", false}});
            }).find("unknown setting \"use_pos_embed\""),
            std::string::npos);
  EXPECT_NE(error_of([] {
              sd3_fields({{"patch_size", 0}});
            }).find("patch_size = 0 is not supported"),
            std::string::npos);
  json f = small_fields();
  f["dual_attention_layers"] = {0, 2};
  EXPECT_NE(error_of([&] {
              dew::models::build("sd3_transformer", f);
            }).find("dual_attention_layers holds 2; accepted: block indices 0 .. 1"),
            std::string::npos);
  f = small_fields();
  f["qk_norm"] = "rms";
  EXPECT_NE(error_of([&] { dew::models::build("sd3_transformer", f); }).find("qk_norm"), std::string::npos);
}

TEST(SD3Transformer, InputsItNeedsAndGridsItCannotPlace) {
  torch::manual_seed(0);
  auto m = dew::models::build("sd3_transformer", small_fields());
  torch::NoGradGuard ng;
  const auto t = torch::full({2}, 500.0);
  auto c = text(2, 3, 12, 10);
  EXPECT_EQ(m->forward(torch::randn({2, 4, 16, 10}), t, c).sizes(), (std::vector<int64_t>{2, 4, 16, 10}));
  EXPECT_NE(error_of([&] {
              m->forward(torch::randn({2, 4, 18, 8}), t, c);
            }).find("a 9 x 4 patch grid exceeds pos_embed_max_size = 8"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              m->forward(torch::randn({2, 4, 7, 8}), t, c);
            }).find("multiples of patch_size 2"),
            std::string::npos);
  auto no_pooled = c;
  no_pooled.pooled = at::Tensor();
  EXPECT_NE(error_of([&] {
              m->forward(torch::randn({2, 4, 8, 8}), t, no_pooled);
            }).find("a pooled text vector [B, 10] (pooled_projections) is required"),
            std::string::npos);
  auto no_text = c;
  no_text.context = at::Tensor();
  EXPECT_NE(error_of([&] {
              m->forward(torch::randn({2, 4, 8, 8}), t, no_text);
            }).find("(encoder_hidden_states) is required"),
            std::string::npos);
  auto labels = c;
  labels.labels = torch::tensor({0, 1}, at::kLong);
  EXPECT_NE(error_of([&] {
              m->forward(torch::randn({2, 4, 8, 8}), t, labels);
            }).find("labels given but num_classes is 0"),
            std::string::npos);
  // A padded text token masked out changes nothing.
  auto masked = c;
  masked.context_mask = torch::tensor({1, 1, 0, 1, 1, 1}, at::kBool).view({2, 3});
  const auto x = torch::randn({2, 4, 8, 8});
  const auto y = m->forward(x, t, masked);
  masked.context = c.context.clone();
  masked.context.index_put_({0, 2}, 100.0);
  EXPECT_TRUE(m->forward(x, t, masked).equal(y));
}

TEST(SD3Transformer, LoadsTheDiffusersCheckpointByItsNamesAndTable) {
  // Every tensor of the golden checkpoint loads under its own name but the last block's text queries,
  // which diffusers holds and never uses for the output; the stored position table equals the computed one.
  const std::string folder = kSd3Golden + "transformer_sd35";
  const json fields = sd3_fields(dew::test::read_json(folder + "/config.json"));
  auto m = dew::models::build("sd3_transformer", fields);
  const auto params = m->named_parameters();
  EXPECT_TRUE(params.contains("transformer_blocks.0.attn2.to_out.0.weight"));
  EXPECT_TRUE(params.contains("transformer_blocks.0.attn.norm_added_q.weight"));
  EXPECT_TRUE(params.contains("transformer_blocks.2.attn.norm_added_k.weight"));
  EXPECT_FALSE(params.contains("transformer_blocks.2.attn.add_q_proj.weight"));
  EXPECT_FALSE(params.contains("transformer_blocks.2.attn.to_add_out.weight"));
  EXPECT_FALSE(params.contains("transformer_blocks.2.ff_context.net.0.proj.weight"));
  EXPECT_EQ(params["transformer_blocks.2.norm1_context.linear.weight"].sizes(), (std::vector<int64_t>{32, 16}));
  EXPECT_EQ(params["transformer_blocks.0.norm1.linear.weight"].sizes(), (std::vector<int64_t>{144, 16}));
  const at::Tensor computed = m->named_buffers()["pos_embed.pos_embed"].clone();
  EXPECT_EQ(computed.sizes(), (std::vector<int64_t>{1, 36, 16}));
  const auto report = dew::models::load_reference_weights(*m, "sd3_transformer", fields,
                                                          folder + "/diffusion_pytorch_model.safetensors");
  auto skipped = report.skipped;
  std::sort(skipped.begin(), skipped.end());
  EXPECT_EQ(skipped, (std::vector<std::string>{"transformer_blocks.2.attn.add_q_proj.bias",
                                               "transformer_blocks.2.attn.add_q_proj.weight",
                                               "transformer_blocks.2.attn.norm_added_q.weight"}))
      << report.summary();
  EXPECT_TRUE(report.unexpected.empty() && report.kept.empty()) << report.summary();
  EXPECT_LT((m->named_buffers()["pos_embed.pos_embed"] - computed).abs().max().item<double>(), 1e-6);
}
