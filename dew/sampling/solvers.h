// Solvers (docs/sampling.md). A solver advances x from schedule time t to s (t > s) using a denoiser
// (x_t, t) -> (x0_hat, eps_hat). Notation: (alpha_t, sigma_t), (alpha_s, sigma_s) are the schedule's
// rates at t and s; z ~ N(0, I) comes from the noise source for the step index.
//
// | solver          | schedules   | update                                                                 |
// | ddpm            | any (large: VP) | alpha_s x0 + (alpha_t sigma_s^2/(alpha_s sigma_t)) eps + g z       |
// | ddim            | any         | alpha_s x0 + sqrt(sigma_s^2 - st^2) eps + st z                          |
// | euler           | any         | x + d (sigma_s - sigma_t), d = (x - c x0)/sigma_t                        |
// | euler_ancestral | VE          | x + (x - x0)/sigma_t (s_down - sigma_t) + s_up z                         |
// | heun            | VE          | EDM algorithm 2 (with optional churn)                                   |
// | rk4             | VE          | classic RK4 on dx/dsigma = eps(x, sigma)                                 |
// | multistep_dpm   | VE          | Adams-Bashforth in sigma over the last 1-3 eps values                    |
// | dpmsolver++     | any         | DPM-Solver++(2M) in lambda = log alpha - log sigma                       |
// | pndm, plms      | any         | pseudo-Runge-Kutta warm-up, then AB4 (55, -59, 37, -9)/24                |
#pragma once
#include "dew/diffusion/process.h"

namespace dew::sampling {

using at::Tensor;
using diffusion::Denoiser;
using diffusion::Prediction;
using diffusion::Schedule;

/// Per-step noise: N(0, I) shaped like `like` for a step index. Replaceable, so a trajectory can be
/// replayed against a reference with recorded noise (as k-diffusion's noise_sampler).
using NoiseSource = std::function<Tensor(int64_t step, const Tensor& like)>;

/// N(0, 1) draws from the generator derived from (seed, step, "sample/noise"), drawn on the CPU.
NoiseSource seeded_noise(uint64_t seed);

/// What a step may use besides x, t and s.
struct StepContext {
  const Schedule& schedule;
  const Denoiser& denoiser;
  const NoiseSource& noise;
  int64_t index;      // interval index, 0 .. num_steps - 2
  int64_t num_steps;  // N, the number of grid points
};

class Solver {
 public:
  virtual ~Solver() = default;
  virtual std::string name() const = 0;
  /// Throws dew::Error if the solver cannot run on this schedule (sigma-space solvers need VE).
  virtual void check(const Schedule& schedule) const {}
  /// Forgets the history of multistep solvers; called at the start of each trajectory.
  virtual void reset() {}
  /// One step from t to s.
  virtual Tensor step(const Tensor& x, double t, double s, const StepContext& c) = 0;
};
using SolverPtr = std::shared_ptr<Solver>;

struct DDPMOptions {
  std::string variance = "small";
  template <class V>
  void visit(V& v) {
    v.choice("variance", variance, {"small", "large"}, "posterior variance (small) or beta (large, VP only)");
  }
};
struct DDIMOptions {
  double eta = 0.0;
  template <class V>
  void visit(V& v) {
    v("eta", eta, "stochasticity: 0 deterministic, 1 = DDPM posterior");
  }
};
struct HeunOptions {
  double s_churn = 0.0;
  double s_tmin = 0.0;
  std::optional<double> s_tmax;
  double s_noise = 1.0;
  template <class V>
  void visit(V& v) {
    v("s_churn", s_churn, "EDM churn S_churn (0 = deterministic)");
    v("s_tmin", s_tmin, "churn only where sigma >= S_tmin");
    v("s_tmax", s_tmax, "churn only where sigma <= S_tmax (null = infinity)");
    v("s_noise", s_noise, "S_noise: scale of the churn noise");
  }
};
struct MultistepOptions {
  int64_t order = 3;
  template <class V>
  void visit(V& v) {
    v("order", order, "highest order, 1 to 3");
  }
};
struct DPMSolverOptions {
  bool lower_order_final = true;
  template <class V>
  void visit(V& v) {
    v("lower_order_final", lower_order_final, "first-order final step when there are fewer than 15 steps");
  }
};

/// ddpm | ddim | euler | euler_ancestral | heun | rk4 | multistep_dpm | dpmsolver++ | pndm | plms.
Registry<Solver>& solvers();
SolverPtr make_solver(const std::string& name, const json& fields = json::object());

/// Runs the denoiser once at a scalar time for the whole batch.
Prediction denoise_at(const Denoiser& d, const Tensor& x, double t);

}  // namespace dew::sampling
