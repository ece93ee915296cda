// Every command and subcommand answers --help with exit 0 and its usage; the commands are read from
// `dew --help` and the train kinds from `dew train --help`, so a new one is walked without a line here.
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>

#include "tests/test_util.h"

namespace {

using dew::test::run_dew;

// The first word of each indented line of a listing after the line `header`.
std::vector<std::string> listed_words(const std::string& text, const std::string& header) {
  std::vector<std::string> out;
  std::istringstream in(text.substr(text.find(header) + header.size()));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("  ", 0) != 0 || line.size() < 3 || line[2] == ' ') continue;
    std::string word = line.substr(2, line.find(' ', 2) - 2);
    if (std::find(out.begin(), out.end(), word) == out.end()) out.push_back(word);
  }
  return out;
}

TEST(HelpCli, EveryCommandAndSubcommandAnswersHelp) {
  const auto top = run_dew("--help");
  ASSERT_EQ(top.code, 0) << top.output;
  const auto commands = listed_words(top.output, "commands:\n");
  // the commands dew dispatches (dew/cli/commands.cpp), each listed by `dew --help`
  EXPECT_EQ(std::set<std::string>(commands.begin(), commands.end()),
            (std::set<std::string>{"train", "launch", "sample", "generate", "eval", "pairs", "task", "bench", "tune",
                                   "tokenize", "export", "forward", "models", "list", "version"}))
      << top.output;
  const auto kinds = run_dew("train --help");
  ASSERT_EQ(kinds.code, 0) << kinds.output;
  const auto train_kinds = listed_words(kinds.output, "kinds:\n");
  EXPECT_EQ(std::set<std::string>(train_kinds.begin(), train_kinds.end()),
            (std::set<std::string>{"autoencoder", "diffusion", "dpo", "grpo", "jepa", "lm", "sft"}));
  std::vector<std::string> calls;
  for (const auto& c : commands) calls.push_back(c);
  for (const auto& k : train_kinds) calls.push_back("train " + k);
  calls.push_back("tune threads");
  calls.push_back("task sums");
  for (const auto& call : calls) {
    for (const char* flag : {"--help", "-h"}) {
      const auto r = run_dew(call + " " + flag);
      EXPECT_EQ(r.code, 0) << "dew " << call << " " << flag << ":\n" << r.output;
      if (call == "version") EXPECT_NE(r.output.find("dew "), std::string::npos);
      else EXPECT_EQ(r.output.rfind("usage: dew", 0), 0u) << "dew " << call << " " << flag << ":\n" << r.output;
    }
  }
}

TEST(HelpCli, EvalListsTheFlagsOfEveryRunKindWithOrWithoutARun) {
  dew::test::TempDir dir("help_eval");
  std::ofstream(dir.file("run.json")) << R"({"kind": "jepa", "format": 2})";
  const auto plain = run_dew("eval --help");
  ASSERT_EQ(plain.code, 0) << plain.output;
  for (const char* kind : {"diffusion", "autoencoder", "jepa", "lm, sft, dpo, grpo"})
    EXPECT_NE(plain.output.find(std::string("\n") + kind), std::string::npos) << kind << "\n" << plain.output;
  for (const char* flag : {"--solvers", "--classifier", "--count", "--knn-k", "--probe-epochs", "--no-baselines",
                           "--prompts", "--reward", "--max-new-tokens", "--weights", "--step", "--device"})
    EXPECT_NE(plain.output.find(flag), std::string::npos) << flag;
  // RUN before --help (any kind) gives the same text, not the diffusion parser's "unknown flag".
  const auto with_run = run_dew("eval " + dir.path.string() + " --help");
  EXPECT_EQ(with_run.code, 0) << with_run.output;
  EXPECT_EQ(with_run.output, plain.output);
}

TEST(HelpCli, SampleListsARunsFlagsAndAPipelines) {
  const auto r = run_dew("sample --help");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* flag : {"--solver", "--labels", "--prompt", "--guidance", "--pipeline", "--negative-prompt",
                           "--scheduler", "--latents", "--lora"})
    EXPECT_NE(r.output.find(flag), std::string::npos) << flag;
}

}  // namespace
