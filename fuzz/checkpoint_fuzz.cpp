// libFuzzer target for a run directory's records (dew/training/checkpoint.cpp and run_dir.cpp, what every resumed
// `dew train` and every `dew sample|eval|export RUN` reads first): the input up to its first NUL byte is
// RUN/run.json, the rest RUN/checkpoints/step_3/state.json, beside that checkpoint's small, valid model, ema and
// optimizer files (an earlier step_1 is complete). The run directory is then read as a resume does: run.json, the
// checkpoint list, each one's damage, the resume point and the newest complete checkpoint. Any input must either
// be refused with a dew::Error or resume from a checkpoint that loads, with a state whose step is its own; a
// crash, a sanitizer report or a huge allocation is a bug. Nothing is written.
#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "dew/core/error.h"
#include "dew/io/safetensors.h"
#include "dew/training/checkpoint.h"
#include "fuzz/fuzz_util.h"

namespace fs = std::filesystem;

namespace {

// One run directory per fuzzing process: step_1 complete, step_3's tensors valid (its state.json is the input's).
const fs::path& scratch_run() {
  static const fs::path run = [] {
    const fs::path r = dew_fuzz::make_scratch_dir("checkpoint");
    for (int step : {1, 3}) {
      const fs::path c = r / "checkpoints" / ("step_" + std::to_string(step));
      fs::create_directories(c);
      for (const char* f : {"model", "ema", "optimizer"})
        dew::io::save_safetensors((c / (std::string(f) + ".safetensors")).string(), {{"w", at::ones({2, 2})}});
      dew_fuzz::write_file(c / "state.json", "{\"step\": " + std::to_string(step) + ", \"format\": 1}");
    }
    return r;
  }();
  return run;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto [record, state] = dew_fuzz::split_at_nul(data, size);
  const fs::path& run = scratch_run();
  dew_fuzz::write_file(run / "run.json", record);
  dew_fuzz::write_file(run / "checkpoints" / "step_3" / "state.json", state);
  const std::string dir = run.string();
  try {
    (void)dew::training::read_run_json(dir);
  } catch (const dew::Error&) {}
  try {
    const auto steps = dew::training::list_checkpoints(dir);
    for (int64_t s : steps) (void)dew::training::checkpoint_damage(dir, s);
    const auto point = dew::training::resume_point(dir, /*strict=*/false);
    FUZZ_REQUIRE(point.step == 1 || point.step == 3);  // step_1 is complete
    const auto c = dew::training::load_checkpoint(dir, point.step);
    FUZZ_REQUIRE(c.step == point.step && c.model.count("w") == 1);
  } catch (const dew::Error&) {}
  return 0;
}
