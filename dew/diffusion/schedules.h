// Noise schedules (docs/diffusion.md). A schedule maps its time t to rates (alpha, sigma) of the forward
// process x_t = alpha(t) x0 + sigma(t) eps, draws training times, gives its own loss weight and the
// value the network is conditioned on (model_time). Schedules are registered by name in `schedules()`.
//
// Time domains: discrete schedules use integer indices t in [0, T); continuous ones t in [0, 1] with
// t = 1 the noisiest point; EDM uses t = sigma. Rates and weights are computed in float64.
#pragma once
#include <ATen/ATen.h>

#include "dew/core/registry.h"

namespace dew::diffusion {

using at::Tensor;

/// Alpha and sigma at a batch of times, same shape as t, float64.
struct Rates {
  Tensor alpha;
  Tensor sigma;
};

/// How a schedule relates alpha and sigma; sigma-space solvers need VE, DDPM's large variance VP.
enum class ScheduleKind {
  variance_preserving,  // alpha^2 + sigma^2 = 1
  variance_exploding,   // alpha = 1
  flow,                 // alpha + sigma = 1
  other,
};
const char* kind_name(ScheduleKind k);

class Schedule {
 public:
  virtual ~Schedule() = default;
  virtual std::string name() const = 0;
  virtual ScheduleKind kind() const = 0;
  /// (alpha(t), sigma(t)) in float64.
  virtual Rates rates(const Tensor& t) const = 0;
  /// n training times (float64 [n]) drawn from the schedule's training density with `gen`.
  virtual Tensor draw_t(int64_t n, at::Generator gen) const = 0;
  /// The schedule's own loss weight w(t) (float64).
  virtual Tensor weight(const Tensor& t) const;
  /// The value the network sees for time t (float32).
  virtual Tensor model_time(const Tensor& t) const;
  /// Noisiest and cleanest times of the sampling grid.
  virtual double t_max() const { return 1.0; }
  virtual double t_min() const { return 0.0; }
  virtual bool discrete() const { return false; }
  /// Inverse of sigma(t) (VE schedules only): the time at which sigma(t) = sigma.
  virtual Tensor t_of_sigma(const Tensor& sigma) const;
  /// The sampling grid: linspace(t_max, t_min, n) in schedule time (rounded for discrete schedules).
  Tensor grid(int64_t n) const;
  /// Scalar convenience: (alpha, sigma) at one time.
  std::pair<double, double> rates_at(double t) const;
  /// Standard deviation of the prior at t_max: sqrt(alpha_T^2 + sigma_T^2).
  double prior_std() const;
  /// SNR = (alpha/sigma)^2 (float64; inf where sigma = 0).
  Tensor snr(const Tensor& t) const;
  /// The {name, fields} record this schedule was built from.
  json spec() const { return spec_; }
  void set_spec(json s) { spec_ = std::move(s); }

 private:
  json spec_;
};
using SchedulePtr = std::shared_ptr<Schedule>;

// ---- options of the registered schedules ----

struct DiscreteOptions {
  int64_t timesteps = 1000;
  double beta_end = 0.999;
  double p2_k = 1.0;
  double p2_gamma = 1.0;
  std::optional<std::pair<double, double>> beta_range;
  bool rescale_zero_snr = false;
  template <class V>
  void visit(V& v) {
    v("timesteps", timesteps, "number of discrete steps T");
    v("beta_end", beta_end, "cosine: upper clip of each beta_i (1.0 gives zero terminal SNR)");
    v("p2_k", p2_k, "P2 loss weight (k + SNR)^-gamma: k");
    v("p2_gamma", p2_gamma, "P2 loss weight (k + SNR)^-gamma: gamma");
    v("beta_range", beta_range,
      "linear, scaled_linear: [beta_start, beta_end] (null: linear [1e-4, 0.02] * 1000/T, scaled_linear "
      "[0.00085, 0.012])");
    v("rescale_zero_snr", rescale_zero_snr,
      "rescale the betas to zero terminal SNR keeping alphabar_0 (Lin et al. 2024, algorithm 1; diffusers' "
      "rescale_betas_zero_snr)");
  }
};

struct KarrasOptions {
  double sigma_min = 0.002;
  double sigma_max = 80.0;
  double rho = 7.0;
  double sigma_data = 0.5;
  template <class V>
  void visit(V& v) {
    v("sigma_min", sigma_min, "smallest sigma (t = 0)");
    v("sigma_max", sigma_max, "largest sigma (t = 1)");
    v("rho", rho, "grid curvature: sigma^(1/rho) is linear in t");
    v("sigma_data", sigma_data, "data standard deviation in the EDM weight");
  }
};

struct EDMOptions {
  std::string regime = "pixel";
  std::optional<double> p_mean;
  std::optional<double> p_std;
  double sigma_min = 0.002;
  double sigma_max = 80.0;
  double sigma_data = 0.5;
  template <class V>
  void visit(V& v) {
    v.choice("regime", regime, {"pixel", "latent"}, "training sigma density: pixel (-1.2, 1.2) or latent (-0.4, 1.0)");
    v("p_mean", p_mean, "explicit P_mean (overrides regime)");
    v("p_std", p_std, "explicit P_std (overrides regime)");
    v("sigma_min", sigma_min, "smallest sigma of the sampling grid");
    v("sigma_max", sigma_max, "largest sigma of the sampling grid");
    v("sigma_data", sigma_data, "data standard deviation in the EDM weight");
  }
};

struct FlowOptions {
  std::string density = "logit_normal";
  double m = 0.0;
  double s = 1.0;
  double mode_scale = 1.29;
  double shift = 1.0;
  template <class V>
  void visit(V& v) {
    v.choice("density", density, {"logit_normal", "mode", "cosmap", "uniform"}, "training density of t");
    v("m", m, "logit_normal: location");
    v("s", s, "logit_normal: scale");
    v("mode_scale", mode_scale, "mode: scale s");
    v("shift", shift, "time shift: t' = shift t / (1 + (shift - 1) t)");
  }
};

/// The registry of schedules: linear, scaled_linear, cosine, exp (discrete); sqrt, cosine_continuous,
/// karras_ve, edm, flow (continuous).
Registry<Schedule>& schedules();

// ---- direct constructors (what the registry calls) ----
SchedulePtr make_linear(const DiscreteOptions& o = {});
/// diffusers' scaled_linear (Stable Diffusion): beta = linspace(sqrt(beta_start), sqrt(beta_end), T)^2.
SchedulePtr make_scaled_linear(const DiscreteOptions& o = {});
SchedulePtr make_cosine(const DiscreteOptions& o = {});
SchedulePtr make_exp(const DiscreteOptions& o = {});
SchedulePtr make_sqrt();
SchedulePtr make_cosine_continuous();
SchedulePtr make_karras_ve(const KarrasOptions& o = {});
SchedulePtr make_edm(const EDMOptions& o = {});
SchedulePtr make_flow(const FlowOptions& o = {});

/// A discrete schedule from explicit betas (float64 [T], e.g. a checkpoint's trained betas); o.timesteps
/// must equal T; o.rescale_zero_snr applies.
SchedulePtr make_discrete_from_betas(const std::string& name, const Tensor& betas, const DiscreteOptions& o);

/// alphabar_i of a discrete schedule, float64 [T] (alphabar = cumprod(1 - beta)).
Tensor alphas_cumprod(const Schedule& s);

/// Zero terminal SNR (Lin et al. 2024, "Common diffusion noise schedules and sample steps are flawed",
/// algorithm 1; diffusers' rescale_zero_terminal_snr): sqrt(alphabar) is shifted so its last value is 0
/// and scaled so its first is kept; returns the betas of the result (float64 [T], last beta 1).
Tensor rescale_zero_terminal_snr(const Tensor& betas);

/// Resolution-dependent flow shift: exp(mu), mu = 0.5 + (1.15 - 0.5)/(4096 - 256) (tokens - 256),
/// tokens = (H/16)(W/16).
double flow_resolution_shift(int64_t height, int64_t width);

/// Broadcasts per-row values [B] against x [B, ...] and casts to x's dtype.
Tensor bcast(const Tensor& v, const Tensor& x);

}  // namespace dew::diffusion
