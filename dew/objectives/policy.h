// What DPO and GRPO share about the model they train (docs/post_training.md): per-token log-probs of token rows,
// and the frozen reference model, which is the trainer's EMA with EmaSpec::frozen_reference() (a copy of the
// starting weights, checkpointed with the run) held in a second model of the same architecture.
//
//   auto logp = dew::post_training::token_logps(*policy, ids);   // ids [N, L] -> [N, L], column 0 = 0
//   dew::post_training::FrozenReference ref(policy);             // in the objective's constructor
//   ref.bind(averages);                                           // Objective::bind_ema
//   at::Tensor ref_logp = dew::post_training::token_logps(ref.model(), ids);   // no gradient
#pragma once
#include <map>
#include <string>

#include "dew/nn/backbones/causal_transformer.h"
#include "dew/objectives/rollouts.h"
#include "dew/training/objective.h"

namespace dew::post_training {

/// log p(ids[:, t] | ids[:, :t]) for t >= 1 under `model` (column 0, which has no context, is 0):
/// ids int64 [N, L] -> float32 [N, L], differentiable unless grad mode is off. Right padding is harmless
/// (causal attention); the caller masks it.
at::Tensor token_logps(nn::CausalTransformerImpl& model, const at::Tensor& ids);

/// A frozen copy of a policy's starting weights, read from the trainer's reference EMA.
class FrozenReference {
 public:
  explicit FrozenReference(const nn::CausalTransformer& policy);
  /// The trainer's EMA averages (parameter name -> tensor): the reference weights. After set(), the set
  /// weights are copied into them, so checkpoints hold the reference that was used.
  void bind(const std::map<std::string, at::Tensor>& averages);
  /// Other reference weights (`--reference DIR`), before the trainer binds: every parameter and buffer of the
  /// architecture, by name (dew::Error naming a missing or mis-shaped tensor). `what` names the source.
  void set(const std::map<std::string, at::Tensor>& weights, const std::string& what);
  /// The reference model, the averages copied in on the first call (the trainer restores a checkpoint's
  /// averages after bind and before the first loss; they never change after). For a LoRA policy, whose EMA
  /// holds only the adapters, the reference is its frozen base with the adapters' starting values merged.
  nn::CausalTransformerImpl& model();

 private:
  nn::CausalTransformer policy_{nullptr};
  nn::CausalTransformer model_{nullptr};
  const std::map<std::string, at::Tensor>* averages_ = nullptr;
  bool loaded_ = false;
  bool set_ = false;  // set() gave the weights: bind() writes them into the averages
};

}  // namespace dew::post_training

namespace dew {

/// What DPOObjective and GRPOObjective share: the policy being trained (the module), its frozen reference
/// (the trainer's reference EMA, or set_reference's weights) and the held-out prompt evaluation run at
/// validation.
class ReferencePolicyObjective : public Objective {
 public:
  torch::nn::Module& module() override { return *model_; }
  training::EmaSpec ema() const override { return training::EmaSpec::frozen_reference(); }
  void bind_ema(const std::map<std::string, at::Tensor>& averages) override { reference_.bind(averages); }
  /// val/reward/NAME, val/reward, val/completion_length of the held-out prompts (none without an evaluator).
  std::map<std::string, double> validate(int64_t step, const std::string& run_dir) override;
  /// A reference other than the starting weights (see FrozenReference::set), before training starts.
  void set_reference(const std::map<std::string, at::Tensor>& weights, const std::string& what) {
    reference_.set(weights, what);
  }

 protected:
  ReferencePolicyObjective(nn::CausalTransformer model, std::shared_ptr<post_training::ChatEvaluator> eval)
      : model_(std::move(model)), eval_(std::move(eval)), reference_(model_) {}
  nn::CausalTransformer model_;
  std::shared_ptr<post_training::ChatEvaluator> eval_;
  post_training::FrozenReference reference_;
};

}  // namespace dew
