// Every registered diffusion backbone, through the paths a run uses: built from its {architecture,
// fields} record, saved to safetensors and loaded into a fresh build (its own checkpoint), listed with
// all its fields, trained a few steps on one batch, and refusing a mismatched checkpoint.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "dew/io/safetensors.h"
#include "dew/io/weights.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/training/trainer.h"
#include "tests/nn/backbone_checks.h"
#include "tests/test_util.h"

namespace {

using dew::json;

struct Tiny {
  std::string arch;
  json fields;
  std::vector<int64_t> input;  // [B, C, H, W] or [B, C, T, H, W]
  int64_t context = 0;         // text width (0: none)
};

// One small configuration per architecture (a few thousand parameters, milliseconds per step).
std::vector<Tiny> tiny_models() {
  const json dit = {{"patch_size", 2}, {"emb_features", 32}, {"num_layers", 2}, {"num_heads", 2}, {"mlp_ratio", 2},
                    {"in_channels", 1}, {"output_channels", 1}, {"num_classes", 3}};
  auto with = [](json base, const json& extra) {
    base.update(extra);
    return base;
  };
  const json unet = {{"emb_features", 16}, {"feature_depths", {8, 16}}, {"attention_configs", {nullptr, 2}},
                     {"num_res_blocks", 1}, {"norm_groups", 4}, {"in_channels", 1}, {"output_channels", 1},
                     {"num_classes", 3}};
  return {
      {"simple_dit", dit, {2, 1, 8, 8}},
      {"unet", unet, {2, 1, 8, 8}},
      {"simple_udit", dit, {2, 1, 8, 8}},
      {"uvit", with(dit, {{"image_size", 8}}), {2, 1, 8, 8}},
      {"simple_mmdit", with(dit, {{"context_features", 8}}), {2, 1, 8, 8}, 8},
      {"hierarchical_mmdit",
       {{"base_patch_size", 2}, {"emb_features", {16, 32}}, {"num_layers", {2, 2}}, {"num_heads", {2, 2}},
        {"mlp_ratio", 2}, {"in_channels", 1}, {"output_channels", 1}, {"num_classes", 3}, {"context_features", 8}},
       {2, 1, 8, 8}, 8},
      {"hybrid_dit", with(dit, {{"ssm_state_dim", 4}, {"num_layers", 4}}), {2, 1, 8, 8}},
      {"video_dit", dit, {2, 1, 3, 8, 8}},
      {"unet_3d", with(unet, {{"temporal_heads", 2}}), {2, 1, 3, 8, 8}},
  };
}

dew::Conditioning conditioning(const Tiny& t) {
  dew::Conditioning c;
  c.labels = torch::tensor({0, 3}, at::kLong);  // a class and the null class
  if (t.context > 0) {
    c.context = torch::randn({2, 5, t.context});
    c.context_mask = torch::tensor({1, 1, 1, 0, 0, 1, 1, 1, 1, 1}, at::kBool).view({2, 5});
  }
  return c;
}

TEST(AllBackbones, EveryDiffusionArchitectureIsRegisteredWithItsFields) {
  const auto& reg = dew::models::registry();
  for (const auto& t : tiny_models()) {
    ASSERT_TRUE(reg.contains(t.arch)) << t.arch;
    std::set<std::string> names;
    for (const auto& f : reg.info(t.arch).fields) names.insert(f.name);
    for (const char* common : {"dtype", "attention_impl", "remat", "in_channels", "output_channels", "num_classes",
                               "context_features"})
      EXPECT_TRUE(names.count(common)) << t.arch << " lacks the common field " << common;
  }
}

TEST(AllBackbones, EachLoadsItsOwnCheckpointAndTrains) {
  dew::test::TempDir dir("all_backbones");
  for (const auto& t : tiny_models()) {
    SCOPED_TRACE(t.arch);
    torch::manual_seed(1);
    auto a = dew::models::build(t.arch, t.fields);
    dew::test::randomize(*a, 0.05);  // off the zero initialisation, so outputs tell weights apart
    auto batch = dew::test::fixed_batch(t.input, 2);
    batch.cond = conditioning(t);
    torch::NoGradGuard ng;
    a->eval();
    const auto ya = a->forward(batch.x_t, batch.t, batch.cond);
    ASSERT_EQ(ya.sizes(), batch.x_t.sizes());
    ASSERT_TRUE(torch::isfinite(ya).all().item<bool>());
    // saved as model.safetensors is, rebuilt from the recorded config, loaded: the same function
    const std::string file = dir.file(t.arch + ".safetensors");
    dew::io::save_safetensors(file, dew::training::module_state(*a), {});
    torch::manual_seed(2);
    auto b = dew::models::build(a->config());
    dew::io::load_weights(*b, dew::io::WeightSource::open(file));
    b->eval();
    EXPECT_TRUE(b->forward(batch.x_t, batch.t, batch.cond).equal(ya));
  }
}

TEST(AllBackbones, EachFitsOneBatchInAFewSteps) {
  // A short smoke of the training path for every architecture (the per-family tests overfit >= 10x).
  for (const auto& t : tiny_models()) {
    SCOPED_TRACE(t.arch);
    torch::manual_seed(3);
    auto m = dew::models::build(t.arch, t.fields);
    auto batch = dew::test::fixed_batch(t.input, 4);
    batch.cond = conditioning(t);
    auto [first, last] = dew::test::overfit(*m, batch, 30, 3e-3);
    EXPECT_LT(last, first) << t.arch << ": " << first << " -> " << last;
  }
}

TEST(AllBackbones, ScanOrdersAreEquivariantWhereTheDesignSaysSo) {
  // Attention is permutation-equivariant, the position table is indexed by each token's true grid cell
  // and unpatchify applies the inverse permutation; RoPE is the identity under hilbert and zigzag. So a
  // hilbert model and a zigzag model with the same weights compute the same function, while raster
  // (RoPE over the sequence index) and an S5 mixer (a recurrence along the scan) see the order.
  const json dit = {{"patch_size", 2}, {"emb_features", 32}, {"num_layers", 2}, {"num_heads", 2},
                    {"in_channels", 1}, {"output_channels", 1}};
  auto with = [](json base, const json& extra) {
    base.update(extra);
    return base;
  };
  struct Case {
    std::string arch;
    json fields;
    bool order_free;  // hilbert == zigzag expected
  };
  const std::vector<Case> cases = {
      {"simple_dit", dit, true},
      {"simple_udit", dit, true},
      {"hybrid_dit", with(dit, {{"ssm_attention_ratio", "all-attn"}}), true},
      {"hybrid_dit", with(dit, {{"ssm_attention_ratio", "all-ssm"}, {"ssm_state_dim", 4}}), false},
  };
  auto batch = dew::test::fixed_batch({2, 1, 8, 12}, 5);
  torch::NoGradGuard ng;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.arch + " " + c.fields.dump());
    torch::manual_seed(4);
    auto hil = dew::models::build(c.arch, with(c.fields, {{"scan_order", "hilbert"}}));
    dew::test::randomize(*hil, 0.1);
    auto zig = dew::models::build(c.arch, with(c.fields, {{"scan_order", "zigzag"}}));
    auto ras = dew::models::build(c.arch, with(c.fields, {{"scan_order", "raster"}}));
    dew::test::copy_parameters(*hil, *zig);
    dew::test::copy_parameters(*hil, *ras);
    const auto yh = hil->forward(batch.x_t, batch.t, {});
    const double scale = yh.abs().max().item<double>();
    ASSERT_GT(scale, 1e-3);
    const double dz = dew::test::max_diff(yh, zig->forward(batch.x_t, batch.t, {}));
    const double dr = dew::test::max_diff(yh, ras->forward(batch.x_t, batch.t, {}));
    if (c.order_free) {
      EXPECT_LT(dz, 1e-5 * (1 + scale)) << "hilbert and zigzag must agree";
    } else {
      EXPECT_GT(dz, 1e-4) << "an S5 mixer must see the scan order";
    }
    EXPECT_GT(dr, 1e-4) << "raster applies RoPE over the sequence index, so it differs";
  }
}

TEST(AllBackbones, AMismatchedCheckpointIsAClearError) {
  auto tiny = tiny_models();
  auto small = dew::models::build(tiny[0].arch, tiny[0].fields);
  json bigger = tiny[0].fields;
  bigger["emb_features"] = 64;
  auto big = dew::models::build(tiny[0].arch, bigger);
  const auto msg = dew::test::error_of(
      [&] { dew::io::load_weights(*big, dew::io::WeightSource::of_tensors(dew::training::module_state(*small), "small.safetensors")); });
  EXPECT_NE(msg.find("small.safetensors"), std::string::npos) << msg;
}

}  // namespace
