#include "dew/bench/timing.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <memory>

#include "dew/bench/measure.h"
#include "dew/core/threads.h"

namespace dew::bench {

namespace {

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

void StepClock::lap() {
  const auto now = synced_now(device_);
  phases_.push_back(seconds_between(last_, now));
  last_ = now;
  lapped_ = true;
}

void StepClock::begin() {
  phases_.clear();
  lapped_ = false;
  start_ = last_ = synced_now(device_);
}

double StepClock::end() {
  const auto now = synced_now(device_);
  if (lapped_) phases_.push_back(seconds_between(last_, now));
  return seconds_between(start_, now);
}

const std::vector<double>& Timings::phase(size_t p) const {
  DEW_CHECK(p < phases.size(), "bench: the timed steps marked ", phases.size(), " phases, not phase ", p);
  return phases[p];
}

Timings timed_loop(const LoopOptions& o, const TimedStep& step, const AfterStep& after) {
  Timings t;
  StepClock clock(o.device);
  std::unique_ptr<torch::autograd::profiler::RecordProfile> trace;  // the timed steps only
  for (int64_t i = 0; i < o.warmup + o.steps; ++i) {
    if (i == o.warmup && !o.profile.empty())
      trace = std::make_unique<torch::autograd::profiler::RecordProfile>(o.profile);
    clock.begin();
    step(i, clock);
    const double total = clock.end();
    if (after) after(i, clock);
    if (i < o.warmup) continue;
    std::vector<double> phases = clock.phases();
    if (o.rest) {
      // Subtracted one by one, as the step's phases add up.
      double rest = total;
      for (double p : phases) rest -= p;
      phases.push_back(std::max(0.0, rest));
    }
    t.total.push_back(total);
    if (t.phases.size() < phases.size()) t.phases.resize(phases.size());
    for (size_t p = 0; p < phases.size(); ++p) t.phases[p].push_back(phases[p]);
  }
  trace.reset();  // writes the trace file
  t.peak_rss_mb = peak_rss_mb();
  return t;
}

std::chrono::steady_clock::time_point synced_now(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
  return std::chrono::steady_clock::now();
}

double peak_rss_mb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // "VmHWM:  123456 kB"
  return 0.0;
}

json step_result(const std::vector<double>& total, const std::vector<double>& fwd, const std::vector<double>& bwd,
                 const std::vector<double>& upd, int64_t batch, int64_t nparams, double loss_value, double peak_mb) {
  const double ms = median(total) * 1e3;
  const char* blas = std::getenv("OPENBLAS_NUM_THREADS");
  return {{"ms_per_step", ms},
          {"samples_per_s", double(batch) / (ms / 1e3)},
          {"peak_rss_mb", peak_mb},
          {"params", nparams},
          {"threads", at::get_num_threads()},
          {"blas_threads", blas ? blas : ""},
          {"blas_core", blas_core()},
          {"phases_ms",
           {{"forward", median(fwd) * 1e3}, {"backward", median(bwd) * 1e3}, {"optimizer", median(upd) * 1e3}}},
          {"loss", loss_value},
          {"torch", TORCH_VERSION}};
}

}  // namespace dew::bench
