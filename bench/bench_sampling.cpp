// Micro-benchmarks of the sampling maths: one solver step of a 16x3x32x32 batch driven by the
// analytic Gaussian denoiser, so the numbers measure the solver's own tensor work.
#include <benchmark/benchmark.h>

#include "dew/diffusion/presets.h"
#include "dew/sampling/sample.h"

namespace {

using namespace dew;

void BM_SolverTrajectory(benchmark::State& state, const std::string& solver, const std::string& schedule) {
  auto s = diffusion::schedules().build(schedule, json::object());
  diffusion::Denoiser oracle = [s](const at::Tensor& x, const at::Tensor& t) {
    auto r = s->rates(t);
    auto a = diffusion::bcast(r.alpha, x), sg = diffusion::bcast(r.sigma, x);
    auto x0 = a * 0.09 / (a * a * 0.09 + sg * sg) * x;
    return diffusion::Prediction{x0, (x - a * x0) / sg};
  };
  auto solv = sampling::make_solver(solver);
  auto noise = sampling::seeded_noise(0);
  auto x = at::randn({16, 3, 32, 32});
  for (auto _ : state) {
    auto out = sampling::sample(oracle, *s, x, 11, *solv, noise, true);
    benchmark::DoNotOptimize(out.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * 10);
}

BENCHMARK_CAPTURE(BM_SolverTrajectory, ddim_cosine, std::string("ddim"), std::string("cosine"));
BENCHMARK_CAPTURE(BM_SolverTrajectory, dpmpp_cosine, std::string("dpmsolver++"), std::string("cosine"));
BENCHMARK_CAPTURE(BM_SolverTrajectory, heun_karras, std::string("heun"), std::string("karras_ve"));
BENCHMARK_CAPTURE(BM_SolverTrajectory, rk4_karras, std::string("rk4"), std::string("karras_ve"));

}  // namespace
