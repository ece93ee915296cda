// One writer per run and graceful stops, through the CLI: a second `dew train` or `dew eval` of a run that a
// live process is training is refused with the holder's PID before any work; SIGTERM checkpoints and exits 0
// with a line on how to resume; a killed writer's lock is taken over by the next command.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "dew/core/error.h"
#include "dew/io/files.h"
#include "dew/training/checkpoint.h"
#include "tests/test_util.h"

extern char** environ;

namespace fs = std::filesystem;

namespace {

using dew::test::run_dew;

const std::string kTrain =
    "train diffusion --data '{\"name\":\"gaussian_blobs\",\"count\":64,\"size\":8,\"classes\":3}'"
    " --model.architecture simple_dit"
    " --model.fields '{\"patch_size\":2,\"emb_features\":16,\"num_layers\":1,\"num_heads\":2}'"
    " --loader.batch_size 8 --trainer.log_every 1 --trainer.val_every 0 --trainer.time_limit_minutes 0"
    " --objective.steps 2 --objective.preview_per_class 1";

// Starts `dew ARGS` with its output in `log`; the PID is dew's own (the shell execs it).
pid_t spawn_dew(const std::string& args, const std::string& log) {
  const std::string cmd = "exec " + std::string(DEW_BINARY) + " " + args + " >" + log + " 2>&1";
  const char* argv[] = {"/bin/sh", "-c", cmd.c_str(), nullptr};
  pid_t pid = -1;
  EXPECT_EQ(posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ), 0);
  return pid;
}

// Waits (bounded) until the run has logged a step: the trainer's signal handlers are installed by then.
bool wait_for_training(const std::string& run, pid_t pid) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return false;  // ended before training
    std::ifstream m(run + "/metrics.jsonl");
    std::string line;
    if (std::getline(m, line) && !line.empty()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

}  // namespace

TEST(RunWriter, ASecondWriterIsRefusedWithTheHoldersPidAndSigtermCheckpointsAndExitsZero) {
  dew::test::TempDir tmp("run_writer");
  const std::string run = tmp.file("run");
  const std::string cmd = kTrain + " --trainer.steps 1000000 --trainer.checkpoint_every 100000 --run " + run;
  const pid_t pid = spawn_dew(cmd, tmp.file("first.log"));
  ASSERT_TRUE(wait_for_training(run, pid)) << read_text(tmp.file("first.log"));
  const std::string holder = "being written by process " + std::to_string(pid);

  // A second training of the run: one line naming the holder, exit 2, before a model is built.
  auto second = run_dew(cmd);
  EXPECT_EQ(second.code, 2) << second.output;
  EXPECT_NE(second.output.find(holder), std::string::npos) << second.output;
  EXPECT_NE(second.output.find("writer.lock"), std::string::npos) << second.output;
  EXPECT_EQ(dew::test::count_lines(second.output), 1u) << second.output;
  // eval writes its rows into the run: refused alike.
  auto eval = run_dew("eval " + run + " --count 8");
  EXPECT_EQ(eval.code, 2) << eval.output;
  EXPECT_NE(eval.output.find(holder), std::string::npos) << eval.output;
  // Readers need no lock.
  auto list = run_dew("list");
  EXPECT_EQ(list.code, 0) << list.output;

  // SIGTERM: the current step finishes, a checkpoint is written, exit 0 with how to resume.
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  const std::string out = read_text(tmp.file("first.log"));
  ASSERT_TRUE(WIFEXITED(status)) << "ended by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0) << "\n" << out;
  EXPECT_EQ(WEXITSTATUS(status), 0) << out;
  EXPECT_NE(out.find("rerun the same command to resume"), std::string::npos) << out;
  const auto steps = dew::training::list_checkpoints(run);
  ASSERT_EQ(steps.size(), 1u) << out;
  EXPECT_GT(steps.back(), 0);
  EXPECT_LT(steps.back(), 100000);  // the checkpoint of the stop, not a periodic one
  dew::training::load_checkpoint(run, steps.back());

  // The lock went with the process: the same run resumes (two more steps) and ends normally.
  auto resumed = run_dew(kTrain + " --trainer.steps " + std::to_string(steps.back() + 2) +
                         " --trainer.checkpoint_every 100000 --run " + run);
  EXPECT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_EQ(dew::training::latest_checkpoint(run), steps.back() + 2) << resumed.output;
}

TEST(RunWriter, AKilledWritersLockIsTakenOver) {
  dew::test::TempDir tmp("run_writer_killed");
  const std::string run = tmp.file("run");
  const std::string cmd = kTrain + " --trainer.checkpoint_every 2 --run " + run;
  const pid_t pid = spawn_dew(cmd + " --trainer.steps 1000000", tmp.file("first.log"));
  ASSERT_TRUE(wait_for_training(run, pid)) << read_text(tmp.file("first.log"));
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  // The lock file still names the dead holder; nothing holds the lock.
  EXPECT_EQ(read_text(run + "/writer.lock"), std::to_string(pid) + "\n");
  EXPECT_NO_THROW(dew::io::FileLock::check_free(run + "/writer.lock", "run", ""));
  const auto steps = dew::training::list_checkpoints(run);
  const int64_t end = (steps.empty() ? 0 : steps.back()) + 2;
  auto again = run_dew(cmd + " --trainer.steps " + std::to_string(end));
  EXPECT_EQ(dew::training::latest_checkpoint(run), end) << again.output;
  EXPECT_EQ(again.code, 0) << again.output;
}

TEST(RunWriter, TheLockIsExclusiveWithinAndAcrossOpenings) {
  dew::test::TempDir tmp("file_lock");
  const std::string path = tmp.file("writer.lock");
  {
    dew::io::FileLock a(path, "run x", "use another");
    EXPECT_EQ(read_text(path), std::to_string(::getpid()) + "\n");
    try {
      dew::io::FileLock b(path, "run x", "use another");
      FAIL() << "a second lock was taken";
    } catch (const dew::Error& e) {
      EXPECT_NE(std::string(e.what()).find("run x is being written by process " + std::to_string(::getpid())),
                std::string::npos)
          << e.what();
    }
    EXPECT_THROW(dew::io::FileLock::check_free(path, "run x", "use another"), dew::Error);
  }
  // Released with its holder, and the PID is cleared.
  EXPECT_NO_THROW(dew::io::FileLock::check_free(path, "run x", "use another"));
  EXPECT_EQ(read_text(path), "");
  dew::io::FileLock c(path, "run x", "use another");
}
