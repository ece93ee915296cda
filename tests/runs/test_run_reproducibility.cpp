// Runs are reproducible at the process level (docs/core.md): the same `dew train` command in two fresh
// run directories writes bitwise-identical checkpoints, whatever the number of loader workers; a run
// killed with SIGKILL at random moments (start-up, steps, checkpoint writes) and rerun ends bit for bit
// where an uninterrupted run ends, and every kill leaves its latest checkpoint loadable.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "dew/training/checkpoint.h"
#include "tests/data/tiny_tokens.h"
#include "tests/runs/checkpoint_checks.h"
#include "tests/test_util.h"

extern char** environ;

namespace fs = std::filesystem;

namespace {

using dew::test::run_dew;

const std::string kDiffusion =
    "train diffusion --data '{\"name\":\"gaussian_blobs\",\"count\":64,\"size\":8,\"classes\":3}'"
    " --model.architecture simple_dit"
    " --model.fields '{\"patch_size\":2,\"emb_features\":32,\"num_layers\":1,\"num_heads\":2}'"
    " --loader.batch_size 8 --trainer.log_every 2 --objective.steps 2 --objective.preview_per_class 1";

using dew::test::expect_same_checkpoint;
using dew::test::read_bytes;

// Starts `dew ARGS` (through the shell, which execs it) with its output discarded; returns the pid.
pid_t spawn_dew(const std::string& args) {
  const std::string cmd = "exec " + std::string(DEW_BINARY) + " " + args + " >/dev/null 2>&1";
  const char* argv[] = {"/bin/sh", "-c", cmd.c_str(), nullptr};
  pid_t pid = -1;
  EXPECT_EQ(posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ), 0);
  return pid;
}

// Kills `args` with SIGKILL `kills` times, rerunning it after each kill, then reruns it to the end. Every
// third kill lands at a random moment of start-up (before the first step can finish); the others wait until
// the run has written 1 to 3 more checkpoints and then kill within the next 15 ms (mid-step or mid-write),
// so the kills depend on the run's progress, not on this machine's speed. After each kill the latest
// checkpoint must load. Returns the number of kills that hit a running process.
int kill_and_rerun(const std::string& args, const std::string& dir, int64_t checkpoint_every, int kills,
                   uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> startup(0.0, 0.4), settle(0.0, 0.015);
  std::uniform_int_distribution<int> advance(1, 3);
  int hit = 0;
  for (int k = 0; k < kills; ++k) {
    SCOPED_TRACE("kill " + std::to_string(k));
    auto steps = dew::training::list_checkpoints(dir);
    const int64_t before = steps.empty() ? 0 : steps.back();
    const pid_t pid = spawn_dew(args);
    int status = 0;
    bool ended = false;
    if (k % 3 == 0) {
      std::this_thread::sleep_for(std::chrono::duration<double>(startup(rng)));
    } else {
      // Wait (bounded) until the latest checkpoint is `advance` checkpoints past the one the run resumed from.
      const int64_t want = before + advance(rng) * checkpoint_every;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      while (std::chrono::steady_clock::now() < deadline) {
        if (waitpid(pid, &status, WNOHANG) == pid) {
          ended = true;
          break;
        }
        auto now = dew::training::list_checkpoints(dir);
        if (!now.empty() && now.back() >= want) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      std::this_thread::sleep_for(std::chrono::duration<double>(settle(rng)));
    }
    if (!ended && waitpid(pid, &status, WNOHANG) == 0) {
      ::kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ++hit;
    }
    steps = dew::training::list_checkpoints(dir);
    if (!steps.empty()) {
      auto c = dew::training::load_checkpoint(dir, steps.back());  // throws on a torn checkpoint
      EXPECT_EQ(c.step, steps.back());
      EXPECT_FALSE(c.model.empty());
    }
  }
  auto r = run_dew(args);
  EXPECT_EQ(r.code, 0) << r.output;
  return hit;
}

// A JEPA run on 16 x 16 blobs (8 x 8 tokens): masks, the EMA target encoder and the predictor.
const std::string kJepaRun =
    "train jepa --data '{\"name\":\"gaussian_blobs\",\"count\":64,\"size\":16,\"classes\":4}'"
    " --model.fields '{\"patch_size\":2,\"emb_features\":16,\"num_layers\":1,\"num_heads\":2}'"
    " --predictor.fields '{\"emb_features\":8,\"num_layers\":1,\"num_heads\":2}'"
    " --loader.batch_size 8 --trainer.log_every 2 --trainer.time_limit_minutes 0 --objective.probe_train 0";

std::string lm_command(const std::string& tokens) {
  return "train lm --data.name tokens --data.dir " + tokens +
         " --model.fields '{\"emb_features\":32,\"num_layers\":1,\"num_heads\":2,\"max_seq_len\":64,\"dropout\":0.1}'"
         " --objective.seq_len 16 --objective.sample_tokens 4 --loader.batch_size 4"
         " --trainer.log_every 2 --trainer.val_every 0 --trainer.time_limit_minutes 0";
}

}  // namespace

TEST(RunReproducibility, DiffusionSameCommandSameBitsAtAnyWorkerCount) {
  dew::test::TempDir tmp("repro_diffusion");
  const std::string steps = " --trainer.steps 6 --trainer.checkpoint_every 3";
  for (const char* dir : {"w0a", "w0b", "w1a", "w1b"}) {
    const std::string workers = dir[1] == '0' ? " --loader.num_workers 0" : " --loader.num_workers 1";
    auto r = run_dew(kDiffusion + steps + workers + " --run " + tmp.file(dir));
    ASSERT_EQ(r.code, 0) << r.output;
  }
  for (const char* dir : {"w0b", "w1a", "w1b"}) {
    expect_same_checkpoint(tmp.file("w0a"), tmp.file(dir), 3);
    expect_same_checkpoint(tmp.file("w0a"), tmp.file(dir), 6);
  }
  // Another seed is another run: other initial weights, other data order and noise.
  auto r = run_dew(kDiffusion + steps + " --seed 1 --run " + tmp.file("seed1"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(read_bytes(tmp.path / "w0a/checkpoints/step_6/model.safetensors") ==
               read_bytes(tmp.path / "seed1/checkpoints/step_6/model.safetensors"));
}

TEST(RunReproducibility, LanguageModelSameCommandSameBits) {
  dew::test::TempDir tmp("repro_lm");
  const std::string cmd =
      lm_command(dew::test::write_tiny_tokens(tmp.file("tokens"))) + " --trainer.steps 6 --trainer.checkpoint_every 3";
  for (const char* dir : {"a", "b"}) {
    auto r = run_dew(cmd + " --run " + tmp.file(dir));
    ASSERT_EQ(r.code, 0) << r.output;
  }
  auto r = run_dew(cmd + " --loader.num_workers 0 --run " + tmp.file("w0"));
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* dir : {"b", "w0"}) {
    expect_same_checkpoint(tmp.file("a"), tmp.file(dir), 3);
    expect_same_checkpoint(tmp.file("a"), tmp.file(dir), 6);
  }
  r = run_dew(cmd + " --seed 7 --run " + tmp.file("seed7"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(read_bytes(tmp.path / "a/checkpoints/step_6/model.safetensors") ==
               read_bytes(tmp.path / "seed7/checkpoints/step_6/model.safetensors"));
}

TEST(RunReproducibility, JepaSameCommandSameBitsAndKilledRunsEndBitForBit) {
  dew::test::TempDir tmp("repro_jepa");
  // With I-JEPA's augmentations (a resized crop and a flip per item), whose draws come from (seed, epoch,
  // position) on the loader's worker.
  const std::string plain = kJepaRun + " --trainer.steps 60 --trainer.checkpoint_every 2";
  const std::string cmd = plain + " --loader.crop_scale '[0.3,1.0]' --loader.hflip true";
  for (const char* dir : {"a", "b"}) {
    auto r = run_dew(cmd + " --run " + tmp.file(dir));
    ASSERT_EQ(r.code, 0) << r.output;
  }
  expect_same_checkpoint(tmp.file("a"), tmp.file("b"), 60);
  // The augmentations change the run: without them the same seed ends elsewhere.
  auto r = run_dew(plain + " --run " + tmp.file("plain"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(read_bytes(tmp.path / "a/checkpoints/step_60/model.safetensors") ==
               read_bytes(tmp.path / "plain/checkpoints/step_60/model.safetensors"));
  // Masks come from (seed, step): a killed run rerun draws the same ones and ends on the same bits.
  const int hit = kill_and_rerun(cmd + " --run " + tmp.file("killed"), tmp.file("killed"), 2, 6, 11);
  EXPECT_GE(hit, 4);
  expect_same_checkpoint(tmp.file("a"), tmp.file("killed"), 60);
}

TEST(RunReproducibility, GrpoSameCommandSameBitsAndKilledRunsEndBitForBit) {
  dew::test::TempDir tmp("repro_grpo");
  auto r = run_dew("task sums --digits 1 --test 20 --out " + tmp.file("sums"));
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_dew("train sft --data " + tmp.file("sums/sft.jsonl") +
              " --model.fields '{\"emb_features\":32,\"num_layers\":1,\"num_heads\":2,\"max_seq_len\":48}'"
              " --trainer.steps 4 --trainer.val_every 0 --eval.prompts '' --loader.batch_size 8 --run " +
              tmp.file("sft"));
  ASSERT_EQ(r.code, 0) << r.output;
  // Rollouts sample from (seed, step); the buffer of a rollout that feeds two updates is checkpointed, so a
  // kill between them resumes from it. A format reward a random model meets about half the time gives the
  // advantages something to push.
  const std::string cmd = "train grpo --init_from " + tmp.file("sft") + " --prompts " +
                          tmp.file("sums/train_prompts.jsonl") +
                          " --reward format --reward_options.format '[\\s\\S]*[0-4][\\s\\S]*' --eval.prompts ''"
                          " --loader.batch_size 2 --objective.group_size 3 --objective.max_new_tokens 4"
                          " --objective.mini_batches 2 --trainer.log_every 2 --trainer.time_limit_minutes 0"
                          " --trainer.steps 40 --trainer.checkpoint_every 1";
  for (const char* dir : {"a", "b"}) {
    r = run_dew(cmd + " --run " + tmp.file(dir));
    ASSERT_EQ(r.code, 0) << r.output;
  }
  expect_same_checkpoint(tmp.file("a"), tmp.file("b"), 40);
  EXPECT_FALSE(read_bytes(tmp.path / "a/checkpoints/step_40/model.safetensors") ==
               read_bytes(tmp.path / "sft/checkpoints/step_4/model.safetensors"))
      << "the policy never moved: the test would not see a wrong resume";
  const int hit = kill_and_rerun(cmd + " --run " + tmp.file("killed"), tmp.file("killed"), 1, 6, 17);
  EXPECT_GE(hit, 3);
  expect_same_checkpoint(tmp.file("a"), tmp.file("killed"), 40);
  // The rollout log of the killed run holds each rollout once, as the whole run's does.
  EXPECT_EQ(read_bytes(tmp.path / "a/rollouts.jsonl"), read_bytes(tmp.path / "killed/rollouts.jsonl"));
}

TEST(RunReproducibility, DiffusionKilledAtRandomMomentsEndsBitForBit) {
  dew::test::TempDir tmp("kill_diffusion");
  // A checkpoint every step: much of the run is spent writing checkpoints, so kills land inside writes too.
  const std::string cmd = kDiffusion + " --trainer.steps 160 --trainer.checkpoint_every 1";
  auto r = run_dew(cmd + " --run " + tmp.file("whole"));
  ASSERT_EQ(r.code, 0) << r.output;
  // 12 kills advance the run by at most 8 x 3 checkpoints of its 160: every kill finds it running.
  const int hit = kill_and_rerun(cmd + " --run " + tmp.file("killed"), tmp.file("killed"), 1, 12, 20261201);
  EXPECT_EQ(hit, 12);
  expect_same_checkpoint(tmp.file("whole"), tmp.file("killed"), 160);
}

TEST(RunReproducibility, LanguageModelKilledAtRandomMomentsEndsBitForBit) {
  dew::test::TempDir tmp("kill_lm");
  // Dropout on: its draws must come from the run's seed and step, not the process.
  const std::string cmd = lm_command(dew::test::write_tiny_tokens(tmp.file("tokens"))) +
                          " --trainer.steps 160 --trainer.checkpoint_every 3";
  auto r = run_dew(cmd + " --run " + tmp.file("whole"));
  ASSERT_EQ(r.code, 0) << r.output;
  // 12 kills advance the run by at most 8 x 3 checkpoints (72 steps) of its 160.
  const int hit = kill_and_rerun(cmd + " --run " + tmp.file("killed"), tmp.file("killed"), 3, 12, 7);
  EXPECT_EQ(hit, 12);
  expect_same_checkpoint(tmp.file("whole"), tmp.file("killed"), 160);
}

namespace {

// Every file under a directory with its bytes.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out[fs::relative(e.path(), dir).string()] = read_bytes(e.path());
  return out;
}

}  // namespace

TEST(RunValidation, FailedCommandsLeaveTheRunDirectoryAsItWas) {
  dew::test::TempDir tmp("validate_first");
  const std::string dir = tmp.file("run");
  auto r = run_dew(kDiffusion + " --trainer.steps 2 --trainer.checkpoint_every 2 --run " + dir);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto before = snapshot(dir);
  // An empty classifier cache: `dew eval` would train the classifier (minutes) before sampling.
  const std::string cache = tmp.file("cache");
  fs::create_directories(cache);
  const std::string env = "DEW_CACHE=" + cache + " ";
  struct Case {
    std::string args, needle;
  };
  const std::vector<Case> cases = {
      {kDiffusion + " --trainer.steps 4 --model.fields.num_layers 2 --run " + dir, "was trained with model"},
      {kDiffusion + " --trainer.steps 4 --seed 3 --run " + dir, "was trained with seed"},
      {kDiffusion + " --trainer.steps 4 --optim.lr -1 --run " + dir, "optim.lr"},
      {kDiffusion + " --trainer.steps 4 --device cuda:7 --run " + dir, "device"},
      {kDiffusion + " --trainer.steps 4 --objective.sampler bogus --run " + dir, "bogus"},
      {"sample " + dir + " --solver bogus --out " + tmp.file("x.png"), "bogus"},
      {"sample " + dir + " --step 99", "no checkpoint of step 99"},
      {"sample " + dir + " --device tpu", "--device: got \"tpu\""},
      {"generate " + dir, "not a language-model run"},
      {"export " + dir + " " + tmp.file("hf"), "not a language-model run"},
  };
  for (const auto& c : cases) {
    r = run_dew(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << c.args << "\n" << r.output;
  }
  // eval checks its solvers before the classifier trains, on a (one-step) Fashion-MNIST run.
  const std::string fm = tmp.file("fm");
  r = run_dew(
      "train diffusion --data '{\"name\":\"fashion_mnist\",\"split\":\"test\"}' --model.architecture simple_dit"
      " --model.fields '{\"patch_size\":4,\"emb_features\":16,\"num_layers\":1,\"num_heads\":2}'"
      " --loader.batch_size 4 --trainer.steps 1 --objective.steps 1 --objective.preview_per_class 1 --run " +
      fm);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto fm_before = snapshot(fm);
  for (const std::string flags :
       {"--solvers euler,bogus", "--solvers euler --count 15", "--solvers euler --steps 0", "--solvers rk4"}) {
    r = run_dew(env + "eval " + fm + " " + flags);
    EXPECT_EQ(r.code, 2) << flags << "\n" << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
  EXPECT_TRUE(fs::is_empty(cache)) << "eval trained the classifier before refusing its input";
  EXPECT_TRUE(snapshot(fm) == fm_before) << "a failed eval changed " << fm;
  EXPECT_TRUE(snapshot(dir) == before) << "a failed command changed " << dir;
  EXPECT_FALSE(fs::exists(tmp.file("hf")));
}
