// The dew program end to end: a tiny training run, sampling, resume, and one-line errors with exit 2.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "dew/core/options.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace {

using Result = dew::test::CliResult;
using dew::test::run_dew;

std::string tmp(const std::string& name) {
  auto d = fs::path(::testing::TempDir()) / ("dew_cli_" + name);
  fs::remove_all(d);
  return d.string();
}

const std::string kTiny =
    " --data '{\"name\":\"gaussian_blobs\",\"count\":64,\"size\":8,\"classes\":3}'"
    " --model.architecture simple_dit"
    " --model.fields '{\"patch_size\":2,\"emb_features\":32,\"num_layers\":1,\"num_heads\":2}'"
    " --loader.batch_size 8 --trainer.log_every 2 --trainer.checkpoint_every 3 --objective.steps 3";

}  // namespace

TEST(Cli, TrainsSamplesAndResumes) {
  auto dir = tmp("run");
  auto r = run_dew("train diffusion --run " + dir + " --trainer.steps 4" + kTiny);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(dir) / "checkpoints" / "step_4" / "ema.safetensors")) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(dir) / "samples" / "step_4.png"));
  auto record = dew::json::parse(std::ifstream(fs::path(dir) / "run.json"));
  EXPECT_EQ(record["model"]["fields"]["num_classes"], 3);  // filled in from the data
  EXPECT_EQ(record["derived"]["sample_shape"], dew::json({1, 8, 8}));
  // rerunning with more steps resumes from step 4
  r = run_dew("train diffusion --run " + dir + " --trainer.steps 6" + kTiny);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("resuming"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(dir) / "checkpoints" / "step_6"));
  // sampling writes a grid
  auto out = (fs::path(dir) / "grid.png").string();
  r = run_dew("sample " + dir + " --steps 3 --solver dpmsolver++ --count 6 --out " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(out));
  // a different model on the same run directory is refused
  r = run_dew("train diffusion --run " + dir + " --trainer.steps 8" + kTiny + " --model.fields.num_layers 2");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("was trained with model"), std::string::npos) << r.output;
}

// objective.preview_per_class 0: a conditional run writes no preview grid (and names none), and ends well.
TEST(Cli, NoPreviewWhenNoneIsAskedFor) {
  auto dir = tmp("no_preview");
  auto r = run_dew("train diffusion --run " + dir + " --trainer.steps 3 --objective.preview_per_class 0" + kTiny);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(dir) / "checkpoints" / "step_3"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "samples" / "step_3.png"));
  EXPECT_EQ(r.output.find("preview:"), std::string::npos) << r.output;
}

TEST(Cli, BadInputIsOneLineAndExitTwo) {
  auto one_line_error = [](const Result& r, const std::string& needle) {
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
  };
  one_line_error(run_dew("frobnicate"), "unknown command \"frobnicate\"");
  one_line_error(run_dew("train diffusion --trainer.stepz 3"),
                 "unknown option --trainer.stepz; valid keys under trainer:");
  one_line_error(run_dew("train diffusion --trainer.steps many --run " + tmp("bad")),
                 "trainer.steps: expected an integer");
  one_line_error(run_dew("train diffusion --preset.name cosin --run " + tmp("bad2")), "unknown preset \"cosin\"");
  one_line_error(run_dew("sample " + tmp("missing")), "does not exist");
  auto empty = tmp("empty");
  fs::create_directories(empty);
  one_line_error(run_dew("sample " + empty), "run.json");
  one_line_error(run_dew("sample x --colour red"), "unknown flag --colour");
  one_line_error(run_dew("list gizmos"), "unknown kind \"gizmos\"");
}

TEST(Cli, HelpListsEveryRecipeField) {
  auto r = run_dew("train diffusion --help");
  EXPECT_EQ(r.code, 0);
  for (auto key : {"--trainer.steps", "--optim.lr", "--objective.guidance.scale", "--loader.batch_size",
                   "--preset.name", "feature_depths"})
    EXPECT_NE(r.output.find(key), std::string::npos) << key;
  r = run_dew("models");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.output.find("simple_dit"), std::string::npos);
  EXPECT_NE(r.output.find("unet"), std::string::npos);
}
