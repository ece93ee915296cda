// LoRA adapters (dew/nn/lora.h) against the installed peft (tests/golden/lora, tests/golden/lora_reference.py):
// forward, adapter gradients and merged weights by the golden rule; merge / unmerge round trip; PEFT's
// initialisation; target matching; the PEFT and diffusers files; refused files leave the model as it was; routing
// through a real family.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "dew/core/error.h"
#include "dew/io/safetensors.h"
#include "dew/nn/attention.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/nn/blocks.h"
#include "dew/nn/lora.h"
#include "tests/golden_util.h"
#include "tests/test_util.h"

namespace {

using at::Tensor;
using dew::nn::LoraOptions;
using dew::test::error_of;
using dew::test::expect_close_f64;
using dew::test::expect_golden;

// The golden script's LoraTiny model, its layers called through nn::conv / nn::dense as the families do.
struct LoraTinyAttnImpl : torch::nn::Module {
  LoraTinyAttnImpl() {
    q_proj = register_module("q_proj", torch::nn::Linear(8, 16));
    v_proj = register_module("v_proj", torch::nn::Linear(torch::nn::LinearOptions(8, 16).bias(false)));
  }
  torch::nn::Linear q_proj{nullptr}, v_proj{nullptr};
};
TORCH_MODULE(LoraTinyAttn);

struct LoraTinyImpl : torch::nn::Module {
  LoraTinyImpl() {
    conv_in = register_module("conv_in", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
    conv_down = register_module("conv_down", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).stride(2).padding(1)));
    proj = register_module("proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 1)));
    attn = register_module("attn", LoraTinyAttn());
    out = register_module("out", torch::nn::Linear(16, 4));
  }
  Tensor forward(const Tensor& x) {  // [B, 3, 8, 8] -> [B, 16, 4]
    Tensor h = at::silu(dew::nn::conv(x, conv_in));
    h = at::silu(dew::nn::conv(h, conv_down));
    h = dew::nn::conv(h, proj);
    Tensor t = h.flatten(2).transpose(1, 2);
    t = at::silu(dew::nn::dense(t, attn->q_proj)) * dew::nn::dense(t, attn->v_proj);
    return dew::nn::dense(t, out);
  }
  torch::nn::Conv2d conv_in{nullptr}, conv_down{nullptr}, proj{nullptr};
  LoraTinyAttn attn{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(LoraTiny);

const std::map<std::string, Tensor>& lora_golden() {
  static const auto g = dew::test::golden("lora/lora.safetensors");
  return g;
}

std::string golden_dir(const std::string& name) { return std::string(DEW_SOURCE_DIR) + "/tests/golden/lora/" + name; }

// The base model of the golden file in `dt`.
LoraTiny base_model(at::ScalarType dt) {
  LoraTiny m;
  torch::NoGradGuard no_grad;
  for (auto& p : m->named_parameters()) p.value().copy_(lora_golden().at("w." + p.key()));
  m->to(dt);
  return m;
}

LoraOptions case_options(const std::string& c) {
  if (c == "list") return LoraOptions().rank(4).alpha(8).target_modules({"q_proj", "v_proj", "conv_in", "proj", "out"});
  return LoraOptions().rank(2).alpha(3).use_rslora(true).target_regex(".*(conv_down|v_proj)");
}

// The golden case's adapted model in `dt`: apply_lora with the case's config, then its adapter weights.
LoraTiny case_model(const std::string& c, at::ScalarType dt) {
  LoraTiny m = base_model(dt);
  dew::nn::apply_lora(*m, case_options(c));
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : dew::nn::lora_parameters(*m)) p.copy_(lora_golden().at(c + "." + name));
  return m;
}

// ---- target matching ----

TEST(Lora, TargetMatchingFollowsPeft) {
  const auto list = LoraOptions().target_modules({"q_proj", "proj"});
  EXPECT_TRUE(dew::nn::lora_target_matches(list, "q_proj"));
  EXPECT_TRUE(dew::nn::lora_target_matches(list, "layers.0.self_attn.q_proj"));
  EXPECT_TRUE(dew::nn::lora_target_matches(list, "a.proj"));
  EXPECT_FALSE(
      dew::nn::lora_target_matches(LoraOptions().target_modules({"proj"}), "attn.q_proj"));  // suffix after "."
  EXPECT_FALSE(dew::nn::lora_target_matches(list, "q_proj.lora_A"));
  const auto re = LoraOptions().target_regex(".*(conv_down|v_proj)");
  EXPECT_TRUE(dew::nn::lora_target_matches(re, "attn.v_proj"));
  EXPECT_TRUE(dew::nn::lora_target_matches(re, "conv_down"));
  EXPECT_FALSE(dew::nn::lora_target_matches(re, "attn.v_proj.x"));  // a full match, as re.fullmatch
  EXPECT_DOUBLE_EQ(dew::nn::lora_scale(LoraOptions().rank(4).alpha(8)), 2.0);
  EXPECT_DOUBLE_EQ(dew::nn::lora_scale(LoraOptions().rank(4).alpha(8).use_rslora(true)), 4.0);
}

TEST(Lora, ApplyChoosesTheGoldenTargetsAndFreezesTheBase) {
  LoraTiny m = base_model(at::kFloat);
  const auto r = dew::nn::apply_lora(*m, case_options("list"));
  EXPECT_EQ(r.targets, (std::vector<std::string>{"conv_in", "proj", "attn.q_proj", "attn.v_proj", "out"}));
  int64_t trainable = 0;
  for (const auto& p : m->named_parameters()) {
    const bool adapter = p.key().find("lora_") != std::string::npos;
    EXPECT_EQ(p.value().requires_grad(), adapter) << p.key();
    if (p.value().requires_grad()) trainable += p.value().numel();
  }
  EXPECT_EQ(trainable, r.trainable);
  // conv_in: A [4, 3, 3, 3] + B [8, 4, 1, 1]; proj: [4, 8, 1, 1] + [8, 4, 1, 1]; q/v: [4, 8] + [16, 4];
  // out: [4, 16] + [4, 4]
  EXPECT_EQ(r.trainable, (108 + 32) + (32 + 32) + 2 * (32 + 64) + (64 + 16));
  const auto regex = dew::nn::apply_lora(*base_model(at::kFloat), case_options("regex"));
  EXPECT_EQ(regex.targets, (std::vector<std::string>{"conv_down", "attn.v_proj"}));
}

// ---- against peft ----

void check_case(const std::string& c) {
  const auto& g = lora_golden();
  const Tensor x = g.at("x"), cot = g.at("g");
  std::map<at::ScalarType, LoraTiny> models{{at::kFloat, case_model(c, at::kFloat)},
                                            {at::kDouble, case_model(c, at::kDouble)}};
  for (auto& [dt, m] : models) {
    const Tensor y = m->forward(x.to(dt));
    (y * cot.to(dt)).sum().backward();
    if (dt == at::kFloat) expect_golden(c + " y", y, g.at(c + ".y_f32"), g.at(c + ".y_f64"));
    else expect_close_f64(c + " y (float64)", y, g.at(c + ".y_f64"));
    for (auto& [name, p] : dew::nn::lora_parameters(*m)) {
      const std::string k = c + ".grad." + name;
      ASSERT_TRUE(p.grad().defined()) << name;
      if (dt == at::kFloat) expect_golden(k, p.grad(), g.at(k + "_f32"), g.at(k + "_f64"));
      else expect_close_f64(k + " (float64)", p.grad(), g.at(k + "_f64"));
    }
    for (const auto& p : m->named_parameters())
      if (p.key().find("lora_") == std::string::npos) {
        EXPECT_FALSE(p.value().grad().defined()) << p.key();
      }
  }
  // Merge: the weights peft's merge_adapter gives, the same output; unmerge: the base weights again.
  LoraTiny& m64 = models.at(at::kDouble);
  torch::NoGradGuard no_grad;
  std::map<std::string, Tensor> before;
  for (const auto& p : m64->named_parameters()) before[p.key()] = p.value().clone();
  dew::nn::merge_lora(*m64);
  for (const auto& name : dew::nn::apply_lora(*base_model(at::kDouble), case_options(c)).targets)
    expect_close_f64(c + " merged " + name, m64->named_parameters()[name + ".weight"],
                     g.at(c + ".merged." + name + ".weight_f64"));
  expect_close_f64(c + " merged y", m64->forward(g.at("x").to(at::kDouble)), g.at(c + ".y_f64"), 1e-12);
  dew::nn::merge_lora(*m64);  // a second merge is a no-op
  dew::nn::unmerge_lora(*m64);
  for (const auto& p : m64->named_parameters()) {
    const Tensor& b = before.at(p.key());
    EXPECT_LE((p.value() - b).abs().max().item<double>(), 1e-14 * std::max(1.0, b.abs().max().item<double>()))
        << p.key();
  }
  expect_close_f64(c + " unmerged y", m64->forward(g.at("x").to(at::kDouble)), g.at(c + ".y_f64"));
}

TEST(Lora, ListTargetsMatchPeftForwardGradientsAndMerge) { check_case("list"); }
TEST(Lora, RegexTargetsWithRsLoraMatchPeft) { check_case("regex"); }

TEST(Lora, DisabledAdapterGivesTheBaseOutput) {
  LoraTiny m = case_model("list", at::kDouble);
  for (const auto& item : m->named_modules())
    if (auto* s = dew::nn::lora_state(*item.value())) s->enabled = false;
  torch::NoGradGuard no_grad;
  expect_close_f64("base y", m->forward(lora_golden().at("x").to(at::kDouble)), lora_golden().at("list.base_y_f64"));
}

// ---- initialisation ----

TEST(Lora, InitialisationIsPeftsKaimingUniformAndZero) {
  torch::manual_seed(3);
  torch::nn::Linear lin(256, 512);
  const Tensor x = torch::randn({3, 256});
  const Tensor y0 = dew::nn::dense(x, lin);
  dew::nn::attach_lora(lin, LoraOptions().rank(64).alpha(16));
  const auto* s = dew::nn::lora_state(*lin);
  ASSERT_NE(s, nullptr);
  const Tensor a = s->linear_A->weight, b = s->linear_B->weight;
  ASSERT_EQ(a.sizes(), (at::IntArrayRef{64, 256}));
  ASSERT_EQ(b.sizes(), (at::IntArrayRef{512, 64}));
  // kaiming_uniform_(a = sqrt(5)): U(-1 / sqrt(fan_in), 1 / sqrt(fan_in)), std bound / sqrt(3).
  const double bound = 1.0 / std::sqrt(256.0);
  EXPECT_LE(a.abs().max().item<double>(), bound);
  EXPECT_GE(a.abs().max().item<double>(), 0.99 * bound);
  EXPECT_NEAR(a.std().item<double>(), bound / std::sqrt(3.0), 0.02 * bound);  // 16384 samples: ~0.5% sd
  EXPECT_NEAR(a.mean().item<double>(), 0.0, 0.02 * bound);
  EXPECT_EQ(b.abs().max().item<double>(), 0.0);
  // B = 0: the adapted layer starts equal to the base.
  EXPECT_EQ((dew::nn::dense(x, lin) - y0).abs().max().item<double>(), 0.0);

  torch::nn::Conv2d cv(torch::nn::Conv2dOptions(16, 32, 3).stride(2).padding(1));
  dew::nn::attach_lora(cv, LoraOptions().rank(8));
  const auto* cs = dew::nn::lora_state(*cv);
  ASSERT_EQ(cs->conv_A->weight.sizes(), (at::IntArrayRef{8, 16, 3, 3}));
  ASSERT_EQ(cs->conv_B->weight.sizes(), (at::IntArrayRef{32, 8, 1, 1}));
  EXPECT_LE(cs->conv_A->weight.abs().max().item<double>(), 1.0 / std::sqrt(16.0 * 9));
}

TEST(Lora, ReducedPrecisionBaseGetsFloat32Adapters) {
  torch::nn::Linear lin(8, 8);
  lin->to(at::kBFloat16);
  dew::nn::attach_lora(lin, LoraOptions().rank(2));
  EXPECT_EQ(dew::nn::lora_state(*lin)->linear_A->weight.scalar_type(), at::kFloat);
  EXPECT_EQ(dew::nn::dense(torch::randn({2, 8}).to(at::kBFloat16), lin).scalar_type(), at::kBFloat16);
}

// ---- bad input ----

TEST(Lora, BadInputIsRefusedNamingTheValue) {
  const auto err = [](LoraOptions o) { return error_of([&] { dew::nn::apply_lora(*base_model(at::kFloat), o); }); };
  const std::string none = err(LoraOptions().target_modules({"q_prj"}));
  EXPECT_NE(none.find("\"q_prj\" matches no Linear or Conv2d"), std::string::npos) << none;
  EXPECT_NE(none.find("attn.q_proj"), std::string::npos) << none;  // the nearest names
  EXPECT_NE(err(LoraOptions().target_regex("nothing")).find("matches no"), std::string::npos);
  EXPECT_NE(err(LoraOptions().target_regex("(")).find("not a valid regular expression"), std::string::npos);
  EXPECT_NE(err(LoraOptions().rank(0).target_modules({"out"})).find("lora.rank must be > 0, got 0"), std::string::npos);
  const std::string big = err(LoraOptions().rank(5).target_modules({"out"}));
  EXPECT_NE(big.find("lora.rank 5 is larger than out (16 -> 4)"), std::string::npos) << big;
  const std::string kind = err(LoraOptions().target_modules({"attn"}));
  EXPECT_NE(kind.find("only Linear and Conv2d"), std::string::npos) << kind;
  EXPECT_NE(err(LoraOptions()).find("both are empty"), std::string::npos);
  LoraTiny m = base_model(at::kFloat);
  dew::nn::apply_lora(*m, LoraOptions().rank(2).target_modules({"out"}));
  EXPECT_NE(error_of([&] { dew::nn::attach_lora(m->out, LoraOptions().rank(2), "out"); }).find("already holds"),
            std::string::npos);
}

// ---- files ----

TEST(Lora, ReadsTheFolderPeftSavePretrainedWrote) {
  LoraTiny m = base_model(at::kFloat);
  const auto c = dew::nn::load_peft_adapter(*m, golden_dir("peft_adapter"));
  EXPECT_EQ(c.lora.rank(), 4);
  EXPECT_DOUBLE_EQ(c.lora.alpha(), 8);
  for (const auto& [name, p] : dew::nn::lora_parameters(*m))
    EXPECT_TRUE(torch::equal(p, lora_golden().at("list." + name))) << name;
  torch::NoGradGuard no_grad;
  expect_golden("peft folder y", m->forward(lora_golden().at("x")), lora_golden().at("list.y_f32"),
                lora_golden().at("list.y_f64"));
}

TEST(Lora, PeftAndDiffusersFilesRoundTrip) {
  dew::test::TempDir dir("lora_files");
  for (const std::string c : {"list", "regex"}) {
    LoraTiny src = case_model(c, at::kFloat);
    dew::nn::save_peft_adapter(dir.file("peft_" + c), *src, case_options(c), "tiny-base");
    dew::nn::save_diffusers_lora(dir.file(c + ".safetensors"), *src, case_options(c));
    LoraTiny a = base_model(at::kFloat), b = base_model(at::kFloat);
    const auto cfg = dew::nn::load_peft_adapter(*a, dir.file("peft_" + c));
    EXPECT_EQ(cfg.base_model_name_or_path, "tiny-base");
    const auto r = dew::nn::load_diffusers_lora(*b, dir.file(c + ".safetensors"));
    EXPECT_EQ(r.targets.size(), dew::nn::apply_lora(*base_model(at::kFloat), case_options(c)).targets.size());
    torch::NoGradGuard no_grad;
    const Tensor x = lora_golden().at("x"), want = src->forward(x);
    EXPECT_TRUE(torch::equal(a->forward(x), want)) << c;
    EXPECT_TRUE(torch::equal(b->forward(x), want)) << c;  // the scale (rsLoRA too) travels in the metadata
  }
  // A file for another base: a shape that does not fit is named.
  struct OtherImpl : torch::nn::Module {
    OtherImpl() { out = register_module("out", torch::nn::Linear(32, 4)); }
    torch::nn::Linear out{nullptr};
  };
  auto other = std::make_shared<OtherImpl>();
  const std::string e = error_of([&] { dew::nn::load_diffusers_lora(*other, dir.file("list.safetensors")); });
  EXPECT_NE(e.find("which the model does not have"), std::string::npos) << e;
  LoraTiny src = base_model(at::kFloat);
  dew::nn::apply_lora(*src, LoraOptions().rank(4).target_modules({"out"}));
  dew::nn::save_diffusers_lora(dir.file("out_only.safetensors"), *src, LoraOptions().rank(4).target_modules({"out"}));
  const std::string shape =
      error_of([&] { dew::nn::load_diffusers_lora(*std::make_shared<OtherImpl>(), dir.file("out_only.safetensors")); });
  EXPECT_NE(shape.find("unet.out.lora_A.weight has shape [4, 16] but the model's out.lora_A.weight is [4, 32]"),
            std::string::npos)
      << shape;
  EXPECT_NE(error_of([&] {
              dew::nn::load_peft_adapter(*std::make_shared<OtherImpl>(), golden_dir("peft_adapter"));
            }).find("matches no"),
            std::string::npos);
}

TEST(Lora, ReadsTheKohyaFileDiffusersConverted) {
  // diffusers' convert_state_dict_to_kohya writes alpha = rank: scale 1.
  LoraTiny m = base_model(at::kFloat);
  const auto r = dew::nn::load_kohya_lora(*m, golden_dir("kohya_from_diffusers.safetensors"));
  EXPECT_EQ(r.targets.size(), 5u);
  for (const auto& [name, p] : dew::nn::lora_parameters(*m))
    EXPECT_TRUE(torch::equal(p, lora_golden().at("list." + name))) << name;
  LoraTiny want = case_model("list", at::kFloat);
  for (const auto& item : want->named_modules())
    if (auto* s = dew::nn::lora_state(*item.value())) s->scale = 1.0;
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(m->forward(lora_golden().at("x")), want->forward(lora_golden().at("x"))));
}

TEST(Lora, KohyaFileRoundTripsTheScale) {
  dew::test::TempDir dir("lora_kohya");
  LoraTiny src = case_model("regex", at::kFloat);  // rsLoRA: scale 3 / sqrt(2), written as alpha = scale * rank
  dew::nn::save_kohya_lora(dir.file("k.safetensors"), *src);
  const auto keys = dew::io::load_safetensors(dir.file("k.safetensors"));
  EXPECT_EQ(keys.count("lora_unet_attn_v_proj.lora_down.weight"), 1u);
  EXPECT_EQ(keys.count("lora_unet_conv_down.alpha"), 1u);
  LoraTiny dst = base_model(at::kFloat);
  dew::nn::load_kohya_lora(*dst, dir.file("k.safetensors"));
  torch::NoGradGuard no_grad;
  const Tensor x = lora_golden().at("x");
  EXPECT_LE(dew::test::max_diff(dst->forward(x), src->forward(x)), 1e-5);
  const std::string e = error_of([&] {
    struct OtherImpl : torch::nn::Module {
      OtherImpl() { register_module("conv_dn", torch::nn::Conv2d(8, 8, 3)); }
    };
    dew::nn::load_kohya_lora(*std::make_shared<OtherImpl>(), dir.file("k.safetensors"));
  });
  EXPECT_NE(e.find("names no Linear or Conv2d of the model; nearest: lora_unet_conv_dn"), std::string::npos) << e;
}

// ---- a refused file is never half applied (docs/reliability.md, findings 34-40: the lora_file fuzz target) ----

// The model's module names, and its parameters with their values and requires_grad flags.
struct ModelState {
  std::vector<std::string> modules;
  std::vector<std::tuple<std::string, Tensor, bool>> params;
};

ModelState state_of(const torch::nn::Module& m) {
  ModelState s;
  for (const auto& item : m.named_modules("", /*include_self=*/false)) s.modules.push_back(item.key());
  for (const auto& p : m.named_parameters())
    s.params.emplace_back(p.key(), p.value().detach().clone(), p.value().requires_grad());
  return s;
}

// No adapter attached, no weight written, nothing frozen.
void expect_same_state(const ModelState& now, const ModelState& before, const std::string& what) {
  EXPECT_EQ(now.modules, before.modules) << what;
  ASSERT_EQ(now.params.size(), before.params.size()) << what;
  for (size_t i = 0; i < now.params.size(); ++i) {
    EXPECT_EQ(std::get<0>(now.params[i]), std::get<0>(before.params[i])) << what;
    EXPECT_TRUE(torch::equal(std::get<1>(now.params[i]), std::get<1>(before.params[i])))
        << what << ": " << std::get<0>(now.params[i]);
    EXPECT_EQ(std::get<2>(now.params[i]), std::get<2>(before.params[i])) << what << ": " << std::get<0>(now.params[i]);
  }
}

TEST(Lora, RefusedFilesLeaveTheModelAsItWas) {
  dew::test::TempDir dir("lora_refused");
  // Each file's first adapter (conv_in, Conv2d 3 -> 8, 3x3) fits; the one of `out` (Linear 16 -> 4), read after
  // it, does not. The loaders used to attach and load conv_in's before refusing out's.
  const auto with_conv_in = [](const std::string& pre, const char* a, const char* b) {
    return std::map<std::string, Tensor>{{pre + "conv_in" + a, torch::randn({2, 3, 3, 3})},
                                         {pre + "conv_in" + b, torch::randn({8, 2, 1, 1})}};
  };
  struct Case {
    std::string name;
    std::map<std::string, Tensor> tensors;
    std::string error;
  };
  std::vector<Case> cases;
  auto d = with_conv_in("unet.", ".lora_A.weight", ".lora_B.weight");
  d["unet.out.lora_A.weight"] = torch::randn({2, 16});
  d["unet.out.lora_B.weight"] = torch::randn({2, 4});
  cases.push_back({"shape", d, "unet.out.lora_B.weight has shape [2, 4] but the model's out.lora_B.weight is [4, 2]"});
  d["unet.out.lora_A.weight"] = torch::randn({5, 16});
  d["unet.out.lora_B.weight"] = torch::randn({4, 5});
  cases.push_back({"rank", d, "(unet.out): lora.rank 5 is larger than out (Linear 16 -> 4)"});
  d["unet.out.lora_A.weight"] = torch::tensor(1.0f);  // was LibTorch's IndexError (c10::Error), naming no file
  cases.push_back({"scalar A", d, "key unet.out.lora_A.weight has shape []; out is a Linear, whose A is [r, in]"});
  auto k = with_conv_in("lora_unet_", ".lora_down.weight", ".lora_up.weight");
  k["lora_unet_out.lora_down.weight"] = torch::randn({2, 16});
  k["lora_unet_out.lora_up.weight"] = torch::randn({4, 2});
  k["lora_unet_out.alpha"] = torch::tensor(-1.0f);
  cases.push_back({"alpha", k, "gives out alpha -1 (key lora_unet_out.alpha); alpha must be > 0"});
  k["lora_unet_out.alpha"] = torch::tensor({1.0f, 2.0f});  // was "a Tensor with 2 elements cannot be converted"
  cases.push_back({"alpha shape", k, "key lora_unet_out.alpha has shape [2]; an alpha is one number"});
  for (const Case& c : cases) {
    const std::string path = dir.file(c.name + ".safetensors");
    dew::io::save_safetensors(path, c.tensors);
    LoraTiny m = base_model(at::kFloat);
    const ModelState before = state_of(*m);
    const std::string e = error_of([&] { dew::nn::load_lora_file(*m, path); });
    EXPECT_NE(e.find(c.error), std::string::npos) << c.name << ": " << e;
    expect_same_state(state_of(*m), before, c.name);
  }

  // A PEFT folder: every target, key and shape is checked before apply_lora attaches anything.
  const LoraOptions o = case_options("list");
  dew::nn::save_peft_adapter(dir.file("peft"), *case_model("list", at::kFloat), o);
  const std::string weights = dir.file("peft/adapter_model.safetensors"), config = dir.file("peft/adapter_config.json");
  const auto tensors = dew::io::load_safetensors(weights);
  const auto refused = [&](const std::string& name, const std::map<std::string, Tensor>& t, const std::string& error) {
    dew::io::save_safetensors(weights, t);
    LoraTiny m = base_model(at::kFloat);
    const ModelState before = state_of(*m);
    const std::string e = error_of([&] { dew::nn::load_peft_adapter(*m, dir.file("peft")); });
    EXPECT_NE(e.find(error), std::string::npos) << name << ": " << e;
    expect_same_state(state_of(*m), before, name);
  };
  auto lacking = tensors;
  lacking.erase("base_model.model.out.lora_B.weight");  // left 5 adapters attached and the base frozen
  refused("lacking", lacking, "has no base_model.model.out.lora_B.weight for the adapted module");
  auto base = tensors;
  base["base_model.model.out.bias"] = torch::zeros({4});  // was copied into the base's bias
  refused("base", base, "holds base_model.model.out.bias but the model has no adapter parameter out.bias");
  dew::io::save_safetensors(weights, tensors);
  nlohmann::json j = dew::test::read_json(config);
  j["r"] = 4.5;  // was cast to 4 (and 1e30 was undefined behaviour)
  std::ofstream(config) << j.dump();
  refused("r", tensors, "field r: expected an integer, got float 4.5");

  // apply_lora checks every target before attaching to the first: here `out` already holds an adapter.
  LoraTiny m = base_model(at::kFloat);
  dew::nn::apply_lora(*m, LoraOptions().rank(2).target_modules({"out"}));
  const ModelState before = state_of(*m);
  const std::string e = error_of([&] {
    dew::nn::apply_lora(*m, LoraOptions().rank(2).target_modules({"conv_in", "out"}));
  });
  EXPECT_NE(e.find("out already holds an adapter"), std::string::npos) << e;
  expect_same_state(state_of(*m), before, "apply_lora");
}

TEST(Lora, TargetRegexIsMatchedInPolynomialTime) {
  // libstdc++'s default executor backtracks: "(.|.)*X" on this 39-character name would take 2^39 steps (an
  // adapter_config.json that hung dew). The breadth-first one answers at once, and refuses back-references.
  struct LongImpl : torch::nn::Module {
    LongImpl() { register_module("a_module_name_of_forty_characters_or_so", torch::nn::Linear(4, 4)); }
  };
  auto m = std::make_shared<LongImpl>();
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = error_of([&] { dew::nn::apply_lora(*m, LoraOptions().rank(2).target_regex("(.|.)*X")); });
  EXPECT_NE(e.find("matches no Linear or Conv2d module name"), std::string::npos) << e;
  EXPECT_TRUE(
      dew::nn::lora_target_matches(LoraOptions().target_regex("(.|.)*so"), "a_module_name_of_forty_characters_or_so"));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  EXPECT_NE(error_of([&] {
              dew::nn::apply_lora(*m, LoraOptions().rank(2).target_regex("(a)\\1"));
            }).find("is not a valid regular expression"),
            std::string::npos);
}

// ---- a family: causal_transformer routes its projections through the adapters ----

TEST(Lora, CausalTransformerProjectionsTakeAdapters) {
  torch::manual_seed(0);
  dew::nn::CausalTransformer lm(dew::nn::CausalTransformerOptions()
                                    .vocab_size(32)
                                    .emb_features(16)
                                    .num_layers(2)
                                    .num_heads(2)
                                    .mlp_features(32)
                                    .max_seq_len(16)
                                    .tie_embeddings(false));
  const Tensor ids = torch::randint(0, 32, {2, 6});
  torch::NoGradGuard no_grad;
  const Tensor base = lm->forward_tokens(ids);
  const auto r = dew::nn::apply_lora(
      *lm, LoraOptions().rank(2).alpha(4).target_modules({"q_proj", "v_proj", "down_proj", "lm_head"}));
  EXPECT_EQ(r.targets.size(), 7u);
  EXPECT_EQ((lm->forward_tokens(ids) - base).abs().max().item<double>(), 0.0);  // B = 0
  lm->named_parameters()["lm_head.lora_B.weight"].normal_(0.0, 0.3);            // the head's own path (not nn::dense)
  EXPECT_GT((lm->forward_tokens(ids) - base).abs().max().item<double>(), 1e-3);
  for (auto& [name, p] : dew::nn::lora_parameters(*lm)) p.normal_(0.0, 0.3);
  const Tensor adapted = lm->forward_tokens(ids);
  EXPECT_GT((adapted - base).abs().max().item<double>(), 1e-3);  // the adapters are on the forward path
  dew::nn::merge_lora(*lm);
  // float32 compute: the merged product rounds differently.
  EXPECT_LE((lm->forward_tokens(ids) - adapted).abs().max().item<double>(),
            1e-4 * std::max(1.0, adapted.abs().max().item<double>()));
}

}  // namespace
