// One writer per run and graceful stops, through the CLI: a second `dew train` or `dew eval` of a run that a
// live process is training is refused with the holder's PID before any work; SIGTERM checkpoints and exits 0
// with a line on how to resume; a killed writer's lock is taken over by the next command; `dew sample` and
// `dew eval` stopped by a signal exit 128 + the signal without writing anything; and, in forked children,
// what each kind of io::StopScope does with a first and a second signal and the temporary files.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <thread>

#include "dew/core/error.h"
#include "dew/io/files.h"
#include "dew/io/stops.h"
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

// Waits (bounded) until `log` holds `marker`: the command is past its checks and in its long work.
bool wait_for_line(const std::string& log, const std::string& marker, pid_t pid) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline) {
    if (read_text(log).find(marker) != std::string::npos) return true;
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// Every entry under `root` by relative path: a file's bytes, "<dir>" for a directory.
std::map<std::string, std::string> tree(const fs::path& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root))
    out[fs::relative(e.path(), root).string()] = e.is_directory() ? std::string("<dir>") : read_text(e.path());
  return out;
}

// Sends `sig` to `pid` and returns its exit code (128 + the signal when a signal ended it).
int stop_and_wait(pid_t pid, int sig) {
  EXPECT_EQ(::kill(pid, sig), 0);
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
}

// Runs `body` in a forked child and returns its wait status; `body`'s return value is the child's exit code.
int in_child(const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    int code = 90;
    try {
      code = body();
    } catch (...) {
      code = 91;
    }
    ::_exit(code);
  }
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  return status;
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

TEST(GracefulStops, SampleAndEvalStoppedBySignalsExitWithoutWritingAnything) {
  dew::test::TempDir tmp("stopped_commands");
  // `dew sample`: SIGINT during its (long) sampling; exit 130, one line, no image and no folder for it.
  const std::string run = tmp.file("run");
  ASSERT_EQ(run_dew(kTrain + " --trainer.steps 2 --run " + run).code, 0);
  const auto run_before = tree(run);
  const std::string out = tmp.file("out/grid.png");
  pid_t pid = spawn_dew("sample " + run + " --steps 100000 --count 60 --out " + out, tmp.file("sample.log"));
  ASSERT_TRUE(wait_for_line(tmp.file("sample.log"), "sampling 60 samples", pid)) << read_text(tmp.file("sample.log"));
  EXPECT_EQ(stop_and_wait(pid, SIGINT), 128 + SIGINT) << read_text(tmp.file("sample.log"));
  std::string log = read_text(tmp.file("sample.log"));
  EXPECT_NE(log.find("\ndew: stopped by SIGINT; no output was written"), std::string::npos) << log;
  EXPECT_EQ(log.find("Aborted"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(tmp.file("out"))) << log;
  EXPECT_EQ(tree(run), run_before);

  // `dew eval` of an autoencoder run over a large held-out set: SIGTERM while it reconstructs; exit 143 and
  // the run byte for byte as before (no eval.jsonl row, no TensorBoard event; the writer lock released).
  const std::string ae = tmp.file("ae");
  const auto trained = run_dew(
      "train autoencoder --run " + ae +
      " --data '{\"name\":\"gaussian_blobs\",\"count\":16,\"size\":16,\"classes\":2}'"
      " --test_data '{\"name\":\"gaussian_blobs\",\"count\":200000,\"size\":16,\"classes\":2,\"seed\":1}'"
      " --model.fields '{\"block_out_channels\":[8,16],\"layers_per_block\":1,\"latent_channels\":2,\"norm_groups\":4}'"
      " --loader.batch_size 8 --trainer.log_every 1 --trainer.val_every 0 --trainer.steps 1");
  ASSERT_EQ(trained.code, 0) << trained.output;
  const auto ae_before = tree(ae);
  pid = spawn_dew("eval " + ae, tmp.file("eval.log"));
  ASSERT_TRUE(wait_for_line(tmp.file("eval.log"), "reconstructing 200000 held-out images", pid))
      << read_text(tmp.file("eval.log"));
  EXPECT_EQ(stop_and_wait(pid, SIGTERM), 128 + SIGTERM) << read_text(tmp.file("eval.log"));
  log = read_text(tmp.file("eval.log"));
  EXPECT_NE(log.find("\ndew: stopped by SIGTERM; no output was written"), std::string::npos) << log;
  EXPECT_EQ(tree(ae), ae_before) << log;
}

TEST(GracefulStops, EachKindOfScopeAnswersTheFirstAndSecondSignal) {
  using dew::io::OnStop;
  using dew::io::StopScope;
  using dew::io::TempFile;
  dew::test::TempDir tmp("stop_scopes");
  const std::string kept = tmp.write("kept.txt", "a file nobody registered\n");

  // kAtCheck: the first signal is remembered and check_stop() throws Stopped naming it; the second ends the
  // process by its own default action, and the registered temporary file is gone.
  const std::string t1 = tmp.file("one.tmp");
  int status = in_child([&] {
    StopScope scope(OnStop::kAtCheck);
    TempFile t(t1);
    std::ofstream(t.path()) << "partial";
    ::raise(SIGINT);
    if (dew::io::stop_signal() != SIGINT) return 2;
    try {
      dew::io::check_stop();
      return 3;
    } catch (const dew::io::Stopped& e) {
      if (e.signal() != SIGINT || std::string(e.what()) != "stopped by SIGINT") return 4;
    }
    ::raise(SIGTERM);
    return 5;  // not reached: SIGTERM ended the process
  });
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << status;
  EXPECT_FALSE(fs::exists(t1));
  EXPECT_TRUE(fs::exists(kept));

  // kAfterStep inside kExit: the first signal is only remembered (check_stop() does not throw); once the
  // inner scope ends, kExit's answer is back: a signal removes the temporary file and ends the process.
  const std::string t2 = tmp.file("two.tmp");
  status = in_child([&] {
    StopScope outer(OnStop::kExit);
    TempFile t(t2);
    std::ofstream(t.path()) << "partial";
    {
      StopScope inner(OnStop::kAfterStep);
      ::raise(SIGINT);
      if (!dew::io::stop_requested()) return 2;
      dew::io::check_stop();  // no throw: the trainer polls stop_requested() instead
    }
    ::raise(SIGINT);
    return 5;
  });
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT) << status;
  EXPECT_FALSE(fs::exists(t2));

  // The outermost scope gives back the handlers it found: the default action again, which removes nothing.
  const std::string t3 = tmp.file("three.tmp");
  status = in_child([&] {
    { StopScope scope(OnStop::kAtCheck); }
    TempFile t(t3);
    std::ofstream(t.path()) << "partial";
    ::raise(SIGTERM);
    return 5;
  });
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << status;
  EXPECT_TRUE(fs::exists(t3));

  // In the process: a TempFile's file is gone when the TempFile is (an exception, a return), renamed or not.
  const std::string t4 = tmp.file("four.tmp");
  try {
    TempFile t(t4);
    std::ofstream(t.path()) << "partial";
    throw dew::Error("write failed");
  } catch (const dew::Error&) {}
  EXPECT_FALSE(fs::exists(t4));
  // write_file_atomic leaves the file and no temporary.
  dew::io::write_file_atomic(tmp.file("done.txt"), "whole\n");
  EXPECT_EQ(read_text(tmp.file("done.txt")), "whole\n");
  EXPECT_FALSE(fs::exists(tmp.file("done.txt.tmp")));
}
