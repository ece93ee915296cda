// flux_transformer beside its goldens: the translation of diffusers' configs, unsupported settings refused by
// name, FluxPipeline's packing and ids, the NCHW forward against the packed one, the text mask, and the
// inputs it needs or refuses. The golden folders tests/golden/flux/transformer_{dev,schnell} (written by
// tests/golden/flux_reference.py from the installed diffusers with every weight moved off its initialisation)
// run in the reference-parity suite, tests/nn/test_reference_parity.cpp; the shared family suite covers the
// rest (tests/nn/test_all_backbones.cpp).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dew/io/safetensors.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/flux_transformer.h"
#include "tests/test_util.h"

using dew::json;
using dew::test::error_of;

namespace {

const std::string kFluxGolden = std::string(DEW_SOURCE_DIR) + "/tests/golden/flux/";

// The tiny schnell-like fields of a test, width 2 x 8.
json flux_test_fields(bool dev) {
  return {{"in_channels", 2},           {"output_channels", 2},    {"context_features", 6},
          {"pooled_projection_dim", 5}, {"num_layers", 1},         {"num_single_layers", 1},
          {"num_attention_heads", 2},   {"attention_head_dim", 8}, {"axes_dims_rope", {2, 2, 4}},
          {"guidance_embeds", dev}};
}

std::shared_ptr<dew::nn::FluxTransformerImpl> flux_test_model(bool dev) {
  torch::manual_seed(21);
  auto m = std::dynamic_pointer_cast<dew::nn::FluxTransformerImpl>(
      dew::models::build("flux_transformer", flux_test_fields(dev)));
  m->eval();
  return m;
}

dew::Conditioning flux_test_conditioning(bool dev) {
  dew::Conditioning c;
  c.context = torch::randn({2, 4, 6});
  c.pooled = torch::randn({2, 5});
  if (dev) c.extra["guidance"] = torch::tensor({3.5f, 2.0f});
  return c;
}

}  // namespace

TEST(FluxTransformer, Flux1ConfigsGiveTheDefaultLayout) {
  // black-forest-labs/FLUX.1-schnell transformer/config.json (dev's differs in guidance_embeds only).
  const json schnell = json::parse(R"({
    "_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.30.0.dev0", "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56], "guidance_embeds": false, "in_channels": 64, "joint_attention_dim": 4096,
    "num_attention_heads": 24, "num_layers": 19, "num_single_layers": 38, "patch_size": 1,
    "pooled_projection_dim": 768})");
  const json f = dew::models::fields_from_reference_config("flux_transformer", schnell);
  EXPECT_EQ(dew::to_json(dew::from_json<dew::nn::FluxTransformerOptions>(f)),
            dew::to_json(dew::nn::FluxTransformerOptions()));
  json dev = schnell;
  dev["guidance_embeds"] = true;
  EXPECT_EQ(dew::models::fields_from_reference_config("flux_transformer", dev)["guidance_embeds"], true);
  // out_channels: null means in_channels, a number is packed too (Flux Fill: 384 in, 64 out)
  json fill = schnell;
  fill["in_channels"] = 384;
  fill["out_channels"] = 64;
  const json ff = dew::models::fields_from_reference_config("flux_transformer", fill);
  EXPECT_EQ(ff["in_channels"], 96);
  EXPECT_EQ(ff["output_channels"], 16);
}

TEST(FluxTransformer, UnsupportedSettingsAreRefusedByName) {
  const json base = {{"in_channels", 16}, {"num_layers", 1}};
  auto refusal = [&](const json& change) {
    json c = base;
    c.update(change);
    return error_of([&] { dew::models::fields_from_reference_config("flux_transformer", c); });
  };
  EXPECT_NE(refusal({{"patch_size", 2}}).find("patch_size = 2 is not supported"), std::string::npos);
  EXPECT_NE(refusal({{"in_channels", 18}}).find("in_channels = 18 must be a positive multiple of 4"),
            std::string::npos);
  EXPECT_NE(refusal({{"out_channels", 6}}).find("out_channels = 6"), std::string::npos);
  EXPECT_NE(refusal({{"qk_norm", "rms_norm"}}).find("unknown setting \"qk_norm\""), std::string::npos);
  // fields the model itself refuses
  auto build_error = [](const json& change) {
    json f = flux_test_fields(false);
    f.update(change);
    return error_of([&] { dew::models::build("flux_transformer", f); });
  };
  EXPECT_NE(build_error({{"axes_dims_rope", {2, 2, 2}}}).find("summing to attention_head_dim 8"), std::string::npos);
  EXPECT_NE(build_error({{"axes_dims_rope", {3, 1, 4}}}).find("axes_dims_rope"), std::string::npos);
  EXPECT_NE(build_error({{"num_classes", 10}}).find("num_classes must be 0"), std::string::npos);
  EXPECT_NE(build_error({{"context_features", 0}}).find("context_features must be > 0"), std::string::npos);
}

TEST(FluxTransformer, PackingAndIdsAreThePipelines) {
  // _pack_latents: token (i, j) holds channel c's 2 x 2 patch at features 4 c + 2 dy + dx.
  const at::Tensor x = torch::arange(2 * 3 * 4 * 6, at::kFloat).view({2, 3, 4, 6});
  const at::Tensor p = dew::nn::flux_pack_latents(x);
  ASSERT_EQ(p.sizes(), (std::vector<int64_t>{2, 6, 12}));
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 3; ++j)
      for (int64_t c = 0; c < 3; ++c)
        for (int64_t dy = 0; dy < 2; ++dy)
          for (int64_t dx = 0; dx < 2; ++dx)
            EXPECT_EQ(p[1][i * 3 + j][4 * c + 2 * dy + dx].item<float>(),
                      x[1][c][2 * i + dy][2 * j + dx].item<float>());
  EXPECT_TRUE(dew::nn::flux_unpack_latents(p, 4, 6).equal(x));
  const at::Tensor ids = dew::nn::flux_image_ids(2, 3);
  EXPECT_TRUE(
      ids.equal(torch::tensor({0, 0, 0, 0, 0, 1, 0, 0, 2, 0, 1, 0, 0, 1, 1, 0, 1, 2}, at::kFloat).view({6, 3})));
  EXPECT_TRUE(dew::nn::flux_text_ids(4).equal(torch::zeros({4, 3})));
  EXPECT_NE(error_of([&] {
              dew::nn::flux_pack_latents(torch::zeros({1, 1, 3, 4}));
            }).find("H and W even"),
            std::string::npos);
}

TEST(FluxTransformer, TheGoldenIdsAreTheLibraryIds) {
  // The golden inputs were made by FluxPipeline's helpers: the library rebuilds them exactly.
  const auto io = dew::io::load_safetensors(kFluxGolden + "transformer_dev/io.safetensors");
  EXPECT_TRUE(io.at("img_ids").equal(dew::nn::flux_image_ids(3, 5)));
  EXPECT_TRUE(io.at("txt_ids").equal(dew::nn::flux_text_ids(io.at("txt_ids").size(0))));
}

TEST(FluxTransformer, TheNchwForwardIsThePackedForward) {
  // forward(x, sigma x 1000, cond) packs x, builds the pipeline's ids and unpacks: the same numbers as
  // forward_packed on the golden inputs (diffusers' timestep in [0, 1] x 1000).
  const std::string folder = kFluxGolden + "transformer_dev";
  const auto io = dew::io::load_safetensors(folder + "/io.safetensors");
  const json fields =
      dew::models::fields_from_reference_config("flux_transformer", dew::test::read_json(folder + "/config.json"));
  auto m = std::dynamic_pointer_cast<dew::nn::FluxTransformerImpl>(dew::models::build("flux_transformer", fields));
  const auto report = dew::models::load_reference_weights(*m, "flux_transformer", fields, folder);
  EXPECT_EQ(report.loaded.size(), m->named_parameters().size()) << report.summary();
  m->eval();
  torch::NoGradGuard ng;
  const at::Tensor t = io.at("timestep") * 1000;
  const at::Tensor packed =
      m->forward_packed(io.at("hidden_states"), io.at("encoder_hidden_states"), io.at("pooled_projections"), t,
                        io.at("guidance"), io.at("img_ids"), io.at("txt_ids"));
  dew::Conditioning c;
  c.context = io.at("encoder_hidden_states");
  c.pooled = io.at("pooled_projections");
  c.extra["guidance"] = io.at("guidance");
  const at::Tensor x = dew::nn::flux_unpack_latents(io.at("hidden_states"), 6, 10);
  const at::Tensor y = m->forward(x, t, c);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 4, 6, 10}));
  EXPECT_TRUE(y.equal(dew::nn::flux_unpack_latents(packed, 6, 10)));
  // and it is the golden output, by the rule's scale (the parity suite checks it exactly)
  EXPECT_LT((packed - io.at("out_f32")).abs().max().item<double>(), 1e-4 * io.at("out_f32").abs().max().item<double>());
}

TEST(FluxTransformer, MaskedTextTokensAreNotAttendedTo) {
  auto m = flux_test_model(false);
  torch::NoGradGuard ng;
  const at::Tensor x = torch::randn({2, 2, 4, 6}), t = torch::tensor({250.0f, 900.0f});
  auto c = flux_test_conditioning(false);
  c.context_mask = torch::tensor({1, 1, 0, 0, 1, 1, 1, 0}, at::kBool).view({2, 4});
  const at::Tensor y = m->forward(x, t, c);
  auto changed = c;
  changed.context = c.context.clone();
  changed.context.index_put_({0, torch::indexing::Slice(2, 4)}, 7.0);  // masked tokens of row 0
  changed.context.index_put_({1, 3}, -7.0);
  EXPECT_LT((m->forward(x, t, changed) - y).abs().max().item<double>(), 1e-5);
  changed.context.index_put_({0, 0}, 7.0);  // a real token
  EXPECT_GT((m->forward(x, t, changed) - y).abs().max().item<double>(), 1e-4);
}

TEST(FluxTransformer, InputsItNeedsOrDoesNotTakeAreErrors) {
  const at::Tensor x = torch::randn({2, 2, 4, 6}), t = torch::tensor({250.0f, 900.0f});
  auto dev = flux_test_model(true);
  auto c = flux_test_conditioning(false);
  EXPECT_NE(error_of([&] { dev->forward(x, t, c); }).find("needs the input \"guidance\""), std::string::npos);
  EXPECT_EQ(error_of([&] { dev->forward(x, t, flux_test_conditioning(true)); }), "");
  auto schnell = flux_test_model(false);
  EXPECT_NE(error_of([&] {
              schnell->forward(x, t, flux_test_conditioning(true));
            }).find("flux_transformer: unknown conditioning input \"guidance\"; accepted: none"),
            std::string::npos);
  auto no_pooled = c;
  no_pooled.pooled = at::Tensor();
  EXPECT_NE(error_of([&] { schnell->forward(x, t, no_pooled); }).find("pooled text"), std::string::npos);
  auto no_text = c;
  no_text.context = at::Tensor();
  EXPECT_NE(error_of([&] { schnell->forward(x, t, no_text); }).find("a text context"), std::string::npos);
  auto labels = c;
  labels.labels = torch::tensor({0, 1}, at::kLong);
  EXPECT_NE(error_of([&] { schnell->forward(x, t, labels); }).find("takes no class labels"), std::string::npos);
  EXPECT_NE(error_of([&] {
              schnell->forward(torch::randn({2, 2, 5, 6}), t, c);
            }).find("H and W even"),
            std::string::npos);
  EXPECT_TRUE(schnell->requires_text());
  EXPECT_TRUE(schnell->takes_pooled());
}
