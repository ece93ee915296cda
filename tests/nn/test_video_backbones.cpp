// The video backbones video_dit and unet_3d: shapes over resolutions and frame counts, zero output at
// initialisation, gradients, overfitting a tiny video batch, frame independence without temporal mixing,
// inflation of a 2D unet into unet_3d, errors, and the config round trip.
#include <gtest/gtest.h>

#include <torch/torch.h>
#include "tests/nn/backbone_checks.h"
#include "tests/test_util.h"

#include <chrono>
#include <map>
#include <set>

#include "dew/core/error.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/unet.h"
#include "dew/nn/backbones/unet_3d.h"
#include "dew/nn/backbones/video_dit.h"

namespace {

using at::Tensor;
using dew::json;
using dew::test::error_of;
using namespace dew::test;

json tiny_video_dit(json extra = json::object()) {
  json f = {{"patch_size", 2}, {"emb_features", 32}, {"num_layers", 2}, {"num_heads", 4}, {"mlp_ratio", 2}};
  f.update(extra);
  return f;
}
json tiny_unet_fields(json extra = json::object()) {
  json f = {{"emb_features", 16},
            {"feature_depths", {8, 16}},
            {"attention_configs", {nullptr, 2}},
            {"num_res_blocks", 1},
            {"norm_groups", 4}};
  f.update(extra);
  return f;
}
json tiny_unet_3d(json extra = json::object()) {
  json f = tiny_unet_fields({{"temporal_heads", 2}});
  f.update(extra);
  return f;
}

std::set<std::string> names_of(const dew::BackboneImpl& m) {
  std::set<std::string> s;
  for (const auto& kv : m.named_parameters()) s.insert(kv.key());
  for (const auto& kv : m.named_buffers()) s.insert(kv.key());
  return s;
}

// ---- shapes, zero at init ----

// Shapes at two resolutions and frame counts, a single frame, zero output at initialisation, gradients
// reaching every parameter (with text) and remat run in the shared suite on the families' variants
// (tests/nn/test_all_backbones.cpp).

// ---- overfitting ----

TEST(VideoBackbones, VideoDiTOverfitsATinyVideoBatch) {
  auto start = std::chrono::steady_clock::now();
  torch::manual_seed(0);
  auto m = dew::models::build("video_dit", tiny_video_dit({{"in_channels", 1}, {"output_channels", 1}}));
  FixedBatch b = fixed_batch({2, 1, 4, 8, 8}, 1);
  auto [first, last] = overfit(*m, b, 60, 3e-3);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "[ video_dit ] loss " << first << " -> " << last << " in 60 steps, " << secs << " s\n";
  EXPECT_LT(last, first / 10);
}

TEST(VideoBackbones, UNet3DOverfitsATinyVideoBatch) {
  auto start = std::chrono::steady_clock::now();
  torch::manual_seed(0);
  auto m = dew::models::build("unet_3d", tiny_unet_3d({{"in_channels", 1}, {"output_channels", 1}}));
  FixedBatch b = fixed_batch({2, 1, 4, 8, 8}, 2);
  auto [first, last] = overfit(*m, b, 60, 3e-3);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "[ unet_3d ] loss " << first << " -> " << last << " in 60 steps, " << secs << " s\n";
  EXPECT_LT(last, first / 10);
}

// ---- factorised attention: frames mix only through temporal attention ----

TEST(VideoBackbones, VideoDiTFramesAreIndependentWithoutTemporalAttention) {
  torch::manual_seed(2);
  auto m = dew::models::build("video_dit", tiny_video_dit());
  auto& dit = dynamic_cast<dew::nn::VideoDiTImpl&>(*m);
  randomize(*m, 0.1);
  torch::manual_seed(3);
  Tensor x = torch::randn({2, 3, 4, 8, 8}), t = torch::rand({2});
  Tensor x2 = x.clone();
  x2.select(2, 2).copy_(torch::randn({2, 3, 8, 8}));  // a different frame 2
  auto frame_change = [&](int64_t f) {
    torch::NoGradGuard no_grad;
    return max_diff(m->forward(x, t, {}).select(2, f), m->forward(x2, t, {}).select(2, f));
  };
  // Temporal attention active: frame 0 sees frame 2.
  const double mixed = frame_change(0);
  std::cout << "[ video_dit ] frame 0 change with temporal attention " << mixed << "\n";
  EXPECT_GT(mixed, 1e-4);
  {
    torch::NoGradGuard no_grad;
    for (auto& block : dit.block_list) {
      block->temporal_attn->proj->weight.zero_();
      block->temporal_attn->proj->bias.zero_();
    }
  }
  EXPECT_LT(frame_change(0), 1e-6);
  EXPECT_LT(frame_change(3), 1e-6);
  EXPECT_GT(frame_change(2), 1e-3);  // the changed frame itself does change
  // Without temporal mixing each frame is the model on a one-frame video of that frame, whose temporal
  // table and RoPE are those of frame index 0 only for frame 0: compare frame 0 with a T = 1 run.
  torch::NoGradGuard no_grad;
  Tensor single = m->forward(x.narrow(2, 0, 1).contiguous(), t, {});
  EXPECT_LT(max_diff(m->forward(x, t, {}).narrow(2, 0, 1), single), 1e-5);
}

// ---- inflation ----

TEST(VideoBackbones, UNet3DInflatesARandomizedUnetFrameByFrame) {
  torch::manual_seed(4);
  json uf = tiny_unet_fields({{"num_classes", 3}, {"context_features", 8}});
  auto unet = dew::models::build("unet", uf);
  randomize(*unet, 0.1);  // away from zero-initialised layers: the output is not trivially 0
  json f3 = uf;
  f3["temporal_heads"] = 2;
  auto m3 = dew::models::build("unet_3d", f3);
  auto& u3 = dynamic_cast<dew::nn::UNet3DImpl&>(*m3);
  auto loaded = dew::nn::load_unet_weights(u3, dynamic_cast<dew::nn::UnetImpl&>(*unet));
  EXPECT_EQ(loaded.size(), unet->named_parameters().size() + unet->named_buffers().size());

  torch::manual_seed(5);
  const int64_t B = 2, T = 3;
  Tensor x = torch::randn({B, 3, T, 8, 8}), t = torch::rand({B});
  dew::Conditioning cond;
  cond.labels = torch::tensor({1, 3}, at::kLong);
  cond.context = torch::randn({B, 4, 8});
  cond.context_mask = torch::tensor({1, 1, 0, 1, 1, 0, 0, 0}, at::kLong).view({B, 4}).to(at::kBool);
  torch::NoGradGuard no_grad;
  Tensor y3 = m3->forward(x, t, cond);
  // The 2D model on each frame, one call per frame, with that video's time, label and text.
  double worst = 0, scale = 0;
  for (int64_t f = 0; f < T; ++f) {
    Tensor y2 = unet->forward(x.select(2, f).contiguous(), t, cond);
    worst = std::max(worst, max_diff(y3.select(2, f), y2));
    scale = std::max(scale, y2.abs().max().item<double>());
  }
  std::cout << "[ unet_3d ] inflated vs per-frame unet: max diff " << worst << " (output scale " << scale << ")\n";
  EXPECT_GT(scale, 1e-3);
  EXPECT_LT(worst, 1e-5);

  // Temporal blocks trained (randomized): the frames now interact, and the output differs.
  for (auto& kv : m3->named_parameters())
    if (dew::nn::is_temporal_parameter(kv.key())) kv.value().add_(torch::randn_like(kv.value()) * 0.1);
  EXPECT_GT(max_diff(m3->forward(x, t, cond), y3), 1e-4);
}

TEST(VideoBackbones, LoadUnetWeightsRefusesMismatchedStates) {
  torch::manual_seed(6);
  auto unet = dew::models::build("unet", tiny_unet_fields());
  auto m3 = dew::models::build("unet_3d", tiny_unet_3d());
  auto& u3 = dynamic_cast<dew::nn::UNet3DImpl&>(*m3);
  std::map<std::string, Tensor> state;
  for (const auto& kv : unet->named_parameters()) state[kv.key()] = kv.value().detach() + 1.0;
  const Tensor before = u3.conv_in->weight.detach().clone();

  auto missing = state;
  missing.erase("down_blocks.1.attention.attn1.qkv.weight");
  auto msg = error_of([&] { dew::nn::load_unet_weights(u3, missing); });
  EXPECT_NE(msg.find("lacks 1 tensor(s) the model needs: \"down_blocks.1.attention.attn1.qkv.weight\""),
            std::string::npos)
      << msg;

  auto wrong = state;
  wrong["conv_out.weight"] = torch::zeros({3, 8, 1, 1});
  msg = error_of([&] { dew::nn::load_unet_weights(u3, wrong); });
  EXPECT_NE(msg.find("conv_out.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the model expects"), std::string::npos) << msg;

  auto extra = state;
  extra["temporal_mid.attn.proj.weight"] = torch::zeros({16, 16});
  msg = error_of([&] { dew::nn::load_unet_weights(u3, extra); });
  EXPECT_NE(msg.find("temporal_mid.attn.proj.weight"), std::string::npos) << msg;

  // A failed load changes nothing.
  EXPECT_EQ(max_diff(u3.conv_in->weight, before), 0.0);
  // Buffers may be absent; every parameter loaded; temporal blocks untouched (still zero projections).
  auto loaded = dew::nn::load_unet_weights(u3, state);
  EXPECT_EQ(loaded.size(), state.size());
  EXPECT_EQ(max_diff(u3.conv_in->weight, state["conv_in.weight"]), 0.0);
  EXPECT_EQ(u3.temporal_mid->attn->proj->weight.abs().max().item<double>(), 0.0);
}

TEST(VideoBackbones, UNet3DSpatialParameterNamesEqualUnets) {
  json uf = tiny_unet_fields({{"num_classes", 2}, {"context_features", 4}});
  auto unet = names_of(*dew::models::build("unet", uf));
  json f3 = uf;
  f3["temporal_heads"] = 4;
  auto all = names_of(*dew::models::build("unet_3d", f3));
  std::set<std::string> spatial, temporal;
  for (const auto& n : all) (dew::nn::is_temporal_parameter(n) ? temporal : spatial).insert(n);
  EXPECT_EQ(spatial, unet);
  for (const char* n : {"temporal_down.0.norm.weight", "temporal_down.1.attn.qkv.weight", "temporal_mid.attn.proj.bias",
                        "temporal_up.0.attn.proj.weight", "temporal_up.1.norm.bias"})
    EXPECT_TRUE(temporal.count(n)) << n;
  EXPECT_EQ(temporal.size(), 5u * 6u);  // 2 down + mid + 2 up, each norm.{w,b}, qkv.{w,b}, proj.{w,b}
}

TEST(VideoBackbones, VideoDiTParameterNames) {
  auto n = names_of(*dew::models::build(
      "video_dit", tiny_video_dit({{"num_classes", 2}, {"context_features", 4}, {"qk_norm", true}})));
  for (const char* name :
       {"x_embedder.weight", "t_embedder.fourier.freqs", "y_embedder.weight", "context_embedder.weight",
        "blocks.0.adaLN_modulation.weight", "blocks.1.attn.qkv.weight", "blocks.1.temporal_attn.proj.bias",
        "blocks.0.temporal_attn.q_norm.weight", "blocks.0.mlp.fc2.weight", "final_layer.linear.weight"})
    EXPECT_TRUE(n.count(name)) << name;
  auto m = dew::models::build("video_dit", tiny_video_dit());
  EXPECT_EQ(m->named_parameters()["blocks.0.adaLN_modulation.weight"].sizes(), (std::vector<int64_t>{9 * 32, 32}));
}

// ---- remat ----

// ---- errors and config ----

TEST(VideoBackbones, ClearErrors) {
  auto msg = error_of([] { dew::models::build("video_dit", tiny_video_dit({{"emb_features", 30}})); });
  EXPECT_NE(msg.find("video_dit: emb_features"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("video_dit", tiny_video_dit({{"temporal_heads", 2}})); });
  EXPECT_NE(msg.find("unknown field \"temporal_heads\""), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("unet_3d", tiny_unet_3d({{"temporal_heads", 3}})); });
  EXPECT_NE(msg.find("unet_3d: temporal_heads must divide"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("unet_3d", tiny_unet_3d({{"norm_groups", 5}})); });
  EXPECT_NE(msg.find("unet_3d: feature_depths[0] must be a positive multiple of norm_groups"), std::string::npos)
      << msg;
  msg = error_of([] { dew::models::build("unet_3d", tiny_unet_3d({{"temporal_headz", 2}})); });
  EXPECT_NE(msg.find("temporal_heads"), std::string::npos) << msg;

  auto dit = dew::models::build("video_dit", tiny_video_dit());
  msg = error_of([&] { dit->forward(torch::randn({1, 3, 8, 8}), torch::rand({1}), {}); });
  EXPECT_NE(msg.find("video_dit: x must be [B, 3, T, H, W]"), std::string::npos) << msg;
  msg = error_of([&] { dit->forward(torch::randn({1, 3, 2, 7, 8}), torch::rand({1}), {}); });
  EXPECT_NE(msg.find("patch_size"), std::string::npos) << msg;
  dew::Conditioning labels;
  labels.labels = torch::tensor({0}, at::kLong);
  msg = error_of([&] { dit->forward(torch::randn({1, 3, 2, 8, 8}), torch::rand({1}), labels); });
  EXPECT_NE(msg.find("num_classes is 0"), std::string::npos) << msg;

  auto u3 = dew::models::build("unet_3d", tiny_unet_3d({{"num_classes", 2}}));
  msg = error_of([&] { u3->forward(torch::randn({1, 3, 8, 8}), torch::rand({1}), {}); });
  EXPECT_NE(msg.find("unet_3d: x must be [B, 3, T, H, W]"), std::string::npos) << msg;
  msg = error_of([&] { u3->forward(torch::randn({1, 3, 2, 7, 8}), torch::rand({1}), {}); });
  EXPECT_NE(msg.find("unet_3d: H and W must be multiples of 2"), std::string::npos) << msg;
  dew::Conditioning two;
  two.labels = torch::tensor({0, 1}, at::kLong);
  msg = error_of([&] { u3->forward(torch::randn({1, 3, 2, 8, 8}), torch::rand({1}), two); });
  EXPECT_NE(msg.find("unet_3d: labels must be [1]"), std::string::npos) << msg;
}

TEST(VideoBackbones, DefaultsRecorded) {
  auto d = dew::to_json(dew::nn::VideoDiTOptions());
  EXPECT_EQ(d["patch_size"], 16);
  EXPECT_EQ(d["emb_features"], 768);
  EXPECT_EQ(d["num_layers"], 12);
  auto u = dew::to_json(dew::nn::UNet3DOptions());
  EXPECT_EQ(u["feature_depths"], json({64, 128, 256, 512}));
  EXPECT_EQ(u["emb_features"], 256);
  EXPECT_EQ(u["temporal_heads"], 8);
  // Every unet field is a unet_3d field, with the same default.
  const json unet = dew::to_json(dew::nn::UnetOptions());
  for (auto it = unet.begin(); it != unet.end(); ++it) EXPECT_EQ(u[it.key()], it.value()) << it.key();
}

}  // namespace
