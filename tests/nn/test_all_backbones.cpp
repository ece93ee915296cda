// Every registered diffusion backbone, through the paths a run uses: built from its {architecture,
// fields} record, saved to safetensors and loaded into a fresh build (its own checkpoint), listed with
// all its fields, trained a few steps on one batch, and refusing a mismatched checkpoint.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <set>

#include "dew/core/rng.h"
#include "dew/io/safetensors.h"
#include "dew/io/weights.h"
#include "dew/nn/attention.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/nn/roles.h"
#include "dew/nn/text_encoder.h"
#include "dew/training/trainer.h"
#include "tests/nn/backbone_checks.h"
#include "tests/test_util.h"

namespace {

using dew::json;

// Every registered family with the given role, with its tiny configuration from the registry.
struct Tiny {
  std::string arch;
  json fields;
  std::vector<int64_t> input;
  int64_t context = 0;
  int64_t pooled = 0;
  std::vector<std::string> extra = {};
};

// Every family name: the denoisers', the language models' and the text encoders' registries.
std::vector<std::string> family_names() {
  // The family table against every role registry: one entry per registered model, none missing.
  auto names = dew::models::registry().names();
  for (const auto& n : dew::models::language_models().names()) names.push_back(n);
  for (const auto& n : dew::text_encoders::registry().names()) names.push_back(n);
  for (const auto& n : dew::models::token_encoders().names()) names.push_back(n);
  for (const auto& n : dew::models::token_predictors().names()) names.push_back(n);
  for (const auto& n : dew::models::autoencoders().names()) names.push_back(n);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, dew::models::family_names());
  return names;
}

// The tiny configurations of a role; with `variants`, each family's variants too (other resolutions,
// channel counts, structural options, text), for the checks that only build and run forward / backward.
std::vector<Tiny> tiny_models(dew::models::Role role = dew::models::Role::kDenoiser, bool variants = false) {
  std::vector<Tiny> out;
  for (const auto& name : family_names()) {
    const auto& f = dew::models::family(name);
    if (f.role != role) continue;
    out.push_back({name, f.tiny.fields, f.tiny.input, f.tiny.context, f.tiny.pooled, f.tiny.extra});
    if (variants)
      for (const auto& v : f.variants) out.push_back({name, v.fields, v.input, v.context, v.pooled, v.extra});
  }
  return out;
}

bool has_field(const std::string& arch, const std::string& field) {
  for (const auto& f : dew::models::registry().info(arch).fields)
    if (f.name == field) return true;
  return false;
}

dew::Conditioning conditioning(const Tiny& t) {
  dew::Conditioning c;
  // a class and the null class, for models with labels
  if (t.fields.value("num_classes", 0) > 0) c.labels = torch::tensor({0, 3}, at::kLong);
  if (t.context > 0) {
    c.context = torch::randn({2, 5, t.context});
    c.context_mask = torch::tensor({1, 1, 1, 0, 0, 1, 1, 1, 1, 1}, at::kBool).view({2, 5});
  }
  if (t.pooled > 0) c.pooled = torch::randn({2, t.pooled});
  for (const auto& name : t.extra) c.extra[name] = torch::rand({2}) * 4;  // e.g. Flux dev's guidance scale
  return c;
}

// The output shape of a denoiser on t.input: output_channels channels.
std::vector<int64_t> output_shape(const Tiny& t) {
  std::vector<int64_t> shape = t.input;
  shape[1] = t.fields.value("output_channels", shape[1]);
  return shape;
}

TEST(AllBackbones, EveryFamilyHasATinyConfigurationThatBuilds) {
  // The suite runs what the registry holds: a family without a tiny configuration fails here.
  size_t denoisers = 0;
  for (const auto& name : family_names()) {
    SCOPED_TRACE(name);
    const dew::models::Family* f = nullptr;
    EXPECT_EQ(dew::test::error_of([&] { f = &dew::models::family(name); }), "");
    if (!f) continue;
    if (f->role == dew::models::Role::kDenoiser) EXPECT_NO_THROW(dew::models::build(name, f->tiny.fields));
    else if (f->role == dew::models::Role::kLanguageModel)
      EXPECT_NO_THROW(dew::models::build_language_model({{"architecture", name}, {"fields", f->tiny.fields}}));
    else if (f->role == dew::models::Role::kTokenEncoder)
      EXPECT_NO_THROW(dew::models::build_token_encoder({{"architecture", name}, {"fields", f->tiny.fields}}));
    else if (f->role == dew::models::Role::kTokenPredictor)
      EXPECT_NO_THROW(dew::models::build_token_predictor({{"architecture", name}, {"fields", f->tiny.fields}}));
    else if (f->role == dew::models::Role::kAutoencoder)
      EXPECT_NO_THROW(dew::models::build_autoencoder({{"architecture", name}, {"fields", f->tiny.fields}}));
    else EXPECT_NO_THROW(dew::text_encoders::build(name, f->tiny.fields));
    EXPECT_FALSE(f->tiny.input.empty());
    denoisers += f->role == dew::models::Role::kDenoiser;
  }
  EXPECT_GE(denoisers, 9u);
}

TEST(AllBackbones, DocsBackbonesNamesEveryFamily) {
  std::ifstream in(std::string(DEW_SOURCE_DIR) + "/docs/backbones.md");
  ASSERT_TRUE(in.good()) << "docs/backbones.md is missing";
  const std::string page((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const auto& name : family_names())
    EXPECT_NE(page.find("| `" + name + "` |"), std::string::npos) << name << " has no row in docs/backbones.md";
}

TEST(AllBackbones, EveryDiffusionArchitectureIsRegisteredWithItsFields) {
  const auto& reg = dew::models::registry();
  for (const auto& t : tiny_models()) {
    ASSERT_TRUE(reg.contains(t.arch)) << t.arch;
    std::set<std::string> names;
    for (const auto& f : reg.info(t.arch).fields) names.insert(f.name);
    for (const char* common :
         {"dtype", "attention_impl", "remat", "in_channels", "output_channels", "num_classes", "context_features"})
      EXPECT_TRUE(names.count(common)) << t.arch << " lacks the common field " << common;
  }
}

TEST(AllBackbones, EachLoadsItsOwnCheckpointAndTrains) {
  dew::test::TempDir dir("all_backbones");
  for (const auto& t : tiny_models(dew::models::Role::kDenoiser, true)) {
    SCOPED_TRACE(t.arch + " " + t.fields.dump());
    torch::manual_seed(1);
    auto a = dew::models::build(t.arch, t.fields);
    dew::test::randomize(*a, 0.05);  // off the zero initialisation, so outputs tell weights apart
    auto batch = dew::test::fixed_batch(t.input, 2);
    batch.cond = conditioning(t);
    torch::NoGradGuard ng;
    a->eval();
    const auto ya = a->forward(batch.x_t, batch.t, batch.cond);
    ASSERT_EQ(ya.sizes().vec(), output_shape(t));
    ASSERT_TRUE(torch::isfinite(ya).all().item<bool>());
    EXPECT_GT(ya.abs().max().item<double>(), 0.0);  // off its initialisation, no longer zero
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
  const json dit = {{"patch_size", 2}, {"emb_features", 32}, {"num_layers", 2},
                    {"num_heads", 2},  {"in_channels", 1},   {"output_channels", 1}};
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

TEST(AllBackbones, TheRecordRebuildsTheSameModel) {
  // run.json's {architecture, fields} record: every field with its default, and it rebuilds the same tree
  // and, with the same weights, the same function.
  for (const auto& t : tiny_models(dew::models::Role::kDenoiser, true)) {
    SCOPED_TRACE(t.arch + " " + t.fields.dump());
    auto m = dew::models::build(t.arch, t.fields);
    const json rec = m->config();
    // every field given, as given (nested objects, e.g. unet_2d_condition's stages, gain their defaults)
    for (auto it = t.fields.begin(); it != t.fields.end(); ++it)
      if (it.value().dump().find('{') == std::string::npos) {
        EXPECT_EQ(rec["fields"][it.key()], it.value()) << it.key();
      }
    EXPECT_EQ(rec["architecture"], t.arch);
    EXPECT_EQ(rec["fields"].size(), dew::models::registry().info(t.arch).fields.size());
    auto again = dew::models::build(json::parse(rec.dump()));
    EXPECT_EQ(again->config(), rec);
    EXPECT_EQ(dew::test::param_shapes(*m), dew::test::param_shapes(*again));
    dew::test::randomize(*m, 0.05);
    dew::test::copy_parameters(*m, *again);
    auto batch = dew::test::fixed_batch(t.input, 16);
    batch.cond = conditioning(t);
    torch::NoGradGuard ng;
    EXPECT_TRUE(m->forward(batch.x_t, batch.t, batch.cond).equal(again->forward(batch.x_t, batch.t, batch.cond)));
  }
}

TEST(AllBackbones, OutputsAreExactlyZeroAtInitWhereTheFamilyPromises) {
  // Zero-initialised output heads (adaLN-Zero's final layer, the unets' conv_out): a fresh model predicts 0.
  size_t checked = 0;
  for (const auto& name : dew::models::registry().names()) {
    const auto& f = dew::models::family(name);
    std::vector<dew::models::TinyConfig> configs{f.tiny};
    configs.insert(configs.end(), f.variants.begin(), f.variants.end());
    for (const auto& c : configs) {
      if (!c.zero_output_at_init) continue;
      SCOPED_TRACE(name + " " + c.fields.dump());
      auto m = dew::models::build(name, c.fields);
      auto batch = dew::test::fixed_batch(c.input, 17);
      batch.cond = conditioning({name, c.fields, c.input, c.context, c.pooled, c.extra});
      torch::NoGradGuard ng;
      const auto y = m->forward(batch.x_t, batch.t, batch.cond);
      ASSERT_EQ(y.sizes().vec(), output_shape({name, c.fields, c.input, c.context}));
      EXPECT_EQ(y.scalar_type(), at::kFloat);
      EXPECT_EQ(y.abs().max().item<double>(), 0.0);
      ++checked;
    }
  }
  EXPECT_GE(checked, 30u);
}

TEST(AllBackbones, GradientsReachEveryParameter) {
  for (const auto& t : tiny_models(dew::models::Role::kDenoiser, true)) {
    SCOPED_TRACE(t.arch + " " + t.fields.dump());
    torch::manual_seed(6);
    auto m = dew::models::build(t.arch, t.fields);
    dew::test::randomize(*m, 0.05);  // off the zero-initialised layers, which block gradients at the start
    auto batch = dew::test::fixed_batch(t.input, 7);
    batch.cond = conditioning(t);
    const auto none = dew::test::params_without_gradient(*m, batch);
    EXPECT_TRUE(none.empty()) << t.arch << ": no gradient reaches " << (none.empty() ? "" : none.front()) << " and "
                              << (none.empty() ? 0 : none.size() - 1) << " more";
  }
}

TEST(AllBackbones, RematChangesNeitherOutputsNorGradients) {
  for (const auto& t : tiny_models(dew::models::Role::kDenoiser, true)) {
    SCOPED_TRACE(t.arch + " " + t.fields.dump());
    torch::manual_seed(8);
    dew::test::expect_remat_matches(t.arch, t.fields, conditioning(t), t.input);
  }
}

TEST(AllBackbones, EveryAttentionImplAgreesWithSmallChunks) {
  // Blocks of 3 query rows: every tiny model's sequences are longer, so "chunked" really splits.
  dew::nn::AttentionChunkRowsScope small_blocks(3);
  for (const auto& t : tiny_models()) {
    if (!has_field(t.arch, "attention_impl")) continue;
    SCOPED_TRACE(t.arch);
    torch::manual_seed(9);
    json f = t.fields;
    f["attention_impl"] = "reference";
    auto ref = dew::models::build(t.arch, f);
    dew::test::randomize(*ref, 0.05);
    auto batch = dew::test::fixed_batch(t.input, 10);
    batch.cond = conditioning(t);
    torch::NoGradGuard ng;
    const auto y = ref->forward(batch.x_t, batch.t, batch.cond);
    for (const auto& impl : dew::nn::attention_impls()) {
      if (impl == "reference") continue;  // y itself
      f["attention_impl"] = impl;
      auto other = dew::models::build(t.arch, f);
      dew::test::copy_parameters(*ref, *other);
      const double d = dew::test::max_diff(y, other->forward(batch.x_t, batch.t, batch.cond));
      EXPECT_LT(d, 1e-5 * (1 + y.abs().max().item<double>())) << impl;
    }
  }
}

TEST(AllBackbones, TheParameterTreeDoesNotDependOnDtypeAttentionOrRemat) {
  for (const auto& t : tiny_models()) {
    SCOPED_TRACE(t.arch);
    const auto base = dew::test::param_shapes(*dew::models::build(t.arch, t.fields));
    for (const json& change :
         {json{{"dtype", "bfloat16"}}, json{{"attention_impl", "chunked"}}, json{{"remat", true}}}) {
      json f = t.fields;
      f.update(change);
      EXPECT_EQ(dew::test::param_shapes(*dew::models::build(t.arch, f)), base) << change.dump();
    }
  }
}

TEST(AllBackbones, TheSameSeedBuildsTheSameModelAndOutput) {
  for (const auto& t : tiny_models()) {
    SCOPED_TRACE(t.arch);
    std::vector<at::Tensor> outs;
    std::vector<std::vector<at::Tensor>> params;
    for (int rep = 0; rep < 2; ++rep) {
      dew::rng::DefaultGeneratorScope init(42, 0, "init");
      auto m = dew::models::build(t.arch, t.fields);
      dew::test::randomize(*m, 0.05);
      auto batch = dew::test::fixed_batch(t.input, 11);
      batch.cond = conditioning(t);
      torch::NoGradGuard ng;
      outs.push_back(m->forward(batch.x_t, batch.t, batch.cond));
      params.push_back(m->parameters());
    }
    EXPECT_TRUE(outs[0].equal(outs[1]));
    for (size_t i = 0; i < params[0].size(); ++i) EXPECT_TRUE(params[0][i].equal(params[1][i])) << i;
  }
}

TEST(AllBackbones, LanguageModelsTrainAndLoadTheirOwnCheckpoint) {
  dew::test::TempDir dir("all_lms");
  const auto lms = tiny_models(dew::models::Role::kLanguageModel);
  ASSERT_FALSE(lms.empty());
  for (const auto& t : lms) {
    SCOPED_TRACE(t.arch);
    torch::manual_seed(12);
    auto m = dew::models::build_language_model({{"architecture", t.arch}, {"fields", t.fields}});
    const auto& o = m->options;
    const at::Tensor ids = torch::randint(0, o.vocab_size(), {t.input[0], t.input[1]});
    const at::Tensor logits = m->forward_tokens(ids);
    ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{t.input[0], t.input[1], o.vocab_size()}));
    (logits * torch::randn_like(logits)).sum().backward();
    for (const auto& kv : m->named_parameters()) {
      ASSERT_TRUE(kv.value().grad().defined()) << kv.key();
      EXPECT_GT(kv.value().grad().abs().max().item<double>(), 0.0) << kv.key();
    }
    const std::string file = dir.file(t.arch + ".safetensors");
    dew::io::save_safetensors(file, dew::training::module_state(*m));
    torch::manual_seed(13);
    auto back = dew::models::build_language_model(m->config());
    dew::io::load_weights(*back, dew::io::WeightSource::open(file));
    torch::NoGradGuard ng;
    EXPECT_TRUE(back->forward_tokens(ids).equal(m->forward_tokens(ids)));
  }
}

TEST(AllBackbones, ConditioningInputsAFamilyDoesNotTakeAreRefused) {
  for (const auto& t : tiny_models()) {
    SCOPED_TRACE(t.arch);
    auto m = dew::models::build(t.arch, t.fields);
    auto batch = dew::test::fixed_batch(t.input, 14);
    batch.cond = conditioning(t);
    batch.cond.extra["guidance"] = torch::ones({t.input[0]});
    EXPECT_NE(dew::test::error_of([&] {
                m->forward(batch.x_t, batch.t, batch.cond);
              }).find(t.arch + ": unknown conditioning input \"guidance\""),
              std::string::npos);
    batch.cond.extra.clear();
    if (m->takes_pooled()) continue;  // pooled text is one of its inputs (SD3, Flux)
    batch.cond.pooled = torch::ones({t.input[0], 4});
    EXPECT_NE(dew::test::error_of([&] { m->forward(batch.x_t, batch.t, batch.cond); }).find("takes no pooled"),
              std::string::npos);
  }
}

TEST(AllBackbones, TextEncodersEncodeTrainAndLoadTheirOwnCheckpoint) {
  dew::test::TempDir dir("all_text_encoders");
  const auto encoders = tiny_models(dew::models::Role::kTextEncoder);
  ASSERT_GE(encoders.size(), 2u);
  for (const auto& t : encoders) {
    SCOPED_TRACE(t.arch);
    torch::manual_seed(15);
    auto enc = dew::text_encoders::build(t.arch, t.fields);
    {
      torch::NoGradGuard ng;  // off the initialisation, so the round trip below tells weights apart
      for (auto& p : enc->parameters()) p.add_(torch::randn_like(p) * 0.05);
    }
    const int64_t B = t.input[0], L = t.input[1], D = enc->features();
    at::Tensor ids = torch::randint(1, 30, {B, L});
    at::Tensor mask = torch::ones({B, L}, at::kBool);
    mask[B - 1].slice(0, L / 2).fill_(false);  // the last caption is padded
    ids.masked_fill_(mask.logical_not(), 0);
    auto e = enc->forward(ids, mask);
    ASSERT_EQ(e.context.sizes(), (std::vector<int64_t>{B, L, D}));
    ASSERT_EQ(e.mask.sizes(), (std::vector<int64_t>{B, L}));
    ASSERT_EQ(e.pooled.sizes(), (std::vector<int64_t>{B, D}));
    ((e.context * torch::randn_like(e.context)).sum() + (e.pooled * torch::randn_like(e.pooled)).sum()).backward();
    for (const auto& kv : enc->named_parameters()) {
      ASSERT_TRUE(kv.value().grad().defined()) << kv.key();
      EXPECT_GT(kv.value().grad().abs().max().item<double>(), 0.0) << kv.key();
    }
    auto back = dew::text_encoders::build(enc->config());
    dew::io::load_weights(*back, dew::io::WeightSource::of_tensors(dew::training::module_state(*enc), t.arch));
    torch::NoGradGuard ng;
    EXPECT_TRUE(back->forward(ids, mask).context.equal(enc->forward(ids, mask).context));
  }
}

// One training step's worth of checks for a token encoder or predictor: every parameter gets a gradient,
// the record rebuilds the same function from the module's own checkpoint.
template <class Build, class Forward>
void check_token_family(const Tiny& t, Build build, Forward forward) {
  SCOPED_TRACE(t.arch);
  torch::manual_seed(16);
  auto m = build(json{{"architecture", t.arch}, {"fields", t.fields}});
  EXPECT_EQ(m->config()["architecture"], t.arch);
  {
    torch::NoGradGuard ng;
    for (auto& p : m->parameters()) p.add_(torch::randn_like(p) * 0.05);
  }
  const at::Tensor y = forward(*m);
  ASSERT_TRUE(torch::isfinite(y).all().item<bool>());
  (y * torch::randn_like(y)).sum().backward();
  torch::nn::Module& module = *m;
  for (const auto& kv : module.named_parameters()) {
    ASSERT_TRUE(kv.value().grad().defined()) << kv.key();
    EXPECT_GT(kv.value().grad().abs().max().item<double>(), 0.0) << kv.key();
  }
  auto back = build(json::parse(m->config().dump()));
  EXPECT_EQ(back->config(), m->config());
  dew::io::load_weights(*back, dew::io::WeightSource::of_tensors(dew::training::module_state(module), t.arch));
  torch::NoGradGuard ng;
  EXPECT_TRUE(forward(*back).equal(forward(*m)));
}

TEST(AllBackbones, TokenEncodersAndPredictorsTrainAndLoadTheirOwnCheckpoint) {
  const auto encoders = tiny_models(dew::models::Role::kTokenEncoder);
  const auto predictors = tiny_models(dew::models::Role::kTokenPredictor);
  ASSERT_GE(encoders.size(), 2u);
  ASSERT_GE(predictors.size(), 1u);
  for (const auto& t : encoders) {
    const at::Tensor x = torch::randn(t.input);
    check_token_family(t, dew::models::build_token_encoder, [&](dew::TokenEncoderImpl& e) {
      const int64_t n = e.grid().tokens();
      const at::Tensor keep = torch::arange(1, n, 2).unsqueeze(0).repeat({t.input[0], 1});
      EXPECT_EQ(e.forward(x).size(1), n);
      return e.forward(x, keep);
    });
  }
  for (const auto& t : predictors) {
    const int64_t M = t.input[0], B = t.input[1], Kc = t.input[2], Kt = t.input[3];
    const int64_t width = t.fields.at("encoder_features");
    const at::Tensor ctx = torch::randn({B, Kc, width});
    const at::Tensor ctx_idx = torch::arange(Kc).unsqueeze(0).repeat({B, 1});
    const at::Tensor tgt = (torch::arange(Kt) + Kc).view({1, 1, Kt}).repeat({M, B, 1});
    check_token_family(t, dew::models::build_token_predictor, [&](dew::TokenPredictorImpl& p) {
      auto y = p.forward(ctx, ctx_idx, tgt);
      EXPECT_EQ(y.sizes(), (std::vector<int64_t>{M * B, Kt, width}));
      return y;
    });
  }
}

TEST(AllBackbones, AutoencodersEncodeDecodeTrainAndLoadTheirOwnCheckpoint) {
  // Every autoencoder family: the posterior and the reconstruction have the promised shapes, gradients of
  // reconstruction + KL reach every parameter, remat changes nothing, the same seed builds the same model,
  // the record rebuilds it from its own checkpoint, to_latent inverts, and an imported family translates a
  // reference config.json (an empty one: the reference's defaults) and has a key map for its checkpoints.
  const auto autoencoders = tiny_models(dew::models::Role::kAutoencoder);
  ASSERT_GE(autoencoders.size(), 1u);
  for (const auto& t : autoencoders) {
    SCOPED_TRACE(t.arch);
    const json record = {{"architecture", t.arch}, {"fields", t.fields}};
    auto build = [&](const json& r) {
      dew::rng::DefaultGeneratorScope init(17, 0, "init");
      auto m = dew::models::build_autoencoder(r);
      torch::NoGradGuard ng;  // off the initialisation, so the round trip below tells weights apart
      for (auto& p : m->parameters()) p.add_(torch::randn_like(p) * 0.05);
      return m;
    };
    auto m = build(record);
    EXPECT_EQ(m->config()["architecture"], t.arch);
    EXPECT_EQ(m->config()["fields"].size(), dew::models::autoencoders().info(t.arch).fields.size());
    torch::manual_seed(18);
    const at::Tensor x = torch::rand(t.input) * 2 - 1;
    auto gen = at::detail::createCPUGenerator(19);
    const dew::DiagonalGaussian q = m->encode(x);
    ASSERT_EQ(q.mean.dim(), 4);
    EXPECT_EQ(q.mean.size(0), t.input[0]);
    EXPECT_EQ(t.input[2] % q.mean.size(2), 0);
    EXPECT_EQ(t.input[3] % q.mean.size(3), 0);
    const at::Tensor y = m->decode(q.sample(gen));
    ASSERT_EQ(y.sizes(), x.sizes());
    ASSERT_TRUE(torch::isfinite(y).all().item<bool>());
    const at::Tensor r = torch::randn_like(y);
    ((y * r).sum() + q.kl().sum()).backward();
    std::map<std::string, at::Tensor> grads;
    torch::nn::Module& module = *m;
    for (const auto& kv : module.named_parameters()) {
      ASSERT_TRUE(kv.value().grad().defined()) << kv.key();
      EXPECT_GT(kv.value().grad().abs().max().item<double>(), 0.0) << kv.key();
      grads[kv.key()] = kv.value().grad().clone();
    }
    // remat: the same outputs and gradients
    json with_remat = t.fields;
    with_remat["remat"] = true;
    auto rm = build({{"architecture", t.arch}, {"fields", with_remat}});
    rm->train();
    auto gen2 = at::detail::createCPUGenerator(19);
    const dew::DiagonalGaussian q2 = rm->encode(x);
    const at::Tensor y2 = rm->decode(q2.sample(gen2));
    EXPECT_TRUE(y2.allclose(y, 1e-6, 1e-6));
    ((y2 * r).sum() + q2.kl().sum()).backward();
    torch::nn::Module& rmodule = *rm;
    for (const auto& kv : rmodule.named_parameters())
      EXPECT_TRUE(kv.value().grad().allclose(grads[kv.key()], 1e-5, 1e-6)) << kv.key();
    // the same seed, the same model; its own checkpoint through the record
    auto again = build(json::parse(m->config().dump()));
    EXPECT_EQ(again->config(), m->config());
    torch::NoGradGuard ng;
    m->eval();
    again->eval();
    EXPECT_TRUE(again->decode(again->encode(x).mean).equal(m->decode(m->encode(x).mean)));
    auto back = dew::models::build_autoencoder(m->config());
    dew::io::load_weights(*back, dew::io::WeightSource::of_tensors(dew::training::module_state(module), t.arch));
    back->eval();
    EXPECT_TRUE(back->decode(back->encode(x).mean).equal(m->decode(m->encode(x).mean)));
    EXPECT_TRUE(m->from_latent(m->to_latent(q.mean)).allclose(q.mean, 1e-5, 1e-6));
    const auto& f = dew::models::family(t.arch);
    EXPECT_EQ(bool(f.from_reference_config), bool(f.reference_key_map));
    if (f.from_reference_config) {
      const json fields = dew::models::fields_from_reference_config(t.arch, json::object());
      EXPECT_NO_THROW(dew::models::build_autoencoder({{"architecture", t.arch}, {"fields", fields}}));
    }
  }
}

TEST(AllBackbones, AMismatchedCheckpointIsAClearError) {
  const auto& tiny = dew::models::family("simple_dit").tiny;
  auto small = dew::models::build("simple_dit", tiny.fields);
  json bigger = tiny.fields;
  bigger["emb_features"] = 64;
  auto big = dew::models::build("simple_dit", bigger);
  const auto msg = dew::test::error_of([&] {
    dew::io::load_weights(*big,
                          dew::io::WeightSource::of_tensors(dew::training::module_state(*small), "small.safetensors"));
  });
  EXPECT_NE(msg.find("small.safetensors"), std::string::npos) << msg;
}

}  // namespace
