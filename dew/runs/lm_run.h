// Language-model runs: the `lm` run kind and a trained run opened for generation and export.
//
//   auto run = dew::runs::open_lm_run("runs/fortunes");                 // EMA weights, latest step
//   auto tok = dew::data::load_tokenizer(run.tokenizer);
//   auto logits = run.model->forward_tokens(ids);                        // ids: [B, S] int64
#pragma once
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/runs/run.h"

namespace dew::runs {

/// A trained language-model run (lm, sft, dpo, grpo) rebuilt from RUN/run.json and one checkpoint.
struct LMRun {
  std::string dir;
  json record;                           // run.json (current shape)
  nn::CausalTransformer model{nullptr};  // in eval mode, with the chosen weights, on the device asked for
  nn::CausalTransformerOptions options;  // the model's fields
  json tokenizer;                        // spec for data::load_tokenizer (null when the data had none)
  int64_t eos_id = -1;                   // the data's EOS (-1 = none)
  int64_t step = 0;                      // the checkpoint's step
};

/// Opens RUN, a run of kind lm, sft, dpo or grpo (dew::Error when it is not, or holds no such checkpoint).
LMRun open_lm_run(const std::string& run_dir, const OpenOptions& o = {});

}  // namespace dew::runs
