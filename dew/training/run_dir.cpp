#include "dew/training/run_dir.h"

#include <filesystem>

namespace fs = std::filesystem;

namespace dew::training {

std::string RunDir::record() const { return (fs::path(path_) / "run.json").string(); }
std::string RunDir::metrics() const { return (fs::path(path_) / "metrics.jsonl").string(); }
std::string RunDir::checkpoints() const { return (fs::path(path_) / "checkpoints").string(); }
std::string RunDir::checkpoint(int64_t step) const {
  return (fs::path(checkpoints()) / ("step_" + std::to_string(step))).string();
}
std::string RunDir::samples() const { return (fs::path(path_) / "samples").string(); }
std::string RunDir::sample(int64_t step, const std::string& ext) const {
  return (fs::path(samples()) / ("step_" + std::to_string(step) + ext)).string();
}

std::string RunDir::tensorboard() const { return (fs::path(path_) / "tensorboard").string(); }
std::string RunDir::eval_log() const { return (fs::path(path_) / "eval.jsonl").string(); }
std::string RunDir::eval_dir() const { return (fs::path(path_) / "eval").string(); }

std::string RunDir::lock() const { return (fs::path(path_) / "writer.lock").string(); }

namespace {
const char* kLockAdvice = "wait for it to end, stop it (Ctrl-C checkpoints and exits), or use another run directory";
}

std::unique_ptr<io::FileLock> RunDir::lock_for_writing() const {
  return std::make_unique<io::FileLock>(lock(), "run " + path_, kLockAdvice);
}

void RunDir::check_not_being_written() const { io::FileLock::check_free(lock(), "run " + path_, kLockAdvice); }

bool RunDir::holds_run(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(RunDir(path).record(), ec);
}

}  // namespace dew::training
