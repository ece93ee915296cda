// CLIP score and LPIPS against their reference packages (tests/golden/clip_lpips_reference.py: torchmetrics 1.9.0's
// CLIPScore on a tiny transformers CLIPModel, lpips 0.1.4 on closed-form weights), by the golden rule
// rms(ours - f64) <= 2 rms(reference f32 - f64), and their refusals of bad input.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "dew/io/safetensors.h"
#include "dew/metrics/clip_score.h"
#include "dew/metrics/lpips.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

namespace clipl_test {

using at::Tensor;
namespace fs = std::filesystem;

std::string clip_folder() { return std::string(DEW_SOURCE_DIR) + "/tests/golden/clip_score"; }

std::map<std::string, Tensor> clip_io() { return dew::test::golden("clip_score/golden.safetensors"); }

std::vector<std::string> clip_prompts() {
  return dew::test::read_json(clip_folder() + "/prompts.json")["prompts"].get<std::vector<std::string>>();
}

// The golden's five images have three sizes: each is preprocessed on its own, as the processor groups them.
Tensor clip_pixels(const std::map<std::string, Tensor>& g, const dew::metrics::ClipImageProcessing& p) {
  std::vector<Tensor> px;
  for (int k = 0; k < 5; ++k)
    px.push_back(dew::metrics::clip_preprocess(g.at("image" + std::to_string(k)).unsqueeze(0), p));
  return at::cat(px);
}

// A scratch copy of the golden CLIP folder whose files a test may break.
fs::path clip_scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("dew_clipl_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::copy(clip_folder(), dir);
  return dir;
}

// lpips.LPIPS(net) on the closed-form weights against the package's distances, in float32 and float64.
void lpips_golden_case(const std::string& net) {
  const auto g = dew::test::golden("lpips/" + net + ".safetensors");
  auto lp = dew::metrics::Lpips(dew::metrics::LpipsOptions().net(net));
  lp->eval();
  torch::NoGradGuard no_grad;
  const Tensor d = lp->forward(g.at("in0"), g.at("in1"));
  dew::test::expect_golden("lpips " + net, d, g.at("d_f32"), g.at("d_f64"));
  lp->to(at::kDouble);
  const Tensor d64 = lp->forward(g.at("in0").to(at::kDouble), g.at("in1").to(at::kDouble));
  // the reference's float64 run: the closed-form weights cast to float32 and back, the stored float32 inputs
  dew::test::expect_close_f64("lpips " + net, d64, g.at("d_f64"), 1e-9);
}

}  // namespace clipl_test

TEST(ClipScore, PreprocessingMatchesClipImageProcessor) {
  const auto g = clipl_test::clip_io();
  const auto p = dew::metrics::read_clip_image_processing(clipl_test::clip_folder());
  EXPECT_EQ(p.shortest_edge, 32);
  const at::Tensor ours = clipl_test::clip_pixels(g, p);
  const double d = dew::test::max_diff(ours, g.at("pixel_values"));
  std::printf("  pixel_values max |diff| %.3e\n", d);
  EXPECT_LE(d, 1e-5);  // same ATen bicubic-antialias kernel on uint8; float32 normalisation
}

TEST(ClipScore, MatchesTorchmetricsOnATinyClip) {
  const auto g = clipl_test::clip_io();
  dew::metrics::ClipScorer clip(clipl_test::clip_folder());
  const auto prompts = clipl_test::clip_prompts();
  const at::Tensor pixels = clipl_test::clip_pixels(g, clip.processing);
  torch::NoGradGuard no_grad;
  const at::Tensor img = clip.vision->forward(pixels).image_embeds;
  const at::Tensor txt = clip.text_embeds(prompts);
  dew::test::expect_golden("image_embeds", img, g.at("image_embeds_f32"), g.at("image_embeds_f64"));
  dew::test::expect_golden("text_embeds", txt, g.at("text_embeds_f32"), g.at("text_embeds_f64"));
  const at::Tensor in = img / img.norm(2, -1, true), tn = txt / txt.norm(2, -1, true);
  const at::Tensor scores = 100.0 * (in * tn).sum(-1);
  dew::test::expect_golden("scores", scores, g.at("scores_f32"), g.at("scores_f64"));
  const double s = dew::metrics::clip_score_from_scores(scores);
  dew::test::expect_golden("score", at::full({1}, s, at::kDouble), g.at("score_f32"), g.at("score_f64"));
  // The whole path on the three same-sized images (score() preprocesses one batch).
  const at::Tensor three = at::stack({g.at("image0"), g.at("image1"), g.at("image2")});
  const at::Tensor s3 = clip.scores(three, {prompts[0], prompts[1], prompts[2]});
  dew::test::expect_golden("scores (first three)", s3, g.at("scores_f32").narrow(0, 0, 3),
                           g.at("scores_f64").narrow(0, 0, 3));
  // Float64: both towers moved to float64 on the same pixel values and ids.
  clip.vision->to(at::kDouble);
  clip.text->to(at::kDouble);
  const at::Tensor img64 = clip.vision->forward(pixels.to(at::kDouble)).image_embeds;
  auto [ids, mask] = clip.text->tokenize(prompts);
  const at::Tensor txt64 = clip.text->forward_outputs(ids, mask).text_embeds;
  dew::test::expect_close_f64("image_embeds", img64, g.at("image_embeds_f64"), 1e-9);
  dew::test::expect_close_f64("text_embeds", txt64, g.at("text_embeds_f64"), 1e-9);
}

TEST(ClipScore, ScoreIsTorchmetricsReduction) {
  EXPECT_DOUBLE_EQ(dew::metrics::clip_score_from_scores(at::tensor({10.0, 20.0, -6.0})), 8.0);
  EXPECT_DOUBLE_EQ(dew::metrics::clip_score_from_scores(at::tensor({-10.0, 5.0})), 0.0);  // max(mean, 0)
}

TEST(ClipScore, RefusesBadInputByName) {
  using dew::test::error_of;
  // a text-only CLIP folder: no vision_config
  {
    const std::filesystem::path dir = clipl_test::clip_scratch("novision");
    auto c = dew::test::read_json((dir / "config.json").string());
    c.erase("vision_config");
    std::ofstream(dir / "config.json") << c.dump();
    const std::string e = error_of([&] { dew::metrics::ClipScorer s(dir.string()); });
    EXPECT_NE(e.find("vision_config"), std::string::npos) << e;
    std::filesystem::remove_all(dir);
  }
  // a checkpoint without visual_projection
  {
    const std::filesystem::path dir = clipl_test::clip_scratch("noproj");
    auto t = dew::io::load_safetensors((dir / "model.safetensors").string());
    t.erase("visual_projection.weight");
    dew::io::save_safetensors((dir / "model.safetensors").string(), t);
    const std::string e = error_of([&] { dew::metrics::ClipScorer s(dir.string()); });
    EXPECT_NE(e.find("visual_projection.weight"), std::string::npos) << e;
    std::filesystem::remove_all(dir);
  }
  // images with 4 channels
  const auto p = dew::metrics::read_clip_image_processing(clipl_test::clip_folder());
  const std::string e = error_of([&] { dew::metrics::clip_preprocess(at::zeros({2, 4, 32, 32}, at::kByte), p); });
  EXPECT_NE(e.find("channels"), std::string::npos) << e;
  // images and prompts of different counts
  dew::metrics::ClipScorer clip(clipl_test::clip_folder());
  const std::string e2 = error_of([&] { clip.scores(at::zeros({2, 3, 32, 32}, at::kByte), {"a"}); });
  EXPECT_NE(e2.find("2 images but 1 texts"), std::string::npos) << e2;
}

TEST(Lpips, MatchesTheLpipsPackageOnClosedFormWeightsAlex) { clipl_test::lpips_golden_case("alex"); }

TEST(Lpips, MatchesTheLpipsPackageOnClosedFormWeightsVgg) { clipl_test::lpips_golden_case("vgg"); }

TEST(Lpips, LoadsFilesAndRefusesBadOnesByName) {
  using dew::test::error_of;
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("dew_clipl_lpips_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto ref = dew::metrics::Lpips(dew::metrics::LpipsOptions().net("alex"));
  std::map<std::string, at::Tensor> backbone, lin;
  for (const auto& p : ref->named_parameters())
    (p.key().rfind("lin", 0) == 0 ? lin : backbone)[p.key()] = p.value().detach().clone();
  // an lpips.LPIPS state names the backbone net.sliceK.N.*
  std::map<std::string, at::Tensor> lpips_state = lin;
  lpips_state["net.slice1.0.weight"] = backbone.at("features.0.weight");
  const std::string bb = (dir / "alexnet.safetensors").string(), lw = (dir / "alex.safetensors").string();
  dew::io::save_safetensors(bb, backbone);
  dew::io::save_safetensors(lw, lin);
  auto loaded = dew::metrics::Lpips(dew::metrics::LpipsOptions().net("alex").weights(lw).backbone(bb));
  const at::Tensor x = at::rand({1, 3, 32, 32}) * 2 - 1, y = at::rand({1, 3, 32, 32}) * 2 - 1;
  EXPECT_TRUE(loaded->forward(x, y).equal(ref->forward(x, y)));
  // grayscale is repeated to 3 channels
  const at::Tensor gx = x.narrow(1, 0, 1), gy = y.narrow(1, 0, 1);
  EXPECT_TRUE(loaded->forward(gx, gy).equal(ref->forward(gx.repeat({1, 3, 1, 1}), gy.repeat({1, 3, 1, 1}))));

  // the backbone missing: names the absent parameters
  std::string e = error_of([&] { dew::metrics::Lpips(dew::metrics::LpipsOptions().net("alex").weights(lw)); });
  EXPECT_NE(e.find("features.0.weight"), std::string::npos) << e;
  // a wrong shape: the vgg lin layers given to alex
  std::map<std::string, at::Tensor> vlin;  // vgg's lin layers: 64, 128, 256, 512, 512 channels
  const int64_t vgg_chns[] = {64, 128, 256, 512, 512};
  for (int k = 0; k < 5; ++k) vlin["lin" + std::to_string(k) + ".model.1.weight"] = at::ones({1, vgg_chns[k], 1, 1});
  const std::string vw = (dir / "vgg_lin.safetensors").string();
  dew::io::save_safetensors(vw, vlin);
  e = error_of([&] { dew::metrics::Lpips(dew::metrics::LpipsOptions().net("alex").weights(vw).backbone(bb)); });
  EXPECT_NE(e.find("lin1.model.1.weight"), std::string::npos) << e;
  // a wrong name
  std::map<std::string, at::Tensor> bad = lin;
  bad["lin9.model.1.weight"] = bad.at("lin0.model.1.weight");
  const std::string bw = (dir / "bad.safetensors").string();
  dew::io::save_safetensors(bw, bad);
  e = error_of([&] { dew::metrics::Lpips(dew::metrics::LpipsOptions().net("alex").weights(bw).backbone(bb)); });
  EXPECT_NE(e.find("lin9"), std::string::npos) << e;
  // an unknown net, wrong channel counts
  e = error_of([&] { dew::metrics::Lpips(dew::metrics::LpipsOptions().net("squeeze")); });
  EXPECT_NE(e.find("squeeze"), std::string::npos) << e;
  e = error_of([&] { ref->forward(at::zeros({1, 4, 32, 32}), at::zeros({1, 4, 32, 32})); });
  EXPECT_NE(e.find("in0"), std::string::npos) << e;
  std::filesystem::remove_all(dir);
}
