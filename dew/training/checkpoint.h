// Run directories and checkpoints (docs/training.md#runs-dewruns):
//   RUN/run.json, RUN/metrics.jsonl, RUN/checkpoints/step_N/{model,ema,optimizer[,objective]}.safetensors +
//   state.json,
//   RUN/samples/step_N.png.
// A checkpoint is written to a temporary directory and renamed into place, so a crash never leaves a torn
// checkpoint; the latest N and the best are kept. A write that fails (a full disk, a file size limit, an I/O
// error) removes its temporary directory and leaves the earlier checkpoints as they were. A resumed run
// starts from the newest checkpoint whose files are complete (resume_point); a damaged newer one is set
// aside as RUN/checkpoints/damaged_step_N, or refused with trainer.strict_resume (docs/reliability.md).
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

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
/// plus the step recorded in state["best"]["step"]. Returns the checkpoint directory. A failed write is one
/// dew::Error saying what failed, that the earlier checkpoints are intact (naming the latest) and how to
/// resume; the temporary directory is removed.
std::string save_checkpoint(const std::string& run_dir, const Checkpoint& c, int64_t keep);

/// Steps of the complete checkpoints under RUN/checkpoints, ascending (tmp directories ignored).
std::vector<int64_t> list_checkpoints(const std::string& run_dir);

/// Loads RUN/checkpoints/step_N; `load_optimizer` false skips optimizer.safetensors.
Checkpoint load_checkpoint(const std::string& run_dir, int64_t step, bool load_optimizer = true);

/// The latest checkpoint's step; a dew::Error naming the run if there is none or the directory is missing.
int64_t latest_checkpoint(const std::string& run_dir);

/// Why RUN/checkpoints/step_N cannot be loaded, or "" when it is complete: state.json must parse as this
/// format's state of step N, and model, ema, optimizer (and objective, when present) .safetensors must
/// each have a valid header and every byte it declares. Reads headers only, not the tensors.
std::string checkpoint_damage(const std::string& run_dir, int64_t step);

/// The checkpoint a resumed run starts from: the newest complete one (step -1 when RUN holds no checkpoint),
/// with the newer ones that are damaged, newest first.
struct ResumePoint {
  int64_t step = -1;
  std::vector<std::pair<int64_t, std::string>> damaged;  // (step, checkpoint_damage)
};

/// Finds the resume point. dew::Error naming the checkpoint and its damage when the latest is damaged and
/// `strict` (trainer.strict_resume), or when checkpoints exist but none is complete. Writes nothing.
ResumePoint resume_point(const std::string& run_dir, bool strict);

/// Renames a damaged RUN/checkpoints/step_N to RUN/checkpoints/damaged_step_N (kept for inspection; no
/// reader lists it, and a later checkpoint of step N is written beside it). Returns the new path.
std::string set_aside_checkpoint(const std::string& run_dir, int64_t step);

/// Reads RUN/run.json (dew::Error naming the file if missing or invalid).
json read_run_json(const std::string& run_dir);

}  // namespace dew::training
