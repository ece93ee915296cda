// The run library: run.json records (both formats), preparing a run writes nothing, EMA specs, devices and
// the seeded default generators.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "dew/core/device.h"
#include "dew/core/rng.h"
#include "dew/runs/run.h"
#include "dew/training/optim.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;
using dew::json;
using dew::test::error_of;

TEST(Runs, FormatOneRecordsAreReadInTheCurrentShape) {
  dew::test::TempDir tmp("runs_format1");
  const json recipe = {{"run", "runs/x"},
                       {"seed", 3},
                       {"model", {{"architecture", "unet"}, {"fields", {{"num_classes", 10}}}}},
                       {"data", {{"name", "fashion_mnist"}}},
                       {"trainer", {{"steps", 5}}}};
  fs::create_directories(tmp.path / "d");
  std::ofstream(tmp.path / "d" / "run.json") << json{
      {"kind", "diffusion"},
      {"dew_version", "0.1.0"},
      {"sample_shape", {1, 28, 28}},
      {"class_names", {"a", "b"}},
      {"recipe", recipe}}.dump();
  json r = dew::runs::read_record(tmp.file("d"));
  EXPECT_EQ(r["format"], dew::runs::kRunFormat);
  EXPECT_EQ(r["kind"], "diffusion");
  EXPECT_EQ(r["model"], recipe["model"]);
  EXPECT_EQ(r["seed"], 3);
  EXPECT_EQ(r["derived"]["sample_shape"], json({1, 28, 28}));
  EXPECT_EQ(r["derived"]["class_names"], json({"a", "b"}));
  EXPECT_EQ(dew::runs::recipe_of_record(r), recipe);

  // The first LM records kept the resolved model and the tokenizer beside the recipe.
  const json model = {{"architecture", "causal_transformer"}, {"fields", {{"vocab_size", 257}}}};
  fs::create_directories(tmp.path / "lm");
  std::ofstream(tmp.path / "lm" / "run.json") << json{{"kind", "lm"},
                                                      {"model", model},
                                                      {"data", {{"name", "tokens"}, {"dir", "t"}}},
                                                      {"tokenizer", {{"name", "byte"}}},
                                                      {"eos_id", 256},
                                                      {"recipe", {{"model", {{"architecture", "causal_transformer"}}}}}}
                                                     .dump();
  r = dew::runs::read_record(tmp.file("lm"));
  EXPECT_EQ(r["model"], model);
  EXPECT_EQ(r["derived"]["tokenizer"]["name"], "byte");
  EXPECT_EQ(r["derived"]["eos_id"], 256);
  EXPECT_EQ(r["derived"]["data_spec"]["dir"], "t");

  fs::create_directories(tmp.path / "future");
  std::ofstream(tmp.path / "future" / "run.json") << json{{"kind", "lm"}, {"format", 9}}.dump();
  EXPECT_NE(error_of([&] { dew::runs::read_record(tmp.file("future")); }).find("run format 9"), std::string::npos);
}

TEST(Runs, PrepareChecksEverythingAndWritesNothing) {
  dew::test::TempDir tmp("runs_prepare");
  json recipe = dew::runs::default_recipe("diffusion");
  recipe["run"] = tmp.file("new_run");
  recipe["data"] = {{"name", "gaussian_blobs"}, {"count", 16}, {"size", 8}, {"classes", 2}};
  recipe["model"] = {{"architecture", "simple_dit"},
                     {"fields", {{"patch_size", 2}, {"emb_features", 16}, {"num_layers", 1}, {"num_heads", 2}}}};
  auto run = dew::runs::prepare("diffusion", recipe);
  EXPECT_FALSE(fs::exists(tmp.file("new_run")));
  EXPECT_EQ(run.record["kind"], "diffusion");
  EXPECT_EQ(run.record["model"]["fields"]["num_classes"], 2);  // completed from the data
  EXPECT_EQ(run.record["derived"]["sample_shape"], json({1, 8, 8}));
  EXPECT_FALSE(run.resumes);

  // The same recipe builds the same initial weights (from the seed, not the process's generator).
  auto again = dew::runs::prepare("diffusion", recipe);
  auto a = run.built.objective->module().named_parameters(), b = again.built.objective->module().named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (const auto& kv : a) EXPECT_TRUE(kv.value().equal(*b.find(kv.key()))) << kv.key();

  auto bad = [&](const std::string& key, const json& value) {
    json r = recipe;
    r[key] = value;
    return error_of([&] { dew::runs::prepare("diffusion", r); });
  };
  EXPECT_NE(bad("device", "gpu").find("device: got \"gpu\", accepted: auto, cpu, cuda, cuda:N"), std::string::npos);
  EXPECT_NE(bad("seed", -1).find("seed: must be >= 0"), std::string::npos);
  EXPECT_NE(bad("run", "").find("run: expected a directory name"), std::string::npos);
  EXPECT_NE(error_of([&] {
              dew::runs::prepare("jepa_v9", recipe);
            }).find("accepted: autoencoder, diffusion, dpo, grpo, jepa, lm, sft"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(tmp.file("new_run")));
}

TEST(Runs, EveryKindParsesItsRecipeOnceIntoTypedSections) {
  dew::test::TempDir tmp("runs_typed_recipe");
  for (const auto& kind : dew::runs::run_kinds()) {
    SCOPED_TRACE(kind);
    json recipe = dew::runs::default_recipe(kind);
    // Every key of the defaults is a field of the kind's recipe type, and reads back as it was.
    EXPECT_EQ(dew::runs::run_kind(kind).parse(recipe)->to_json(), recipe);
    for (const char* section : {"run", "seed", "loader", "optim", "trainer", "dist", "model", "objective"})
      EXPECT_TRUE(recipe.contains(section)) << section;
    recipe["run"] = tmp.file(kind);
    // A field the type does not have, or a section of the wrong type, is refused before anything is built or
    // written, named, with what is valid.
    json bogus = recipe;
    bogus["bogus"] = 1;
    const std::string unknown = error_of([&] { dew::runs::prepare(kind, bogus); });
    EXPECT_NE(unknown.find("unknown field \"bogus\"; valid fields: "), std::string::npos) << unknown;
    for (const char* section : {"dist", "loader", "model", "objective", "optim", "trainer"})
      EXPECT_NE(unknown.find(section), std::string::npos) << unknown;
    json wrong = recipe;
    wrong["objective"] = 3;
    const std::string type = error_of([&] { dew::runs::prepare(kind, wrong); });
    EXPECT_NE(type.find("objective: expected an object, got int 3"), std::string::npos) << type;
    wrong = recipe;
    wrong["model"]["fields"] = json::object();
    wrong["model"]["architecture"] = 7;
    const std::string arch = error_of([&] { dew::runs::prepare(kind, wrong); });
    EXPECT_NE(arch.find("model.architecture: expected a string, got int 7"), std::string::npos) << arch;
    EXPECT_FALSE(fs::exists(tmp.file(kind)));
  }
}

TEST(Runs, DeviceNames) {
  EXPECT_TRUE(dew::parse_device("cpu").is_cpu());
  EXPECT_EQ(dew::parse_device("auto").is_cuda(), dew::available_devices() != "cpu");
  for (const char* bad : {"cuda:", "cuda:x", "CUDA", "cuda:-1", "tpu"})
    EXPECT_NE(error_of([&] { dew::parse_device(bad, "--device"); }).find("accepted: auto, cpu, cuda, cuda:N"),
              std::string::npos)
        << bad;
  if (dew::available_devices() == "cpu") {
    EXPECT_NE(error_of([] { dew::parse_device("cuda:0"); }).find("no CUDA device"), std::string::npos);
  }
}

TEST(Runs, EmaSpecDecays) {
  dew::training::EmaSpec constant(0.999);
  EXPECT_DOUBLE_EQ(constant.at(0, 100), 0.1);  // (1 + 0)/(10 + 0): the warm-up
  EXPECT_DOUBLE_EQ(constant.at(90, 100), 91.0 / 100.0);
  EXPECT_DOUBLE_EQ(constant.at(100000, 200000), 0.999);
  EXPECT_DOUBLE_EQ(dew::training::EmaSpec(1.0).at(0, 10), 1.0);  // a frozen copy from the first step
  // JEPA's momentum: linear from 0.996 at the first step to 1.0 at the last.
  auto ramp = dew::training::EmaSpec::ramp(0.996, 1.0);
  EXPECT_DOUBLE_EQ(ramp.at(0, 101), 0.996);
  EXPECT_DOUBLE_EQ(ramp.at(50, 101), 0.998);
  EXPECT_DOUBLE_EQ(ramp.at(100, 101), 1.0);
}

TEST(Runs, EmaAveragesOnlyTheParametersItsSpecNames) {
  using dew::training::NamedTensors;
  NamedTensors params = {{"encoder.w", at::ones({2})}, {"predictor.w", at::ones({2})}};
  dew::training::EmaSpec spec(0.5);
  spec.prefixes = {"encoder."};
  dew::training::EMA ema(params, spec, 10);
  ASSERT_EQ(ema.averages().size(), 1u);
  params[0].second.fill_(3);
  params[1].second.fill_(3);
  ema.update(params, 100);  // decay min(0.5, 101/110) = 0.5: 0.5 * 1 + 0.5 * 3
  EXPECT_TRUE(ema.averages().at("encoder.w").equal(at::full({2}, 2.0)));
  ema.swap_into(params);
  EXPECT_TRUE(params[0].second.equal(at::full({2}, 2.0)));
  EXPECT_TRUE(params[1].second.equal(at::full({2}, 3.0)));  // not averaged: untouched
}

TEST(Runs, DefaultGeneratorScopeSeedsAndRestores) {
  at::manual_seed(11);
  const at::Tensor expected = at::randn({4});
  at::manual_seed(11);
  at::Tensor in_scope_a, in_scope_b;
  {
    dew::rng::DefaultGeneratorScope s(5, 0, "init");
    in_scope_a = at::randn({4});
  }
  // The draw after the scope continues the stream from before it, as if the scope never ran.
  EXPECT_TRUE(at::randn({4}).equal(expected));
  {
    dew::rng::DefaultGeneratorScope s(5, 0, "init");
    in_scope_b = at::randn({4});
  }
  EXPECT_TRUE(in_scope_a.equal(in_scope_b));
  {
    dew::rng::DefaultGeneratorScope s(5, 1, "init");
    EXPECT_FALSE(at::randn({4}).equal(in_scope_a));  // another step, another stream
  }
}
