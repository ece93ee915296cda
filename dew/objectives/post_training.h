// Post-training losses (docs/post_training.md): DPO from policy and reference logits, the group-relative
// advantages of GRPO (and RLOO, mean), the PPO-clip policy loss and the k3 KL to a reference. Free functions
// on tensors, so the trainers and the parity tests call the same code. Each one equals its reference
// implementation on the same tensors (tests/golden/post_training, docs/post_training.md):
//   dpo_loss           TRL DPOTrainer, loss_type "sigmoid" (label smoothing as TRL v0.28's cDPO form)
//   grpo_advantages    verl compute_grpo_outcome_advantage (mean_advantages: norm_adv_by_std_in_grpo false)
//   rloo_advantages    verl compute_rloo_outcome_advantage
//   policy_loss        verl compute_policy_loss_vanilla with agg_loss
//   k3_kl              verl kl_penalty(..., "low_var_kl")
// Inputs keep their floating dtype: float64 in, float64 arithmetic throughout.
//
//   auto d = dew::post_training::dpo_loss(policy_logits, reference_logits, ids, completion_mask);
//   d.loss.backward();                                   // d.metrics["rewards/accuracies"], ...
//   auto adv = dew::post_training::grpo_advantages(rewards, prompt_ids, response_mask);
//   auto pl = dew::post_training::policy_loss(old_logp, logp, adv, response_mask, 0.2, 0.28);
//   at::Tensor loss = pl.loss + beta * dew::post_training::agg_loss(dew::post_training::k3_kl(logp, ref_logp),
//                                                                   response_mask, "token-mean");
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

namespace dew {
namespace post_training {

/// Summed log-probabilities of each sequence's tokens after the first: sum over t in [1, S) with
/// mask[..., t] != 0 of log softmax(logits[..., t - 1, :])[ids[..., t]] (TRL's shift, selective_log_softmax
/// and masking). logits: [..., S, V] floating; ids: [..., S] int64 in [0, V); mask: [..., S] bool or numeric
/// (only mask[..., 1:] is read) -> [...] in the logits' dtype, differentiable in the logits.
at::Tensor sequence_logps(const at::Tensor& logits, const at::Tensor& ids, const at::Tensor& mask);

/// The DPO loss of a batch of pairs and what TRL logs about it.
struct DpoLoss {
  at::Tensor loss;              // scalar: mean over pairs of the per-pair loss (differentiable)
  at::Tensor chosen_rewards;    // [B] beta * (log pi - log ref) of the chosen completions (detached)
  at::Tensor rejected_rewards;  // [B] the same for the rejected completions (detached)
  at::Tensor chosen_logps;      // [B] summed policy log-probs of the chosen completions (differentiable)
  at::Tensor rejected_logps;    // [B]
  /// rewards/chosen, rewards/rejected, rewards/accuracies (chosen reward > rejected reward),
  /// rewards/margins, logps/chosen, logps/rejected: means over the batch, as TRL logs them.
  std::map<std::string, double> metrics;
};

/// DPO (Rafailov et al. 2023) from logits. policy_logits, reference_logits: [B, 2, S, V] (index 0 = chosen,
/// 1 = rejected); ids: [B, 2, S] int64; completion_mask: [B, 2, S] (nonzero on the completion tokens whose
/// log-probs count). Per pair, with D = (log pi - log ref)(chosen) - (log pi - log ref)(rejected):
///   loss = -(1 - label_smoothing) log sigmoid(beta D) - label_smoothing log sigmoid(-beta D).
/// The reference side carries no gradient. beta > 0; label_smoothing in [0, 0.5).
DpoLoss dpo_loss(const at::Tensor& policy_logits, const at::Tensor& reference_logits, const at::Tensor& ids,
                 const at::Tensor& completion_mask, double beta = 0.1, double label_smoothing = 0.0);

/// The same from summed log-probs (e.g. reference log-probs precomputed once): policy_logps,
/// reference_logps: [B, 2] (column 0 = chosen), as sequence_logps returns them for [B, 2, S] ids.
DpoLoss dpo_loss_from_logps(const at::Tensor& policy_logps, const at::Tensor& reference_logps, double beta = 0.1,
                            double label_smoothing = 0.0);

/// GRPO's outcome advantage (Shao et al. 2024): per group of completions of one prompt,
/// (r - mean) / (std + eps) with the sample std (ddof 1), or r - mean when normalize_by_std is false
/// (Dr. GRPO), broadcast over each completion's tokens. A group of one has mean 0 and std 1 (verl).
/// scores: [N] floating; group_ids: [N] integral (equal ids = one group, in any order); response_mask:
/// [N, T] -> [N, T] in the scores' dtype, zero outside the mask, without gradient. eps > 0.
at::Tensor grpo_advantages(const at::Tensor& scores, const at::Tensor& group_ids, const at::Tensor& response_mask,
                           bool normalize_by_std = true, double eps = 1e-6);

/// RLOO's leave-one-out advantage (Ahmadian et al. 2024): r_i minus the mean of the other scores of its
/// group, computed as verl does, r n / (n - 1) - mean n / (n - 1); a group of one keeps its raw score.
/// Shapes as grpo_advantages.
at::Tensor rloo_advantages(const at::Tensor& scores, const at::Tensor& group_ids, const at::Tensor& response_mask);

/// r - group mean (GRPO without the std). Shapes as grpo_advantages.
at::Tensor mean_advantages(const at::Tensor& scores, const at::Tensor& group_ids, const at::Tensor& response_mask);

/// The loss aggregation modes of policy_loss and agg_loss: token-mean, seq-mean-token-mean,
/// seq-mean-token-sum.
const std::vector<std::string>& agg_modes();

/// sum(values where mask) / sum(mask), 0 for an empty mask: verl's masked_mean, whose + 1e-8 on the count
/// vanishes in float32 for its integer masks. values, mask: the same shape.
at::Tensor masked_mean(const at::Tensor& values, const at::Tensor& mask);

/// A scalar from a per-token loss, verl's agg_loss on one process. loss_mat, mask: [N, T].
///   token-mean:          sum of the masked losses / the number of masked tokens
///   seq-mean-token-mean: per sequence the mean of its masked losses, averaged over sequences with tokens
///   seq-mean-token-sum:  per sequence the sum of its masked losses, averaged over sequences with tokens
/// A mask without tokens (or sequences) gives 0, where verl divides by zero.
at::Tensor agg_loss(const at::Tensor& loss_mat, const at::Tensor& mask, const std::string& mode);

/// The PPO-clip policy loss and its statistics (scalars; the statistics are detached).
struct PolicyLoss {
  at::Tensor loss;            // aggregated per-token loss (differentiable in logp)
  at::Tensor clipfrac;        // masked fraction of tokens where the clipped term is the larger one
  at::Tensor clipfrac_lower;  // masked fraction of tokens with A < 0 held by the dual clip
  at::Tensor ppo_kl;          // masked mean of log pi_old - log pi (the log-ratio clamped)
};

/// PPO-clip (Schulman et al. 2017) with dual clip (Ye et al. 2020), verl's compute_policy_loss_vanilla:
/// r = exp(clamp(logp - old_logp, -20, 20)); per token max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)),
/// and for A < 0 that bounded by -A dual_clip; aggregated with agg_loss(mode). old_logp, logp, advantages,
/// response_mask: [N, T]; old_logp and advantages are constants (detached). eps_low in [0, 1),
/// eps_high >= 0, dual_clip > 1, agg one of agg_modes().
PolicyLoss policy_loss(const at::Tensor& old_logp, const at::Tensor& logp, const at::Tensor& advantages,
                       const at::Tensor& response_mask, double eps_low = 0.2, double eps_high = 0.2,
                       double dual_clip = 3.0, const std::string& agg = "token-mean");

/// The k3 estimator of KL(pi || ref) per token (Schulman 2020), verl's low_var_kl: with
/// d = clamp(ref_logp - logp, -20, 20), exp(d) - d - 1 clamped to [-10, 10]. logp, ref_logp: the same shape
/// -> that shape, differentiable in both.
at::Tensor k3_kl(const at::Tensor& logp, const at::Tensor& ref_logp);

}  // namespace post_training
}  // namespace dew
