// DPOObjective (docs/post_training.md): direct preference optimisation of a causal_transformer against its frozen
// starting weights (the reference), TRL's sigmoid loss with beta and label smoothing
// (post_training::dpo_loss), the reference log-probs computed per batch without gradient or once for the
// whole dataset, and optionally TRL's "sft" term (RPO, Pang et al. 2024): the token-mean cross entropy of the
// chosen completions, which keeps their likelihood from falling with the rejected ones'.
//
//   auto rows = dew::data::preference_rows("pairs.jsonl", fmt, model->options.max_seq_len());
//   auto obj = std::make_shared<dew::DPOObjective>(model, dew::DPOObjectiveOptions{}, rows, evaluator);
//   // batch: ids [B, 2, L], completion_mask [B, 2, L], index [B]; metrics: rewards/chosen, rewards/rejected,
//   //        rewards/accuracies, rewards/margins, logps/chosen, logps/rejected (+ sft_loss)
#pragma once
#include "dew/objectives/policy.h"
#include "dew/objectives/rollouts.h"

namespace dew {

struct DPOObjectiveOptions {
  double beta = 0.1;
  double label_smoothing = 0.0;
  std::string reference_logps = "batch";
  double sft_weight = 0.0;
  template <class V>
  void visit(V& v) {
    v("beta", beta, "DPO beta (the implicit KL constraint to the reference)");
    v("label_smoothing", label_smoothing,
      "cDPO label smoothing: the assumed probability that a pair's label is flipped, in [0, 0.5)");
    v.choice("reference_logps", reference_logps, {"batch", "precompute"},
             "reference log-probs: per batch without gradient, or precomputed once for the dataset");
    v("sft_weight", sft_weight,
      "weight of the chosen completions' cross entropy added to the loss (TRL loss_type [sigmoid, sft], RPO; 0 = off)");
  }
};

class DPOObjective : public ReferencePolicyObjective {
 public:
  /// rows: preference_rows of the training file (read by "precompute"); eval: held-out prompts (null = none).
  DPOObjective(nn::CausalTransformer model, DPOObjectiveOptions o, data::Batch rows,
               std::shared_ptr<post_training::ChatEvaluator> eval);
  std::string name() const override { return "dpo"; }
  LossOutput loss(const data::Batch& batch, int64_t step, at::Generator gen) override;
  std::vector<std::string> batch_fields() const override { return {"ids", "completion_mask", "index"}; }
  std::vector<std::string> progress_metrics() const override { return {"rewards/accuracies", "rewards/margins"}; }

 private:
  // Summed reference log-probs [n, 2] of rows ids [n, 2, L] (no gradient).
  at::Tensor reference_logps(const at::Tensor& ids, const at::Tensor& mask);
  DPOObjectiveOptions o_;
  data::Batch rows_;
  at::Tensor precomputed_;  // [N, 2] for "precompute", filled on the first loss
};

}  // namespace dew
