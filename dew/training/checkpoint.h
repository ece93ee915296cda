// Run directories and checkpoints (docs/training.md#runs-dewruns):
//   RUN/run.json, RUN/metrics.jsonl, RUN/checkpoints/step_N/{model,ema,optimizer[,objective]}.safetensors +
//   state.json,
//   RUN/samples/step_N.png.
// A checkpoint is written to a temporary directory and renamed into place, so a crash never leaves a torn
// checkpoint; the latest N and the best are kept.
#pragma once
#include <ATen/ATen.h>

#include "dew/core/options.h"

namespace dew::training {

using TensorMap = std::map<std::string, at::Tensor>;

/// Version of the checkpoint layout; loading a different one fails with a hint.
inline constexpr int kCheckpointFormat = 1;

struct Checkpoint {
  int64_t step = 0;
  TensorMap model;      // parameters and buffers, by module path
  TensorMap ema;        // fp32 averages of the parameters
  TensorMap optimizer;  // Optimizer::state_dict()
  TensorMap objective;  // Objective::state() (objective.safetensors, written when not empty)
  json state;           // step, data position, best metric, counters, format
};

/// Writes RUN/checkpoints/step_N atomically (tmp dir + fsync + rename), then prunes to the latest `keep`
/// plus the step recorded in state["best"]["step"]. Returns the checkpoint directory.
std::string save_checkpoint(const std::string& run_dir, const Checkpoint& c, int64_t keep);

/// Steps of the complete checkpoints under RUN/checkpoints, ascending (tmp directories ignored).
std::vector<int64_t> list_checkpoints(const std::string& run_dir);

/// Loads RUN/checkpoints/step_N; `load_optimizer` false skips optimizer.safetensors.
Checkpoint load_checkpoint(const std::string& run_dir, int64_t step, bool load_optimizer = true);

/// The latest checkpoint's step; a dew::Error naming the run if there is none or the directory is missing.
int64_t latest_checkpoint(const std::string& run_dir);

/// Reads RUN/run.json (dew::Error naming the file if missing or invalid).
json read_run_json(const std::string& run_dir);

}  // namespace dew::training
