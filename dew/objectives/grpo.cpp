#include "dew/objectives/grpo.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "dew/core/error.h"
#include "dew/io/files.h"
#include "dew/objectives/post_training.h"
#include "dew/training/distributed.h"
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
  if (dist_ && !dist_->is_main()) return;  // rank 0 writes the run directory
  rollouts_path_ = (fs::path(run_dir) / "rollouts.jsonl").string();
  // A killed run's rollouts past its checkpoint are made again (lines carry the step they feed up to).
  io::truncate_jsonl(rollouts_path_, step);
}

void GRPOObjective::load_state(const std::map<std::string, at::Tensor>& state) {
  buffer_.clear();
  for (const auto& [k, v] : state) buffer_[k] = v.clone();
}

namespace {

const std::vector<std::string> kFinish = {"length", "eos", "stop"};

// Every rank's rows [first, first + local.size(0)) of a [n, C] float64 matrix, summed into the whole on every
// rank (the others' rows are zeros here, so the sum is exact).
at::Tensor gather_rows(training::Distributed& dist, const at::Tensor& local, int64_t first, int64_t n) {
  at::Tensor all = at::zeros({n, local.size(1)}, at::kDouble);
  all.narrow(0, first, local.size(0)).copy_(local);
  const at::Tensor flat = all.reshape(-1).contiguous();
  std::vector<double> v(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel());
  v = dist.sum(v);
  return at::tensor(v, at::kDouble).view({n, local.size(1)});
}

}  // namespace

void GRPOObjective::roll_out(const at::Tensor& index, int64_t begin, int64_t end, int64_t step, at::Generator& gen) {
  const int64_t p = index.size(0), g = o_.group_size, n = p * g, first = begin * g, local = (end - begin) * g;
  DEW_CHECK(n % o_.mini_batches == 0, "objective.mini_batches: ", o_.mini_batches, " does not divide the rollout's ", n,
            " completions (", p, " prompts x group_size ", g, ")");
  auto ix = index.accessor<int64_t, 1>();
  std::vector<const data::Prompt*> rows;  // the whole rollout's, group by group
  size_t longest = 0;
  for (int64_t i = 0; i < p; ++i) {
    DEW_CHECK(ix[i] >= 0 && ix[i] < int64_t(prompts_.size()), "objective grpo: prompt index ", ix[i], " out of range");
    for (int64_t k = 0; k < g; ++k) rows.push_back(&prompts_[size_t(ix[i])]);
    longest = std::max(longest, prompts_[size_t(ix[i])].ids.size());
  }
  sampling::GenerationOptions go;
  // Capped by the longest prompt of the whole batch, so every rank generates to the same length.
  const int64_t room = model_->options.max_seq_len() - int64_t(longest);
  go.max_new_tokens = room > 0 ? std::min(o_.max_new_tokens, room) : o_.max_new_tokens;
  go.temperature = o_.temperature;
  go.top_p = o_.top_p;
  go.top_k = o_.top_k;
  go.seed = uint64_t(at::randint(int64_t(1) << 62, {1}, gen, at::kLong).item<int64_t>());  // the same on every rank
  go.first_row = first;
  const bool was_training = model_->is_training();
  model_->eval();
  const std::vector<const data::Prompt*> mine(rows.begin() + first, rows.begin() + first + local);
  post_training::Rollout r = post_training::roll_out(*model_, fmt_, mine, go, rewards_, o_.reward_weights);
  if (was_training) model_->train();

  // This rank's rows: prompt + completion, right-padded; the mask covers the completion tokens.
  int64_t len = 0;
  for (int64_t i = 0; i < local; ++i)
    len = std::max(len, int64_t(mine[size_t(i)]->ids.size() + r.completions[size_t(i)].ids.size()));
  if (dist_)  // the longest row of any rank
    len = int64_t(gather_rows(*dist_, at::full({1, 1}, double(len), at::kDouble), dist_->rank(), dist_->world_size())
                      .max()
                      .item<double>());
  at::Tensor ids = at::zeros({local, len}, at::kLong), mask = at::zeros({local, len}, at::kFloat);
  auto ia = ids.accessor<int64_t, 2>();
  auto ma = mask.accessor<float, 2>();
  for (int64_t i = 0; i < local; ++i) {
    const auto& pr = mine[size_t(i)]->ids;
    const auto& c = r.completions[size_t(i)].ids;
    for (size_t t = 0; t < pr.size(); ++t) ia[i][int64_t(t)] = pr[t];
    for (size_t t = 0; t < c.size(); ++t) {
      ia[i][int64_t(pr.size() + t)] = c[t];
      ma[i][int64_t(pr.size() + t)] = 1.0f;
    }
  }
  // Per row: the total reward, each reward's score (in name order) and how the completion ended.
  std::vector<std::string> reward_names;
  for (const auto& kv : r.scores) reward_names.push_back(kv.first);
  at::Tensor per_row = at::zeros({local, int64_t(2 + reward_names.size())}, at::kDouble);
  for (int64_t i = 0; i < local; ++i) {
    per_row[i][0] = r.total[size_t(i)];
    per_row[i][1] =
        double(std::find(kFinish.begin(), kFinish.end(), r.completions[size_t(i)].finish) - kFinish.begin());
    for (size_t k = 0; k < reward_names.size(); ++k)
      per_row[i][int64_t(2 + k)] = r.scores.at(reward_names[k])[size_t(i)];
  }
  // Groups never straddle ranks: the advantages are this rank's to compute.
  const at::Tensor groups = at::arange(local, at::kLong).div(g, "floor");
  const at::Tensor scores = per_row.select(1, 0).to(at::kFloat);
  at::Tensor adv = o_.advantage == "grpo"   ? post_training::grpo_advantages(scores, groups, mask)
                   : o_.advantage == "mean" ? post_training::mean_advantages(scores, groups, mask)
                                            : post_training::rloo_advantages(scores, groups, mask);
  at::Tensor old_logp, ref_logp;
  {
    at::NoGradGuard ng;
    old_logp = post_training::token_logps(*model_, ids).cpu();
    if (o_.beta > 0) ref_logp = post_training::token_logps(reference_.model(), ids).cpu();
  }
  if (dist_) {
    // The whole rollout on every rank, bit for bit what each row's rank computed (float32 and int64 values
    // are exact in float64).
    std::vector<at::Tensor> parts = {ids.to(at::kDouble), mask.to(at::kDouble), old_logp.to(at::kDouble),
                                     adv.to(at::kDouble)};
    if (o_.beta > 0) parts.push_back(ref_logp.to(at::kDouble));
    parts.push_back(per_row);
    const at::Tensor all = gather_rows(*dist_, at::cat(parts, 1), first, n);
    auto column = [&](int64_t k) { return all.narrow(1, k * len, len); };
    ids = column(0).to(at::kLong);
    mask = column(1).to(at::kFloat);
    old_logp = column(2).to(old_logp.scalar_type());
    adv = column(3).to(adv.scalar_type());
    if (o_.beta > 0) ref_logp = column(4).to(ref_logp.scalar_type());
    per_row = all.narrow(1, int64_t(parts.size() - 1) * len, per_row.size(1)).contiguous();
  }
  std::map<std::string, at::Tensor> b;
  b["old_logp"] = old_logp;
  if (o_.beta > 0) b["ref_logp"] = ref_logp;
  b["ids"] = ids;
  b["response_mask"] = mask;
  b["advantages"] = adv;
  b["step"] = at::tensor({step - step % updates_per_rollout()}, at::kLong);

  // The rollout's statistics over all its rows, logged with every update it feeds.
  auto column_of = [&](int64_t k) {
    const at::Tensor c = per_row.select(1, k).contiguous();
    return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + n);
  };
  const std::vector<double> total = column_of(0), finish = column_of(1);
  std::map<std::string, double> m;
  m["reward"] = mean_of(total);
  m["reward_std"] = std_of(total);
  for (size_t k = 0; k < reward_names.size(); ++k) {
    const std::vector<double> s = column_of(int64_t(2 + k));
    m["reward/" + reward_names[k]] = mean_of(s);
    m["reward/" + reward_names[k] + "_std"] = std_of(s);
  }
  const at::Tensor tokens = mask.sum(1).to(at::kLong).contiguous();  // completion length per row
  const int64_t* count = tokens.data_ptr<int64_t>();
  double length = 0, flat = 0;
  for (int64_t i = 0; i < n; ++i) length += double(count[i]);
  for (int64_t i = 0; i < p; ++i) {
    bool same = true;
    for (int64_t k = 1; k < g; ++k) same = same && total[size_t(i * g + k)] == total[size_t(i * g)];
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
    const at::Tensor row_adv = (adv.sum(1) / mask.sum(1)).to(at::kDouble).contiguous();  // constant over its tokens
    for (int64_t i = 0; i < n; ++i) {
      const auto& pr = rows[size_t(i)]->ids;
      const at::Tensor c = ids[i].narrow(0, int64_t(pr.size()), count[i]).contiguous();
      const std::vector<int64_t> completion(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
      json rewards = json::object();
      for (size_t k = 0; k < reward_names.size(); ++k)
        rewards[reward_names[k]] = per_row[i][int64_t(2 + k)].item<double>();
      json line = {{"step", step + 1},
                   {"prompt", rows[size_t(i)]->text},
                   {"completion", post_training::completion_text(fmt_, completion, rows[size_t(i)]->conversational)},
                   {"rewards", rewards},
                   {"reward", total[size_t(i)]},
                   {"advantage", row_adv[i].item<double>()},
                   {"finish", kFinish.at(size_t(finish[size_t(i)]))}};
      // A sampled completion need not be valid UTF-8: invalid bytes are written as U+FFFD.
      f << line.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
    }
    f.flush();
  }
}

LossOutput GRPOObjective::loss(const data::Batch& batch, int64_t step, at::Generator gen) {
  return loss_of_rows(batch, 0, batch.at("index").size(0), step, gen);
}

LossOutput GRPOObjective::loss_of_rows(const data::Batch& batch, int64_t begin, int64_t end, int64_t step,
                                       at::Generator gen) {
  const at::Tensor& index = batch.at("index");
  const int64_t u = updates_per_rollout(), start = step - step % u;
  if (buffer_.empty() || buffer_.at("step").item<int64_t>() != start) roll_out(index, begin, end, step, gen);
  const auto device = model_->head_weight().device();
  // Mini-batch m of the rollout, and this rank's equal slice of it.
  const int64_t n = buffer_.at("ids").size(0), part = n / o_.mini_batches, m = (step % u) % o_.mini_batches;
  const int64_t world = dist_ ? dist_->world_size() : 1, rank = dist_ ? dist_->rank() : 0;
  const int64_t lo = m * part + part * rank / world, hi = m * part + part * (rank + 1) / world;
  DEW_CHECK(hi > lo, "objective grpo: a mini-batch of ", part, " completions leaves rank ", rank, " of ", world,
            " none; use fewer objective.mini_batches or more prompts per rollout");
  auto rows = [&](const char* k) { return buffer_.at(k).narrow(0, lo, hi - lo).to(device); };
  const at::Tensor ids = rows("ids"), mask = rows("response_mask");
  const at::Tensor logp = post_training::token_logps(*model_, ids);
  auto pl = post_training::policy_loss(rows("old_logp"), logp, rows("advantages"), mask, o_.eps_low, o_.eps_high,
                                       o_.dual_clip, o_.agg);
  // Data-parallel: this slice's share of the mini-batch's aggregate (tokens for token-mean and the token
  // statistics, sequences with tokens for the seq-mean modes), over the trainer's weight of this rank's rows.
  double agg_scale = 1, token_scale = 1;
  if (dist_) {
    const at::Tensor all = buffer_.at("response_mask").narrow(0, m * part, part);
    const at::Tensor here = all.narrow(0, lo - m * part, hi - lo);
    auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
    const double share = double(end - begin) / double(index.size(0));
    token_scale = ratio(here.sum().item<double>(), all.sum().item<double>()) / share;
    agg_scale = o_.agg == "token-mean"
                    ? token_scale
                    : ratio(here.sum(1).gt(0).sum().item<double>(), all.sum(1).gt(0).sum().item<double>()) / share;
  }
  at::Tensor loss = pl.loss * agg_scale;
  std::map<std::string, double> metrics = {{"pg_loss", pl.loss.item<double>() * agg_scale},
                                           {"pg_clipfrac", pl.clipfrac.item<double>() * token_scale},
                                           {"pg_clipfrac_lower", pl.clipfrac_lower.item<double>() * token_scale},
                                           {"ppo_kl", pl.ppo_kl.item<double>() * token_scale}};
  if (o_.beta > 0) {
    const at::Tensor kl = post_training::agg_loss(post_training::k3_kl(logp, rows("ref_logp")), mask, o_.agg);
    loss = loss + o_.beta * kl * agg_scale;
    metrics["kl"] = kl.item<double>() * agg_scale;
  }
  const at::Tensor values = buffer_.at("metrics");
  DEW_CHECK(metric_names_.size() == size_t(values.numel()), "objective grpo: the rollout buffer holds ", values.numel(),
            " statistics, the rewards make ", metric_names_.size(), " (a checkpoint of other rewards?)");
  for (size_t i = 0; i < metric_names_.size(); ++i) metrics[metric_names_[i]] = values[int64_t(i)].item<double>();
  return {loss, metrics};
}

}  // namespace dew
