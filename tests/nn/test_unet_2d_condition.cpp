// unet_2d_condition beside its goldens: the translation of diffusers' configs, unsupported settings refused
// by name, and inputs it does not take. The golden folders under tests/golden/sd/ (written by
// tests/golden/sd_reference.py from the real diffusers code with every weight moved off its initialisation)
// run in the reference-parity suite, tests/nn/test_reference_parity.cpp.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/unet_2d_condition.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

using dew::json;
using dew::test::error_of;

namespace {

const std::string kSdGolden = std::string(DEW_SOURCE_DIR) + "/tests/golden/sd/";

using dew::test::read_json;

// Builds the folder's model as a user's `dew forward` would: config -> fields -> model -> weights.
std::shared_ptr<dew::nn::UNet2DConditionImpl> load_folder(const std::string& folder) {
  const json fields =
      dew::models::fields_from_reference_config("unet_2d_condition", read_json(folder + "/config.json"));
  auto model = std::dynamic_pointer_cast<dew::nn::UNet2DConditionImpl>(dew::models::build("unet_2d_condition", fields));
  const auto report = dew::models::load_reference_weights(*model, "unet_2d_condition", fields,
                                                          folder + "/diffusion_pytorch_model.safetensors");
  EXPECT_TRUE(report.unexpected.empty()) << report.summary();
  EXPECT_TRUE(report.kept.empty()) << report.summary();
  EXPECT_EQ(report.loaded.size(), model->named_parameters().size()) << report.summary();
  model->eval();
  return model;
}

}  // namespace

TEST(UNet2DCondition, SD15ConfigGivesItsLayout) {
  // runwayml/stable-diffusion-v1-5 unet/config.json (diffusers 0.6 era keys).
  const json config = json::parse(R"({
    "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.6.0", "act_fn": "silu",
    "attention_head_dim": 8, "block_out_channels": [320, 640, 1280, 1280], "center_input_sample": false,
    "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1, "flip_sin_to_cos": true, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2,
    "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4, "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]})");
  const json f = dew::models::fields_from_reference_config("unet_2d_condition", config);
  const auto o = dew::from_json<dew::nn::UNet2DConditionOptions>(f);
  const auto d = dew::nn::UNet2DConditionOptions();  // the defaults are SD 1.5's
  ASSERT_EQ(o.stages().size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(o.stages()[i].features, d.stages()[i].features);
    EXPECT_EQ(o.stages()[i].heads, 8);
    EXPECT_EQ(o.stages()[i].cross_attention, i < 3);
  }
  EXPECT_EQ(o.context_features(), 768);
  EXPECT_FALSE(o.linear_projection());
  EXPECT_TRUE(o.middle_attention());
  EXPECT_EQ(o.additional_time_features(), 0);
}

TEST(UNet2DCondition, SDXLConfigGivesItsLayout) {
  // stabilityai/stable-diffusion-xl-base-1.0 unet/config.json (its layout keys).
  const json config = json::parse(R"({
    "_class_name": "UNet2DConditionModel", "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
    "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280], "cross_attention_dim": 2048,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"], "in_channels": 4,
    "layers_per_block": 2, "projection_class_embeddings_input_dim": 2816, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "use_linear_projection": true,
    "upcast_attention": null, "num_attention_heads": null, "class_embed_type": null, "sample_size": 128})");
  const json& c = config;
  const auto o = dew::from_json<dew::nn::UNet2DConditionOptions>(
      dew::models::fields_from_reference_config("unet_2d_condition", c));
  ASSERT_EQ(o.stages().size(), 3u);
  EXPECT_FALSE(o.stages()[0].cross_attention);
  EXPECT_EQ(o.stages()[1].heads, 10);
  EXPECT_EQ(o.stages()[2].depth, 10);
  EXPECT_EQ(o.additional_time_features(), 256);
  EXPECT_EQ(o.additional_embedding_features(), 2816);
  EXPECT_TRUE(o.linear_projection());
  EXPECT_EQ(o.context_features(), 2048);
}

TEST(UNet2DCondition, UnsupportedSettingsAreRefusedByName) {
  const json base = read_json(kSdGolden + "unet_sd/config.json");
  auto refusal = [&](const std::string& key, const json& value) {
    json c = base;
    c[key] = value;
    return error_of([&] { dew::models::fields_from_reference_config("unet_2d_condition", c); });
  };
  EXPECT_NE(refusal("attention_type", "gated").find("attention_type"), std::string::npos);
  EXPECT_NE(refusal("class_embed_type", "timestep").find("class_embed_type"), std::string::npos);
  EXPECT_NE(refusal("time_embedding_type", "fourier").find("time_embedding_type"), std::string::npos);
  EXPECT_NE(refusal("addition_embed_type", "text").find("addition_embed_type"), std::string::npos);
  EXPECT_NE(refusal("mid_block_type", "UNetMidBlock2DSimpleCrossAttn").find("mid_block_type"), std::string::npos);
  EXPECT_NE(refusal("made_up_key", 1).find("made_up_key"), std::string::npos);
  json down = base["down_block_types"];
  down[0] = "AttnDownBlock2D";
  EXPECT_NE(refusal("down_block_types", down).find("AttnDownBlock2D"), std::string::npos);
  EXPECT_NE(refusal("transformer_layers_per_block", json::parse("[[1, 2], [1, 2]]")).find("nested"), std::string::npos);
}

TEST(UNet2DCondition, InputsItDoesNotTakeAreRefused) {
  auto model = load_folder(kSdGolden + "unet_sd");
  auto io = dew::io::load_safetensors(kSdGolden + "unet_sd/io.safetensors");
  torch::NoGradGuard no_grad;
  dew::Conditioning c;
  EXPECT_NE(error_of([&] { model->forward(io.at("sample"), io.at("timestep"), c); }).find("encoder_hidden_states"),
            std::string::npos);
  c.context = io.at("encoder_hidden_states");
  c.extra["time_ids"] = at::zeros({2, 6});
  EXPECT_NE(error_of([&] { model->forward(io.at("sample"), io.at("timestep"), c); }).find("time_ids"),
            std::string::npos);
}
