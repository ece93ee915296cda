#include "dew/objectives/grpo.h"

#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "dew/core/error.h"
#include "dew/io/files.h"
#include "dew/objectives/post_training.h"
#include "dew/training/trainer.h"

namespace fs = std::filesystem;

namespace dew {

namespace {

double mean_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / double(v.size());
}

double std_of(const std::vector<double>& v) {
  if (v.size() < 2) return 0.0;
  const double m = mean_of(v);
  double s = 0;
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / double(v.size() - 1));
}

}  // namespace

GRPOObjective::GRPOObjective(nn::CausalTransformer model, GRPOObjectiveOptions o, data::ChatFormat fmt,
                             std::vector<data::Prompt> prompts, std::vector<post_training::RewardPtr> rewards,
                             std::shared_ptr<post_training::ChatEvaluator> eval)
    : ReferencePolicyObjective(std::move(model), std::move(eval)),
      o_(std::move(o)),
      fmt_(std::move(fmt)),
      prompts_(std::move(prompts)),
      rewards_(std::move(rewards)) {
  DEW_CHECK(o_.group_size >= 2, "objective.group_size: must be >= 2 (advantages compare completions of a prompt), got ",
            o_.group_size);
  DEW_CHECK(o_.max_new_tokens > 0, "objective.max_new_tokens: must be > 0, got ", o_.max_new_tokens);
  DEW_CHECK(o_.temperature > 0, "objective.temperature: must be > 0 (rollouts sample), got ", o_.temperature);
  DEW_CHECK(o_.top_p > 0 && o_.top_p <= 1, "objective.top_p: must be in (0, 1], got ", o_.top_p);
  DEW_CHECK(o_.top_k >= 0, "objective.top_k: must be >= 0, got ", o_.top_k);
  DEW_CHECK(o_.eps_low >= 0 && o_.eps_low < 1 && o_.eps_high >= 0,
            "objective.eps_low must be in [0, 1) and eps_high >= 0, got ", o_.eps_low, " and ", o_.eps_high);
  DEW_CHECK(o_.dual_clip > 1, "objective.dual_clip: must be > 1, got ", o_.dual_clip);
  DEW_CHECK(o_.beta >= 0, "objective.beta: must be >= 0, got ", o_.beta);
  DEW_CHECK(o_.epochs >= 1 && o_.mini_batches >= 1, "objective.epochs and objective.mini_batches: must be >= 1, got ",
            o_.epochs, " and ", o_.mini_batches);
  DEW_CHECK(o_.reward_weights.empty() || o_.reward_weights.size() == rewards_.size(),
            "objective.reward_weights: ", o_.reward_weights.size(), " weights for ", rewards_.size(), " rewards");
  DEW_CHECK(!prompts_.empty() && !rewards_.empty(), "objective grpo: needs prompts and at least one reward");
  // The rollout statistics, in a fixed order (the buffer holds their values; a resumed run logs the same).
  std::map<std::string, int> names = {
      {"reward", 0}, {"reward_std", 0}, {"completion_length", 0}, {"groups_without_signal", 0}};
  for (const auto& r : rewards_) {
    names["reward/" + r->name()] = 0;
    names["reward/" + r->name() + "_std"] = 0;
  }
  for (const auto& kv : names) metric_names_.push_back(kv.first);
}

void GRPOObjective::begin(int64_t step, const std::string& run_dir) {
  rollouts_path_ = (fs::path(run_dir) / "rollouts.jsonl").string();
  // A killed run's rollouts past its checkpoint are made again (lines carry the step they feed up to).
  io::truncate_jsonl(rollouts_path_, step);
}

void GRPOObjective::load_state(const std::map<std::string, at::Tensor>& state) {
  buffer_.clear();
  for (const auto& [k, v] : state) buffer_[k] = v.clone();
}

void GRPOObjective::roll_out(const at::Tensor& index, int64_t step, at::Generator& gen) {
  const int64_t p = index.size(0), g = o_.group_size, n = p * g;
  DEW_CHECK(n % o_.mini_batches == 0, "objective.mini_batches: ", o_.mini_batches, " does not divide the rollout's ", n,
            " completions (", p, " prompts x group_size ", g, ")");
  auto ix = index.accessor<int64_t, 1>();
  std::vector<const data::Prompt*> rows;
  for (int64_t i = 0; i < p; ++i) {
    DEW_CHECK(ix[i] >= 0 && ix[i] < int64_t(prompts_.size()), "objective grpo: prompt index ", ix[i], " out of range");
    for (int64_t k = 0; k < g; ++k) rows.push_back(&prompts_[size_t(ix[i])]);
  }
  sampling::GenerationOptions go;
  go.max_new_tokens = o_.max_new_tokens;
  go.temperature = o_.temperature;
  go.top_p = o_.top_p;
  go.top_k = o_.top_k;
  go.seed = uint64_t(at::randint(int64_t(1) << 62, {1}, gen, at::kLong).item<int64_t>());
  const bool was_training = model_->is_training();
  model_->eval();
  post_training::Rollout r = post_training::roll_out(*model_, fmt_, rows, go, rewards_, o_.reward_weights);
  if (was_training) model_->train();

  // Rows: prompt + completion, right-padded; the mask covers the completion tokens.
  size_t len = 0;
  for (int64_t i = 0; i < n; ++i) len = std::max(len, rows[i]->ids.size() + r.completions[i].ids.size());
  at::Tensor ids = at::zeros({n, int64_t(len)}, at::kLong), mask = at::zeros({n, int64_t(len)}, at::kFloat);
  auto ia = ids.accessor<int64_t, 2>();
  auto ma = mask.accessor<float, 2>();
  for (int64_t i = 0; i < n; ++i) {
    const auto& pr = rows[i]->ids;
    const auto& c = r.completions[i].ids;
    for (size_t t = 0; t < pr.size(); ++t) ia[i][int64_t(t)] = pr[t];
    for (size_t t = 0; t < c.size(); ++t) {
      ia[i][int64_t(pr.size() + t)] = c[t];
      ma[i][int64_t(pr.size() + t)] = 1.0f;
    }
  }
  const at::Tensor scores = at::tensor(r.total, at::kDouble).to(at::kFloat);
  const at::Tensor groups = at::arange(n, at::kLong).div(g, "floor");
  at::Tensor adv = o_.advantage == "grpo"   ? post_training::grpo_advantages(scores, groups, mask)
                   : o_.advantage == "mean" ? post_training::mean_advantages(scores, groups, mask)
                                            : post_training::rloo_advantages(scores, groups, mask);
  std::map<std::string, at::Tensor> b;
  {
    at::NoGradGuard ng;
    b["old_logp"] = post_training::token_logps(*model_, ids).cpu();
    if (o_.beta > 0) b["ref_logp"] = post_training::token_logps(reference_.model(), ids).cpu();
  }
  b["ids"] = ids;
  b["response_mask"] = mask;
  b["advantages"] = adv;
  b["step"] = at::tensor({step - step % updates_per_rollout()}, at::kLong);

  // The rollout's statistics, logged with every update it feeds.
  std::map<std::string, double> m;
  m["reward"] = mean_of(r.total);
  m["reward_std"] = std_of(r.total);
  for (const auto& [name, s] : r.scores) {
    m["reward/" + name] = mean_of(s);
    m["reward/" + name + "_std"] = std_of(s);
  }
  double length = 0, flat = 0;
  for (const auto& c : r.completions) length += double(c.ids.size());
  for (int64_t i = 0; i < p; ++i) {
    bool same = true;
    for (int64_t k = 1; k < g; ++k) same = same && r.total[size_t(i * g + k)] == r.total[size_t(i * g)];
    flat += same ? 1.0 : 0.0;
  }
  m["completion_length"] = length / double(n);
  m["groups_without_signal"] = flat / double(p);  // groups whose completions all scored alike (zero advantage)
  std::vector<double> values;
  for (const auto& k : metric_names_) values.push_back(m.at(k));
  b["metrics"] = at::tensor(values, at::kDouble);
  buffer_ = std::move(b);

  if (!rollouts_path_.empty()) {
    std::ofstream f(rollouts_path_, std::ios::app | std::ios::binary);
    const at::Tensor per_row = (adv.sum(1) / mask.sum(1)).to(at::kDouble).contiguous();  // constant over its tokens
    const double* row_adv = per_row.data_ptr<double>();
    for (int64_t i = 0; i < n; ++i) {
      json rewards = json::object();
      for (const auto& [name, s] : r.scores) rewards[name] = s[size_t(i)];
      json line = {{"step", step + 1},
                   {"prompt", rows[i]->text},
                   {"completion", r.completions[i].text},
                   {"rewards", rewards},
                   {"reward", r.total[size_t(i)]},
                   {"advantage", row_adv[i]},
                   {"finish", r.completions[i].finish}};
      // A sampled completion need not be valid UTF-8: invalid bytes are written as U+FFFD.
      f << line.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
    }
    f.flush();
  }
}

LossOutput GRPOObjective::loss(const data::Batch& batch, int64_t step, at::Generator gen) {
  const int64_t u = updates_per_rollout(), start = step - step % u;
  if (buffer_.empty() || buffer_.at("step").item<int64_t>() != start) roll_out(batch.at("index"), step, gen);
  const auto device = model_->head_weight().device();
  const int64_t n = buffer_.at("ids").size(0), part = n / o_.mini_batches, m = (step % u) % o_.mini_batches;
  auto rows = [&](const char* k) { return buffer_.at(k).narrow(0, m * part, part).to(device); };
  const at::Tensor ids = rows("ids"), mask = rows("response_mask");
  const at::Tensor logp = post_training::token_logps(*model_, ids);
  auto pl = post_training::policy_loss(rows("old_logp"), logp, rows("advantages"), mask, o_.eps_low, o_.eps_high,
                                       o_.dual_clip, o_.agg);
  at::Tensor loss = pl.loss;
  std::map<std::string, double> metrics = {{"pg_loss", pl.loss.item<double>()},
                                           {"pg_clipfrac", pl.clipfrac.item<double>()},
                                           {"pg_clipfrac_lower", pl.clipfrac_lower.item<double>()},
                                           {"ppo_kl", pl.ppo_kl.item<double>()}};
  if (o_.beta > 0) {
    const at::Tensor kl = post_training::agg_loss(post_training::k3_kl(logp, rows("ref_logp")), mask, o_.agg);
    loss = loss + o_.beta * kl;
    metrics["kl"] = kl.item<double>();
  }
  const at::Tensor values = buffer_.at("metrics");
  DEW_CHECK(metric_names_.size() == size_t(values.numel()), "objective grpo: the rollout buffer holds ", values.numel(),
            " statistics, the rewards make ", metric_names_.size(), " (a checkpoint of other rewards?)");
  for (size_t i = 0; i < metric_names_.size(); ++i) metrics[metric_names_[i]] = values[int64_t(i)].item<double>();
  return {loss, metrics};
}

}  // namespace dew
