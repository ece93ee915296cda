#include "dew/objectives/post_training.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>

#include "dew/core/error.h"

namespace dew {
namespace post_training {

using at::Tensor;

namespace {

// The mask in the values' dtype (bool and integer masks become 0 / 1).
Tensor as_weights(const Tensor& mask, const Tensor& like) { return mask.to(like.scalar_type()); }

// sum(values * mask) with entries outside the mask dropped first (so inf or NaN there cannot leak in):
// verl's masked_sum, over `dim` (or everything when dim is empty).
Tensor masked_sum(const Tensor& values, const Tensor& w, c10::optional<int64_t> dim = c10::nullopt) {
  Tensor v = values.masked_fill(w == 0, 0.0) * w;
  return dim ? v.sum(*dim) : v.sum();
}

// count where it is > 0, else 1: a division by it turns an empty (all-zero) numerator into 0.
Tensor safe_count(const Tensor& count) { return at::where(count > 0, count, at::ones_like(count)); }

void check_same_shape(const char* fn, const char* name, const Tensor& t, const char* ref_name, const Tensor& ref) {
  DEW_CHECK(t.sizes() == ref.sizes(), fn, ": ", name, " ", t.sizes(), " must have the shape of ", ref_name, " ",
            ref.sizes());
}

void check_floating(const char* fn, const char* name, const Tensor& t) {
  DEW_CHECK(t.defined() && t.is_floating_point(), fn, ": ", name, " must be a floating tensor, got ",
            t.defined() ? std::string(c10::toString(t.scalar_type())) : std::string("an undefined tensor"));
}

void check_mask(const char* fn, const char* name, const Tensor& t) {
  DEW_CHECK(t.defined() && !t.is_complex(), fn, ": ", name, " must be a bool, integer or floating tensor");
}

void check_beta_smoothing(const char* fn, double beta, double label_smoothing) {
  DEW_CHECK(std::isfinite(beta) && beta > 0, fn, ": beta must be > 0, got ", beta);
  DEW_CHECK(label_smoothing >= 0 && label_smoothing < 0.5, fn, ": label_smoothing must be in [0, 0.5), got ",
            label_smoothing);
}

// Per completion: its group's mean and sample std (a group of one: 0 and 1, as verl) and size, each [N].
// Each group's statistics come from at::mean / at::std over its scores in their original order, as verl
// computes them from torch.stack of the group's scores.
struct GroupStats {
  Tensor mean, std, size;
};

GroupStats group_stats(const char* fn, const Tensor& scores, const Tensor& group_ids, const Tensor& response_mask) {
  check_floating(fn, "scores", scores);
  DEW_CHECK(scores.dim() == 1 && scores.size(0) > 0, fn, ": scores ", scores.sizes(), " must be [N] with N > 0");
  DEW_CHECK(group_ids.defined() && at::isIntegralType(group_ids.scalar_type(), /*includeBool=*/false), fn,
            ": group_ids must be an integer tensor, got ",
            group_ids.defined() ? std::string(c10::toString(group_ids.scalar_type())) : std::string("undefined"));
  DEW_CHECK(group_ids.dim() == 1 && group_ids.size(0) == scores.size(0), fn, ": group_ids ", group_ids.sizes(),
            " must be [", scores.size(0), "] like scores");
  check_mask(fn, "response_mask", response_mask);
  DEW_CHECK(response_mask.dim() == 2 && response_mask.size(0) == scores.size(0), fn, ": response_mask ",
            response_mask.sizes(), " must be [", scores.size(0), ", T] like scores");
  at::NoGradGuard no_grad;
  const Tensor s = scores.detach();
  Tensor uniq, inverse, counts;
  std::tie(uniq, inverse, counts) = at::_unique2(group_ids, /*sorted=*/true, /*return_inverse=*/true,
                                                 /*return_counts=*/true);
  // A stable sort lists each group's scores in their original order, the groups in the order of uniq.
  const Tensor order = std::get<1>(group_ids.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  const Tensor sorted = s.index_select(0, order);
  const Tensor n = counts.to(at::kCPU);
  const int64_t* np = n.data_ptr<int64_t>();
  std::vector<Tensor> means, stds;
  int64_t offset = 0;
  for (int64_t g = 0; g < n.numel(); ++g) {
    if (np[g] == 1) {
      means.push_back(at::zeros({}, s.options()));
      stds.push_back(at::ones({}, s.options()));
    } else {
      const Tensor group = sorted.narrow(0, offset, np[g]);
      means.push_back(group.mean());
      stds.push_back(group.std());
    }
    offset += np[g];
  }
  return {at::stack(means).index_select(0, inverse), at::stack(stds).index_select(0, inverse),
          counts.to(s.scalar_type()).index_select(0, inverse)};
}

Tensor broadcast_tokens(const Tensor& per_completion, const Tensor& response_mask) {
  return per_completion.unsqueeze(-1) * as_weights(response_mask, per_completion);
}

}  // namespace

Tensor sequence_logps(const Tensor& logits, const Tensor& ids, const Tensor& mask) {
  check_floating("sequence_logps", "logits", logits);
  DEW_CHECK(logits.dim() >= 2 && logits.size(-1) > 0 && logits.size(-2) > 0, "sequence_logps: logits ", logits.sizes(),
            " must be [..., S, V] with S, V > 0");
  DEW_CHECK(ids.defined() && ids.scalar_type() == at::kLong, "sequence_logps: ids must be int64, got ",
            ids.defined() ? std::string(c10::toString(ids.scalar_type())) : std::string("undefined"));
  DEW_CHECK(ids.sizes() == logits.sizes().slice(0, logits.dim() - 1), "sequence_logps: ids ", ids.sizes(),
            " must be logits ", logits.sizes(), " without the vocabulary dimension");
  check_mask("sequence_logps", "mask", mask);
  check_same_shape("sequence_logps", "mask", mask, "ids", ids);
  const int64_t V = logits.size(-1), S = ids.size(-1);
  if (ids.numel() > 0) {
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    DEW_CHECK(lo >= 0 && hi < V, "sequence_logps: ids must be in [0, ", V, "), got values in [", lo, ", ", hi, "]");
  }
  // TRL: shift, selective_log_softmax (the target logit minus the logsumexp), zero outside the mask, sum.
  const Tensor shift_logits = logits.narrow(-2, 0, S - 1);
  const Tensor labels = ids.narrow(-1, 1, S - 1);
  const Tensor shift_mask = mask.narrow(-1, 1, S - 1);
  Tensor per_token = shift_logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - at::logsumexp(shift_logits, {-1});
  return per_token.masked_fill(shift_mask == 0, 0.0).sum(-1);
}

DpoLoss dpo_loss_from_logps(const Tensor& policy_logps, const Tensor& reference_logps, double beta,
                            double label_smoothing) {
  check_beta_smoothing("dpo_loss", beta, label_smoothing);
  check_floating("dpo_loss", "policy_logps", policy_logps);
  check_floating("dpo_loss", "reference_logps", reference_logps);
  DEW_CHECK(policy_logps.dim() == 2 && policy_logps.size(1) == 2 && policy_logps.size(0) > 0, "dpo_loss: policy_logps ",
            policy_logps.sizes(), " must be [B, 2] with B > 0 (column 0 = chosen)");
  check_same_shape("dpo_loss", "reference_logps", reference_logps, "policy_logps", policy_logps);
  const Tensor ref = reference_logps.detach();
  DpoLoss out;
  out.chosen_logps = policy_logps.select(1, 0);
  out.rejected_logps = policy_logps.select(1, 1);
  const Tensor chosen_logratios = out.chosen_logps - ref.select(1, 0);
  const Tensor rejected_logratios = out.rejected_logps - ref.select(1, 1);
  const Tensor delta = chosen_logratios - rejected_logratios;
  // TRL main's sigmoid loss; with label smoothing, TRL v0.28's conservative (cDPO) form.
  const Tensor per_pair = label_smoothing == 0 ? -at::log_sigmoid(beta * delta)
                                               : (-at::log_sigmoid(beta * delta)) * (1 - label_smoothing) -
                                                     at::log_sigmoid(-beta * delta) * label_smoothing;
  out.loss = per_pair.mean();
  out.chosen_rewards = beta * chosen_logratios.detach();
  out.rejected_rewards = beta * rejected_logratios.detach();
  at::NoGradGuard no_grad;
  const Tensor& cr = out.chosen_rewards;
  const Tensor& rr = out.rejected_rewards;
  out.metrics["rewards/chosen"] = cr.mean().item<double>();
  out.metrics["rewards/rejected"] = rr.mean().item<double>();
  out.metrics["rewards/accuracies"] = (cr > rr).to(at::kFloat).mean().item<double>();
  out.metrics["rewards/margins"] = (cr - rr).mean().item<double>();
  out.metrics["logps/chosen"] = out.chosen_logps.detach().mean().item<double>();
  out.metrics["logps/rejected"] = out.rejected_logps.detach().mean().item<double>();
  return out;
}

DpoLoss dpo_loss(const Tensor& policy_logits, const Tensor& reference_logits, const Tensor& ids,
                 const Tensor& completion_mask, double beta, double label_smoothing) {
  check_beta_smoothing("dpo_loss", beta, label_smoothing);
  check_floating("dpo_loss", "policy_logits", policy_logits);
  check_floating("dpo_loss", "reference_logits", reference_logits);
  DEW_CHECK(policy_logits.dim() == 4 && policy_logits.size(1) == 2 && policy_logits.size(0) > 0,
            "dpo_loss: policy_logits ", policy_logits.sizes(),
            " must be [B, 2, S, V] with B > 0 (index 0 = chosen, 1 = rejected)");
  check_same_shape("dpo_loss", "reference_logits", reference_logits, "policy_logits", policy_logits);
  DEW_CHECK(ids.defined() && ids.sizes() == policy_logits.sizes().slice(0, 3), "dpo_loss: ids ",
            ids.defined() ? ids.sizes() : at::IntArrayRef{},
            " must be [B, 2, S] = ", policy_logits.sizes().slice(0, 3));
  check_mask("dpo_loss", "completion_mask", completion_mask);
  check_same_shape("dpo_loss", "completion_mask", completion_mask, "ids", ids);
  const Tensor policy = sequence_logps(policy_logits, ids, completion_mask);  // [B, 2]
  Tensor reference;
  {
    at::NoGradGuard no_grad;
    reference = sequence_logps(reference_logits.detach(), ids, completion_mask);
  }
  return dpo_loss_from_logps(policy, reference, beta, label_smoothing);
}

Tensor grpo_advantages(const Tensor& scores, const Tensor& group_ids, const Tensor& response_mask,
                       bool normalize_by_std, double eps) {
  DEW_CHECK(std::isfinite(eps) && eps > 0, "grpo_advantages: eps must be > 0, got ", eps);
  const GroupStats g = group_stats("grpo_advantages", scores, group_ids, response_mask);
  at::NoGradGuard no_grad;
  const Tensor s = scores.detach();
  const Tensor adv = normalize_by_std ? (s - g.mean) / (g.std + eps) : s - g.mean;
  return broadcast_tokens(adv, response_mask);
}

Tensor mean_advantages(const Tensor& scores, const Tensor& group_ids, const Tensor& response_mask) {
  const GroupStats g = group_stats("mean_advantages", scores, group_ids, response_mask);
  at::NoGradGuard no_grad;
  return broadcast_tokens(scores.detach() - g.mean, response_mask);
}

Tensor rloo_advantages(const Tensor& scores, const Tensor& group_ids, const Tensor& response_mask) {
  const GroupStats g = group_stats("rloo_advantages", scores, group_ids, response_mask);
  at::NoGradGuard no_grad;
  const Tensor s = scores.detach();
  const Tensor many = g.size > 1;
  const Tensor n_1 = at::where(many, g.size - 1, at::ones_like(g.size));
  // verl's order of operations: score * n / (n - 1) - mean * n / (n - 1).
  const Tensor adv = at::where(many, s * g.size / n_1 - g.mean * g.size / n_1, s);
  return broadcast_tokens(adv, response_mask);
}

const std::vector<std::string>& agg_modes() {
  static const std::vector<std::string> modes{"token-mean", "seq-mean-token-mean", "seq-mean-token-sum"};
  return modes;
}

Tensor masked_mean(const Tensor& values, const Tensor& mask) {
  check_floating("masked_mean", "values", values);
  check_mask("masked_mean", "mask", mask);
  check_same_shape("masked_mean", "mask", mask, "values", values);
  // verl divides by mask.sum() + 1e-8; for its integer masks that sum is an integer tensor, the 1e-8 makes
  // it float32 and vanishes for any count >= 1, so this is sum / count, and 0 for an empty mask.
  const Tensor w = as_weights(mask, values);
  return masked_sum(values, w) / safe_count(w.sum());
}

Tensor agg_loss(const Tensor& loss_mat, const Tensor& mask, const std::string& mode) {
  const auto& modes = agg_modes();
  DEW_CHECK(std::find(modes.begin(), modes.end(), mode) != modes.end(), "agg_loss: mode: got \"", mode,
            "\", accepted: token-mean, seq-mean-token-mean, seq-mean-token-sum");
  check_floating("agg_loss", "loss_mat", loss_mat);
  DEW_CHECK(loss_mat.dim() == 2, "agg_loss: loss_mat ", loss_mat.sizes(), " must be [N, T]");
  check_mask("agg_loss", "mask", mask);
  check_same_shape("agg_loss", "mask", mask, "loss_mat", loss_mat);
  const Tensor w = as_weights(mask, loss_mat);
  if (mode == "token-mean") return masked_sum(loss_mat, w) / safe_count(w.sum());
  const Tensor tokens = w.sum(-1);                  // [N]
  Tensor seq_losses = masked_sum(loss_mat, w, -1);  // [N] token sums
  if (mode == "seq-mean-token-mean") seq_losses = seq_losses / safe_count(tokens);
  const Tensor seq_w = (tokens > 0).to(loss_mat.scalar_type());  // sequences without tokens do not count
  return masked_sum(seq_losses, seq_w) / safe_count(seq_w.sum());
}

PolicyLoss policy_loss(const Tensor& old_logp, const Tensor& logp, const Tensor& advantages,
                       const Tensor& response_mask, double eps_low, double eps_high, double dual_clip,
                       const std::string& agg) {
  const auto& modes = agg_modes();
  DEW_CHECK(std::find(modes.begin(), modes.end(), agg) != modes.end(), "policy_loss: agg: got \"", agg,
            "\", accepted: token-mean, seq-mean-token-mean, seq-mean-token-sum");
  DEW_CHECK(eps_low >= 0 && eps_low < 1, "policy_loss: eps_low must be in [0, 1), got ", eps_low);
  DEW_CHECK(std::isfinite(eps_high) && eps_high >= 0, "policy_loss: eps_high must be >= 0, got ", eps_high);
  DEW_CHECK(std::isfinite(dual_clip) && dual_clip > 1, "policy_loss: dual_clip must be > 1, got ", dual_clip);
  check_floating("policy_loss", "logp", logp);
  check_floating("policy_loss", "old_logp", old_logp);
  check_floating("policy_loss", "advantages", advantages);
  DEW_CHECK(logp.dim() == 2, "policy_loss: logp ", logp.sizes(), " must be [N, T]");
  check_same_shape("policy_loss", "old_logp", old_logp, "logp", logp);
  check_same_shape("policy_loss", "advantages", advantages, "logp", logp);
  check_mask("policy_loss", "response_mask", response_mask);
  check_same_shape("policy_loss", "response_mask", response_mask, "logp", logp);
  const Tensor A = advantages.detach();
  // verl compute_policy_loss_vanilla, operation for operation.
  const Tensor negative_approx_kl = at::clamp(logp - old_logp.detach(), -20.0, 20.0);
  const Tensor ratio = at::exp(negative_approx_kl);
  const Tensor pg_losses1 = -A * ratio;
  const Tensor pg_losses2 = -A * at::clamp(ratio, 1 - eps_low, 1 + eps_high);
  const Tensor clip_pg_losses1 = at::maximum(pg_losses1, pg_losses2);
  const Tensor pg_losses3 = -A * dual_clip;
  const Tensor clip_pg_losses2 = at::minimum(pg_losses3, clip_pg_losses1);
  const Tensor negative = A < 0;
  const Tensor pg_losses = at::where(negative, clip_pg_losses2, clip_pg_losses1);
  PolicyLoss out;
  out.loss = agg_loss(pg_losses, response_mask, agg);
  at::NoGradGuard no_grad;
  const auto dtype = logp.scalar_type();
  out.ppo_kl = masked_mean(-negative_approx_kl.detach(), response_mask);
  out.clipfrac = masked_mean(at::gt(pg_losses2, pg_losses1).to(dtype), response_mask);
  out.clipfrac_lower = masked_mean(at::gt(clip_pg_losses1, pg_losses3).to(dtype) * negative.to(dtype), response_mask);
  return out;
}

Tensor k3_kl(const Tensor& logp, const Tensor& ref_logp) {
  check_floating("k3_kl", "logp", logp);
  check_floating("k3_kl", "ref_logp", ref_logp);
  check_same_shape("k3_kl", "ref_logp", ref_logp, "logp", logp);
  const Tensor kl = at::clamp(ref_logp - logp, -20.0, 20.0);
  const Tensor kld = at::exp(kl) - kl - 1;
  return at::clamp(kld, -10.0, 10.0);
}

}  // namespace post_training
}  // namespace dew
