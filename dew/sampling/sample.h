// The sample driver (docs/sampling.md): walks the grid linspace(T, 0, N) of the sampling schedule with a
// solver, then (final_denoise) returns the x0 prediction at the last grid point.
#pragma once
#include "dew/sampling/guidance.h"
#include "dew/sampling/solvers.h"

namespace dew::sampling {

/// Called after each step with (interval index, x).
using StepCallback = std::function<void(int64_t, const Tensor&)>;

/// Samples from x_T with `steps` grid points (steps - 1 solver steps). The solver is checked against the
/// schedule and reset first.
Tensor sample(const Denoiser& denoiser, const Schedule& schedule, const Tensor& x_T, int64_t steps, Solver& solver,
              const NoiseSource& noise, bool final_denoise = true, const StepCallback& callback = {});

}  // namespace dew::sampling
