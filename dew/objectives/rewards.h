// The reward functions of GRPO (docs/post_training.md): each scores a batch of completions, one finite double per
// completion. Built in: exact (the last answer-like match against the prompt record's reference answer),
// format (the whole completion matches a regex) and length (a penalty past a token budget); and an external
// command that reads the batch as JSON lines and prints one reward per line.
//
//   dew::post_training::RewardOptions o;                       // o.format = "<think>[\\s\\S]*</think>[\\s\\S]*"
//   auto rewards = dew::post_training::make_rewards("exact,format", "python3 score.py", o);
//   std::vector<double> r = rewards[0]->score(inputs);        // r[i]: the reward of inputs[i]
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dew/core/options.h"

namespace dew::post_training {

/// One completion to score.
struct RewardInput {
  std::string prompt;             // the prompt text as the model saw it (rendered)
  std::string completion;         // the generated text, end-of-turn marker already cut off
  json record;                    // the prompts-file line it came from, e.g. {"prompt": ..., "answer": "82"}
  int64_t completion_tokens = 0;  // tokens of the completion, e.g. 117
};

/// Options of the rewards (each reward reads only its own fields).
struct RewardOptions {
  std::string extract = "(-?[0-9][0-9,]*(?:\\.[0-9]+)?)";
  std::string answer_field = "answer";
  std::string format = "";
  int64_t length_target = 0;
  double length_scale = 0.01;
  double timeout_s = 60;
  template <class V>
  void visit(V& v) {
    v("extract", extract, "exact: ECMAScript regex; its last match in the completion (group 1 if any) is the answer");
    v("answer_field", answer_field, "exact: record field holding the reference answer (string or number)");
    v("format", format, "format: ECMAScript regex the whole completion must match (reward 1, else 0)");
    v("length_target", length_target, "length: completion tokens allowed without penalty");
    v("length_scale", length_scale, "length: reward = -length_scale * max(0, completion_tokens - length_target)");
    v("timeout_s", timeout_s, "command: seconds one batch may take (then the command is killed)");
  }
};

/// A reward function: a batch of completions -> one reward each.
class Reward {
 public:
  virtual ~Reward() = default;
  /// "exact", "format", "length" or "command".
  virtual std::string name() const = 0;
  /// One reward per input, finite doubles. dew::Error (naming the reward and, for records, what is wrong) on bad input.
  virtual std::vector<double> score(const std::vector<RewardInput>& inputs) = 0;
};
using RewardPtr = std::shared_ptr<Reward>;

/// The built-in names: exact, format, length.
const std::vector<std::string>& builtin_rewards();

/// A built-in reward by name (dew::Error listing builtin_rewards() otherwise; bad regexes are a dew::Error
/// naming the field and the pattern).
///   exact:  1 if the answer extracted from the completion equals record[answer_field], else 0 (no match: 0).
///           Both sides are trimmed; numbers ("1,234", "82.0") compare by value, other text as is.
///   format: 1 if std::regex_match(completion, format), else 0.
///   length: -length_scale * max(0, completion_tokens - length_target).
/// The regex rewards reject completions over 256 KiB (dew::Error), past which std::regex may overflow the stack.
RewardPtr make_reward(const std::string& name, const RewardOptions& o);

/// An external reward: `command` runs with /bin/sh -c once per score() call (in its own process group).
/// Its stdin holds one JSON object a line per input, {"prompt", "completion", "completion_tokens", "record"}
/// ("record" the prompt record as is); its stdout must hold one line per input: a number, or an object with a
/// numeric "reward". Its stderr passes through. Not starting, a non-zero exit or a signal, too few or too many
/// lines, a line of anything else, a non-finite reward, or a batch longer than timeout_s (the process group is
/// then killed) is a one-line dew::Error `reward command "CMD": what happened`. SIGPIPE from a command that
/// stops reading is held off in the calling thread.
RewardPtr make_command_reward(const std::string& command, const RewardOptions& o);

/// Built-ins named in a list ("exact,format": comma-separated, no empties, no duplicates) plus an optional
/// command (empty = none) -> the rewards in that order, the command last (named "command"). At least one.
std::vector<RewardPtr> make_rewards(const std::string& names, const std::string& command, const RewardOptions& o);

}  // namespace dew::post_training
