// libFuzzer target for scheduler_config.json (dew/sampling/scheduler_config.cpp and schedulers.cpp:
// Scheduler::from_file, what `dew sample --pipeline` reads from a folder): the input is written as a
// scheduler_config.json, read, and each scheduler it gives is set to 1, 2 and 25 steps (flow matching with and
// without mu) and stepped through from a zero output. Any input must either be refused with a dew::Error or give
// finite timesteps, finite training alphas in [0, 1] (0: zero terminal SNR), a finite initial sigma and finite steps; a crash, a
// sanitizer report, a hang on a huge step or train count, or a silent NaN is a bug.
#include <ATen/ATen.h>
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "dew/core/error.h"
#include "dew/sampling/schedulers.h"
#include "fuzz/fuzz_util.h"

namespace {

const std::filesystem::path& scratch_path() {
  static const auto path = dew_fuzz::make_scratch_dir("scheduler") / "scheduler_config.json";
  return path;
}

bool finite(const at::Tensor& t) { return !t.defined() || t.numel() == 0 || t.isfinite().all().item<bool>(); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dew_fuzz::write_file(scratch_path(), std::string_view(reinterpret_cast<const char*>(data), size));
  dew::sampling::SchedulerPtr s;
  try {
    s = dew::sampling::Scheduler::from_file(scratch_path().string());
  } catch (const dew::Error&) {
    return 0;
  }
  const at::Tensor& a = s->alphas_cumprod();
  if (a.defined() && a.numel() > 0) FUZZ_REQUIRE(finite(a) && a.ge(0).all().item<bool>() && a.le(1).all().item<bool>());
  auto* flow = dynamic_cast<dew::sampling::FlowMatchEulerScheduler*>(s.get());
  const dew::sampling::NoiseSource noise = [](int64_t, const at::Tensor& like) { return at::zeros_like(like); };
  for (int64_t n : {1, 2, 25}) {
    try {
      if (flow && flow->use_dynamic_shifting()) flow->set_timesteps(n, {}, flow->mu_for(256));
      else s->set_timesteps(n);
    } catch (const dew::Error&) {
      continue;
    }
    FUZZ_REQUIRE(s->num_steps() >= 1 && finite(s->timesteps()) && std::isfinite(s->init_noise_sigma()));
    if (flow) FUZZ_REQUIRE(finite(flow->sigmas()));
    // every step in order (multistep methods need it), from a zero model output
    at::Tensor x = at::ones({1, 1, 2, 2});
    try {
      for (int64_t i = 0; i < s->num_steps(); ++i) {
        FUZZ_REQUIRE(finite(s->scale_model_input(x, i)));
        x = s->step(at::zeros_like(x), i, x, noise);
        FUZZ_REQUIRE(finite(x));
      }
    } catch (const dew::Error&) {}
  }
  return 0;
}
