// Every run's TensorBoard files, read by the installed TensorBoard (tests/training/tb_read.py, its
// EventAccumulator): a tiny diffusion run is killed with SIGKILL mid-training and resumed; then every
// numeric field of every metrics.jsonl line is one TensorBoard scalar at its step (equal in float32), no
// (tag, step) is there twice or missing, the sample grid of the final validation is an image of the PNG's
// size, and the recipe is a text at each start's step. A DEW_PYTHON without tensorboard fails the test
// (scripts/setup installs it). --tensorboard off writes no files. The browser check
// (tests/training/tb_browser_check.py): TensorBoard served over a run, its scalars page in headless Chromium,
// the loss chart found on the screenshot.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include <nlohmann/json.hpp>

#include "dew/io/files.h"
#include "dew/io/tensorboard.h"
#include "dew/training/checkpoint.h"
#include "tests/test_util.h"

extern char** environ;

namespace fs = std::filesystem;

namespace tb_run_test {

const std::string kTrain =
    "train diffusion --data '{\"name\":\"gaussian_blobs\",\"count\":64,\"size\":8,\"classes\":3}'"
    " --model.architecture simple_dit"
    " --model.fields '{\"patch_size\":2,\"emb_features\":16,\"num_layers\":1,\"num_heads\":2}'"
    " --loader.batch_size 8 --trainer.log_every 1 --trainer.val_every 0 --trainer.time_limit_minutes 0"
    " --objective.steps 2 --objective.preview_per_class 1 --trainer.checkpoint_every 2";

// Starts `dew ARGS` with its output in `log`; the PID is dew's own (the shell execs it).
pid_t spawn(const std::string& args, const std::string& log) {
  const std::string cmd = "exec " + std::string(DEW_BINARY) + " " + args + " >" + log + " 2>&1";
  const char* argv[] = {"/bin/sh", "-c", cmd.c_str(), nullptr};
  pid_t pid = -1;
  EXPECT_EQ(posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ), 0);
  return pid;
}

// Waits (bounded) until metrics.jsonl holds `lines` lines.
bool wait_for_lines(const std::string& run, pid_t pid, size_t lines) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return false;
    if (dew::test::count_lines(dew::test::read_bytes(run + "/metrics.jsonl")) >= lines) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// The last JSON object a tests/training script printed (ARGS after the script's name), or null when it
// failed; `output` gets everything it printed.
nlohmann::json run_script(const std::string& script, const std::string& args, std::string& output) {
  // timeout: a hung server or browser fails the test instead of holding CTest (the script kills both itself).
  const std::string cmd = "timeout -k 10 300 " + std::string(DEW_PYTHON) + " " + DEW_SOURCE_DIR + "/tests/training/" +
                          script + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return nullptr;
  std::array<char, 4096> buf{};
  while (fgets(buf.data(), buf.size(), p)) output += buf.data();
  const int status = pclose(p);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return nullptr;
  const size_t last = output.rfind("\n{");
  try {
    return nlohmann::json::parse(last == std::string::npos ? output : output.substr(last + 1));
  } catch (const std::exception&) {
    return nullptr;
  }
}

}  // namespace tb_run_test

TEST(TensorBoardRun, AKilledAndResumedRunsEventsEqualMetricsJsonlInTensorBoardsReader) {
  dew::test::TempDir tmp("tensorboard_run");
  const std::string run = tmp.file("run");
  const std::string cmd = tb_run_test::kTrain + " --run " + run;
  const pid_t pid = tb_run_test::spawn(cmd + " --trainer.steps 1000000", tmp.file("first.log"));
  const bool trained = tb_run_test::wait_for_lines(run, pid, 5);
  ::kill(pid, SIGKILL);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(trained) << dew::test::read_bytes(tmp.file("first.log"));
  const auto steps = dew::training::list_checkpoints(run);
  const int64_t resumed_from = steps.empty() ? 0 : steps.back();
  const int64_t end = resumed_from + 3;
  const auto again = dew::test::run_dew(cmd + " --trainer.steps " + std::to_string(end));
  ASSERT_EQ(again.code, 0) << again.output;

  // metrics.jsonl: the scalars TensorBoard must show, (tag, step) -> value.
  std::map<std::pair<std::string, int64_t>, double> expected;
  std::ifstream metrics(run + "/metrics.jsonl");
  std::string line;
  while (std::getline(metrics, line)) {
    const auto j = nlohmann::json::parse(line);
    const int64_t step = j["step"].get<int64_t>();
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (!it->is_number() || it.key() == "step" || it.key() == "time") continue;
      EXPECT_TRUE(expected.emplace(std::make_pair(it.key(), step), it->get<double>()).second)
          << it.key() << " twice at step " << step << " in metrics.jsonl";
    }
  }
  ASSERT_TRUE(expected.count({"train/loss", end})) << "metrics.jsonl has no train/loss at step " << end;
  ASSERT_TRUE(expected.count({"val/sample_std", end}));

  std::string output;
  const auto tb = tb_run_test::run_script("tb_read.py", run + "/tensorboard", output);
  ASSERT_TRUE(tb.is_object()) << "tb_read.py with " << DEW_PYTHON << " failed (is tensorboard installed? "
                              << "scripts/setup installs it):\n"
                              << output;
  std::map<std::pair<std::string, int64_t>, int> seen;
  for (const auto& s : tb["scalars"]) {
    const auto key = std::make_pair(s[0].get<std::string>(), s[1].get<int64_t>());
    ++seen[key];
    auto it = expected.find(key);
    if (it == expected.end()) {
      ADD_FAILURE() << "TensorBoard has " << key.first << " at step " << key.second << ", metrics.jsonl does not";
      continue;
    }
    EXPECT_EQ(s[2].get<double>(), double(float(it->second))) << key.first << " at step " << key.second;
  }
  for (const auto& [key, value] : expected)
    EXPECT_EQ(seen[key], 1) << key.first << " at step " << key.second << " is in TensorBoard " << seen[key]
                            << " times (metrics.jsonl: " << value << ")";

  // The final validation's grid, with the PNG's size.
  const auto png =
      dew::io::tb::png_header(dew::test::read_bytes(run + "/samples/step_" + std::to_string(end) + ".png"));
  ASSERT_EQ(tb["images"].size(), 1u) << tb["images"].dump();
  EXPECT_EQ(tb["images"][0][0], "samples");
  EXPECT_EQ(tb["images"][0][1].get<int64_t>(), end);
  EXPECT_EQ(tb["images"][0][2].get<int64_t>(), png.width);
  EXPECT_EQ(tb["images"][0][3].get<int64_t>(), png.height);
  EXPECT_GT(tb["images"][0][4].get<int64_t>(), 0);

  // The recipe once per start: at step 0 and at the step resumed from (once when both are 0).
  std::vector<int64_t> recipe_steps;
  for (const auto& t : tb["texts"])
    if (t[0] == "recipe") {
      recipe_steps.push_back(t[1].get<int64_t>());
      EXPECT_NE(t[2].get<std::string>().find("simple_dit"), std::string::npos) << t[2];
    }
  std::sort(recipe_steps.begin(), recipe_steps.end());
  const std::vector<int64_t> starts =
      resumed_from == 0 ? std::vector<int64_t>{0} : std::vector<int64_t>{0, resumed_from};
  EXPECT_EQ(recipe_steps, starts);
}

TEST(TensorBoardRun, OffWritesNoEventFilesAndABadValueIsRefusedByName) {
  dew::test::TempDir tmp("tensorboard_off");
  const std::string run = tmp.file("run");
  const auto off = dew::test::run_dew(tb_run_test::kTrain + " --trainer.steps 2 --tensorboard off --run " + run);
  ASSERT_EQ(off.code, 0) << off.output;
  EXPECT_TRUE(fs::exists(run + "/metrics.jsonl"));
  EXPECT_FALSE(fs::exists(run + "/tensorboard"));
  const auto bad =
      dew::test::run_dew(tb_run_test::kTrain + " --trainer.steps 2 --tensorboard maybe --run " + tmp.file("bad"));
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.output.find("trainer.tensorboard"), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("maybe"), std::string::npos) << bad.output;
}

TEST(TensorBoardRun, TheLossChartIsDrawnOnTheScalarsPageInHeadlessChromium) {
  dew::test::TempDir tmp("tensorboard_browser");
  const std::string run = tmp.file("run");
  const auto trained = dew::test::run_dew(tb_run_test::kTrain + " --trainer.steps 6 --run " + run);
  ASSERT_EQ(trained.code, 0) << trained.output;
  std::string output;
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = tb_run_test::run_script("tb_browser_check.py", run + "/tensorboard " + tmp.file("browser"), output);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(r.is_object()) << output;
  EXPECT_EQ(r["points"].get<int64_t>(), 6) << output;
  EXPECT_GE(r["line_pixels"].get<int64_t>(), 100) << output;
  std::printf("browser check: %.1f s (%s)\n", secs, r.dump().c_str());
}

TEST(TensorBoardRun, AnAutoencodersReconstructionsAndItsEvalRowsAreInTensorBoard) {
  dew::test::TempDir tmp("tensorboard_eval");
  const std::string run = tmp.file("run");
  const auto trained = dew::test::run_dew(
      "train autoencoder --run " + run +
      " --data '{\"name\":\"gaussian_blobs\",\"count\":48,\"size\":16,\"classes\":3}'"
      " --test_data '{\"name\":\"gaussian_blobs\",\"count\":24,\"size\":16,\"classes\":3,\"seed\":1}'"
      " --model.fields '{\"block_out_channels\":[8,16],\"layers_per_block\":1,\"latent_channels\":2,\"norm_groups\":4}'"
      " --loader.batch_size 8 --trainer.log_every 1 --trainer.val_every 0 --trainer.steps 3");
  ASSERT_EQ(trained.code, 0) << trained.output;
  const auto eval = dew::test::run_dew("eval " + run);
  ASSERT_EQ(eval.code, 0) << eval.output;
  const auto row = nlohmann::json::parse(dew::test::read_bytes(run + "/eval.jsonl"));
  std::string output;
  const auto tb = tb_run_test::run_script("tb_read.py", run + "/tensorboard", output);
  ASSERT_TRUE(tb.is_object()) << output;
  std::map<std::string, std::pair<int64_t, double>> scalars;
  for (const auto& s : tb["scalars"]) scalars[s[0].get<std::string>()] = {s[1].get<int64_t>(), s[2].get<double>()};
  for (const char* name : {"psnr", "ssim", "l1", "kl", "images"}) {
    const std::string tag = std::string("eval/ema/") + name;
    ASSERT_TRUE(scalars.count(tag)) << tag << " missing: " << tb["tags"].dump();
    EXPECT_EQ(scalars[tag].first, 3) << tag;
    EXPECT_EQ(scalars[tag].second, double(float(row[name].get<double>()))) << tag;
  }
  bool eval_text = false, grid = false;
  for (const auto& t : tb["texts"])
    if (t[0] == "eval" && t[1] == 3) eval_text = t[2].get<std::string>().find("dew eval") != std::string::npos;
  for (const auto& i : tb["images"]) grid = grid || (i[0] == "samples" && i[1] == 3);
  EXPECT_TRUE(eval_text) << tb["texts"].dump();
  EXPECT_TRUE(grid) << "the reconstructions of the final validation: " << tb["images"].dump();
}
