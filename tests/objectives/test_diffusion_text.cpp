// Text conditioning of the diffusion objective: captions of labels, the empty caption as the null
// datum, the encoder trained jointly with the backbone or, frozen, its captions encoded once, and prompts in
// generate().
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dew/diffusion/presets.h"
#include "dew/objectives/diffusion.h"
#include "tests/test_util.h"

namespace {

dew::TextConditioner fashion_captions() {
  dew::TextConditioner t;
  t.class_names = {"T-shirt/top", "Trouser", "Ankle boot"};
  return t;
}

TEST(DiffusionText, CaptionsAreTheClassNamesWithTheirArticle) {
  auto t = fashion_captions();
  EXPECT_EQ(t.caption(0), "a photo of a t-shirt/top");
  EXPECT_EQ(t.caption(2), "a photo of an ankle boot");
  EXPECT_EQ(t.caption(3), "");  // the null class
  t.caption_template = "{} on a table";
  EXPECT_EQ(t.caption(1), "a trouser on a table");
  EXPECT_EQ(t.captions(torch::tensor({2, 3, 0})),
            (std::vector<std::string>{"an ankle boot on a table", "", "a t-shirt/top on a table"}));
  EXPECT_NE(dew::test::error_of([&] { t.caption(4); }).find("label 4"), std::string::npos);
}

struct TextRun {
  dew::BackbonePtr model;
  dew::TextEncoderPtr encoder;
  std::shared_ptr<dew::DiffusionObjective> objective;
};

TextRun text_run(double unconditional_prob) {
  torch::manual_seed(0);
  TextRun r;
  r.encoder = dew::text_encoders::build("byte_text_encoder",
                                        {{"features", 16}, {"num_layers", 1}, {"num_heads", 2}, {"max_length", 32}});
  r.model = dew::models::build("simple_dit", {{"patch_size", 2},
                                              {"emb_features", 32},
                                              {"num_layers", 1},
                                              {"num_heads", 2},
                                              {"in_channels", 1},
                                              {"output_channels", 1},
                                              {"context_features", 16}});
  dew::DiffusionObjectiveOptions o;
  o.unconditional_prob = unconditional_prob;
  o.steps = 2;
  r.objective = std::make_shared<dew::DiffusionObjective>(
      r.model, *dew::diffusion::presets().build(dew::json{{"name", "flow"}}), o, 3, std::vector<int64_t>{1, 8, 8},
      r.encoder, std::vector<std::string>{"Sandal", "Bag", "Coat"});
  return r;
}

TEST(DiffusionText, TheEncoderTrainsWithTheBackboneInOneModuleTree) {
  auto r = text_run(0.0);
  // randomize the zero-initialised output layers so gradients flow back to the text encoder
  {
    torch::NoGradGuard ng;
    for (auto& p : r.model->parameters()) p.add_(torch::randn_like(p) * 0.05);
  }
  bool found = false;
  for (const auto& kv : r.objective->module().named_parameters())
    found |= kv.key() == "text_encoder.token_embedding.weight";
  EXPECT_TRUE(found) << "the encoder's parameters belong to the checkpointed module";
  dew::data::Batch b = {{"image", torch::randint(0, 256, {4, 1, 8, 8}).to(at::kByte)},
                        {"label", torch::tensor({0, 1, 2, 1}, at::kLong)}};
  auto gen = at::detail::createCPUGenerator(7);
  auto out = r.objective->loss(b, 0, gen);
  out.loss.backward();
  for (const auto& kv : r.encoder->named_parameters()) {
    const auto& g = kv.value().grad();
    ASSERT_TRUE(g.defined()) << kv.key();
    if (kv.key() != "token_embedding.weight") {
      EXPECT_GT(g.abs().max().item<double>(), 0.0) << kv.key();
    }
  }
  // the rows of the bytes of "a photo of a sandal" receive gradient; a byte that never occurs does not
  const auto& emb = r.encoder->named_parameters()["token_embedding.weight"].grad();
  EXPECT_GT(emb[int('s') + 1].abs().max().item<double>(), 0.0);
  EXPECT_EQ(emb[int('Z') + 1].abs().max().item<double>(), 0.0);
}

TEST(DiffusionText, AFrozenEncodersCaptionsAreEncodedOnceAndGiveTheLossOfEncodingEachBatch) {
  // Two runs with the same weights, one encoder trainable (encodes each batch), one frozen (cached captions);
  // half the labels dropped to the empty caption. Same batch, same draws: the same loss, up to the rounding of
  // encoding 4 rows rather than all 4 captions.
  auto trained = text_run(0.5), frozen = text_run(0.5);
  for (auto* r : {&trained, &frozen}) {
    torch::manual_seed(1);
    torch::NoGradGuard ng;
    for (auto& q : r->model->parameters()) q.add_(torch::randn_like(q) * 0.05);
  }
  for (auto& p : frozen.encoder->parameters()) p.set_requires_grad(false);
  dew::data::Batch b = {{"image", torch::randint(0, 256, {6, 1, 8, 8}).to(at::kByte)},
                        {"label", torch::tensor({0, 1, 2, 1, 0, 2}, at::kLong)}};
  auto loss = [&](TextRun& r) { return r.objective->loss(b, 0, at::detail::createCPUGenerator(5)).loss; };
  const at::Tensor a = loss(trained), c = loss(frozen);
  EXPECT_NEAR(c.item<double>(), a.item<double>(), 1e-6 * std::abs(a.item<double>()));
  auto fresh = text_run(0.5);
  EXPECT_NE(a.item<double>(), loss(fresh).item<double>());  // the loss depends on the model's weights
  // The frozen encoder trains nothing and its captions are not encoded again: moving its weights now changes
  // the trainable run's loss, not the frozen one's.
  c.backward();
  for (const auto& p : frozen.encoder->parameters()) EXPECT_FALSE(p.grad().defined());
  for (auto* r : {&trained, &frozen}) {
    torch::NoGradGuard ng;
    for (auto& q : r->encoder->parameters()) q.add_(0.1);
  }
  EXPECT_EQ(loss(frozen).item<double>(), c.item<double>());
  EXPECT_GT(std::abs(loss(trained).item<double>() - a.item<double>()), 1e-6);
  // Trainable again (a parameter requires its gradient): encoded per batch, with the moved weights.
  for (auto& p : frozen.encoder->parameters()) p.set_requires_grad(true);
  EXPECT_NEAR(loss(frozen).item<double>(), loss(trained).item<double>(), 1e-6 * std::abs(a.item<double>()));
}

TEST(DiffusionText, DroppedRowsSeeTheEmptyCaption) {
  // Every label dropped: the loss no longer depends on the labels. Kept: it does. (Same draws both times.)
  auto image = torch::randint(0, 256, {3, 1, 8, 8}).to(at::kByte);
  for (double p : {1.0, 0.0}) {
    auto r = text_run(p);
    {
      torch::NoGradGuard ng;
      for (auto& q : r.model->parameters()) q.add_(torch::randn_like(q) * 0.05);
    }
    torch::NoGradGuard ng;
    auto loss = [&](std::vector<int64_t> labels) {
      dew::data::Batch b = {{"image", image}, {"label", torch::tensor(labels, at::kLong)}};
      return r.objective->loss(b, 0, at::detail::createCPUGenerator(3)).loss.item<double>();
    };
    const double a = loss({0, 1, 2}), b = loss({2, 2, 0});
    if (p == 1.0) {
      EXPECT_EQ(a, b);
    } else {
      EXPECT_NE(a, b);
    }
  }
}

TEST(DiffusionText, GenerateConditionsOnPromptsAndGuidesWithTheEmptyCaption) {
  auto r = text_run(0.1);
  {
    torch::NoGradGuard ng;
    for (auto& p : r.model->parameters()) p.add_(torch::randn_like(p) * 0.05);
  }
  dew::TextConditioner t;
  t.encoder = r.encoder;
  t.class_names = {"Sandal", "Bag", "Coat"};
  dew::DiffusionSampleOptions g;
  g.count = 2;
  g.shape = {1, 8, 8};
  g.steps = 2;
  g.solver = "euler";
  g.text = &t;
  g.guidance.scale = 1.0;
  g.prompts = {"a photo of a bag", "a photo of a bag"};
  auto a = dew::sample_diffusion(*r.model, r.objective->process(), g);
  g.prompts = {"a photo of a coat", "a photo of a coat"};
  auto b = dew::sample_diffusion(*r.model, r.objective->process(), g);
  EXPECT_GT((a - b).abs().max().item<double>(), 1e-6) << "the prompt must change the samples";
  // labels are captioned: label 1 gives the same samples as the prompt "a photo of a bag"
  g.prompts.clear();
  g.labels = torch::tensor({1, 1}, at::kLong);
  auto c = dew::sample_diffusion(*r.model, r.objective->process(), g);
  EXPECT_TRUE(a.equal(c));
  // guidance with scale 0 keeps only the unconditional branch: the "" caption
  g.labels = at::Tensor();
  g.guidance.scale = 0.0;
  g.prompts = {"a photo of a coat", "a photo of a coat"};
  auto uncond = dew::sample_diffusion(*r.model, r.objective->process(), g);
  g.guidance.scale = 1.0;
  g.prompts = {"", ""};
  auto empty = dew::sample_diffusion(*r.model, r.objective->process(), g);
  EXPECT_LT((uncond - empty).abs().max().item<double>(), 1e-5);
}

}  // namespace
