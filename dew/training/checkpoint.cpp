#include "dew/training/checkpoint.h"

#include <algorithm>
#include <filesystem>

#include "dew/io/files.h"
#include "dew/io/safetensors.h"
#include "dew/training/run_dir.h"

namespace fs = std::filesystem;

namespace dew::training {

namespace {

fs::path ckpt_root(const std::string& run_dir) { return RunDir(run_dir).checkpoints(); }

// The latest checkpoint that is on disk now, for the message of a failed write.
std::string earlier_checkpoints(const std::string& run_dir) {
  std::vector<int64_t> steps;
  try {
    steps = list_checkpoints(run_dir);
  } catch (const std::exception&) {}
  if (steps.empty()) return "the run has no earlier checkpoint; rerun the same command to start again";
  return "the earlier checkpoints are intact (latest: step_" + std::to_string(steps.back()) +
         "); free disk space (or raise the file size limit) and rerun the same command to resume from step_" +
         std::to_string(steps.back());
}

[[noreturn]] void fail_checkpoint_write(const std::string& run_dir, int64_t step, const std::string& why) {
  fail("checkpoint step_", step, " of run ", run_dir, " could not be written (", why, "); ",
       earlier_checkpoints(run_dir));
}

}  // namespace

std::string save_checkpoint(const std::string& run_dir, const Checkpoint& c, int64_t keep) {
  const fs::path root = ckpt_root(run_dir);
  const fs::path final_dir = RunDir(run_dir).checkpoint(c.step);
  const fs::path tmp = root / (".tmp_step_" + std::to_string(c.step));
  json state = c.state;
  state["step"] = c.step;
  state["format"] = kCheckpointFormat;
  // Everything goes into the temporary directory first: a write that fails there (ENOSPC, EFBIG, EIO) only
  // costs that directory, which is removed, and no reader ever sees a part of a checkpoint.
  try {
    fs::create_directories(root);
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    io::save_safetensors((tmp / "model.safetensors").string(), c.model, {{"format", "dew"}});
    io::save_safetensors((tmp / "ema.safetensors").string(), c.ema, {{"format", "dew"}});
    io::save_safetensors((tmp / "optimizer.safetensors").string(), c.optimizer, {{"format", "dew"}});
    if (!c.objective.empty())
      io::save_safetensors((tmp / "objective.safetensors").string(), c.objective, {{"format", "dew"}});
    io::write_file_atomic((tmp / "state.json").string(), state.dump(2));
    io::fsync_path(tmp.string());
  } catch (const std::exception& e) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    fail_checkpoint_write(run_dir, c.step, e.what());
  }
  // Replacing an existing step_N (a rerun at the same step): move the old one aside first, and back if the
  // new one cannot take its place.
  const fs::path old = root / (".old_step_" + std::to_string(c.step));
  std::error_code ec;
  if (fs::exists(final_dir)) {
    fs::remove_all(old, ec);
    fs::rename(final_dir, old, ec);
    if (!ec) {
      fs::rename(tmp, final_dir, ec);
      if (ec) {
        std::error_code back;
        fs::rename(old, final_dir, back);
      } else {
        fs::remove_all(old, ec);
        ec.clear();
      }
    }
  } else {
    fs::rename(tmp, final_dir, ec);
  }
  if (ec) {
    const std::string why = "cannot rename " + tmp.string() + " to " + final_dir.string() + ": " + ec.message();
    fs::remove_all(tmp, ec);
    fail_checkpoint_write(run_dir, c.step, why);
  }
  io::fsync_path(root.string());

  int64_t best = -1;
  if (state.contains("best") && state["best"].is_object() && state["best"].contains("step"))
    best = state["best"]["step"].get<int64_t>();
  auto steps = list_checkpoints(run_dir);
  const int64_t excess = int64_t(steps.size()) - std::max<int64_t>(keep, 1);
  for (int64_t i = 0; i < excess; ++i)
    if (steps[i] != best && steps[i] != c.step) fs::remove_all(RunDir(run_dir).checkpoint(steps[i]), ec);
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

std::string checkpoint_damage(const std::string& run_dir, int64_t step) {
  const fs::path dir = RunDir(run_dir).checkpoint(step);
  try {
    const std::string state_path = (dir / "state.json").string();
    const json state = io::parse_json(io::read_file(state_path, "checkpoint state"), state_path);
    DEW_CHECK(state.is_object(), state_path, ": expected a JSON object");
    const json format = state.value("format", json()), at = state.value("step", json());
    DEW_CHECK(format == kCheckpointFormat, state_path, ": checkpoint format ", format.dump(),
              ", this dew reads format ", kCheckpointFormat);
    DEW_CHECK(at == step, state_path, ": records step ", at.dump(), " in the directory of step ", step);
    for (const std::string name : {"model", "ema", "optimizer", "objective"}) {
      const fs::path f = dir / (name + ".safetensors");
      if (name == "objective" && !fs::exists(f)) continue;  // written only by objectives with state
      io::SafetensorsFile::open(f.string());                // the header, and that the file holds its bytes
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

ResumePoint resume_point(const std::string& run_dir, bool strict) {
  ResumePoint rp;
  const std::vector<int64_t> steps = list_checkpoints(run_dir);
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    std::string damage = checkpoint_damage(run_dir, *it);
    if (damage.empty()) {
      rp.step = *it;
      break;
    }
    DEW_CHECK(!strict, "checkpoint ", RunDir(run_dir).checkpoint(*it), " is damaged (", damage,
              "); trainer.strict_resume refuses to resume from an older one: restore or remove it, or rerun without "
              "--strict-resume to resume from the newest complete checkpoint");
    rp.damaged.emplace_back(*it, std::move(damage));
  }
  DEW_CHECK(steps.empty() || rp.step >= 0, "run ", run_dir, ": every checkpoint is damaged (the latest, ",
            RunDir(run_dir).checkpoint(steps.back()), ": ", rp.damaged.front().second, "); move ",
            RunDir(run_dir).checkpoints(), " away to train the run from scratch");
  return rp;
}

std::string set_aside_checkpoint(const std::string& run_dir, int64_t step) {
  const fs::path from = RunDir(run_dir).checkpoint(step);
  const std::string base =
      (fs::path(RunDir(run_dir).checkpoints()) / ("damaged_step_" + std::to_string(step))).string();
  std::string to = base;
  for (int i = 1; fs::exists(to); ++i) to = base + "." + std::to_string(i);
  std::error_code ec;
  fs::rename(from, to, ec);
  DEW_CHECK(!ec, "cannot set the damaged checkpoint ", from.string(), " aside as ", to, ": ", ec.message());
  io::fsync_path(RunDir(run_dir).checkpoints());
  return to;
}

Checkpoint load_checkpoint(const std::string& run_dir, int64_t step, bool load_optimizer) {
  const fs::path dir = RunDir(run_dir).checkpoint(step);
  DEW_CHECK(fs::is_directory(dir), "checkpoint ", dir.string(), " does not exist");
  Checkpoint c;
  c.step = step;
  const std::string state_path = (dir / "state.json").string();
  c.state = io::parse_json(io::read_file(state_path, "checkpoint state"), state_path);
  DEW_CHECK(c.state.is_object(), state_path, ": expected a JSON object");
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
  std::error_code ec;
  DEW_CHECK(fs::is_regular_file(p, ec), "cannot read ", p.string(), " (is ", run_dir, " a dew run directory?)");
  return io::parse_json(io::read_file(p.string(), "run record"), p.string());
}

}  // namespace dew::training
