// `dew export RUN DEST` end to end on a run directory made with the library's own checkpoint writer:
// the exported folder loads back to the checkpoint's (or the EMA's) weights exactly; errors exit 2 with
// one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "dew/interop/hf_decoder.h"
#include "dew/training/checkpoint.h"
#include "dew/training/trainer.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;
using dew::json;

namespace {

using Result = dew::test::CliResult;
using dew::test::run_dew;

/// A run directory holding one checkpoint of a tiny causal_transformer, written with the library's
/// checkpoint writer; the EMA differs from the live weights so the test can tell which one was exported.
dew::nn::CausalTransformer make_run(const std::string& dir, const json& fields, const json& tokenizer) {
  auto o = dew::from_json<dew::nn::CausalTransformerOptions>(fields);
  torch::manual_seed(4);
  dew::nn::CausalTransformer model(o);
  fs::create_directories(dir);
  // The run.json fields `dew train lm` writes and load_lm_run reads.
  json model_record = {{"architecture", "causal_transformer"}, {"fields", fields}};
  json record = {{"kind", "lm"},
                 {"model", model_record},
                 {"tokenizer", tokenizer},
                 {"eos_id", 256},
                 {"recipe", {{"model", model_record}}}};
  std::ofstream(dir + "/run.json") << record.dump(2);
  dew::training::Checkpoint c;
  c.step = 7;
  c.model = dew::training::module_state(*model);
  for (const auto& p : model->named_parameters()) c.ema[p.key()] = p.value().detach() * 0.5;
  c.optimizer["dummy"] = torch::zeros({1});
  c.state = json::object();
  dew::training::save_checkpoint(dir, c, 2);
  return model;
}

TEST(ExportCli, ExportsTheLatestCheckpointAndItsEma) {
  dew::test::TempDir dir("export_cli");
  json fields = {{"vocab_size", 257}, {"emb_features", 32}, {"num_layers", 1},   {"num_heads", 2},
                 {"head_dim", 16},    {"mlp_features", 32}, {"max_seq_len", 32}, {"qk_norm", false}};
  auto model = make_run(dir.file("run"), fields, "byte");
  auto r = run_dew("export " + dir.file("run") + " " + dir.file("hf") + " --family llama");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("step 7"), std::string::npos) << r.output;
  auto back = dew::interop::load_pretrained_decoder(dir.file("hf"));
  for (const auto& p : model->named_parameters())
    EXPECT_TRUE(torch::equal(p.value(), back->named_parameters()[p.key()])) << p.key();
  EXPECT_TRUE(fs::exists(dir.file("hf/tokenizer.json")));

  r = run_dew("export " + dir.file("run") + " " + dir.file("hf_ema") + " --ema");  // auto family: llama
  ASSERT_EQ(r.code, 0) << r.output;
  auto ema = dew::interop::load_pretrained_decoder(dir.file("hf_ema"));
  for (const auto& p : model->named_parameters())
    EXPECT_TRUE(torch::equal(p.value() * 0.5, ema->named_parameters()[p.key()])) << p.key();
}

TEST(ExportCli, ErrorsExit2WithOneLine) {
  dew::test::TempDir dir("export_cli_err");
  json fields = {{"vocab_size", 257},  {"emb_features", 16}, {"num_layers", 1}, {"num_heads", 2},
                 {"mlp_features", 16}, {"max_seq_len", 16},  {"qk_norm", true}};
  make_run(dir.file("run"), fields, "byte");
  auto expect_error = [&](const std::string& args, const std::string& needle) {
    auto r = run_dew("export " + args);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
  };
  expect_error(dir.file("run") + " " + dir.file("out") + " --family llama", "llama cannot express qk_norm");
  expect_error(dir.file("run") + " " + dir.file("out") + " --family gpt2", "accepted: auto, llama");
  expect_error(dir.file("nope") + " " + dir.file("out"), "nope");
  expect_error(dir.file("run"), "expected RUN and DEST");
  EXPECT_FALSE(fs::exists(dir.file("out/config.json")));
}

}  // namespace
