// The JEPA loss against I-JEPA's training step (tests/golden/jepa/ijepa_loss.safetensors: the reference's
// encoder, predictor and target encoder with its apply_masks / repeat_interleave_batch), the distances
// against hand computation, and the target encoder's EMA schedule.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dew/io/weights.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/objectives/jepa.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

namespace {

using dew::json;

struct Golden {
  std::map<std::string, at::Tensor> g;
  std::shared_ptr<dew::TokenEncoderImpl> encoder;
  std::shared_ptr<dew::TokenPredictorImpl> predictor;
  std::map<std::string, at::Tensor> averages;  // "encoder.<name>" -> the target encoder's weights
  dew::data::Masks masks;
};

Golden load_golden() {
  Golden s;
  s.g = dew::test::golden("jepa/ijepa_loss.safetensors");
  s.encoder = dew::models::build_token_encoder({{"architecture", "jepa_encoder"},
                                                {"fields",
                                                 {{"image_size", 16},
                                                  {"patch_size", 4},
                                                  {"in_channels", 2},
                                                  {"emb_features", 32},
                                                  {"num_layers", 2},
                                                  {"num_heads", 4}}}});
  s.predictor = dew::models::build_token_predictor({{"architecture", "jepa_predictor"},
                                                    {"fields",
                                                     {{"image_size", 16},
                                                      {"patch_size", 4},
                                                      {"encoder_features", 32},
                                                      {"emb_features", 16},
                                                      {"num_layers", 2},
                                                      {"num_heads", 2}}}});
  dew::io::load_weights(*s.encoder,
                        dew::io::WeightSource::of_tensors(dew::test::golden_weights(s.g, "w.encoder."), "encoder"));
  dew::io::load_weights(*s.predictor,
                        dew::io::WeightSource::of_tensors(dew::test::golden_weights(s.g, "w.predictor."), "predictor"));
  for (const auto& [k, v] : dew::test::golden_weights(s.g, "w.target."))
    if (k != "pos_embed") s.averages["encoder." + k] = v.clone();
  s.masks = {s.g["masks_enc"][0], s.g["masks_pred"]};
  return s;
}

dew::JEPAObjectiveOptions with_loss(const std::string& loss) {
  dew::JEPAObjectiveOptions o;
  o.loss = loss;
  o.masks.min_keep = 2;  // blocks that fit the 4 x 4 grid of the golden
  o.masks.target_scale = {0.25, 0.3};
  return o;
}

TEST(JepaObjective, LossMatchesIJepaTrainingStep) {
  for (const std::string loss : {"smooth_l1", "l1", "mse"}) {
    SCOPED_TRACE(loss);
    Golden s = load_golden();
    dew::JEPAObjective obj(s.encoder, s.predictor, with_loss(loss));
    obj.bind_ema(s.averages);
    s.encoder->eval();
    s.predictor->eval();
    const auto out = obj.loss_of(s.g["x"], s.masks);
    dew::test::expect_golden("loss " + loss, out.loss, s.g["loss_" + loss + "_f32"], s.g["loss_" + loss + "_f64"]);
    EXPECT_EQ(out.metrics.at("context_tokens"), 7);
    EXPECT_EQ(out.metrics.at("target_tokens"), 4);
  }
}

TEST(JepaObjective, GradientsMatchIJepaInFloat64) {
  Golden s = load_golden();
  s.encoder->to(at::kDouble);
  s.predictor->to(at::kDouble);
  for (auto& [k, v] : s.averages) v = v.to(at::kDouble);
  dew::JEPAObjective obj(s.encoder, s.predictor, with_loss("smooth_l1"));
  obj.bind_ema(s.averages);
  s.encoder->eval();
  s.predictor->eval();
  const auto out = obj.loss_of(s.g["x"].to(at::kDouble), s.masks);
  dew::test::expect_close_f64("loss smooth_l1 (float64)", out.loss, s.g["loss_smooth_l1_f64"], 1e-12);
  out.loss.backward();
  int64_t compared = 0;
  for (auto& [prefix, module] : std::vector<std::pair<std::string, torch::nn::Module*>>{
           {"encoder", s.encoder.get()}, {"predictor", s.predictor.get()}}) {
    for (const auto& kv : module->named_parameters()) {
      const std::string key = "grad." + prefix + "." + kv.key();
      ASSERT_TRUE(s.g.count(key)) << key;
      ASSERT_TRUE(kv.value().grad().defined()) << key;
      dew::test::expect_close_f64(key, kv.value().grad(), s.g[key], 1e-9);
      ++compared;
    }
  }
  EXPECT_EQ(compared, 28 + 31);  // every encoder and predictor parameter (mask_token included)
  // The target encoder received no gradient: it is the EMA, not a trained module.
  for (const auto& p : obj.target_encoder().parameters()) EXPECT_FALSE(p.grad().defined());
}

TEST(JepaObjective, DistancesByHand) {
  const at::Tensor z = torch::tensor({0.0, 2.0, -0.5, 1.0}, at::kDouble).view({1, 2, 2});
  const at::Tensor h = torch::tensor({0.5, 0.0, -0.5, 4.0}, at::kDouble).view({1, 2, 2});
  // differences 0.5, -2, 0, 3
  EXPECT_DOUBLE_EQ(dew::jepa_distance(z, h, "mse").item<double>(), (0.25 + 4 + 0 + 9) / 4);
  EXPECT_DOUBLE_EQ(dew::jepa_distance(z, h, "l1").item<double>(), (0.5 + 2 + 0 + 3) / 4);
  // smooth L1 (beta 1): 0.5 d^2 for |d| < 1, |d| - 0.5 otherwise
  EXPECT_DOUBLE_EQ(dew::jepa_distance(z, h, "smooth_l1").item<double>(), (0.125 + 1.5 + 0 + 2.5) / 4);
  EXPECT_NE(dew::test::error_of([&] { dew::jepa_distance(z, h, "huber"); }).find("accepted: mse, smooth_l1, l1"),
            std::string::npos);
}

TEST(JepaObjective, TheTargetIsTheEncodersEmaWithALinearMomentumRamp) {
  Golden s = load_golden();
  dew::JEPAObjectiveOptions o = with_loss("mse");
  dew::JEPAObjective obj(s.encoder, s.predictor, o);
  const auto spec = obj.ema();
  EXPECT_TRUE(spec.includes("encoder.blocks.0.attn.qkv.weight"));
  EXPECT_FALSE(spec.includes("predictor.mask_token"));
  EXPECT_DOUBLE_EQ(spec.at(0, 101), 0.996);
  EXPECT_DOUBLE_EQ(spec.at(50, 101), 0.998);
  EXPECT_DOUBLE_EQ(spec.at(100, 101), 1.0);
  // The EMA the trainer keeps follows I-JEPA's update param_k = m param_k + (1 - m) param_q.
  dew::training::NamedTensors params;
  for (const auto& kv : obj.module().named_parameters()) params.emplace_back(kv.key(), kv.value());
  dew::training::EMA ema(params, spec, 101);
  const at::Tensor before = ema.averages().at("encoder.norm.weight").clone();
  {
    torch::NoGradGuard ng;
    s.encoder->named_parameters()["norm.weight"].add_(1.0);
  }
  ema.update(params, 0);
  const at::Tensor expect = 0.996 * before + 0.004 * (s.encoder->named_parameters()["norm.weight"]);
  EXPECT_LT((ema.averages().at("encoder.norm.weight") - expect).abs().max().item<double>(), 1e-6);
  EXPECT_EQ(ema.averages().count("predictor.mask_token"), 0u);
}

TEST(JepaObjective, RefusesAPredictorOfAnotherGrid) {
  Golden s = load_golden();
  auto other = dew::models::build_token_predictor({{"architecture", "jepa_predictor"},
                                                   {"fields",
                                                    {{"image_size", 16},
                                                     {"patch_size", 2},
                                                     {"encoder_features", 32},
                                                     {"emb_features", 16},
                                                     {"num_layers", 1},
                                                     {"num_heads", 2}}}});
  EXPECT_NE(dew::test::error_of([&] {
              dew::JEPAObjective(s.encoder, other, with_loss("mse"));
            }).find("model.predictor.fields.patch_size: must be the encoder's 4"),
            std::string::npos);
  dew::JEPAObjectiveOptions bad = with_loss("mse");
  bad.momentum = 1.2;
  EXPECT_NE(dew::test::error_of([&] { dew::JEPAObjective(s.encoder, s.predictor, bad); }).find("objective.momentum"),
            std::string::npos);
}

TEST(JepaObjective, GridPoolsAreRegionMeansOfTheTokenGrid) {
  // The golden's encoder has a 4 x 4 grid: grid2 is the means of its four 2 x 2 quadrants (region-major, then
  // the width D), grid1 the mean over tokens, grid4 every token; a K beyond the grid is refused by name.
  Golden s = load_golden();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor images = at::randint(0, 256, {3, 2, 16, 16}, gen, at::kLong).to(at::kByte);
  at::Tensor tokens;
  {
    at::NoGradGuard ng;
    s.encoder->eval();
    tokens = s.encoder->forward(dew::data::to_model_range(images));  // [3, 16, 32]
  }
  std::vector<at::Tensor> quadrants;
  for (int64_t r : {0, 2})
    for (int64_t c : {0, 2})
      quadrants.push_back(
          tokens.index_select(1, torch::tensor({r * 4 + c, r * 4 + c + 1, (r + 1) * 4 + c, (r + 1) * 4 + c + 1}))
              .mean(1));
  const at::Tensor want2 = at::cat(quadrants, 1);  // [3, 4 * 32]
  EXPECT_TRUE(at::allclose(dew::pooled_features(*s.encoder, images, "grid2"), want2, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(dew::pooled_features(*s.encoder, images, "grid1"), tokens.mean(1), 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(dew::pooled_features(*s.encoder, images, "grid4"), tokens.flatten(1), 1e-5, 1e-6));
  EXPECT_NE(dew::test::error_of([&] {
              dew::pooled_features(*s.encoder, images, "grid5");
            }).find("pool: got \"grid5\", accepted: mean, tokens, gridK with 1 <= K <= 4"),
            std::string::npos);
  EXPECT_NE(dew::test::error_of([&] { dew::pooled_features(*s.encoder, images, "gridx"); }).find("pool: got \"gridx\""),
            std::string::npos);
  dew::JEPAObjectiveOptions bad = with_loss("mse");
  bad.probe_pool = "grid9";
  EXPECT_NE(dew::test::error_of([&] {
              dew::JEPAObjective(s.encoder, s.predictor, bad);
            }).find("objective.probe_pool: got \"grid9\""),
            std::string::npos);
  bad = with_loss("mse");
  bad.knn_temperature = -1;
  EXPECT_NE(dew::test::error_of([&] {
              dew::JEPAObjective(s.encoder, s.predictor, bad);
            }).find("objective.knn_temperature: must be > 0, got -1"),
            std::string::npos);
}

}  // namespace
