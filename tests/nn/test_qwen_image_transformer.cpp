// qwen_image_transformer beside its goldens: the translation of diffusers' configs, unsupported settings refused by
// name, the NCHW forward against the joint one, the block-causal mask and the padded text keys, the prefix KV
// cache (equal to the plain forward; its timing printed, not asserted), and bad inputs refused in one line
// before compute. The golden folders tests/golden/qwen_image/transformer_{causal,plain} (written by
// tests/golden/qwen_image_reference.py from the installed diffusers with every weight moved off its
// initialisation) run in the reference-parity suite, tests/nn/test_reference_parity.cpp; the shared family suite
// covers the rest (tests/nn/test_all_backbones.cpp).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>

#include "dew/io/safetensors.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/qwen_image_transformer.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

using dew::json;
using dew::test::error_of;

namespace qwen_image_test {

const std::string kQwenGolden = std::string(DEW_SOURCE_DIR) + "/tests/golden/qwen_image/";

json qwen_test_fields(bool causal, int64_t heads = 2, int64_t layers = 2) {
  return {{"in_channels", 4},     {"output_channels", 4},         {"context_features", 6},
          {"num_layers", layers}, {"num_attention_heads", heads}, {"attention_head_dim", 8},
          {"mlp_ratio", 2},       {"axes_dims_rope", {2, 2, 4}},  {"causal_condition", causal}};
}

std::shared_ptr<dew::nn::QwenImageTransformerImpl> qwen_test_model(const json& fields) {
  torch::manual_seed(31);
  auto m = std::dynamic_pointer_cast<dew::nn::QwenImageTransformerImpl>(
      dew::models::build("qwen_image_transformer", fields));
  // off the zero-centred text norm's zeros
  torch::NoGradGuard ng;
  for (auto& p : m->parameters()) p.add_(0.1 * torch::randn_like(p));
  m->eval();
  return m;
}

dew::Conditioning qwen_test_conditioning(int64_t B, int64_t L, int64_t width) {
  dew::Conditioning c;
  c.context = torch::randn({B, L, width});
  c.context_mask = torch::ones({B, L}, at::kBool);
  c.context_mask.index_put_({B - 1, torch::indexing::Slice(L / 2, L)}, false);  // the last row right-padded
  return c;
}

std::shared_ptr<dew::nn::QwenImageTransformerImpl> qwen_golden_model(const std::string& folder) {
  const json fields = dew::models::fields_from_reference_config("qwen_image_transformer",
                                                                dew::test::read_json(folder + "/config.json"));
  auto m = std::dynamic_pointer_cast<dew::nn::QwenImageTransformerImpl>(
      dew::models::build("qwen_image_transformer", fields));
  const auto report = dew::models::load_reference_weights(*m, "qwen_image_transformer", fields, folder);
  EXPECT_EQ(report.loaded.size(), m->named_parameters().size()) << report.summary();
  m->eval();
  return m;
}

}  // namespace qwen_image_test

using namespace qwen_image_test;

TEST(QwenImageTransformer, Qwen21ConfigGivesTheDefaultLayout) {
  const json release = json::parse(R"({
    "_class_name": "QwenImage21Transformer2DModel", "_diffusers_version": "0.42.1", "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56], "causal_condition": true, "context_in_dim": 4096, "eps": 1e-06,
    "in_channels": 64, "mlp_ratio": 3, "num_attention_heads": 32, "num_layers": 32, "out_channels": 64,
    "patch_size": 1})");
  const json f = dew::models::fields_from_reference_config("qwen_image_transformer", release);
  EXPECT_EQ(dew::to_json(dew::from_json<dew::nn::QwenImageTransformerOptions>(f)),
            dew::to_json(dew::nn::QwenImageTransformerOptions()));
  json patched = release;
  patched["patch_size"] = 2;
  EXPECT_NE(error_of([&] {
              dew::models::fields_from_reference_config("qwen_image_transformer", patched);
            }).find("patch_size = 2 is not supported"),
            std::string::npos);
  json unknown = release;
  unknown["guidance_embeds"] = true;
  EXPECT_NE(error_of([&] {
              dew::models::fields_from_reference_config("qwen_image_transformer", unknown);
            }).find("unknown setting \"guidance_embeds\""),
            std::string::npos);
  json bad_axes = qwen_test_fields(true);
  bad_axes["axes_dims_rope"] = {2, 2, 2};
  EXPECT_NE(error_of([&] { dew::models::build("qwen_image_transformer", bad_axes); }).find("axes_dims_rope"),
            std::string::npos);
}

TEST(QwenImageTransformer, TheNchwForwardIsTheJointForward) {
  // forward(x, sigma x 1000, cond) lays out [text; image] as QwenImage21Pipeline does: on the golden inputs (padded
  // prompts of lengths 7 and 4) its output is the image part of the golden joint output.
  for (const char* name : {"transformer_causal", "transformer_plain"}) {
    SCOPED_TRACE(name);
    const std::string folder = kQwenGolden + name;
    const auto io = dew::io::load_safetensors(folder + "/io.safetensors");
    auto m = qwen_golden_model(folder);
    torch::NoGradGuard ng;
    dew::Conditioning c;
    c.context = io.at("encoder_hidden_states");
    c.context_mask = io.at("encoder_hidden_states_mask");
    const at::Tensor hs = io.at("hidden_states");  // [2, 24, 8]: a 4 x 6 grid
    const at::Tensor x = hs.transpose(1, 2).reshape({2, 8, 4, 6});
    const at::Tensor y = m->forward(x, io.at("timestep") * 1000, c);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 6, 4, 6}));
    const int64_t L = c.context.size(1);
    auto image = [&](const at::Tensor& joint) { return joint.narrow(1, L, 24).transpose(1, 2).reshape({2, 6, 4, 6}); };
    dew::test::expect_golden(std::string(name) + " nchw", y, image(io.at("out_f32")), image(io.at("out_f64")));
  }
}

TEST(QwenImageTransformer, TextIsCausalAndPaddedKeysAreNotAttended) {
  auto m = qwen_test_model(qwen_test_fields(true));
  torch::NoGradGuard ng;
  const int64_t B = 2, L = 6;
  const at::Tensor x = torch::randn({B, 4, 4, 4});
  const at::Tensor vlm = torch::cat({torch::zeros({L}, at::kBool), torch::ones({4}, at::kBool)});
  auto c = qwen_test_conditioning(B, L, 6);  // row 1: tokens 3..5 padded
  const auto layout = dew::nn::qwen_image_layout({{1, 4, 4}}, vlm, c.context_mask, {2, 2, 4}, "test");
  const at::Tensor tokens = x.flatten(2).transpose(1, 2), t = torch::tensor({300.0f, 700.0f});
  const at::Tensor y = m->forward_joint(tokens, c.context, t, layout);  // [2, 22, 4]
  // a later text token changes no earlier text row, but every image row
  at::Tensor later = c.context.clone();
  later.index_put_({0, 4}, 5.0);
  const at::Tensor y2 = m->forward_joint(tokens, later, t, layout);
  EXPECT_LT((y2.narrow(1, 0, 4) - y.narrow(1, 0, 4)).abs().max().item<double>(), 1e-6);
  EXPECT_GT((y2.narrow(1, L, 16) - y.narrow(1, L, 16)).abs().max().item<double>(), 1e-4);
  // padded keys of row 1: no real row of row 1 moves
  at::Tensor padded = c.context.clone();
  padded.index_put_({1, torch::indexing::Slice(3, L)}, -5.0);
  const at::Tensor y3 = m->forward_joint(tokens, padded, t, layout);
  EXPECT_LT((y3.select(0, 1).narrow(0, L, 16) - y.select(0, 1).narrow(0, L, 16)).abs().max().item<double>(), 1e-6);
  EXPECT_LT((y3.select(0, 1).narrow(0, 0, 3) - y.select(0, 1).narrow(0, 0, 3)).abs().max().item<double>(), 1e-6);
}

TEST(QwenImageTransformer, TheKvCacheGivesTheForwardsOutput) {
  // causal_condition: the text's keys and values do not depend on t, so a step from the cache equals the full
  // forward to float rounding. Timing of a short sampling loop with and without the cache is printed.
  auto m = qwen_test_model(qwen_test_fields(true, 4, 3));
  torch::NoGradGuard ng;
  const int64_t B = 2, L = 48;
  auto c = qwen_test_conditioning(B, L, 6);
  at::Tensor x = torch::randn({B, 4, 8, 8});
  dew::nn::QwenImageKVCache cache;
  const at::Tensor t0 = torch::tensor({1000.0f, 1000.0f});
  EXPECT_TRUE(m->forward_extract(x, t0, c, cache).equal(m->forward(x, t0, c)));
  ASSERT_TRUE(cache.filled());
  EXPECT_EQ(cache.prefix_len, L);
  EXPECT_EQ(cache.k[0].sizes(), (std::vector<int64_t>{B, 4, L, 8}));
  const at::Tensor x1 = torch::randn({B, 4, 8, 8}), t1 = torch::tensor({400.0f, 650.0f});
  const at::Tensor full = m->forward(x1, t1, c), cached = m->forward_cached(x1, t1, c, cache);
  EXPECT_LT((cached - full).abs().max().item<double>(), 1e-5 * (1 + full.abs().max().item<double>()));

  // Euler over 8 steps, with and without the cache: the same samples, and the time of each.
  auto sample = [&](bool use_cache) {
    at::Tensor z = x.clone();
    dew::nn::QwenImageKVCache k;
    const int steps = 8;
    for (int i = 0; i < steps; ++i) {
      const float s = 1.0f - float(i) / steps, s_next = 1.0f - float(i + 1) / steps;
      const at::Tensor t = torch::full({B}, 1000.0f * s);
      const at::Tensor v = !use_cache ? m->forward(z, t, c)
                           : i == 0   ? m->forward_extract(z, t, c, k)
                                      : m->forward_cached(z, t, c, k);
      z = z + (s_next - s) * v;
    }
    return z;
  };
  sample(true);  // warm-up
  const auto a = std::chrono::steady_clock::now();
  const at::Tensor plain = sample(false);
  const auto b = std::chrono::steady_clock::now();
  const at::Tensor with_cache = sample(true);
  const auto e = std::chrono::steady_clock::now();
  EXPECT_LT((plain - with_cache).abs().max().item<double>(), 1e-4 * (1 + plain.abs().max().item<double>()));
  std::printf(
      "qwen_image_transformer KV cache, 8 Euler steps, B 2, 48 text + 64 image tokens: %.1f ms without, "
      "%.1f ms with\n",
      std::chrono::duration<double, std::milli>(b - a).count(),
      std::chrono::duration<double, std::milli>(e - b).count());

  // without causal_condition the cache is refused by name
  auto plain_model = qwen_test_model(qwen_test_fields(false));
  EXPECT_NE(error_of([&] { plain_model->forward_extract(x, t0, c, cache); }).find("needs causal_condition"),
            std::string::npos);
}

TEST(QwenImageTransformer, BadInputsAreOneLineErrorsBeforeCompute) {
  const auto& f = dew::models::family("qwen_image_transformer");
  const dew::models::ReferenceMethod* forward = nullptr;
  for (const auto& r : f.reference_methods)
    if (r.name == "forward") forward = &r;
  ASSERT_TRUE(forward);
  auto m = qwen_test_model(qwen_test_fields(true));
  torch::NoGradGuard ng;
  const int64_t B = 2, L = 5;
  std::map<std::string, at::Tensor> in = {
      {"hidden_states", torch::randn({B, 16, 4})},
      {"encoder_hidden_states", torch::randn({B, L, 6})},
      {"timestep", torch::tensor({0.5f, 0.25f})},
      {"img_shapes", torch::tensor({1, 4, 4}, at::kLong).view({1, 1, 3}).expand({B, 1, 3})},
      {"img_mask", torch::cat({torch::zeros({L}, at::kBool), torch::ones({4}, at::kBool)}).expand({B, L + 4})},
      {"encoder_hidden_states_mask", torch::ones({B, L}, at::kBool)}};
  const std::string where = "QwenImage21Transformer2DModel.forward";
  EXPECT_EQ(error_of([&] { forward->run(*m, in, where); }), "");
  auto shapes = in;
  shapes["img_shapes"] = torch::tensor({1, 4, 6}, at::kLong).view({1, 1, 3});
  const std::string e1 = error_of([&] { forward->run(*m, shapes, where); });
  EXPECT_NE(e1.find("img_shapes [[1,4,6]] accounts for 24 image tokens but img_mask's 4 image slots stand for 16"),
            std::string::npos)
      << e1;
  EXPECT_EQ(dew::test::count_lines(e1), 0u) << e1;
  auto mask = in;
  mask["encoder_hidden_states_mask"] = torch::ones({B, L + 2}, at::kBool);
  const std::string e2 = error_of([&] { forward->run(*m, mask, where); });
  EXPECT_NE(e2.find("encoder_hidden_states_mask must be [2, E] no longer than encoder_hidden_states (5 rows)"),
            std::string::npos)
      << e2;
  EXPECT_EQ(dew::test::count_lines(e2), 0u) << e2;
  // over Dew's interface: a grid without whole 2 x 2 slots, a mask longer than the context
  auto c = qwen_test_conditioning(B, L, 6);
  EXPECT_NE(error_of([&] {
              m->forward(torch::randn({B, 4, 3, 3}), torch::tensor({1.0f, 2.0f}), c);
            }).find("H W a multiple of 4"),
            std::string::npos);
  auto longer = c;
  longer.context_mask = torch::ones({B, L + 1}, at::kBool);
  EXPECT_NE(error_of([&] {
              m->forward(torch::randn({B, 4, 4, 4}), torch::tensor({1.0f, 2.0f}), longer);
            }).find("context_mask must be [2, 5] like the context"),
            std::string::npos);
}
