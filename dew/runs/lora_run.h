// LoRA fine-tuning runs (docs/lora.md): the recipe section `lora` of the kinds that fine-tune a pretrained
// model (sft, dpo, grpo, and diffusion with init_from), the reference to the base that a LoRA run's
// checkpoints hold instead of its weights, and the weights such a checkpoint opens to.
//
//   dew train sft --init_from hf_folder --lora.targets q_proj,v_proj --lora.rank 8 --data chat.jsonl
//   -> RUN/checkpoints/step_N/model.safetensors holds "<module>.lora_A.weight" / ".lora_B.weight" only;
//      state.json's "lora" holds the adapters' options and the base {kind, path, step, files}.
//   auto w = dew::runs::run_weights("RUN", {});   // the base's weights with scale * B @ A added
#pragma once
#include <optional>
#include <string>

#include "dew/io/weights.h"
#include "dew/nn/lora.h"
#include "dew/runs/run.h"

namespace dew::runs {

/// The recipe section `lora`. No targets (both empty) = no adapters: every parameter trains.
struct LoraRecipe {
  std::string targets;       // "q_proj,v_proj": module names as PEFT's target_modules list
  std::string target_regex;  // ".*(to_q|to_v)": a full match of the module name (PEFT's string form)
  int64_t rank = 8;
  double alpha = 8;
  double dropout = 0;
  bool rslora = false;
  template <class V>
  void visit(V& v) {
    v("targets", targets,
      "comma-separated module names to adapt (a module matches when its name equals one or ends with '.' + one), "
      "e.g. q_proj,v_proj; empty with target_regex empty = no LoRA");
    v("target_regex", target_regex, "instead of targets: a regular expression matching whole module names");
    v("rank", rank, "adapter rank r");
    v("alpha", alpha, "the adapter output is scaled by alpha / rank (alpha / sqrt(rank) with rslora)");
    v("dropout", dropout, "dropout on the adapter input while training, in [0, 1)");
    v("rslora", rslora, "rank-stabilised scale alpha / sqrt(rank)");
  }
};

/// The section as the kinds' default recipes hold it.
json lora_recipe_defaults();

/// The adapters a recipe's `lora` section asks for, or nullopt when it names no targets; the section is then
/// emptied, so the record of a run without adapters has none (and runs recorded before LoRA existed resume).
/// dew::Error naming the field for rank <= 0, alpha <= 0, dropout outside [0, 1), both targets and
/// target_regex, other fields set without targets, and adapters with an empty `init_from` (a random base).
std::optional<nn::LoraOptions> lora_options_of(Omittable<LoraRecipe>& section, const std::string& init_from);

/// The base a LoRA run trains on, with a fingerprint of its files (size and a hash of their first and last
/// MiB) that notices a base replaced or retrained under the same path. kind "run": a dew run's checkpoint
/// `step` (its "ema" weights, as init_from reads them); "hf": a transformers folder; "diffusers": a diffusers
/// model folder (the denoiser) with, when `text_encoder` is a recipe's encoder other than "none", that encoder,
/// rebuilt from its fields (its weights file) for the tree's "text_encoder."; "file": a .safetensors.
json lora_base(const std::string& kind, const std::string& path, int64_t step = -1, const json& text_encoder = nullptr);

/// Attaches the adapters to `model` (nn::apply_lora: everything else frozen) and returns the run's LoRA
/// record {"options", "base", "adapted", "trainable", "frozen"}, which checkpoints keep in state.json.
json apply_lora_to_run(torch::nn::Module& model, const nn::LoraOptions& o, json base);

/// The key map that loads base weights into a model already carrying adapters (theirs are not in the base).
io::KeyMap lora_base_key_map();

/// The weights a LoRA checkpoint stands for: the base's (lora["base"], refused when its files changed) with
/// scale * B @ A added to each adapted weight, under the base model's names (no adapter tensors).
/// `adapters`: "<module>.lora_A.weight" / ".lora_B.weight"; `where` names the checkpoint in errors.
training::TensorMap merged_lora_weights(const training::TensorMap& adapters, const json& lora,
                                        const std::string& where);

/// Why a resumed run's base differs from the one it recorded ("" when it does not).
std::string lora_base_change(const json& recorded, const json& now);

/// Why a PEFT adapter whose adapter_config.json names `adapter_base` (base_model_name_or_path) may not belong on
/// run `run_dir`, or "" when it names none or one of the run's bases: the run itself, its init_from, its LoRA base,
/// or the `_name_or_path` of a transformers folder among them. Local paths compare after canonicalisation; a name
/// that is no local path (a hub id "org/name") matches a base whose last path component is "name". Reads run.json
/// and config.json files only. `dew generate --lora` warns with this (`--lora.strict` refuses).
std::string lora_adapter_base_mismatch(const std::string& adapter_base, const std::string& run_dir);

/// `dew export RUN DEST --adapter`: the adapters of a LoRA run's checkpoint (o: weights and step) as a PEFT
/// adapter folder (language-model runs) or a diffusers pytorch_lora_weights.safetensors file (diffusion runs;
/// DEST is the file). dew::Error for a run without adapters. Returns what was written, for the report.
std::string export_lora_adapters(const std::string& run_dir, const OpenOptions& o, const std::string& dest);

}  // namespace dew::runs
