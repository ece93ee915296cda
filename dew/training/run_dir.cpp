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

std::string RunDir::eval_log() const { return (fs::path(path_) / "eval.jsonl").string(); }
std::string RunDir::eval_dir() const { return (fs::path(path_) / "eval").string(); }

bool RunDir::holds_run(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(RunDir(path).record(), ec);
}

}  // namespace dew::training
