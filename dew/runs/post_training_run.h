// Post-training runs (docs/post_training.md): the `sft`, `dpo` and `grpo` run kinds. Each trains a causal_transformer
// policy that starts from `init_from` — a dew language-model run (lm, sft, dpo, grpo: its latest checkpoint),
// a Hugging Face folder (config.json + weights + tokenizer, e.g. one `dew export` wrote), or nothing (a fresh
// model from `model.fields`, the SFT of a small byte model) — with that model's tokenizer and chat template.
// DPO and GRPO keep the starting weights as the frozen reference (the trainer's reference EMA). The trained
// runs open with open_lm_run() like any language-model run and export with `dew export`.
//
//   json r = dew::runs::default_recipe("sft");
//   r["data"] = "data/sums/sft.jsonl";
//   r["eval"]["prompts"] = "data/sums/test_prompts.jsonl";
//   auto run = dew::runs::prepare("sft", r);
//   dew::runs::train(run);
#pragma once
#include "dew/data/post_training_data.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/runs/run.h"

namespace dew::runs {

/// The run kinds a language-model policy trains under: lm, sft, dpo, grpo.
const std::vector<std::string>& language_model_kinds();

/// The policy a post-training recipe starts from, resolved from init_from (or the recipe's model and
/// tokenizer), on `device`, with its weights still to be loaded by `init` (a fresh run only).
struct Policy {
  nn::CausalTransformer model{nullptr};
  data::ChatFormat format;
  json tokenizer_spec;           // what data::load_tokenizer rebuilds the tokenizer from
  json source = json::object();  // {"init_from", "kind": run|hf|none, "step"} for the run record
  std::function<void()> init;    // loads the starting weights (empty: the fresh initialisation)
};

/// Resolves r["init_from"], r["model"], r["tokenizer"] and r["chat_template"] (completing r["model"] to the
/// model's whole record). dew::Error naming the field when the source is not a run or a folder, the run is
/// not a language-model run, or the folder's chat template is unknown.
Policy resolve_policy(json& r, const c10::Device& device);

/// The chat format of a trained language-model run (its tokenizer and recorded chat template; plain for a
/// byte model that recorded none).
data::ChatFormat chat_format_of(const json& record, const std::string& run_dir);

}  // namespace dew::runs
