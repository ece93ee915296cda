// The diffusion process (docs/diffusion.md): draws t, noises x0, builds the training target and weight,
// computes the loss, and turns a raw network output into (x0_hat, eps_hat) for sampling.
#pragma once
#include "dew/diffusion/presets.h"

namespace dew::diffusion {

/// A network: raw output F for the scaled input x_t * c_in and the model time.
using Model = std::function<Tensor(const Tensor& x_in, const Tensor& model_time)>;
/// A raw output at schedule time t (per-row [B] float64): F(x_t, t). Guidance wraps this level.
using RawFn = std::function<Tensor(const Tensor& x_t, const Tensor& t)>;
/// (x_t, t) -> (x0_hat, eps_hat): what solvers call.
using Denoiser = std::function<Prediction(const Tensor& x_t, const Tensor& t)>;

/// Everything one training step needs, per row of the batch.
struct TrainingInputs {
  Tensor t;           // [B] float64 schedule time
  Tensor eps;         // like x0
  Tensor x_t;         // alpha x0 + sigma eps
  Tensor net_input;   // x_t * c_in
  Tensor model_time;  // [B] float32
  Tensor target;      // what `prediction(F)` is compared with
  Tensor weight;      // [B] float32 loss weight
};

class DiffusionProcess {
 public:
  explicit DiffusionProcess(Preset p);

  const Preset& preset() const { return p_; }
  const Schedule& train_schedule() const { return *p_.train; }
  const Schedule& sample_schedule() const { return *p_.sample; }
  const Transform& transform() const { return *p_.transform; }

  /// Draws t ~ training density and eps ~ N(0, I) from `gen` (on the CPU, moved to x0's device).
  TrainingInputs training_inputs(const Tensor& x0, at::Generator gen) const;
  /// The same with given t ([B], training-schedule time) and eps.
  TrainingInputs training_inputs(const Tensor& x0, const Tensor& t, const Tensor& eps) const;

  /// Per-row loss 0.5 mean_elements((prediction(F) - target)^2) * w, shape [B].
  Tensor loss_per_row(const Tensor& F, const TrainingInputs& in) const;
  /// Batch mean of loss_per_row.
  Tensor loss(const Tensor& F, const TrainingInputs& in) const;

  /// Reads the raw output F at time t of `schedule` (default: the sampling schedule) as (x0_hat, eps_hat).
  Prediction denoise(const Tensor& F, const Tensor& x_t, const Tensor& t, const Schedule* schedule = nullptr) const;

  /// Wraps a network as a raw function of the sampling schedule's time: F = net(x_t c_in(t), model_time(t)).
  RawFn raw(Model net) const;
  /// A denoiser over the sampling schedule from a raw function (possibly guided).
  Denoiser denoiser(RawFn raw) const;

  /// x_T ~ N(0, 1) * prior_std of the sampling schedule, drawn from (seed, 0, "sample/prior").
  Tensor prior(at::IntArrayRef shape, uint64_t seed, const at::TensorOptions& options = {}) const;

 private:
  Preset p_;
};

}  // namespace dew::diffusion
