// Full disks and torn checkpoints, through the CLI (issue 44, item 4). A checkpoint write that fails (the
// file size limit of RLIMIT_FSIZE, with SIGXFSZ ignored, so write() returns EFBIG as on a full disk) leaves
// the earlier checkpoints byte for byte, says so in one line and exits 2; rerunning the same command resumes
// and ends bit for bit where an uninterrupted run ends. A truncated latest checkpoint is named, set aside
// and the run resumes from the newest complete one (again bit for bit); --strict-resume refuses instead,
// leaving the run directory as it was, as does a run whose every checkpoint is damaged.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>

#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace checkpoint_failures {

const std::string kTrain =
    "train diffusion --data '{\"name\":\"gaussian_blobs\",\"count\":64,\"size\":8,\"classes\":3}'"
    " --model.architecture simple_dit"
    " --model.fields '{\"patch_size\":2,\"emb_features\":16,\"num_layers\":1,\"num_heads\":2}'"
    " --loader.batch_size 8 --trainer.log_every 1 --trainer.val_every 0 --trainer.time_limit_minutes 0"
    " --trainer.checkpoint_every 2 --trainer.keep_checkpoints 3 --tensorboard off"
    " --objective.steps 2 --objective.preview_per_class 1";

struct Result {
  int code = -1;  // exit status; 128 + N when ended by signal N
  std::string out, err;
};

// Runs `dew ARGS` (split as a shell would) with stdout and stderr apart; `file_limit` > 0 sets RLIMIT_FSIZE
// in the child and ignores SIGXFSZ there, so a write past the limit fails with EFBIG instead of killing it.
Result run(const std::string& args, const std::string& logs, rlim_t file_limit = 0) {
  const std::string out = logs + "/out.txt", err = logs + "/err.txt";
  // DEW_THREADS_CACHE=off: every run here takes the same built-in thread split (and no info line announces a
  // measured one), so the runs compare bit for bit on any machine.
  const std::string cmd =
      "exec env DEW_THREADS_CACHE=off " + std::string(DEW_BINARY) + " " + args + " >" + out + " 2>" + err;
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (file_limit > 0) {
      ::signal(SIGXFSZ, SIG_IGN);  // inherited through exec: write() returns EFBIG
      rlimit lim{file_limit, file_limit};
      ::setrlimit(RLIMIT_FSIZE, &lim);
    }
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  Result r;
  int status = 0;
  if (pid > 0 && ::waitpid(pid, &status, 0) == pid)
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = dew::test::read_bytes(out);
  r.err = dew::test::read_bytes(err);
  return r;
}

// Every file under `root` by relative path with its bytes (directories as "<dir>").
std::map<std::string, std::string> tree(const fs::path& root) {
  std::map<std::string, std::string> out;
  if (!fs::exists(root)) return out;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    const std::string rel = fs::relative(e.path(), root).string();
    out[rel] = e.is_directory() ? std::string("<dir>") : dew::test::read_bytes(e.path());
  }
  return out;
}

std::string checkpoint_file(const std::string& run, int64_t step, const std::string& name) {
  return dew::test::read_bytes(fs::path(run) / "checkpoints" / ("step_" + std::to_string(step)) / name);
}

// The lines of `text` that start with `prefix`.
size_t lines_starting(const std::string& text, const std::string& prefix) {
  size_t n = 0, at = 0;
  while (at < text.size()) {
    const size_t end = text.find('\n', at);
    if (text.compare(at, prefix.size(), prefix) == 0) ++n;
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return n;
}

// A crash, an abort or a LibTorch backtrace in a command's output.
bool crashed(const Result& r) {
  for (const char* s : {"terminate called", "Aborted", "Segmentation fault", "Exception raised from", "frame #"})
    if (r.err.find(s) != std::string::npos || r.out.find(s) != std::string::npos) return true;
  return r.code > 128;
}

// One uninterrupted run to step 6 (checkpoints 2, 4, 6), trained once for the tests below.
class CheckpointFailures : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tmp_ = std::make_unique<dew::test::TempDir>("ckpt_failures_ref");
    reference_ = tmp_->file("reference");
    const Result r = run(kTrain + " --trainer.steps 6 --run " + reference_, tmp_->path.string());
    ASSERT_EQ(r.code, 0) << r.err;
  }
  static void TearDownTestSuite() { tmp_.reset(); }
  static std::unique_ptr<dew::test::TempDir> tmp_;
  static std::string reference_;
};

std::unique_ptr<dew::test::TempDir> CheckpointFailures::tmp_;
std::string CheckpointFailures::reference_;

TEST_F(CheckpointFailures, AFailedWriteKeepsTheEarlierCheckpointsAndTheRunResumesBitForBit) {
  ASSERT_FALSE(reference_.empty());
  dew::test::TempDir tmp("ckpt_efbig");
  const std::string run_dir = tmp.file("run"), logs = tmp.path.string();
  Result r = run(kTrain + " --trainer.steps 2 --run " + run_dir, logs);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto before = tree(fs::path(run_dir) / "checkpoints");
  ASSERT_EQ(before.count("step_2/model.safetensors"), 1u);

  // A limit below the model file's size: the metrics, the preview and run.json still fit, the checkpoint
  // of step 4 does not.
  const size_t model_bytes = checkpoint_file(run_dir, 2, "model.safetensors").size();
  const rlim_t limit = model_bytes - 1;
  ASSERT_LT(fs::file_size(fs::path(run_dir) / "run.json"), limit);
  r = run(kTrain + " --trainer.steps 4 --run " + run_dir, logs, limit);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_FALSE(crashed(r)) << r.err;
  // One line says what failed and that the run resumes from step 2.
  EXPECT_EQ(lines_starting(r.err, "dew: error: "), 1u) << r.err;
  const std::string last = r.err.substr(r.err.rfind("dew: error: "));
  EXPECT_EQ(dew::test::count_lines(last), 1u) << r.err;
  EXPECT_NE(last.find("checkpoint step_4 of run " + run_dir + " could not be written"), std::string::npos) << last;
  EXPECT_NE(last.find("File too large"), std::string::npos) << last;
  EXPECT_NE(last.find("model.safetensors"), std::string::npos) << last;
  EXPECT_NE(last.find("the earlier checkpoints are intact (latest: step_2)"), std::string::npos) << last;
  EXPECT_NE(last.find("rerun the same command to resume from step_2"), std::string::npos) << last;
  // The earlier checkpoint byte for byte, and nothing of the failed one (not even its temporary directory).
  EXPECT_EQ(tree(fs::path(run_dir) / "checkpoints"), before);

  // The same command without the limit resumes and ends as the uninterrupted run does, bit for bit.
  r = run(kTrain + " --trainer.steps 4 --run " + run_dir, logs);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("from step 2"), std::string::npos) << r.err;
  for (const char* f : {"model.safetensors", "ema.safetensors", "optimizer.safetensors", "state.json"})
    EXPECT_EQ(checkpoint_file(run_dir, 4, f), checkpoint_file(reference_, 4, f)) << f;
}

TEST_F(CheckpointFailures, ATruncatedLatestCheckpointIsSetAsideAndTheRunResumesFromTheNewestComplete) {
  ASSERT_FALSE(reference_.empty());
  dew::test::TempDir tmp("ckpt_torn");
  const std::string run_dir = tmp.file("run"), logs = tmp.path.string();
  Result r = run(kTrain + " --trainer.steps 4 --run " + run_dir, logs);
  ASSERT_EQ(r.code, 0) << r.err;
  const fs::path torn = fs::path(run_dir) / "checkpoints" / "step_4" / "model.safetensors";
  fs::resize_file(torn, fs::file_size(torn) / 2);
  const auto before = tree(run_dir);

  // --strict-resume refuses, naming the file, and leaves the run as it was.
  r = run(kTrain + " --trainer.steps 6 --strict-resume --run " + run_dir, logs);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_FALSE(crashed(r)) << r.err;
  EXPECT_EQ(dew::test::count_lines(r.err), 1u) << r.err;
  EXPECT_EQ(r.err.rfind("dew: error: checkpoint " + run_dir + "/checkpoints/step_4 is damaged", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("step_4/model.safetensors"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("strict_resume"), std::string::npos) << r.err;
  EXPECT_EQ(tree(run_dir), before);
  // `dew sample` reads the latest checkpoint: it names the torn file.
  r = run("sample " + run_dir + " --steps 2 --out " + tmp.file("grid.png"), logs);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("step_4/model.safetensors"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(tmp.file("grid.png")));

  // Without it the damaged checkpoint is named and set aside, and the run resumes from step 2.
  r = run(kTrain + " --trainer.steps 6 --run " + run_dir, logs);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("checkpoint " + run_dir + "/checkpoints/step_4 is damaged"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("set aside as " + run_dir + "/checkpoints/damaged_step_4"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("resuming from step_2"), std::string::npos) << r.err;
  EXPECT_EQ(dew::test::read_bytes(fs::path(run_dir) / "checkpoints" / "damaged_step_4" / "model.safetensors"),
            before.at("checkpoints/step_4/model.safetensors"));
  for (int64_t step : {4, 6})
    for (const char* f : {"model.safetensors", "ema.safetensors", "optimizer.safetensors", "state.json"})
      EXPECT_EQ(checkpoint_file(run_dir, step, f), checkpoint_file(reference_, step, f)) << step << " " << f;
}

TEST_F(CheckpointFailures, ARunWhoseEveryCheckpointIsDamagedIsRefusedAsItWas) {
  dew::test::TempDir tmp("ckpt_all_damaged");
  const std::string run_dir = tmp.file("run"), logs = tmp.path.string();
  Result r = run(kTrain + " --trainer.steps 2 --run " + run_dir, logs);
  ASSERT_EQ(r.code, 0) << r.err;
  std::ofstream(fs::path(run_dir) / "checkpoints" / "step_2" / "state.json") << "{\"step\": 2, \"format\": ";
  const auto before = tree(run_dir);
  r = run(kTrain + " --trainer.steps 4 --run " + run_dir, logs);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_FALSE(crashed(r)) << r.err;
  EXPECT_EQ(dew::test::count_lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find("every checkpoint is damaged"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("step_2/state.json"), std::string::npos) << r.err;
  EXPECT_EQ(tree(run_dir), before);  // run.json not rewritten, nothing set aside
}

}  // namespace checkpoint_failures
