// The Objective interface (docs/training.md): what a training run optimises. The trainer owns the
// optimizer, EMA, checkpoints and logging; the objective owns its modules, the loss and validation.
#pragma once
#include <torch/nn/module.h>

#include "dew/data/dataset.h"
#include "dew/training/optim.h"

namespace dew {
namespace training {
class Distributed;
}

/// A scalar loss to minimise and metrics to log (already reduced to numbers).
struct LossOutput {
  at::Tensor loss;
  std::map<std::string, double> metrics;
};

class Objective {
 public:
  virtual ~Objective() = default;
  virtual std::string name() const = 0;
  /// The root module holding every trainable parameter; its parameter names are the checkpoint's.
  virtual torch::nn::Module& module() = 0;
  /// The loss of one (micro-)batch. `gen` is derived by the trainer from (seed, step, micro-batch).
  virtual LossOutput loss(const data::Batch& batch, int64_t step, at::Generator gen) = 0;
  /// Data-parallel training (docs/distributed.md): the loss of rows [begin, end) of the global (micro-)batch,
  /// the share one rank computes. The default slices the batch (every field's first dimension) and calls
  /// loss(); an objective whose loss draws per-row noise from `gen` overrides it to draw for the whole batch
  /// and keep its rows, so each rank sees the noise a one-process run gives those rows.
  virtual LossOutput loss_of_rows(const data::Batch& batch, int64_t begin, int64_t end, int64_t step,
                                  at::Generator gen) {
    data::Batch rows;
    for (const auto& [name, t] : batch) rows[name] = t.dim() > 0 ? t.narrow(0, begin, end - begin) : t;
    return loss(rows, step, gen);
  }
  /// Data-parallel training: the trainer hands its process group over before the first step (never in a
  /// one-process run), for objectives that need collectives of their own (GRPO gathers its rollouts).
  virtual void bind_distributed(std::shared_ptr<training::Distributed> dist) {}
  /// Validation (run with the EMA weights swapped in): metrics to log; may write files under run_dir.
  virtual std::map<std::string, double> validate(int64_t step, const std::string& run_dir) { return {}; }
  /// Which parameters the trainer averages and with what decay (a constant, a ramp, 1.0 = frozen copy).
  virtual training::EmaSpec ema() const = 0;
  /// Called once by the trainer with its EMA averages (parameter name -> tensor, updated in place after every
  /// step), for objectives whose loss reads them (JEPA's target encoder).
  virtual void bind_ema(const std::map<std::string, at::Tensor>& averages) {}
  /// Called by the trainer once before its first step, with the step it starts from (0, or the checkpoint's
  /// when it resumes) and the run directory (for objectives that write files as they train: GRPO's rollouts).
  virtual void begin(int64_t step, const std::string& run_dir) {}
  /// Tensors the loss carries from step to step (GRPO's rollout buffer), saved in every checkpoint as
  /// objective.safetensors and handed back by load_state() when the run resumes, so it continues bit for bit.
  virtual std::map<std::string, at::Tensor> state() const { return {}; }
  virtual void load_state(const std::map<std::string, at::Tensor>& state) {}
  /// The batch fields the loss reads.
  virtual std::vector<std::string> batch_fields() const = 0;
  /// Names among loss()'s metrics that the progress line shows beside the loss: what the run kind exists
  /// for (GRPO's sampled reward, DPO's preference accuracy). Every metric goes to metrics.jsonl regardless.
  virtual std::vector<std::string> progress_metrics() const { return {}; }
};
using ObjectivePtr = std::shared_ptr<Objective>;

}  // namespace dew
