// `dew train lm` and `dew generate` end to end on a tiny token directory, and their one-line errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "tests/data/tiny_tokens.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace {

using dew::test::run_dew;

std::string lm_tmp(const std::string& name) {
  auto d = fs::path(::testing::TempDir()) / ("dew_lm_cli_" + name);
  fs::remove_all(d);
  return d.string();
}

// Each test its own token folder: CTest runs the tests of this file side by side.
std::string tiny_tokens(const std::string& test) { return dew::test::write_tiny_tokens(lm_tmp("tokens_" + test)); }

}  // namespace

TEST(LmCli, TrainsAndGenerates) {
  const std::string data = tiny_tokens("run"), dir = lm_tmp("run");
  const std::string tiny = " --data.name tokens --data.dir " + data +
                           " --model.fields '{\"emb_features\":32,\"num_layers\":1,\"num_heads\":2,\"max_seq_len\":64}'"
                           " --objective.seq_len 16 --objective.sample_tokens 8 --loader.batch_size 4"
                           " --trainer.log_every 2 --trainer.val_every 0 --trainer.time_limit_minutes 0";
  auto r = run_dew("train lm --run " + dir + " --trainer.steps 4" + tiny);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(dir) / "checkpoints" / "step_4" / "model.safetensors")) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(dir) / "samples" / "step_4.txt"));
  EXPECT_NE(r.output.find("val/perplexity"), std::string::npos) << r.output;
  auto record = dew::json::parse(std::ifstream(fs::path(dir) / "run.json"));
  EXPECT_EQ(record["kind"], "lm");
  EXPECT_EQ(record["model"]["architecture"], "causal_transformer");
  EXPECT_EQ(record["model"]["fields"]["vocab_size"], 257);  // filled in from the data
  EXPECT_EQ(record["derived"]["tokenizer"]["name"], "byte");
  // greedy generation is deterministic; --json reports tokens and both log-probs
  r = run_dew("generate " + dir + " --prompt 'the ' --prompt 'a' --max-new-tokens 5 --temperature 0 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  ASSERT_EQ(dew::test::count_lines(r.output), 2u) << r.output;
  auto first = dew::json::parse(r.output.substr(0, r.output.find('\n')));
  EXPECT_EQ(first["prompt"], "the ");
  EXPECT_EQ(first["tokens"].size(), first["logprobs"].size());
  EXPECT_EQ(first["raw_logprobs"].size(), first["tokens"].size());
  auto again = run_dew("generate " + dir + " --prompt 'the ' --prompt 'a' --max-new-tokens 5 --temperature 0 --json");
  EXPECT_EQ(again.output, r.output);
}

TEST(LmCli, BadInputIsOneLineAndExitTwo) {
  const std::string data = tiny_tokens("bad"), dir = lm_tmp("bad");
  for (std::string args :
       {std::string("train lm --model.fields.num_heads 3 --data.name tokens --data.dir ") + data,
        std::string("train lm --objective.loss_role everything --data.name tokens --data.dir ") + data,
        std::string("train lm --data.name tokens --data.dir /nonexistent/tokens"),
        std::string("train lm --model.architecture unet"), std::string("generate /nonexistent/run --prompt hi"),
        std::string("generate /nonexistent/run --temperature -1"),
        std::string("generate /nonexistent/run --bogus 1")}) {
    if (args.rfind("train", 0) == 0) args += " --run " + dir;
    auto r = run_dew(args);
    EXPECT_FALSE(fs::exists(dir)) << args;  // nothing is written before the input is valid
    EXPECT_EQ(r.code, 2) << args << "\n" << r.output;
    EXPECT_EQ(dew::test::count_lines(r.output), 1u) << args << "\n" << r.output;
    EXPECT_EQ(r.output.rfind("dew: error: ", 0), 0u) << r.output;
  }
}
