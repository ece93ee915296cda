// The JEPA encoder, video encoder and predictor against facebookresearch/ijepa and facebookresearch/jepa
// (goldens made by tests/golden/jepa_reference.py with the reference classes), and their own invariants.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dew/io/weights.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/jepa.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

namespace {

using dew::json;
using dew::test::expect_close_f64;
using dew::test::expect_golden;
using dew::test::golden;
using dew::test::golden_weights;

// Loads a golden file's weights strictly: every parameter and buffer (the sin-cos tables included) present.
void load(torch::nn::Module& m, const std::map<std::string, at::Tensor>& w, const std::string& what) {
  dew::io::load_weights(m, dew::io::WeightSource::of_tensors(w, what));
}

dew::nn::JepaEncoderOptions ijepa_encoder_options() {
  return dew::nn::JepaEncoderOptions()
      .image_size(16)
      .patch_size(4)
      .in_channels(2)
      .emb_features(32)
      .num_layers(2)
      .num_heads(4);
}
dew::nn::JepaPredictorOptions ijepa_predictor_options() {
  return dew::nn::JepaPredictorOptions()
      .image_size(16)
      .patch_size(4)
      .encoder_features(32)
      .emb_features(16)
      .num_layers(2)
      .num_heads(2);
}

TEST(Jepa, EncoderMatchesIJepaVisionTransformer) {
  auto g = golden("jepa/ijepa_encoder.safetensors");
  dew::nn::JepaEncoder enc(ijepa_encoder_options());
  load(*enc, golden_weights(g), "ijepa_encoder");
  enc->eval();
  torch::NoGradGuard ng;
  expect_golden("full", enc->forward(g["x"]), g["full_f32"], g["full_f64"]);
  expect_golden("masked", enc->forward(g["x"], g["mask"]), g["masked_f32"], g["masked_f64"]);
  // Our table (built in float64, stored float32) is the reference's.
  EXPECT_TRUE(dew::nn::JepaEncoder(ijepa_encoder_options())->pos_embed.equal(g["w.pos_embed"]));
  enc->to(at::kDouble);
  expect_close_f64("full (float64)", enc->forward(g["x"].to(at::kDouble)), g["full_f64"]);
  expect_close_f64("masked (float64)", enc->forward(g["x"].to(at::kDouble), g["mask"]), g["masked_f64"]);
}

TEST(Jepa, PredictorMatchesIJepaPredictor) {
  auto g = golden("jepa/ijepa_predictor.safetensors");
  dew::nn::JepaPredictor pred(ijepa_predictor_options());
  load(*pred, golden_weights(g), "ijepa_predictor");
  pred->eval();
  torch::NoGradGuard ng;
  expect_golden("predictor", pred->forward(g["ctx"], g["masks_x"], g["masks"]), g["out_f32"], g["out_f64"]);
  pred->to(at::kDouble);
  expect_close_f64("predictor (float64)", pred->forward(g["ctx"].to(at::kDouble), g["masks_x"], g["masks"]),
                   g["out_f64"]);
}

TEST(Jepa, VideoEncoderMatchesVJepaVisionTransformer) {
  auto g = golden("jepa/vjepa_encoder.safetensors");
  auto enc = dew::models::build_token_encoder({{"architecture", "jepa_video_encoder"},
                                               {"fields",
                                                {{"image_size", 8},
                                                 {"patch_size", 4},
                                                 {"frames", 4},
                                                 {"tubelet_size", 2},
                                                 {"in_channels", 2},
                                                 {"emb_features", 32},
                                                 {"num_layers", 2},
                                                 {"num_heads", 2}}}});
  load(*enc, golden_weights(g), "vjepa_encoder");
  enc->eval();
  torch::NoGradGuard ng;
  expect_golden("video full", enc->forward(g["x"]), g["full_f32"], g["full_f64"]);
  expect_golden("video masked", enc->forward(g["x"], g["mask"]), g["masked_f32"], g["masked_f64"]);
  enc->to(at::kDouble);
  expect_close_f64("video masked (float64)", enc->forward(g["x"].to(at::kDouble), g["mask"]), g["masked_f64"]);
}

TEST(Jepa, VideoPredictorMatchesVJepaPredictor) {
  auto g = golden("jepa/vjepa_predictor.safetensors");
  dew::nn::JepaPredictor pred(dew::nn::JepaPredictorOptions()
                                  .image_size(8)
                                  .patch_size(4)
                                  .frames(4)
                                  .tubelet_size(2)
                                  .encoder_features(32)
                                  .emb_features(16)
                                  .num_layers(2)
                                  .num_heads(2));
  load(*pred, golden_weights(g), "vjepa_predictor");
  pred->eval();
  torch::NoGradGuard ng;
  expect_golden("video predictor", pred->forward(g["ctx"], g["masks_x"], g["masks"]), g["out_f32"], g["out_f64"]);
}

TEST(Jepa, PositionTablesAreTheReferenceTables) {
  // The 3D table of a 2 x 2 x 2 grid at width 32 (V-JEPA's, committed in the golden) and the 2D table's
  // layout: the first half of a row encodes the column.
  auto g = golden("jepa/vjepa_encoder.safetensors");
  const auto t3 = dew::nn::jepa_position_table(32, {2, 2, 2}, true);
  EXPECT_TRUE(t3.unsqueeze(0).equal(g["w.pos_embed"]));
  const auto t2 = dew::nn::jepa_position_table(8, {1, 3, 3}, false);  // [9, 8]
  EXPECT_TRUE(t2[1].slice(0, 4).equal(t2[0].slice(0, 4)));            // token (0, 1): same row as (0, 0)
  EXPECT_FALSE(t2[1].slice(0, 0, 4).equal(t2[0].slice(0, 0, 4)));     // a different column
}

TEST(Jepa, RefusesInputsItCannotTake) {
  dew::nn::JepaEncoder enc(ijepa_encoder_options());
  EXPECT_NE(dew::test::error_of([&] {
              enc->forward(at::zeros({2, 2, 12, 12}));
            }).find("x must be [B, 2, 16, 16]"),
            std::string::npos);
  EXPECT_NE(dew::test::error_of([&] {
              enc->forward(at::zeros({2, 2, 16, 16}), at::full({2, 3}, 16, at::kLong));
            }).find("token indices must be in [0, 16)"),
            std::string::npos);
  EXPECT_NE(dew::test::error_of([] {
              dew::models::build_token_encoder(
                  {{"architecture", "jepa_encoder"}, {"fields", {{"image_size", 30}, {"patch_size", 4}}}});
            }).find("image_size: must be a positive multiple of patch_size 4"),
            std::string::npos);
  EXPECT_NE(dew::test::error_of([] {
              dew::models::build_token_encoder(
                  {{"architecture", "jepa_video_encoder"}, {"fields", {{"frames", 5}, {"tubelet_size", 2}}}});
            }).find("tubelet_size: must divide frames 5"),
            std::string::npos);
  dew::nn::JepaPredictor pred(ijepa_predictor_options());
  EXPECT_NE(dew::test::error_of([&] {
              pred->forward(at::zeros({2, 3, 32}), at::zeros({2, 3}, at::kLong), at::zeros({2, 3}, at::kLong));
            }).find("targets must be [M, 2, Kt]"),
            std::string::npos);
}

}  // namespace
