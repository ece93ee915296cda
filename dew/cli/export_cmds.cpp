// `dew export RUN DEST`: a trained causal_transformer run -> a Hugging Face checkpoint folder.
#include <iostream>

#include "dew/cli/commands.h"
#include "dew/cli/recipe.h"
#include "dew/data/chat.h"
#include "dew/data/tokenizer.h"
#include "dew/interop/hf_decoder.h"
#include "dew/runs/lm_run.h"
#include "dew/runs/lora_run.h"

namespace dew::cli {

namespace {

const char* kExportUsage =
    "usage: dew export RUN DEST [--ema] [--family auto|llama|qwen3|gemma3_text] [--tokenizer SPEC]\n"
    "       dew export RUN DEST --adapter [--ema]\n"
    "\n"
    "Writes RUN's latest checkpoint as a transformers folder: config.json, generation_config.json,\n"
    "model.safetensors and the tokenizer's files (with the chat template of an sft, dpo or grpo run in\n"
    "tokenizer_config.json). --ema exports the EMA weights; --family picks the target (auto: from the\n"
    "model's features); --tokenizer overrides the run's tokenizer record. A LoRA run exports its base with\n"
    "the adapters merged; --adapter writes the adapters alone: a PEFT adapter folder (language-model runs)\n"
    "or a diffusers LoRA file DEST.safetensors (diffusion runs).\n";

}  // namespace

int cmd_export(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::cout << kExportUsage;
      return 0;
    }
  auto f = parse_flags(args, {"family", "tokenizer"}, {"ema", "adapter"});
  DEW_CHECK(f.positional.size() == 2, "export: expected RUN and DEST, got ", f.positional.size(),
            " arguments (dew export --help)");
  const std::string run_dir = f.positional[0], dest = f.positional[1];
  if (f.has("adapter")) {
    DEW_CHECK(!f.has("family") && !f.has("tokenizer"),
              "--adapter: writes the adapters alone; --family and "
              "--tokenizer are for a whole-model export");
    runs::OpenOptions open;
    open.weights = f.has("ema") ? "ema" : "live";
    const std::string what = runs::export_lora_adapters(run_dir, open, dest);
    std::cout << "exported the adapters of " << run_dir << (f.has("ema") ? " (ema)" : "") << " as " << what << " to "
              << dest << "\n";
    return 0;
  }
  std::string family = f.get("family", "auto");
  DEW_CHECK(family == "auto" || family == "llama" || family == "qwen3" || family == "gemma3_text", "--family: got \"",
            family, "\", accepted: auto, llama, qwen3, gemma3_text");
  bool ema = f.has("ema");
  runs::OpenOptions open;
  open.weights = ema ? "ema" : "live";
  auto run = runs::open_lm_run(run_dir, open);
  json tok_spec = f.has("tokenizer") ? json(f.get("tokenizer", "")) : run.tokenizer;
  DEW_CHECK(!tok_spec.is_null(), run_dir, "/run.json records no tokenizer; pass --tokenizer byte|PATH");
  auto tok = data::load_tokenizer(tok_spec);
  auto& model = run.model;
  const auto& options = run.options;
  const int64_t step = run.step;
  interop::save_pretrained_decoder(model, dest, tok.get(), family);
  // A post-trained run's chat template goes with it, so the folder renders chats as the run did.
  const std::string templ = run.record.value("derived", json::object()).value("chat_template", "");
  if (!templ.empty()) interop::add_chat_template(dest, data::chat_template_jinja(data::parse_chat_template(templ)));
  std::cout << "exported " << run_dir << " step " << step << (ema ? " (ema)" : "") << " as "
            << (family == "auto" ? interop::infer_family(options) : family) << " to " << dest << "\n";
  return 0;
}

}  // namespace dew::cli
