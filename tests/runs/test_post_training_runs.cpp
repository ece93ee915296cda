// `dew train sft|dpo|grpo` from the command line on a tiny sums task: SFT from scratch, pairs from the SFT
// model's samples, DPO and GRPO from the SFT run, an export to a Hugging Face folder and GRPO from that
// folder, `dew eval` on the runs; the frozen reference of DPO is the SFT checkpoint's weights bit for bit;
// bad input is one line and exit 2 with the run directory untouched.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include "dew/io/safetensors.h"
#include "dew/runs/run.h"
#include "dew/training/checkpoint.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace {

using dew::test::run_dew;

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

int64_t count_lines(const fs::path& p) {
  std::ifstream f(p);
  int64_t n = 0;
  for (std::string s; std::getline(f, s);) n += !s.empty();
  return n;
}

const char* kTinyModel = " --model.fields '{\"emb_features\":32,\"num_layers\":1,\"num_heads\":2,\"max_seq_len\":64}'";

}  // namespace

TEST(PostTrainingRuns, SftDpoGrpoFromTheCommandLineAndThroughAnExport) {
  dew::test::TempDir tmp("pt_runs");
  const std::string sums = tmp.file("sums");
  auto r = run_dew("task sums --digits 1 --test 20 --out " + sums);
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string test = " --eval.prompts " + sums + "/test_prompts.jsonl --eval.max_new_tokens 6";

  r = run_dew("train sft --data " + sums + "/sft.jsonl --val_data " + sums + "/sft.jsonl" + kTinyModel + test +
              " --trainer.steps 6 --trainer.val_every 3 --loader.batch_size 8 --run " + tmp.file("sft"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("val/reward/exact:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("val/ce:"), std::string::npos) << r.output;
  // The progress shows learning: the header says what ends the run, each validation prints its scores.
  EXPECT_NE(r.output.find("training to step 6 or for 15 minutes, whichever ends first"), std::string::npos)
      << r.output;  // the sft recipe's time limit
  EXPECT_NE(r.output.find("step 3/6  validation: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("val/reward/exact "), std::string::npos) << r.output;
  // ... and what they were computed on: the 20 held-out prompts, a whole count of validation tokens.
  EXPECT_NE(r.output.find("val/prompt_count 20"), std::string::npos) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("val/tokens [0-9]+(,|\\n)"))) << r.output;
  EXPECT_TRUE(fs::exists(tmp.path / "sft/samples/step_6.txt"));

  r = run_dew("pairs " + tmp.file("sft") + " --prompts " + sums +
              "/train_prompts.jsonl --samples 2 --max-new-tokens 6 --out " + tmp.file("pairs.jsonl"));
  ASSERT_EQ(r.code, 0) << r.output;
  // A 6-step model is almost never right: nearly every prompt gets a pair (chosen = the answer).
  EXPECT_GE(count_lines(tmp.path / "pairs.jsonl"), 60) << r.output;

  r = run_dew("train dpo --init_from " + tmp.file("sft") + " --data " + tmp.file("pairs.jsonl") + test +
              " --objective.reference_logps precompute --trainer.steps 4 --trainer.val_every 0 --loader.batch_size 8"
              " --trainer.time_limit_minutes 60 --run " +
              tmp.file("dpo"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("training to step 4 or for 60 minutes, whichever ends first"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 4/4  loss "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("  rewards/accuracies "), std::string::npos) << r.output;  // on the progress line
  std::ifstream m(tmp.path / "dpo/metrics.jsonl");
  bool logged = false;
  for (std::string s; std::getline(m, s);) logged = logged || s.find("train/rewards/accuracies") != std::string::npos;
  EXPECT_TRUE(logged);
  // The frozen reference of the DPO run is the SFT checkpoint, bit for bit.
  {
    dew::runs::OpenOptions ref, sft;
    ref.weights = "reference";
    sft.weights = "live";
    auto a = dew::runs::run_weights(tmp.file("dpo"), ref), b = dew::runs::run_weights(tmp.file("sft"), sft);
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [k, v] : b) EXPECT_TRUE(a.at(k).equal(v)) << k;
    auto live = dew::runs::run_weights(tmp.file("dpo"), dew::runs::OpenOptions{});
    EXPECT_FALSE(live.at("embed_tokens.weight").equal(b.at("embed_tokens.weight"))) << "DPO did not move the policy";
  }

  const std::string grpo =
      " --prompts " + sums +
      "/train_prompts.jsonl --reward exact,length --loader.batch_size 4"
      " --objective.group_size 2 --objective.max_new_tokens 4 --trainer.steps 4 --trainer.val_every 0";
  r = run_dew("train grpo --init_from " + tmp.file("sft") + grpo + test + " --run " + tmp.file("grpo"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("  reward "), std::string::npos) << r.output;  // the sampled reward on the progress line
  // 4 steps, 2 per rollout: 2 rollouts of 4 prompts x 2 completions.
  EXPECT_EQ(count_lines(tmp.path / "grpo/rollouts.jsonl"), 16);
  const std::string metrics = slurp(tmp.path / "grpo/metrics.jsonl");
  for (const char* k : {"train/pg_loss", "train/pg_clipfrac", "train/pg_clipfrac_lower", "train/ppo_kl", "train/kl",
                        "train/reward/exact", "train/reward/length_std", "train/completion_length"})
    EXPECT_NE(metrics.find(k), std::string::npos) << k;

  // An external reward: one JSON line in, one number out per completion. A command that fails stops the run
  // with one line; its checkpoints stay and the run resumes when the command works again.
  const std::string cmd_grpo = "train grpo --init_from " + tmp.file("sft") + " --prompts " + sums +
                               "/train_prompts.jsonl --loader.batch_size 2 --objective.group_size 2"
                               " --objective.max_new_tokens 4 --trainer.val_every 0 --trainer.checkpoint_every 2"
                               " --eval.prompts '' --run " +
                               tmp.file("grpo_cmd");
  // The scorer fails while a flag file exists (a crashed script, fixed later: the command line stays the same).
  const std::string scorer =
      " --reward-command \"test -e " + tmp.file("broken") + " && exit 3; awk '{print length(\\$0) % 3}'\"";
  r = run_dew(cmd_grpo + " --trainer.steps 2" + scorer);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(slurp(tmp.path / "grpo_cmd/metrics.jsonl").find("train/reward/command"), std::string::npos);
  std::ofstream(tmp.file("broken")) << "";
  r = run_dew(cmd_grpo + " --trainer.steps 4" + scorer);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("exit status 3"), std::string::npos) << r.output;
  EXPECT_EQ(dew::training::latest_checkpoint(tmp.file("grpo_cmd")), 2);
  fs::remove(tmp.file("broken"));
  r = run_dew(cmd_grpo + " --trainer.steps 4" + scorer);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(dew::training::latest_checkpoint(tmp.file("grpo_cmd")), 4);

  // --reference: another run's weights as the frozen reference, held in the run's checkpoints.
  r = run_dew("train dpo --init_from " + tmp.file("sft") + " --reference " + tmp.file("grpo") + " --data " +
              tmp.file("pairs.jsonl") + " --eval.prompts '' --trainer.steps 2 --loader.batch_size 8 --run " +
              tmp.file("dpo_ref"));
  ASSERT_EQ(r.code, 0) << r.output;
  {
    dew::runs::OpenOptions ref, live;
    ref.weights = "reference";
    live.weights = "live";
    auto a = dew::runs::run_weights(tmp.file("dpo_ref"), ref), b = dew::runs::run_weights(tmp.file("grpo"), live);
    for (const auto& [k, v] : b) EXPECT_TRUE(a.at(k).equal(v)) << k;
  }

  // Out through dew export, back in from the Hugging Face folder (its chat template is recognised).
  r = run_dew("export " + tmp.file("grpo") + " " + tmp.file("hf") + " --family qwen3");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(slurp(tmp.path / "hf/tokenizer_config.json").find("chat_template"), std::string::npos);
  r = run_dew("train grpo --init_from " + tmp.file("hf") + grpo + test + " --run " + tmp.file("grpo_hf"));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_dew("train sft --init_from " + tmp.file("hf") + " --data " + sums +
              "/sft.jsonl --trainer.steps 2 --eval.prompts ''"
              " --loader.batch_size 8 --run " +
              tmp.file("sft_hf"));
  ASSERT_EQ(r.code, 0) << r.output;

  r = run_dew("eval " + tmp.file("grpo") + " --prompts " + sums + "/test_prompts.jsonl --max-new-tokens 6 --samples 2");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("reward/exact: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("<|assistant|>"), std::string::npos) << r.output;
  {  // the scores, with the command that made them, in the run's eval.jsonl
    const dew::json row = dew::json::parse(slurp(tmp.path / "grpo/eval.jsonl"));
    EXPECT_EQ(row["command"], "dew eval " + tmp.file("grpo") + " --prompts " + sums +
                                  "/test_prompts.jsonl --max-new-tokens 6 --samples 2");
    EXPECT_TRUE(row.contains("reward/exact")) << row.dump();
    EXPECT_EQ(row["weights"], "ema");
  }
  r = run_dew("generate " + tmp.file("dpo") + " --prompt 'x' --max-new-tokens 3");
  EXPECT_EQ(r.code, 0) << r.output;
}

TEST(PostTrainingRuns, BadInputIsOneLineAndLeavesTheRunAsItWas) {
  dew::test::TempDir tmp("pt_bad");
  auto r = run_dew("task sums --digits 1 --test 20 --out " + tmp.file("sums"));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string sft = "train sft --data " + tmp.file("sums/sft.jsonl") + kTinyModel +
                          " --eval.prompts '' --trainer.steps 2 --loader.batch_size 8 --run " + tmp.file("sft");
  r = run_dew(sft);
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string before = slurp(tmp.path / "sft/run.json");
  std::ofstream(tmp.file("bad.jsonl")) << R"({"prompt":"p","chosen":"a"})"
                                       << "\n";
  struct Case {
    std::string args, needle;
  };
  const std::vector<Case> cases = {
      {"train sft --run " + tmp.file("sft") + kTinyModel, "data: expected a chat JSON-lines file"},
      {"train dpo --init_from " + tmp.file("sft") + " --data " + tmp.file("bad.jsonl") + " --run " + tmp.file("sft"),
       "bad.jsonl:1: no \"rejected\""},
      {"train grpo --init_from " + tmp.file("sft") + " --prompts " + tmp.file("sums/train_prompts.jsonl") +
           " --reward exactly --run " + tmp.file("sft"),
       "exactly"},
      {"train grpo --init_from " + tmp.file("sft") + " --prompts " + tmp.file("sums/train_prompts.jsonl") + " --run " +
           tmp.file("x"),
       "reward: none given; pass --reward NAME[,NAME] (exact, format, length) or --reward-command CMD"},
      {"train grpo --init_from " + tmp.file("nowhere") + " --prompts " + tmp.file("sums/train_prompts.jsonl") +
           " --reward exact --run " + tmp.file("sft"),
       "is neither a dew run (run.json) nor a Hugging Face folder"},
      {"train sft --data " + tmp.file("sums/sft.jsonl") + " --chat_template chatml --run " + tmp.file("sft"), "chatml"},
      {"train grpo --init_from " + tmp.file("sft") + " --prompts " + tmp.file("sums/train_prompts.jsonl") +
           " --reward exact --objective.group_size 1 --run " + tmp.file("x"),
       "objective.group_size: must be >= 2"},
      {"eval " + tmp.file("sft") + " --prompts " + tmp.file("missing.jsonl"), "missing.jsonl is not a file"},
  };
  for (const auto& c : cases) {
    r = run_dew(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_LE(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
  EXPECT_EQ(slurp(tmp.path / "sft/run.json"), before);
  EXPECT_FALSE(fs::exists(tmp.path / "x"));
}
