// What the measuring commands (`dew bench`, `dew tune threads`) share to time the code `dew train` runs: a
// throwaway run directory and a Trainer that steps an objective on one fixed batch.
#pragma once
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "dew/training/trainer.h"

namespace dew::bench {

/// A directory "dew_<name>_XXXXXX" under the system's temporary directory, removed with its contents at
/// scope exit (dew::Error when it cannot be made).
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& name);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

/// The median of v (the mean of the middle two for an even count); dew::Error for an empty v.
double median(std::vector<double> v);
/// The 1-minute load average as /proc/loadavg writes it ("n/a" where it cannot be read).
std::string load_average();
/// The current time, e.g. "2026-12-02 05:17 UTC".
std::string utc_now();
/// v with `digits` digits after the point.
std::string fixed(double v, int digits);

/// A Trainer of `objective` whose loader serves exactly `batch` every step (in order, no worker thread, so
/// data costs one gather), for `steps` steps under `optim`, autocast off (fp32 on both sides of a
/// comparison), seed 0, in `run_dir` (it writes nothing there unless a run of non-finite losses makes it
/// checkpoint). Step it with train_step(), the step `dew train` takes.
std::unique_ptr<training::Trainer> fixed_batch_trainer(const ObjectivePtr& objective, const data::Batch& batch,
                                                       const training::OptimOptions& optim, int64_t steps,
                                                       const std::string& run_dir);

}  // namespace dew::bench
