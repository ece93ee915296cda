#include "dew/objectives/sft.h"

namespace dew {

namespace {

LMObjectiveOptions lm_options(int64_t seq_len, const SFTObjectiveOptions& o) {
  LMObjectiveOptions lm;
  lm.seq_len = seq_len;
  lm.loss_role = "loss_mask";
  lm.vocab_chunk = o.vocab_chunk;
  lm.sample_tokens = 0;
  return lm;
}

}  // namespace

SFTObjective::SFTObjective(nn::CausalTransformer model, int64_t seq_len, const SFTObjectiveOptions& o,
                           data::Batch val_rows, std::shared_ptr<post_training::ChatEvaluator> eval)
    : LMObjective(std::move(model), nullptr, lm_options(seq_len, o)),
      pack_(o.pack),
      val_rows_(std::move(val_rows)),
      eval_(std::move(eval)) {
  if (!val_rows_.empty())
    DEW_CHECK(val_rows_.at("tokens").size(1) == seq_len + 1, "objective sft: validation rows hold ",
              val_rows_.at("tokens").size(1), " ids, the training rows ", seq_len + 1);
}

std::vector<std::string> SFTObjective::batch_fields() const {
  if (pack_) return {"tokens", "loss_mask", "segment_ids", "positions"};
  return {"tokens", "loss_mask"};
}

std::map<std::string, double> SFTObjective::validate(int64_t step, const std::string& run_dir) {
  std::map<std::string, double> out;
  if (!val_rows_.empty())
    for (const auto& [k, v] : evaluate(val_rows_)) out["val/" + k] = v;
  if (eval_)
    for (const auto& kv : eval_->validate(*model(), step, run_dir)) out.insert(kv);
  return out;
}

}  // namespace dew
