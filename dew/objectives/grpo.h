// GRPOObjective (docs/post_training.md): group-relative policy optimisation (Shao et al. 2024) of a
// causal_transformer, as verl computes it. Each rollout takes the batch's prompts, generates group_size
// completions of each with the batched KV-cache generator (temperature, top-p), scores them with the rewards,
// and turns the scores into advantages (grpo, rloo or mean). The rollout then feeds epochs x mini_batches
// optimizer steps, each the PPO-clip loss of one mini-batch against the rollout's old log-probs, plus beta
// times the k3 KL to the frozen reference. The rollout buffer is part of every checkpoint, so a resumed run
// continues bit for bit; every rollout's prompt, completion and rewards are appended to RUN/rollouts.jsonl.
//
//
// Data-parallel (docs/distributed.md): each rank rolls out its rows of the batch's prompts (whole groups, so the
// advantages need no other rank), then the ranks gather the rollout: every rank holds the whole buffer, the one
// a single process makes (a row's sampling stream is its own), and each takes an equal slice of every
// mini-batch, its loss scaled so the ranks' sum is the mini-batch's loss over all its rows.
//
//   batch: {"index": int64 [P]} (rows of the prompt list); metrics: pg_loss, pg_clipfrac, pg_clipfrac_lower,
//   ppo_kl, kl, reward, reward/NAME, reward/NAME_std, completion_length
#pragma once
#include "dew/objectives/policy.h"
#include "dew/objectives/rollouts.h"

namespace dew {

struct GRPOObjectiveOptions {
  int64_t group_size = 8;
  int64_t max_new_tokens = 64;
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  std::string advantage = "grpo";
  double eps_low = 0.2;
  double eps_high = 0.2;
  double dual_clip = 3.0;
  std::string agg = "token-mean";
  double beta = 0.04;
  int64_t epochs = 1;
  int64_t mini_batches = 2;
  std::vector<double> reward_weights;
  template <class V>
  void visit(V& v) {
    v("group_size", group_size, "completions per prompt (>= 2)");
    v("max_new_tokens", max_new_tokens, "tokens per completion at most");
    v("temperature", temperature, "sampling temperature of the rollouts (> 0)");
    v("top_p", top_p, "nucleus sampling of the rollouts (1 = off)");
    v("top_k", top_k, "top-k sampling of the rollouts (0 = off)");
    v.choice("advantage", advantage, {"grpo", "mean", "rloo"},
             "grpo: (r - mean) / (std + 1e-6); mean: r - mean; rloo: leave-one-out baseline");
    v("eps_low", eps_low, "PPO clip: ratio >= 1 - eps_low");
    v("eps_high", eps_high, "PPO clip: ratio <= 1 + eps_high (DAPO: 0.28)");
    v("dual_clip", dual_clip, "dual clip bound of negative advantages (> 1)");
    v.choice("agg", agg, {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum"}, "loss aggregation");
    v("beta", beta, "weight of the k3 KL to the frozen reference (0 = none)");
    v("epochs", epochs, "passes over each rollout");
    v("mini_batches", mini_batches, "optimizer steps per pass over a rollout");
    v("reward_weights", reward_weights, "one weight per reward (empty = 1 each)");
  }
};

class GRPOObjective : public ReferencePolicyObjective {
 public:
  /// prompts: the training prompts (the loader's "index" picks rows); rewards: what scores a completion.
  GRPOObjective(nn::CausalTransformer model, GRPOObjectiveOptions o, data::ChatFormat fmt,
                std::vector<data::Prompt> prompts, std::vector<post_training::RewardPtr> rewards,
                std::shared_ptr<post_training::ChatEvaluator> eval);
  std::string name() const override { return "grpo"; }
  LossOutput loss(const data::Batch& batch, int64_t step, at::Generator gen) override;
  LossOutput loss_of_rows(const data::Batch& batch, int64_t begin, int64_t end, int64_t step,
                          at::Generator gen) override;
  void bind_distributed(std::shared_ptr<training::Distributed> dist) override { dist_ = std::move(dist); }
  void begin(int64_t step, const std::string& run_dir) override;
  std::map<std::string, at::Tensor> state() const override { return buffer_; }
  void load_state(const std::map<std::string, at::Tensor>& state) override;
  std::vector<std::string> batch_fields() const override { return {"index"}; }
  std::vector<std::string> progress_metrics() const override { return {"reward"}; }
  /// Optimizer steps one rollout feeds (epochs x mini_batches).
  int64_t updates_per_rollout() const { return o_.epochs * o_.mini_batches; }

 private:
  // Rolls out prompts [begin, end) of `index` (all of them in one process) into buffer_, the whole rollout's.
  void roll_out(const at::Tensor& index, int64_t begin, int64_t end, int64_t step, at::Generator& gen);
  std::shared_ptr<training::Distributed> dist_;
  GRPOObjectiveOptions o_;
  data::ChatFormat fmt_;
  std::vector<data::Prompt> prompts_;
  std::vector<post_training::RewardPtr> rewards_;
  std::string rollouts_path_;
  // The current rollout: ids, response_mask, old_logp, ref_logp, advantages [N, L]; step [1] (the step it
  // was made at); metrics [K] with their names in metric_names_ (stable order of reward names).
  std::map<std::string, at::Tensor> buffer_;
  std::vector<std::string> metric_names_;
};

}  // namespace dew
