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
#include "dew/objectives/rollouts.h"
#include "dew/runs/lora_run.h"
#include "dew/runs/run.h"

namespace dew::runs {

/// The run kinds a language-model policy trains under: lm, sft, dpo, grpo.
const std::vector<std::string>& language_model_kinds();

/// The sections of every post-training recipe (sft, dpo, grpo) that say where the policy starts: each kind adds
/// its data and objective.
struct PolicyRecipe : RecipeBase {
  std::string init_from;
  ModelSpec model;
  json tokenizer = "byte";
  std::string chat_template = "auto";
  Omittable<LoraRecipe> lora;
  post_training::EvalOptions eval;
  template <class V>
  void visit(V& v) {
    RecipeBase::visit(v);
    v("init_from", init_from, "a language-model run or a Hugging Face folder to start from; empty = a fresh model");
    v("model", model, "the fresh model (init_from empty): a causal_transformer");
    v("tokenizer", tokenizer, "the fresh model's tokenizer (a spec of data::load_tokenizer)");
    v("chat_template", chat_template,
      "auto (the source's own) or a name: llama3, llama3.1, qwen2.5, qwen3, gemma3, plain");
    v("lora", lora, "LoRA adapters on the init_from model (docs/lora.md); a run without adapters records none");
    v("eval", eval, "validation: greedy answers to held-out prompts");
  }
};

/// The policy a post-training recipe starts from, resolved from init_from (or the recipe's model and
/// tokenizer), on `device`, with its weights still to be loaded by `init` (a fresh run only).
struct Policy {
  nn::CausalTransformer model{nullptr};
  data::ChatFormat format;
  json tokenizer_spec;           // what data::load_tokenizer rebuilds the tokenizer from
  json source = json::object();  // {"init_from", "kind": run|hf|none, "step"} for the run record
  std::function<void()> init;    // loads the starting weights (empty: the fresh initialisation)
  json lora = nullptr;           // LoRA: the run's record of its adapters (apply_lora_to_run); null = none
};

/// Resolves the recipe's init_from, model, tokenizer, chat_template and lora (completing `model` to the model's
/// whole record; with lora.targets the adapters are attached and the base frozen). dew::Error
/// naming the field when the source is not a run or a folder, the run is not a language-model run, the
/// folder's chat template is unknown, or the LoRA settings are refused (with `loss_reads_head_weight`, as
/// SFT's chunked cross-entropy does, lm_head of an untied model among the targets: its adapter would not train).
Policy resolve_policy(PolicyRecipe& r, const c10::Device& device, bool loss_reads_head_weight = false);

/// The chat format of a trained language-model run (its tokenizer and recorded chat template; plain for a
/// byte model that recorded none).
data::ChatFormat chat_format_of(const json& record, const std::string& run_dir);

}  // namespace dew::runs
