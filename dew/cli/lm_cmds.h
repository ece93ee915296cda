// `dew train lm` and `dew generate RUN`, and the loader of a trained LM run (used by `dew export`).
//
//   auto run = dew::cli::load_lm_run("runs/fortunes", "ema");
//   auto tok = dew::data::load_tokenizer(run.tokenizer);
//   auto logits = run.model->forward_tokens(ids);
#pragma once
#include <string>
#include <vector>

#include "dew/nn/backbones/causal_transformer.h"

namespace dew::cli {

/// A trained language-model run rebuilt from RUN/run.json and its latest checkpoint.
struct LoadedLMRun {
  nn::CausalTransformer model{nullptr};  // in eval mode, with the chosen weights
  nn::CausalTransformerOptions options;  // the model's fields
  json tokenizer;                        // spec for data::load_tokenizer (null when the data had none)
  int64_t eos_id = -1;                   // the data's EOS (-1 = none)
  json recipe;                           // the whole recipe the run was trained with
  int64_t step = 0;                      // the checkpoint's step
};

/// Loads RUN's model with weights "ema" (the EMA averages; equal to live when the run kept none) or
/// "live". dew::Error when RUN is not an LM run or has no checkpoint.
LoadedLMRun load_lm_run(const std::string& run_dir, const std::string& weights = "ema");

/// The default recipe of `dew train lm` (a byte-level model on the fortunes corpus).
json lm_recipe();

/// `dew train lm [--config FILE] [--a.b value ...]`.
int cmd_train_lm(const std::vector<std::string>& args);
/// `dew generate RUN --prompt TEXT [--prompt TEXT ...] [--max-new-tokens N --temperature T --top-k K
/// --top-p P --min-p M --repetition-penalty R --seed S --weights ema|live --stop S ... --padding left|right
/// --threads N --json]`.
int cmd_generate(const std::vector<std::string>& args);

}  // namespace dew::cli
