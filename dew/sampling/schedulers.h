// diffusers-compatible schedulers (docs/sampling.md), built from a pipeline folder's scheduler_config.json by
// its `_class_name`. They follow diffusers' StableDiffusionPipeline loop, with the step index passed in:
//
//   auto sched = Scheduler::from_file("scheduler/scheduler_config.json");
//   sched->set_timesteps(30);
//   Tensor x = noise * sched->init_noise_sigma();                         // x: [B, 4, H/8, W/8]
//   for (int64_t i = 0; i < sched->num_steps(); ++i) {
//     auto in = sched->scale_model_input(at::cat({x, x}), i);            // CFG: one doubled batch
//     auto out = unet(in, sched->timestep(i), text);                     // the model sees timesteps()[i]
//     x = sched->step(cfg(out), i, x, noise_source);
//   }
//
// | _class_name                     | method                                                        |
// | DDIMScheduler                   | DDIM (Song et al. 2021), eta from set_eta                     |
// | PNDMScheduler                   | PLMS (Liu et al. 2022); skip_prk_steps true or false          |
// | EulerDiscreteScheduler          | Euler in sigma = sqrt((1 - abar)/abar) (k-diffusion)          |
// | EulerAncestralDiscreteScheduler | Euler ancestral (k-diffusion)                                 |
// | LMSDiscreteScheduler            | linear multistep in sigma, order 4 (k-diffusion)              |
// | DPMSolverMultistepScheduler     | DPM-Solver++ 1M/2M/3M (Lu et al. 2022), ODE or SDE            |
// | FlowMatchEulerDiscreteScheduler | Euler on the flow x_t = (1 - s) x0 + s noise (SD3, Flux)      |
//
// FlowMatchEulerDiscreteScheduler (class FlowMatchEulerScheduler below) has no betas: schedule() is null and
// alphas_cumprod() undefined; the model predicts the velocity noise - x0 at time sigma x 1000 and the pipelines
// pass it sigmas / mu (set_timesteps(n, sigmas, mu)), as StableDiffusion3Pipeline and FluxPipeline do.
//
// Schedule constants are float64 (alphas_cumprod comes from the dew discrete schedule of the same betas,
// dew/diffusion/schedules.h); each step computes in float64 and returns x in its own dtype. Settings the
// class does not take are ignored (as diffusers does), `_`-prefixed keys are bookkeeping, and a setting the
// class takes with a value not supported here is a dew::Error naming the file, the field, the value and
// what is accepted.
#pragma once
#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dew/core/options.h"
#include "dew/diffusion/schedules.h"
#include "dew/sampling/solvers.h"

namespace dew::sampling {

class Scheduler {
 public:
  virtual ~Scheduler() = default;
  /// Builds the scheduler named by cfg["_class_name"]; `where` (the file name) prefixes every error.
  static std::unique_ptr<Scheduler> from_config(const json& cfg, const std::string& where);
  /// Reads a scheduler_config.json (Python's -Infinity / Infinity / NaN, which diffusers writes for
  /// lambda_min_clipped, are accepted) and calls from_config with the path as `where`.
  static std::unique_ptr<Scheduler> from_file(const std::string& path);

  /// The diffusers class, e.g. "EulerDiscreteScheduler".
  const std::string& class_name() const { return class_name_; }
  /// "epsilon" | "v_prediction" | "sample": what the model's output is.
  const std::string& prediction_type() const { return prediction_type_; }
  /// Prepares n inference steps and forgets the history of multistep methods.
  virtual void set_timesteps(int64_t n) = 0;
  /// The times passed to the model, float64 [num_steps()] (PNDM repeats some; Karras sigmas give fractions).
  const at::Tensor& timesteps() const;
  double timestep(int64_t i) const;
  int64_t num_steps() const;
  /// Standard deviation of the initial noise: x_T = N(0, I) * init_noise_sigma().
  double init_noise_sigma() const;
  /// The model input at step i (sigma schedulers divide by sqrt(sigma_i^2 + 1); others return x).
  virtual at::Tensor scale_model_input(const at::Tensor& x, int64_t i) const;
  /// One step from the model output at step i; noise(i, x) supplies the ancestral / eta / SDE noise.
  /// Multistep schedulers need i = 0, 1, 2, ... in order after set_timesteps.
  virtual at::Tensor step(const at::Tensor& model_output, int64_t i, const at::Tensor& x, const NoiseSource& noise) = 0;
  /// DDIM's eta (diffusers passes it to step; 0 = deterministic). Other classes refuse eta != 0.
  virtual void set_eta(double eta);

  /// alphabar of the training schedule, float64 [num_train_timesteps], as the class uses it (Euler, Euler
  /// ancestral and DPM-Solver set the last value to 2^-24 under zero terminal SNR, as diffusers does).
  const at::Tensor& alphas_cumprod() const { return alphas_cumprod_; }
  /// The dew discrete schedule of the same betas (for training or dew's own solvers).
  const diffusion::SchedulePtr& schedule() const { return schedule_; }

 protected:
  void check_index(int64_t i) const;
  std::string class_name_, where_, prediction_type_;
  diffusion::SchedulePtr schedule_;
  at::Tensor alphas_cumprod_;  // float64 [T]
  at::Tensor timesteps_;       // float64 [N]
  double init_noise_sigma_ = 1.0;
};
using SchedulerPtr = std::unique_ptr<Scheduler>;

/// diffusers' FlowMatchEulerDiscreteScheduler (0.42.1): sigmas from 1 down to 0, the model time
/// sigma x num_train_timesteps, x_{i+1} = x_i + (sigma_{i+1} - sigma_i) v. Settings: num_train_timesteps, shift,
/// use_dynamic_shifting with time_shift_type exponential | linear, base/max_shift and base/max_image_seq_len
/// (for mu_for), shift_terminal; invert_sigmas, karras / exponential / beta sigmas and stochastic_sampling are
/// refused by name. Sigmas are computed in float64 by diffusers' formulas (including its shift of sigma_min at
/// construction, which set_timesteps shifts again).
class FlowMatchEulerScheduler : public Scheduler {
 public:
  /// cfg: a scheduler_config.json with _class_name FlowMatchEulerDiscreteScheduler; `where` prefixes errors.
  FlowMatchEulerScheduler(const json& cfg, const std::string& where);
  /// set_timesteps(n) without sigmas or mu (refused under use_dynamic_shifting, which needs mu).
  void set_timesteps(int64_t n) override;
  /// diffusers' set_timesteps(n, sigmas=sigmas or None, mu=mu): sigmas (empty: linspace from sigma_max to
  /// sigma_min of the training table in n points) go through the shift (mu under use_dynamic_shifting,
  /// otherwise `shift`) and shift_terminal; mu is ignored without use_dynamic_shifting, as diffusers does.
  void set_timesteps(int64_t n, const std::vector<double>& sigmas, std::optional<double> mu);
  /// sigma_0 .. sigma_{N-1}, 0: float64 [num_steps() + 1].
  const at::Tensor& sigmas() const;
  double sigma(int64_t i) const;
  bool use_dynamic_shifting() const { return dynamic_; }
  /// The pipelines' calculate_shift for this config: mu of an image of image_seq_len latent tokens. A config
  /// without max_shift: StableDiffusion3Pipeline takes 1.16, FluxPipeline 1.15 (max_shift_if_absent).
  double mu_for(int64_t image_seq_len, double max_shift_if_absent = 1.15) const;
  /// x_{i+1} = x_i + (sigma_{i+1} - sigma_i) v, computed in float64, returned in x's dtype (noise unused).
  at::Tensor step(const at::Tensor& velocity, int64_t i, const at::Tensor& x, const NoiseSource& noise) override;

 private:
  double shifted(double s, std::optional<double> mu) const;
  int64_t T_ = 1000;
  double shift_ = 1, base_shift_ = 0.5, max_shift_ = 1.15, sigma_min_ = 0, sigma_max_ = 1;
  int64_t base_seq_ = 256, max_seq_ = 4096;
  bool dynamic_ = false, linear_shift_ = false, max_shift_set_ = false;
  std::optional<double> shift_terminal_;
  std::vector<double> sigmas_v_;
  at::Tensor sigmas_;  // float64 [N + 1]
};

/// diffusers' calculate_shift (pipeline_flux.py, copied into pipeline_stable_diffusion_3.py): mu linear in the
/// image sequence length, base_shift at base_seq_len and max_shift at max_seq_len.
double calculate_shift(int64_t image_seq_len, int64_t base_seq_len, int64_t max_seq_len, double base_shift,
                       double max_shift);

/// The `_class_name` values from_config accepts.
const std::vector<std::string>& scheduler_classes();

/// A scheduler_config.json as JSON, with Python's -Infinity / Infinity / NaN accepted (as strings).
json read_scheduler_config(const std::string& path);

}  // namespace dew::sampling
