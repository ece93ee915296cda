// `dew generate RUN`: continue prompts with a trained language model.
#include <iostream>

#include "dew/cli/commands.h"
#include "dew/cli/recipe.h"
#include "dew/core/threads.h"
#include "dew/data/tokenizer.h"
#include "dew/nn/lora.h"
#include "dew/runs/lm_run.h"
#include "dew/runs/lora_run.h"
#include "dew/sampling/generate.h"

namespace dew::cli {

int cmd_generate(const std::vector<std::string>& args_in) {
  for (const auto& a : args_in) {
    if (a == "--help" || a == "-h") {
      std::cout
          << "usage: dew generate RUN [--prompt TEXT ...] [--max-new-tokens 200] [--temperature 0.8 (0 = greedy)]\n"
             "       [--top-k 0] [--top-p 1] [--min-p 0] [--repetition-penalty 1] [--seed 0] [--weights ema|live]\n"
             "       [--stop S ...] [--padding left|right] [--threads N] [--step N] [--device auto|cpu|cuda[:N]]\n"
             "       [--lora DIR [--lora.strict]] [--no-eos] [--json]\n"
             "Continues each prompt (an empty or missing prompt starts a new document) with the run's model;\n"
             "--json prints one object per prompt with the tokens, log-probs and finish reason. --lora applies a\n"
             "PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to the model at load; an adapter\n"
             "whose base_model_name_or_path names another base than RUN (RUN itself, its init_from or LoRA base)\n"
             "gets a warning, or is refused with --lora.strict.\n";
      return 0;
    }
  }
  std::vector<std::string> args = args_in;
  auto prompts = take_repeated(args, "prompt");
  auto stops = take_repeated(args, "stop");
  auto f = parse_flags(args,
                       {"max-new-tokens", "temperature", "top-k", "top-p", "min-p", "repetition-penalty", "seed",
                        "weights", "padding", "threads", "step", "device", "lora"},
                       {"json", "no-eos", "lora.strict"});
  DEW_CHECK(f.positional.size() == 1, "generate: expected one RUN directory, got ", f.positional.size(), " arguments");
  // Batch-1 generation: one-row GEMMs the row-parallel split leaves alone, so OpenBLAS gets the cores.
  set_threads(f.get_int("threads", 0), Workload::kGemm);
  sampling::GenerationOptions g;
  g.max_new_tokens = f.get_int("max-new-tokens", 200);
  g.temperature = f.get_double("temperature", 0.8);
  g.top_k = f.get_int("top-k", 0);
  g.top_p = f.get_double("top-p", 1.0);
  g.min_p = f.get_double("min-p", 0.0);
  g.repetition_penalty = f.get_double("repetition-penalty", 1.0);
  const int64_t seed = f.get_int("seed", 0);
  DEW_CHECK(seed >= 0, "--seed: must be >= 0, got ", seed);
  g.seed = uint64_t(seed);
  g.padding = f.get("padding", "left");
  g.stop = stops;
  sampling::validate(g);  // bad flag values fail before the model loads
  const std::string lora = f.get("lora", "");
  DEW_CHECK(!lora.empty() || !f.has("lora.strict"), "--lora.strict: applies to --lora DIR, which is not given");
  if (!lora.empty()) {  // so does a folder that is not an adapter, or one for another base with --lora.strict
    const std::string why =
        runs::lora_adapter_base_mismatch(nn::read_peft_adapter_config(lora).base_model_name_or_path, f.positional[0]);
    DEW_CHECK(why.empty() || !f.has("lora.strict"), "--lora ", lora, ": ", why, " (--lora.strict)");
    if (!why.empty())
      std::cerr << "generate: warning: --lora " << lora << ": " << why << "; its shapes fit (checked at load), "
                << "its weights may not (--lora.strict refuses)\n";
  }
  auto run = runs::open_lm_run(f.positional[0], open_options(f));
  if (!lora.empty()) {
    // Unmerged: each adapted layer adds scale * B(A(x)) to its output, as PEFT's model does before merging.
    nn::load_peft_adapter(*run.model, lora);
    run.model->eval();
  }
  DEW_CHECK(!run.tokenizer.is_null(), f.positional[0], "/run.json: the run records no tokenizer");
  auto tok = data::load_tokenizer(run.tokenizer);
  if (!f.has("no-eos")) g.eos_id = run.eos_id;
  g.decode = [tok](const std::vector<int64_t>& ids) { return tok->decode(ids); };
  if (prompts.empty()) prompts.push_back("");
  std::vector<std::vector<int64_t>> ids;
  for (const auto& p : prompts) {
    auto e = tok->encode(p, /*add_special=*/true);
    if (e.empty()) {
      DEW_CHECK(run.eos_id >= 0, "--prompt: an empty prompt needs a tokenizer with EOS");
      e = {run.eos_id};  // a new document
    }
    ids.push_back(e);
  }
  const int64_t room = run.options.max_seq_len();
  for (const auto& e : ids) g.max_new_tokens = std::min<int64_t>(g.max_new_tokens, room - int64_t(e.size()));
  DEW_CHECK(g.max_new_tokens > 0, "--prompt: a prompt fills the model's max_seq_len ", room);
  auto res = sampling::generate_tokens(*run.model, ids, g);
  for (size_t i = 0; i < prompts.size(); ++i) {
    std::string text = tok->decode(res.tokens[i]);
    if (res.finish_reason[i] == "stop") {
      // Cut at the first stop string: it is the end marker, not part of the answer.
      size_t cut = std::string::npos;
      for (const auto& s : stops) cut = std::min(cut, text.find(s));
      if (cut != std::string::npos) text = text.substr(0, cut);
    }
    if (f.has("json")) {
      json line = {{"prompt", prompts[i]},
                   {"text", text},
                   {"tokens", res.tokens[i]},
                   {"length", res.lengths[i]},
                   {"logprobs", res.logprobs[i]},
                   {"raw_logprobs", res.raw_logprobs[i]},
                   {"finish_reason", res.finish_reason[i]}};
      // A byte-level model may emit bytes that are not UTF-8: JSON carries them as U+FFFD (the ids are exact).
      std::cout << line.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
    } else {
      std::cout << prompts[i] << text << "\n";
      if (prompts.size() > 1 && i + 1 < prompts.size()) std::cout << "----\n";
    }
  }
  return 0;
}

}  // namespace dew::cli
