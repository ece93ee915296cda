// Optimizers and learning-rate schedules (docs/training.md). Written here rather than taken from
// torch::optim so the per-parameter state is keyed by parameter name: checkpoints save and restore it
// exactly, and a run resumed from a checkpoint continues bit for bit.
#pragma once
#include <ATen/ATen.h>

#include "dew/core/options.h"

namespace dew::training {

using at::Tensor;
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

struct OptimOptions {
  std::string name = "adamw";
  double lr = 2.7e-4;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  double momentum = 0.9;
  std::string schedule = "cosine";
  int64_t warmup_steps = 100;
  double min_lr_ratio = 0.1;
  double grad_clip = 1.0;
  template <class V>
  void visit(V& v) {
    v.choice("name", name, {"adamw", "adam", "sgd"}, "optimizer");
    v("lr", lr, "peak learning rate");
    v("beta1", beta1, "Adam beta1");
    v("beta2", beta2, "Adam beta2");
    v("eps", eps, "Adam epsilon");
    v("weight_decay", weight_decay, "weight decay on matrices (decoupled for adamw, L2 for adam and sgd)");
    v("momentum", momentum, "SGD momentum");
    v.choice("schedule", schedule, {"cosine", "linear", "constant"}, "learning-rate decay after warm-up");
    v("warmup_steps", warmup_steps, "linear warm-up steps from 0");
    v("min_lr_ratio", min_lr_ratio, "final lr as a fraction of lr (cosine, linear)");
    v("grad_clip", grad_clip, "clip the global gradient norm to this (0 = off)");
  }
};

/// Checks ranges; throws dew::Error naming the field.
void validate(const OptimOptions& o);

/// Learning rate at `step` (0-based) of `total` steps: linear warm-up, then the decay schedule.
double learning_rate(const OptimOptions& o, int64_t step, int64_t total);

/// Scales gradients so their global L2 norm is at most max_norm; returns the norm before clipping.
double clip_grad_norm(const NamedTensors& params, double max_norm);

class Optimizer {
 public:
  Optimizer(NamedTensors params, OptimOptions options);
  /// One update with learning rate lr from the parameters' .grad(); parameters without grad are skipped.
  void step(double lr);
  /// Drops the gradients (undefined, as PyTorch's zero_grad(set_to_none=True)).
  void zero_grad();
  /// Per-parameter state ("exp_avg/NAME", "exp_avg_sq/NAME", "momentum/NAME") and "step".
  std::map<std::string, Tensor> state_dict() const;
  /// Restores state_dict(); missing or mis-shaped entries are a dew::Error.
  void load_state_dict(const std::map<std::string, Tensor>& state);
  const NamedTensors& params() const { return params_; }
  int64_t steps_taken() const { return t_; }

 private:
  NamedTensors params_;
  OptimOptions o_;
  int64_t t_ = 0;
  std::map<std::string, Tensor> m_, v_;
};

/// What an objective averages (docs/training.md): which parameters, and the decay at each step.
///   EmaSpec{0.999}                          constant decay, warmed up as min(d, (1 + step)/(10 + step))
///   EmaSpec{1.0}                            a frozen copy of the starting weights (a reference policy)
///   EmaSpec::ramp(0.996, 1.0)               linear in the step from 0.996 to 1.0 over the run (JEPA's target)
struct EmaSpec {
  EmaSpec(double constant_decay = 0.999) : decay(constant_decay) {}  // NOLINT: EmaSpec{0.999} reads as the decay
  double decay = 0.999;                                              // the constant decay, or the ramp's first value
  double final_decay = -1;                                           // >= 0: the ramp's value at the last step
  std::vector<std::string> prefixes;  // parameters averaged: names starting with one of these (empty = all trainable)
  /// The copy is the frozen reference of post-training (decay 1.0), not an average: validation runs the live
  /// weights, and opening the run's "ema" weights gives the trained ones (see runs::OpenOptions).
  bool reference = false;
  static EmaSpec ramp(double from, double to) {
    EmaSpec s;
    s.decay = from;
    s.final_decay = to;
    return s;
  }
  /// A frozen copy of the starting weights: the reference model of DPO and GRPO.
  static EmaSpec frozen_reference() {
    EmaSpec s(1.0);
    s.reference = true;
    return s;
  }
  /// The decay applied after optimizer step `step` (0-based) of a run of `total_steps`.
  double at(int64_t step, int64_t total_steps) const;
  bool includes(const std::string& name) const;
};

/// Exponential moving average of parameters, kept in fp32, with the decay of an EmaSpec; decay 1.0 keeps a
/// frozen copy.
class EMA {
 public:
  /// `params` are the trainable parameters; those the spec includes are averaged.
  EMA(const NamedTensors& params, EmaSpec spec, int64_t total_steps = 1);
  void update(const NamedTensors& params, int64_t step);
  const std::map<std::string, Tensor>& averages() const { return avg_; }
  std::map<std::string, Tensor>& averages() { return avg_; }
  /// Copies the averages into the parameters (saving the live values) and back.
  void swap_into(const NamedTensors& params);
  const EmaSpec& spec() const { return spec_; }

 private:
  EmaSpec spec_;
  int64_t total_steps_;
  std::map<std::string, Tensor> avg_;
};

}  // namespace dew::training
