// The one timed loop every case of `dew bench` runs its work through: `warmup` untimed steps, then `steps`
// timed ones, each between two time stamps taken once the device has finished its queued work, with the
// phases the step marks and the process's peak memory; and the JSON line a measured child prints.
//
//   bench::LoopOptions o;
//   o.warmup = 5;
//   o.steps = 20;
//   const bench::Timings t = bench::timed_loop(o, [&](int64_t i, bench::StepClock& clock) {
//     loss = forward(batch);   // phase 0
//     clock.lap();
//     loss.backward();         // phase 1: from the lap to the step's end
//   });
//   double ms = bench::median(t.total) * 1e3;
#pragma once
#include <c10/core/Device.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "dew/core/options.h"

namespace dew::bench {

/// A step's side of the timed loop: the step marks where a phase ends (lap) or records a phase it timed
/// itself (phase). The loop calls begin() and end() around the step.
class StepClock {
 public:
  explicit StepClock(const c10::Device& device) : device_(device) {}
  /// Ends the current phase here, once the device has finished its queued work; the next one starts.
  void lap();
  /// Records a phase of `seconds` the step measured itself (e.g. the trainer's own phase timers).
  void phase(double seconds) { phases_.push_back(seconds); }

  /// Starts a step: forgets the last step's phases and takes the first time stamp.
  void begin();
  /// Ends the step: its seconds since begin(). A step that lapped gets the time since its last lap as its
  /// last phase.
  double end();
  /// The phases of the step that ended, in seconds, in the order the step marked them.
  const std::vector<double>& phases() const { return phases_; }

 private:
  c10::Device device_;
  std::chrono::steady_clock::time_point start_, last_;
  bool lapped_ = false;
  std::vector<double> phases_;
};

struct LoopOptions {
  int64_t warmup = 0;             // untimed steps first
  int64_t steps = 1;              // timed steps
  c10::Device device{c10::kCPU};  // synchronised before every time stamp (CUDA runs asynchronously)
  std::string profile;            // non-empty: a Chrome trace of the timed steps' operators to this file
  bool rest = false;              // append each step's time beyond its phases as a last phase (at least 0)
};

/// The timed steps' seconds and the process's peak memory once they have run.
struct Timings {
  std::vector<double> total;                // seconds of each timed step
  std::vector<std::vector<double>> phases;  // phases[p][k]: phase p of timed step k, seconds
  double peak_rss_mb = 0;                   // peak resident set size of this process after the loop (MB)
  /// Phase p of every timed step; dew::Error when no step marked it.
  const std::vector<double>& phase(size_t p) const;
};

/// Step i's work, timed as a whole; it marks its phases on the clock.
using TimedStep = std::function<void(int64_t i, StepClock& clock)>;
/// Untimed work after step i's closing time stamp: reading its loss back, checks, freeing what it left, and
/// recording the phases it timed itself (clock.phase). May be empty.
using AfterStep = std::function<void(int64_t i, StepClock& clock)>;

/// Runs o.warmup + o.steps steps and times the last o.steps of them (the trace, when asked, covers those too).
Timings timed_loop(const LoopOptions& o, const TimedStep& step, const AfterStep& after = nullptr);

/// The time once `device` has finished its queued work (CUDA runs asynchronously; the CPU does not).
std::chrono::steady_clock::time_point synced_now(const c10::Device& device);
/// Peak resident set size of this process (VmHWM), in MB.
double peak_rss_mb();

/// The result line a measured child prints (the keys the Python peers print too), from per-step seconds:
/// the total and the forward / backward / optimizer phases (medians, in ms), rows per step, trainable parameters,
/// the last loss and the peak memory, with this process's threads, BLAS and torch version.
json step_result(const std::vector<double>& total, const std::vector<double>& fwd, const std::vector<double>& bwd,
                 const std::vector<double>& upd, int64_t batch, int64_t nparams, double loss_value, double peak_mb);

}  // namespace dew::bench
