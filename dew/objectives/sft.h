// SFTObjective (docs/post_training.md): supervised fine-tuning of a causal_transformer on chat rows, the next-token
// cross entropy of LMObjective counted on the assistant tokens only (the rows' loss_mask), with validation
// on held-out rows and greedy completions of held-out prompts scored by rewards.
//
//   auto rows = dew::data::sft_rows("chat.jsonl", fmt, model->options.max_seq_len() + 1);
//   auto obj = std::make_shared<dew::SFTObjective>(model, rows.at("tokens").size(1) - 1, false, val_rows, evaluator);
#pragma once
#include "dew/objectives/lm.h"
#include "dew/objectives/rollouts.h"

namespace dew {

struct SFTObjectiveOptions {
  bool pack = false;
  int64_t vocab_chunk = 8192;
  template <class V>
  void visit(V& v) {
    v("pack", pack, "pack conversations into rows of the model's context (block-diagonal attention); false: pad each");
    v("vocab_chunk", vocab_chunk, "vocabulary columns per cross-entropy chunk (0 = one chunk)");
  }
};

class SFTObjective : public LMObjective {
 public:
  /// seq_len: S of the rows (they hold S + 1 ids); val_rows: sft_rows of a held-out file (empty = none);
  /// eval: held-out prompts (null = none).
  SFTObjective(nn::CausalTransformer model, int64_t seq_len, const SFTObjectiveOptions& o, data::Batch val_rows,
               std::shared_ptr<post_training::ChatEvaluator> eval);
  std::string name() const override { return "sft"; }
  /// val/ce, val/perplexity, val/token_accuracy on the held-out rows; val/reward/NAME, val/reward and
  /// val/completion_length of the held-out prompts (RUN/samples/step_N.txt holds some completions).
  std::map<std::string, double> validate(int64_t step, const std::string& run_dir) override;
  std::vector<std::string> batch_fields() const override;

 private:
  bool pack_;
  data::Batch val_rows_;
  std::shared_ptr<post_training::ChatEvaluator> eval_;
};

}  // namespace dew
