// The registered backbones: zero output at initialisation, overfitting one batch, remat equivalence,
// conditioning, field validation and the {architecture, fields} config round trip.
#include <gtest/gtest.h>

#include <torch/torch.h>
#include "tests/nn/backbone_checks.h"
#include "tests/test_util.h"

#include <chrono>
#include <set>

#include "dew/core/error.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/simple_dit.h"
#include "dew/nn/backbones/unet.h"

namespace {

using at::Tensor;
using dew::json;

// Tiny configurations: a few thousand parameters, milliseconds per step on one CPU core.
json tiny_dit(json extra = json::object()) {
  json f = {{"patch_size", 2}, {"emb_features", 64}, {"num_layers", 2}, {"num_heads", 4}, {"mlp_ratio", 2}};
  f.update(extra);
  return f;
}
json tiny_unet(json extra = json::object()) {
  json f = {{"emb_features", 32},
            {"feature_depths", {16, 32}},
            {"attention_configs", {nullptr, 4}},
            {"num_res_blocks", 1},
            {"norm_groups", 8}};
  f.update(extra);
  return f;
}

using dew::test::error_of;
using namespace dew::test;
using Batch = dew::test::FixedBatch;

// ---- zero output at initialisation ----

// Zero output at initialisation (SimpleDiT at every scan order on a non-square grid, the unet with other
// output channels) and remat with text run in the shared suite on the families' variants
// (tests/nn/test_all_backbones.cpp).

// ---- overfitting one batch ----

TEST(Backbones, SimpleDiTOverfitsOneBatch) {
  auto start = std::chrono::steady_clock::now();
  torch::manual_seed(0);
  auto m = dew::models::build("simple_dit", tiny_dit());
  Batch b = fixed_batch(4, 3, 8, 1);
  auto [first, last] = overfit(*m, b, 300, 3e-3);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "[ simple_dit ] loss " << first << " -> " << last << " in 300 steps, " << secs << " s\n";
  EXPECT_LT(last, first / 10);
}

TEST(Backbones, ConditionalHilbertSimpleDiTOverfitsOneBatch) {
  torch::manual_seed(0);
  auto m = dew::models::build(
      "simple_dit",
      tiny_dit({{"scan_order", "hilbert"}, {"num_classes", 4}, {"context_features", 8}, {"qk_norm", true}}));
  Batch b = fixed_batch(4, 3, 8, 2);
  b.cond.labels = torch::tensor({0, 1, 2, 4}, at::kLong);
  b.cond.context = torch::randn({4, 5, 8});
  b.cond.context_mask = torch::rand({4, 5}) > 0.3;
  auto [first, last] = overfit(*m, b, 300, 3e-3);
  std::cout << "[ simple_dit hilbert + labels + text ] loss " << first << " -> " << last << "\n";
  EXPECT_LT(last, first / 10);
}

TEST(Backbones, UnetOverfitsOneBatch) {
  auto start = std::chrono::steady_clock::now();
  torch::manual_seed(0);
  auto m = dew::models::build("unet", tiny_unet({{"num_classes", 2}, {"context_features", 8}}));
  Batch b = fixed_batch(4, 3, 8, 3);
  b.cond.labels = torch::tensor({0, 1, 2, 1}, at::kLong);
  b.cond.context = torch::randn({4, 3, 8});
  auto [first, last] = overfit(*m, b, 300, 3e-3);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "[ unet ] loss " << first << " -> " << last << " in 300 steps, " << secs << " s\n";
  EXPECT_LT(last, first / 10);
}

// ---- remat ----

// ---- conditioning ----

TEST(Backbones, MaskedContextTokensAndAbsentLabelsBehave) {
  auto m = dew::models::build("simple_dit", tiny_dit({{"context_features", 6}, {"num_classes", 3}}));
  auto* dit = dynamic_cast<dew::nn::SimpleDiTImpl*>(m.get());
  ASSERT_NE(dit, nullptr);
  randomize(*m, 0.1);
  dew::Conditioning a;
  a.labels = torch::tensor({3, 3}, at::kLong);  // the null class
  a.context = torch::randn({2, 4, 6});
  a.context_mask = torch::tensor({1, 0, 1, 0, 1, 1, 0, 0}, at::kLong).view({2, 4}).to(at::kBool);
  dew::Conditioning b = a;
  b.context = a.context.masked_fill(a.context_mask.logical_not().unsqueeze(-1), 50.0);
  b.labels = Tensor();  // absent labels = the null class
  Tensor t = torch::rand({2});
  EXPECT_LT(max_diff(dit->condition(t, a, 2), dit->condition(t, b, 2)), 1e-5);
  a.labels = torch::tensor({0, 4}, at::kLong);
  EXPECT_NE(error_of([&] {
              m->forward(torch::randn({2, 3, 4, 4}), t, a);
            }).find("labels must lie in"),
            std::string::npos);
  auto plain = dew::models::build("simple_dit", tiny_dit());
  dew::Conditioning text;
  text.context = torch::randn({2, 4, 6});
  EXPECT_NE(error_of([&] {
              plain->forward(torch::randn({2, 3, 4, 4}), t, text);
            }).find("context_features is 0"),
            std::string::npos);
}

TEST(Backbones, Bfloat16ComputeRunsAndStaysClose) {
  for (const std::string arch : {"simple_dit", "unet"}) {
    json f = arch == "simple_dit" ? tiny_dit() : tiny_unet();
    auto ref = dew::models::build(arch, f);
    f["dtype"] = "bfloat16";
    auto lo = dew::models::build(arch, f);
    randomize(*ref, 0.05);
    copy_parameters(*ref, *lo);
    Tensor x = torch::randn({2, 3, 8, 8}), t = torch::rand({2});
    Tensor a = ref->forward(x, t, {}), b = lo->forward(x, t, {});
    EXPECT_EQ(b.scalar_type(), at::kFloat);
    EXPECT_LT(max_diff(a, b), 0.05 * (1 + a.abs().max().item<double>())) << arch;
    for (const auto& p : lo->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
  }
}

// ---- fields, names and the config round trip ----

TEST(Backbones, UnknownFieldsAndBadValuesAreErrors) {
  // a unet would ignore a text context without an attention level: refused, naming the fix
  EXPECT_NE(
      error_of([] {
        dew::models::build("unet", tiny_unet({{"attention_configs", {nullptr, nullptr}}, {"context_features", 8}}));
      }).find("needs at least one attention level"),
      std::string::npos);
  auto msg = error_of([] { dew::models::build("simple_dit", {{"num_layerz", 2}}); });
  EXPECT_NE(msg.find("unknown field \"num_layerz\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("num_layers"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("unet", {{"feature_depth", {16}}}); });
  EXPECT_NE(msg.find("feature_depths"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("transformer_xl", json::object()); });
  EXPECT_NE(msg.find("simple_dit"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("simple_dit", tiny_dit({{"scan_order", "spiral"}})); });
  EXPECT_NE(msg.find("hilbert"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("simple_dit", tiny_dit({{"num_heads", 3}})); });
  EXPECT_NE(msg.find("num_heads"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("unet", tiny_unet({{"attention_configs", {nullptr}}})); });
  EXPECT_NE(msg.find("attention_configs"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build("unet", tiny_unet({{"norm_groups", 5}})); });
  EXPECT_NE(msg.find("norm_groups"), std::string::npos) << msg;
  msg = error_of([] { dew::models::build(json{{"architecture", "unet"}, {"feilds", json::object()}}); });
  EXPECT_NE(msg.find("feilds"), std::string::npos) << msg;
  auto m = dew::models::build("simple_dit", tiny_dit());
  msg = error_of([&] { m->forward(torch::randn({1, 3, 7, 8}), torch::rand({1}), {}); });
  EXPECT_NE(msg.find("patch_size"), std::string::npos) << msg;
}

TEST(Backbones, ParameterNamesAreStable) {
  auto names = [](const dew::BackbonePtr& m) {
    std::set<std::string> s;
    for (const auto& kv : m->named_parameters()) s.insert(kv.key());
    for (const auto& kv : m->named_buffers()) s.insert(kv.key());
    return s;
  };
  auto dit = names(
      dew::models::build("simple_dit", tiny_dit({{"num_classes", 2}, {"context_features", 4}, {"qk_norm", true}})));
  for (const char* n :
       {"x_embedder.weight", "t_embedder.fourier.freqs", "t_embedder.linear_1.weight", "t_embedder.linear_2.bias",
        "y_embedder.weight", "context_embedder.weight", "blocks.0.adaLN_modulation.weight", "blocks.1.attn.qkv.weight",
        "blocks.1.attn.proj.bias", "blocks.1.attn.q_norm.weight", "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight",
        "final_layer.adaLN_modulation.weight", "final_layer.linear.weight"})
    EXPECT_TRUE(dit.count(n)) << n;
  auto unet = names(dew::models::build("unet", tiny_unet({{"context_features", 4}})));
  for (const char* n : {"conv_in.weight", "t_embedder.linear_1.weight", "down_blocks.0.resnets.0.conv1.weight",
                        "down_blocks.0.resnets.0.time_emb_proj.weight", "down_blocks.0.downsample.weight",
                        "down_blocks.1.resnets.0.conv_shortcut.weight", "down_blocks.1.attention.attn1.qkv.weight",
                        "down_blocks.1.attention.attn2.kv.weight", "mid_block.resnets.1.norm2.weight",
                        "mid_block.attention.norm1.weight", "up_blocks.0.resnets.1.conv_shortcut.weight",
                        "up_blocks.0.attention.attn2.q.weight", "up_blocks.0.upsample.weight",
                        "up_blocks.1.resnets.1.conv2.weight", "norm_out.weight", "conv_out.weight"})
    EXPECT_TRUE(unet.count(n)) << n;
}

TEST(Backbones, DefaultsMatchTheSpec) {
  auto d = dew::to_json(dew::nn::SimpleDiTOptions());
  EXPECT_EQ(d["output_channels"], 3);
  EXPECT_EQ(d["patch_size"], 16);
  EXPECT_EQ(d["emb_features"], 768);
  EXPECT_EQ(d["num_layers"], 12);
  EXPECT_EQ(d["num_heads"], 12);
  EXPECT_EQ(d["mlp_ratio"], 4.0);
  EXPECT_EQ(d["norm_epsilon"], 1e-5);
  EXPECT_EQ(d["force_fp32_for_softmax"], true);
  EXPECT_EQ(d["qk_norm"], false);
  EXPECT_EQ(d["scan_order"], "raster");
  auto u = dew::to_json(dew::nn::UnetOptions());
  EXPECT_EQ(u["emb_features"], 256);
  EXPECT_EQ(u["feature_depths"], json({64, 128, 256, 512}));
  EXPECT_EQ(u["num_res_blocks"], 2);
  EXPECT_EQ(u["num_middle_res_blocks"], 1);
  EXPECT_EQ(u["activation"], "swish");
  EXPECT_EQ(u["norm_groups"], 8);
  EXPECT_EQ(dew::models::registry().kind(), "model");
  EXPECT_TRUE(dew::models::registry().contains("simple_dit"));
  EXPECT_TRUE(dew::models::registry().contains("unet"));
}

TEST(Backbones, OptionsBuilderBuildsTheSameModelAsJson) {
  dew::nn::Unet u(
      dew::nn::UnetOptions().emb_features(32).feature_depths({16, 32}).attention_configs({{}, 4}).num_res_blocks(1));
  EXPECT_EQ(param_shapes(*u), param_shapes(*dew::models::build("unet", tiny_unet())));
  dew::nn::SimpleDiT d(
      dew::nn::SimpleDiTOptions().patch_size(2).emb_features(64).num_layers(2).num_heads(4).mlp_ratio(2));
  EXPECT_EQ(param_shapes(*d), param_shapes(*dew::models::build("simple_dit", tiny_dit())));
  dew::nn::Unet full;  // the default Options are the registry's defaults: the same parameter tree
  EXPECT_EQ(param_shapes(*full), param_shapes(*dew::models::build("unet", json::object())));
  int64_t n = 0;
  for (const auto& p : full->parameters()) n += p.numel();
  std::cout << "[ unet defaults ] " << n << " parameters\n";
}

}  // namespace
