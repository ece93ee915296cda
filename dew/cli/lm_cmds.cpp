// `dew generate RUN`: continue prompts with a trained language model.
#include <iostream>

#include "dew/cli/commands.h"
#include "dew/cli/recipe.h"
#include "dew/core/threads.h"
#include "dew/data/tokenizer.h"
#include "dew/runs/lm_run.h"
#include "dew/sampling/generate.h"

namespace dew::cli {

namespace {

// Takes every `--name VALUE` / `--name=VALUE` of a repeatable flag out of args.
std::vector<std::string> take_repeated(std::vector<std::string>& args, const std::string& name) {
  std::vector<std::string> out, rest;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--" + name) {
      DEW_CHECK(i + 1 < args.size(), "--", name, ": expected a value");
      out.push_back(args[++i]);
    } else if (args[i].rfind("--" + name + "=", 0) == 0) {
      out.push_back(args[i].substr(name.size() + 3));
    } else {
      rest.push_back(args[i]);
    }
  }
  args = rest;
  return out;
}

}  // namespace

int cmd_generate(const std::vector<std::string>& args_in) {
  for (const auto& a : args_in) {
    if (a == "--help" || a == "-h") {
      std::cout
          << "usage: dew generate RUN [--prompt TEXT ...] [--max-new-tokens 200] [--temperature 0.8 (0 = greedy)]\n"
             "       [--top-k 0] [--top-p 1] [--min-p 0] [--repetition-penalty 1] [--seed 0] [--weights ema|live]\n"
             "       [--stop S ...] [--padding left|right] [--threads N] [--step N] [--device auto|cpu|cuda[:N]]\n"
             "       [--no-eos] [--json]\n"
             "Continues each prompt (an empty or missing prompt starts a new document) with the run's model;\n"
             "--json prints one object per prompt with the tokens, log-probs and finish reason.\n";
      return 0;
    }
  }
  std::vector<std::string> args = args_in;
  auto prompts = take_repeated(args, "prompt");
  auto stops = take_repeated(args, "stop");
  auto f = parse_flags(args,
                       {"max-new-tokens", "temperature", "top-k", "top-p", "min-p", "repetition-penalty", "seed",
                        "weights", "padding", "threads", "step", "device"},
                       {"json", "no-eos"});
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
  auto run = runs::open_lm_run(f.positional[0], open_options(f));
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
      std::cout << line.dump() << "\n";
    } else {
      std::cout << prompts[i] << text << "\n";
      if (prompts.size() > 1 && i + 1 < prompts.size()) std::cout << "----\n";
    }
  }
  return 0;
}

}  // namespace dew::cli
