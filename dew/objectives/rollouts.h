// Rollouts (docs/post_training.md): completions of prompts from the batched KV-cache generator, scored by rewards.
// GRPO trains on them, validation and `dew eval` score greedy ones on held-out prompts, `dew pairs` turns
// sampled ones into DPO pairs.
//
//   auto prompts = dew::data::read_prompts("test_prompts.jsonl", fmt, model->options.max_seq_len());
//   auto rewards = dew::post_training::make_rewards("exact", "", {});
//   dew::sampling::GenerationOptions g;  g.temperature = 0;  g.max_new_tokens = 8;
//   auto r = dew::post_training::roll_out(*model, fmt, pointers_to(prompts), g, rewards);
//   // r.completions[i].text ("82"), r.scores["exact"][i] (1 or 0), r.total[i]
#pragma once
#include <map>
#include <string>
#include <vector>

#include "dew/data/post_training_data.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/objectives/rewards.h"
#include "dew/sampling/generate.h"

namespace dew::post_training {

/// One generated completion.
struct Completion {
  std::vector<int64_t> ids;  // new tokens, the end marker (EOS or the template's end of turn) included
  std::string text;          // decoded, cut before the end-of-turn marker (what the rewards score)
  std::string finish;        // eos | stop | length
};

/// What the rewards score of a completion's tokens: decoded without special tokens and, for a conversational
/// prompt, cut before the format's end-of-turn marker.
std::string completion_text(const data::ChatFormat& fmt, const std::vector<int64_t>& ids, bool conversational);

/// Completions of a batch of prompts and their rewards.
struct Rollout {
  std::vector<Completion> completions;                // one per prompt given
  std::map<std::string, std::vector<double>> scores;  // reward name -> one per completion
  std::vector<double> total;                          // sum over rewards of weight * score
};

/// Generates one completion per entry of `prompts` (a prompt may appear several times: a group) with `g`
/// (its eos_id and stop are set here from the format: the tokenizer's EOS, and the end-of-turn marker for
/// conversational prompts), in chunks of `chunk` rows, and scores them. weights: one per reward (empty = 1).
/// max_new_tokens is cut to the room each prompt leaves in the model's context.
Rollout roll_out(nn::CausalTransformerImpl& model, const data::ChatFormat& fmt,
                 const std::vector<const data::Prompt*>& prompts, sampling::GenerationOptions g,
                 const std::vector<RewardPtr>& rewards, const std::vector<double>& weights = {}, int64_t chunk = 256);

/// Scores completions texts of `prompts` (no generation): the rewards of roll_out.
Rollout score(const std::vector<const data::Prompt*>& prompts, std::vector<Completion> completions,
              const std::vector<RewardPtr>& rewards, const std::vector<double>& weights = {});

/// Pointers to every prompt of a list (roll_out's argument).
std::vector<const data::Prompt*> pointers_to(const std::vector<data::Prompt>& prompts);

/// Held-out evaluation of a policy: greedy completions of a fixed prompt set, scored.
struct EvalOptions {
  std::string prompts;
  std::string reward = "exact";
  int64_t max_new_tokens = 32;
  int64_t count = 0;
  int64_t samples = 8;
  template <class V>
  void visit(V& v) {
    v("prompts", prompts,
      "held-out prompts file ({\"prompt\", \"answer\", ...} lines) scored at validation (empty = none)");
    v("reward", reward, "rewards scored there (comma-separated: exact, format, length)");
    v("max_new_tokens", max_new_tokens, "tokens per greedy completion at most");
    v("count", count, "prompts evaluated: the file's first N (0 = all)");
    v("samples", samples, "completions written to RUN/samples/step_N.txt");
  }
};

/// Reads and checks the prompts and rewards once; evaluate() then runs them on the current weights.
class ChatEvaluator {
 public:
  /// An empty o.prompts gives an evaluator that does nothing.
  ChatEvaluator(const EvalOptions& o, const data::ChatFormat& fmt, int64_t max_seq_len,
                const RewardOptions& reward_options = {});
  bool enabled() const { return !prompts_.empty(); }
  /// "reward/NAME" (mean score), "reward" (mean total) and "completion_length"; writes `o.samples`
  /// prompt, completion, reward blocks to samples_path when it is not empty.
  std::map<std::string, double> evaluate(nn::CausalTransformerImpl& model, const std::string& samples_path = "");
  /// What an objective's validate() reports: evaluate()'s metrics prefixed "val/", the samples written to
  /// RUN/samples/step_N.txt; nothing when not enabled().
  std::map<std::string, double> validate(nn::CausalTransformerImpl& model, int64_t step, const std::string& run_dir);

 private:
  EvalOptions o_;
  data::ChatFormat fmt_;
  std::vector<data::Prompt> prompts_;
  std::vector<RewardPtr> rewards_;
};

}  // namespace dew::post_training
