#include "dew/training/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "dew/io/files.h"
#include "dew/io/safetensors.h"
#include "dew/training/run_dir.h"

namespace fs = std::filesystem;

namespace dew::training {

namespace {

fs::path ckpt_root(const std::string& run_dir) { return RunDir(run_dir).checkpoints(); }

}  // namespace

std::string save_checkpoint(const std::string& run_dir, const Checkpoint& c, int64_t keep) {
  const fs::path root = ckpt_root(run_dir);
  fs::create_directories(root);
  const fs::path final_dir = RunDir(run_dir).checkpoint(c.step);
  const fs::path tmp = root / (".tmp_step_" + std::to_string(c.step));
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  io::save_safetensors((tmp / "model.safetensors").string(), c.model, {{"format", "dew"}});
  io::save_safetensors((tmp / "ema.safetensors").string(), c.ema, {{"format", "dew"}});
  io::save_safetensors((tmp / "optimizer.safetensors").string(), c.optimizer, {{"format", "dew"}});
  if (!c.objective.empty())
    io::save_safetensors((tmp / "objective.safetensors").string(), c.objective, {{"format", "dew"}});
  json state = c.state;
  state["step"] = c.step;
  state["format"] = kCheckpointFormat;
  io::write_file_atomic((tmp / "state.json").string(), state.dump(2));
  io::fsync_path(tmp.string());
  // Replacing an existing step_N (a rerun at the same step): move the old one aside first.
  if (fs::exists(final_dir)) {
    const fs::path old = root / (".old_step_" + std::to_string(c.step));
    fs::remove_all(old);
    fs::rename(final_dir, old);
    fs::rename(tmp, final_dir);
    fs::remove_all(old);
  } else {
    fs::rename(tmp, final_dir);
  }
  io::fsync_path(root.string());

  int64_t best = -1;
  if (state.contains("best") && state["best"].is_object() && state["best"].contains("step"))
    best = state["best"]["step"].get<int64_t>();
  auto steps = list_checkpoints(run_dir);
  const int64_t excess = int64_t(steps.size()) - std::max<int64_t>(keep, 1);
  for (int64_t i = 0; i < excess; ++i)
    if (steps[i] != best && steps[i] != c.step) fs::remove_all(RunDir(run_dir).checkpoint(steps[i]));
  return final_dir.string();
}

std::vector<int64_t> list_checkpoints(const std::string& run_dir) {
  std::vector<int64_t> out;
  const fs::path root = ckpt_root(run_dir);
  if (!fs::is_directory(root)) return out;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("step_", 0) != 0 || !e.is_directory()) continue;
    if (!fs::exists(e.path() / "state.json")) continue;  // incomplete (should not happen: renamed whole)
    try {
      out.push_back(std::stoll(n.substr(5)));
    } catch (const std::exception&) {}
  }
  std::sort(out.begin(), out.end());
  return out;
}

int64_t latest_checkpoint(const std::string& run_dir) {
  DEW_CHECK(fs::is_directory(run_dir), "run directory ", run_dir, " does not exist");
  auto steps = list_checkpoints(run_dir);
  DEW_CHECK(!steps.empty(), "run directory ", run_dir, " holds no checkpoint (expected ", run_dir,
            "/checkpoints/step_N/)");
  return steps.back();
}

Checkpoint load_checkpoint(const std::string& run_dir, int64_t step, bool load_optimizer) {
  const fs::path dir = RunDir(run_dir).checkpoint(step);
  DEW_CHECK(fs::is_directory(dir), "checkpoint ", dir.string(), " does not exist");
  Checkpoint c;
  c.step = step;
  std::ifstream f(dir / "state.json");
  DEW_CHECK(f.good(), "cannot read ", (dir / "state.json").string());
  try {
    c.state = json::parse(f);
  } catch (const std::exception& e) {
    fail((dir / "state.json").string(), ": invalid JSON: ", e.what());
  }
  const int format = c.state.value("format", 0);
  DEW_CHECK(format == kCheckpointFormat, dir.string(), ": checkpoint format ", format, ", this dew reads format ",
            kCheckpointFormat, "; use the dew version that wrote it");
  c.model = io::load_safetensors((dir / "model.safetensors").string());
  c.ema = io::load_safetensors((dir / "ema.safetensors").string());
  if (load_optimizer) c.optimizer = io::load_safetensors((dir / "optimizer.safetensors").string());
  if (load_optimizer && fs::exists(dir / "objective.safetensors"))
    c.objective = io::load_safetensors((dir / "objective.safetensors").string());
  return c;
}

json read_run_json(const std::string& run_dir) {
  const fs::path p = RunDir(run_dir).record();
  DEW_CHECK(fs::is_directory(run_dir), "run directory ", run_dir, " does not exist");
  std::ifstream f(p);
  DEW_CHECK(f.good(), "cannot read ", p.string(), " (is ", run_dir, " a dew run directory?)");
  try {
    return json::parse(f);
  } catch (const std::exception& e) {
    fail(p.string(), ": invalid JSON: ", e.what());
  }
}

}  // namespace dew::training
