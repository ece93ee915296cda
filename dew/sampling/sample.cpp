#include "dew/sampling/sample.h"

#include "dew/io/stops.h"

namespace dew::sampling {

Tensor sample(const Denoiser& denoiser, const Schedule& schedule, const Tensor& x_T, int64_t steps, Solver& solver,
              const NoiseSource& noise, bool final_denoise, const StepCallback& callback) {
  DEW_CHECK(steps >= 1, "sample: steps must be >= 1, got ", steps);
  solver.check(schedule);
  solver.reset();
  auto grid = schedule.grid(steps);
  auto g = grid.accessor<double, 1>();
  Tensor x = x_T;
  for (int64_t i = 0; i + 1 < steps; ++i) {
    io::check_stop();  // `dew sample` / `dew eval` stopped by a signal: no output from a cut-short run
    StepContext c{schedule, denoiser, noise, i, steps};
    x = solver.step(x, g[i], g[i + 1], c);
    if (callback) callback(i, x);
  }
  if (final_denoise) x = denoise_at(denoiser, x, g[steps - 1]).x0;
  return x;
}

}  // namespace dew::sampling
