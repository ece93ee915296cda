#include "dew/objectives/rollouts.h"

#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "dew/core/error.h"
#include "dew/training/run_dir.h"

namespace fs = std::filesystem;

namespace dew::post_training {

std::vector<const data::Prompt*> pointers_to(const std::vector<data::Prompt>& prompts) {
  std::vector<const data::Prompt*> out;
  out.reserve(prompts.size());
  for (const auto& p : prompts) out.push_back(&p);
  return out;
}

Rollout score(const std::vector<const data::Prompt*>& prompts, std::vector<Completion> completions,
              const std::vector<RewardPtr>& rewards, const std::vector<double>& weights) {
  DEW_CHECK(prompts.size() == completions.size(), "score: ", prompts.size(), " prompts and ", completions.size(),
            " completions");
  DEW_CHECK(weights.empty() || weights.size() == rewards.size(), "reward weights: ", weights.size(), " weights for ",
            rewards.size(), " rewards");
  Rollout r;
  r.completions = std::move(completions);
  std::vector<RewardInput> inputs(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i)
    inputs[i] = {prompts[i]->text, r.completions[i].text, prompts[i]->record, int64_t(r.completions[i].ids.size())};
  r.total.assign(prompts.size(), 0.0);
  for (size_t k = 0; k < rewards.size(); ++k) {
    std::vector<double> s = rewards[k]->score(inputs);
    DEW_CHECK(s.size() == inputs.size(), "reward ", rewards[k]->name(), ": ", s.size(), " scores for ", inputs.size(),
              " completions");
    const double w = weights.empty() ? 1.0 : weights[k];
    for (size_t i = 0; i < s.size(); ++i) r.total[i] += w * s[i];
    r.scores[rewards[k]->name()] = std::move(s);
  }
  return r;
}

std::string completion_text(const data::ChatFormat& fmt, const std::vector<int64_t>& ids, bool conversational) {
  std::string text = fmt.tokenizer->decode(ids, /*skip_special=*/true);
  const size_t cut = conversational ? text.find(fmt.end_of_turn()) : std::string::npos;
  return cut == std::string::npos ? text : text.substr(0, cut);
}

Rollout roll_out(nn::CausalTransformerImpl& model, const data::ChatFormat& fmt,
                 const std::vector<const data::Prompt*>& prompts, sampling::GenerationOptions g,
                 const std::vector<RewardPtr>& rewards, const std::vector<double>& weights, int64_t chunk) {
  DEW_CHECK(!prompts.empty(), "roll_out: no prompts");
  DEW_CHECK(chunk > 0, "roll_out: chunk must be > 0, got ", chunk);
  const auto& tok = *fmt.tokenizer;
  const std::string eot = fmt.end_of_turn();
  g.eos_id = tok.eos_id();
  g.stop.clear();
  if (prompts[0]->conversational) {
    g.stop = {eot};
    g.decode = [&tok](const std::vector<int64_t>& ids) { return tok.decode(ids, false); };
  }
  const int64_t room = model.options.max_seq_len();
  std::vector<Completion> out;
  out.reserve(prompts.size());
  at::NoGradGuard ng;
  for (size_t s = 0; s < prompts.size(); s += size_t(chunk)) {
    const size_t e = std::min(prompts.size(), s + size_t(chunk));
    std::vector<std::vector<int64_t>> ids;
    sampling::GenerationOptions gc = g;
    for (size_t i = s; i < e; ++i) {
      ids.push_back(prompts[i]->ids);
      gc.max_new_tokens = std::min<int64_t>(gc.max_new_tokens, room - int64_t(prompts[i]->ids.size()));
    }
    DEW_CHECK(gc.max_new_tokens > 0, prompts[s]->where, ": the prompt fills the model's context of ", room, " tokens");
    gc.first_row = g.first_row + int64_t(s);  // each row its own stream: the chunking changes no draw
    auto res = sampling::generate_tokens(model, ids, gc);
    for (size_t i = 0; i < ids.size(); ++i) {
      Completion c;
      c.ids = res.tokens[i];
      c.finish = res.finish_reason[i];
      c.text = completion_text(fmt, c.ids, prompts[0]->conversational);
      out.push_back(std::move(c));
    }
  }
  return score(prompts, std::move(out), rewards, weights);
}

ChatEvaluator::ChatEvaluator(const EvalOptions& o, const data::ChatFormat& fmt, int64_t max_seq_len,
                             const RewardOptions& reward_options)
    : o_(o), fmt_(fmt) {
  DEW_CHECK(o_.max_new_tokens > 0, "eval.max_new_tokens: must be > 0, got ", o_.max_new_tokens);
  DEW_CHECK(o_.count >= 0 && o_.samples >= 0, "eval.count and eval.samples: must be >= 0");
  if (o_.prompts.empty()) return;
  prompts_ = data::read_prompts(o_.prompts, fmt_, max_seq_len);
  if (o_.count > 0 && int64_t(prompts_.size()) > o_.count) prompts_.resize(size_t(o_.count));
  rewards_ = make_rewards(o_.reward, "", reward_options);
}

std::map<std::string, double> ChatEvaluator::evaluate(nn::CausalTransformerImpl& model,
                                                      const std::string& samples_path) {
  std::map<std::string, double> m;
  if (!enabled()) return m;
  const bool was_training = model.is_training();
  model.eval();
  sampling::GenerationOptions g;
  g.temperature = 0;  // greedy: the evaluation is a function of the weights alone
  g.max_new_tokens = o_.max_new_tokens;
  const auto ptrs = pointers_to(prompts_);
  Rollout r = roll_out(model, fmt_, ptrs, g, rewards_, {}, 128);
  if (was_training) model.train();
  const double n = double(prompts_.size());
  double total = 0, length = 0;
  for (size_t i = 0; i < prompts_.size(); ++i) {
    total += r.total[i];
    length += double(r.completions[i].ids.size());
  }
  for (const auto& [name, s] : r.scores) {
    double sum = 0;
    for (double x : s) sum += x;
    m["reward/" + name] = sum / n;
  }
  m["reward"] = total / n;
  m["completion_length"] = length / n;
  m["prompt_count"] = n;  // what the scores were computed on
  if (!samples_path.empty() && o_.samples > 0) {
    fs::create_directories(fs::path(samples_path).parent_path());
    std::ofstream f(samples_path, std::ios::binary);
    for (size_t i = 0; i < prompts_.size() && int64_t(i) < o_.samples; ++i)
      f << prompts_[i].text << r.completions[i].text << "\n    reward " << r.total[i] << " (" << r.completions[i].finish
        << ")\n";
  }
  return m;
}

std::map<std::string, double> ChatEvaluator::validate(nn::CausalTransformerImpl& model, int64_t step,
                                                      const std::string& run_dir) {
  std::map<std::string, double> out;
  if (!enabled()) return out;
  const std::string samples = training::RunDir(run_dir).sample(step, ".txt");
  for (const auto& [k, v] : evaluate(model, samples)) out["val/" + k] = v;
  return out;
}

}  // namespace dew::post_training
