// Post-training commands: `dew eval RUN --prompts F` on a language-model run, `dew pairs` (DPO pairs from a
// policy's own samples) and `dew task sums` (the demo's data).
#include <filesystem>
#include <fstream>
#include <iostream>

#include <unistd.h>

#include "dew/cli/commands.h"
#include "dew/cli/recipe.h"
#include "dew/core/threads.h"
#include "dew/io/stops.h"
#include "dew/objectives/rollouts.h"
#include "dew/runs/lm_run.h"
#include "dew/runs/post_training_run.h"

namespace fs = std::filesystem;

namespace dew::cli {

namespace {

bool wants_help(const std::vector<std::string>& args, const char* usage) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::cout << usage;
      return true;
    }
  return false;
}

const char* kPairsUsage =
    "usage: dew pairs RUN --prompts FILE --out FILE [--samples 4] [--temperature 1] [--top-p 1] [--max-new-tokens 32]\n"
    "                 [--reward exact] [--format REGEX] [--chosen-field answer] [--seed 0] [--threads N] [--device D]\n"
    "Preference pairs from the run's own samples, for dew train dpo: each prompt gets --samples completions,\n"
    "scored by the rewards. chosen: the record's --chosen-field (e.g. the reference answer; \"\" = the best\n"
    "sample); rejected: the first sample scoring below it. Prompts without such a sample are skipped.\n";

const char* kTaskUsage =
    "usage: dew task sums --out DIR [--digits 2] [--test 500] [--seed 0]\n"
    "Writes the post-training demo's task: \"A+B=\" -> \"C\" over every pair of DIGITS-digit numbers, --test of\n"
    "them held out: DIR/sft.jsonl (chat), DIR/train_prompts.jsonl and DIR/test_prompts.jsonl ({prompt, answer}).\n";

struct OpenedPolicy {
  runs::LMRun run;
  data::ChatFormat format;
};

OpenedPolicy open_policy(const Flags& f) {
  DEW_CHECK(f.positional.size() == 1, "expected one RUN directory, got ", f.positional.size(), " arguments");
  set_threads(f.get_int("threads", 0), Workload::kGemm);
  OpenedPolicy p{runs::open_lm_run(f.positional[0], open_options(f)), {}};
  p.format = runs::chat_format_of(p.run.record, f.positional[0]);
  return p;
}

// `text` with each invalid UTF-8 sequence replaced by U+FFFD (a sampled completion may hold any bytes).
std::string valid_utf8(const std::string& text) {
  return json::parse(json(text).dump(-1, ' ', false, json::error_handler_t::replace)).get<std::string>();
}

std::string required(const Flags& f, const char* name) {
  DEW_CHECK(f.has(name) && !f.get(name, "").empty(), "--", name, ": required");
  return f.get(name, "");
}

}  // namespace

int cmd_eval_policy(const std::vector<std::string>& args) {  // `dew eval --help` covers its flags (help.cpp)
  auto f = parse_flags(args, {"prompts", "reward", "format", "max-new-tokens", "count", "samples", "weights", "step",
                              "threads", "device"});
  post_training::EvalOptions eo;
  eo.prompts = required(f, "prompts");
  DEW_CHECK(fs::is_regular_file(eo.prompts), "--prompts: ", eo.prompts, " is not a file");
  eo.reward = f.get("reward", "exact");
  eo.max_new_tokens = f.get_int("max-new-tokens", 32);
  eo.count = f.get_int("count", 0);
  eo.samples = f.get_int("samples", 5);
  post_training::RewardOptions ro;
  ro.format = f.get("format", "");
  post_training::make_rewards(eo.reward, "", ro);  // a bad reward fails before the model loads
  auto p = open_policy(f);
  post_training::ChatEvaluator ev(eo, p.format, p.run.options.max_seq_len(), ro);
  const io::TempFile samples_file(
      (fs::temp_directory_path() / ("dew_eval_" + std::to_string(::getpid()) + ".txt")).string());
  const std::string& samples = samples_file.path();
  auto m = ev.evaluate(*p.run.model, samples);
  std::cout << "run:     " << p.run.dir << " step " << p.run.step << "\n";
  std::cout << "prompts: " << eo.prompts << (eo.count > 0 ? " (first " + std::to_string(eo.count) + ")" : "") << "\n";
  for (const auto& [k, v] : m) std::cout << k << ": " << v << "\n";
  json row = {{"step", p.run.step}, {"weights", f.get("weights", "ema")}, {"prompts", eo.prompts}};
  for (const auto& [k, v] : m) row[k] = v;
  std::cout << "row appended to " << append_eval_row(p.run.dir, row, args) << "\n";
  if (eo.samples > 0) {
    std::ifstream s(samples);
    std::cout << "samples:\n" << s.rdbuf();
  }
  return 0;
}

int cmd_pairs(const std::vector<std::string>& args) {
  if (wants_help(args, kPairsUsage)) return 0;
  auto f = parse_flags(args, {"prompts", "out", "samples", "temperature", "top-p", "max-new-tokens", "reward", "format",
                              "chosen-field", "seed", "weights", "step", "threads", "device"});
  const std::string prompts_file = required(f, "prompts"), out = required(f, "out");
  const int64_t samples = f.get_int("samples", 4);
  DEW_CHECK(samples >= 1, "--samples: must be >= 1, got ", samples);
  const std::string chosen_field = f.get("chosen-field", "answer");
  sampling::GenerationOptions g;
  g.temperature = f.get_double("temperature", 1.0);
  g.top_p = f.get_double("top-p", 1.0);
  g.max_new_tokens = f.get_int("max-new-tokens", 32);
  const int64_t seed = f.get_int("seed", 0);
  DEW_CHECK(seed >= 0, "--seed: must be >= 0, got ", seed);
  g.seed = uint64_t(seed);
  sampling::validate(g);
  post_training::RewardOptions ro;
  ro.format = f.get("format", "");
  auto rewards = post_training::make_rewards(f.get("reward", "exact"), "", ro);
  auto p = open_policy(f);
  auto prompts = data::read_prompts(prompts_file, p.format, p.run.options.max_seq_len());
  std::vector<const data::Prompt*> rows;
  for (const auto& pr : prompts) {
    if (!chosen_field.empty())
      DEW_CHECK(pr.record.contains(chosen_field) &&
                    (pr.record[chosen_field].is_string() || pr.record[chosen_field].is_number()),
                pr.where, ": no \"", chosen_field, "\" (text or number) for the chosen completion (--chosen-field)");
    for (int64_t k = 0; k < samples; ++k) rows.push_back(&pr);
  }
  auto r = post_training::roll_out(*p.run.model, p.format, rows, g, rewards);
  for (auto& c : r.completions) c.text = valid_utf8(c.text);
  // The chosen texts scored by the same rewards, so "below the chosen" compares like with like.
  std::vector<post_training::Completion> chosen_texts;
  std::vector<const data::Prompt*> chosen_rows;
  if (!chosen_field.empty())
    for (const auto& pr : prompts) {
      const json& v = pr.record[chosen_field];
      post_training::Completion c;
      c.text = v.is_string() ? v.get<std::string>() : v.dump();
      c.ids = p.format.tokenizer->encode(c.text);
      chosen_texts.push_back(c);
      chosen_rows.push_back(&pr);
    }
  auto cr = chosen_field.empty() ? post_training::Rollout{} : post_training::score(chosen_rows, chosen_texts, rewards);
  const io::TempFile guard(out + ".tmp");  // gone unless renamed into place
  const fs::path tmp = guard.path();
  if (fs::path(out).has_parent_path()) fs::create_directories(fs::path(out).parent_path());
  std::ofstream o(tmp, std::ios::binary);
  DEW_CHECK(o.good(), "--out: cannot write ", out);
  int64_t written = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const size_t first = i * size_t(samples);
    size_t best = first;
    for (size_t k = first; k < first + size_t(samples); ++k)
      if (r.total[k] > r.total[best]) best = k;
    const double chosen_score = chosen_field.empty() ? r.total[best] : cr.total[i];
    const std::string chosen = chosen_field.empty() ? r.completions[best].text : chosen_texts[i].text;
    // The rejected one: the first sample scoring below the chosen, preferring one that ended by itself, among
    // those that are not blank and fit the model's context as `dew train dpo` will render them.
    size_t pick = std::string::npos;
    for (size_t k = first; k < first + size_t(samples); ++k) {
      const std::string& text = r.completions[k].text;
      if (r.total[k] >= chosen_score || text.find_first_not_of(" \t\r\n") == std::string::npos) continue;
      const auto ids = data::completion_ids(prompts[i], json(text), p.format, "rejected", prompts[i].where);
      if (int64_t(prompts[i].ids.size() + ids.size()) > p.run.options.max_seq_len()) continue;
      if (pick == std::string::npos || (r.completions[pick].finish == "length" && r.completions[k].finish != "length"))
        pick = k;
    }
    if (pick != std::string::npos) {
      const json pair = {
          {"prompt", prompts[i].record["prompt"]}, {"chosen", chosen}, {"rejected", r.completions[pick].text}};
      o << pair.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
      ++written;
    }
  }
  o.close();
  DEW_CHECK(o.good(), "--out: cannot write ", out);
  fs::rename(tmp, out);
  std::cout << "pairs: " << written << " of " << prompts.size() << " prompts (the others had no sample scoring below "
            << (chosen_field.empty() ? "their best" : "\"" + chosen_field + "\"") << ") -> " << out << "\n";
  return 0;
}

int cmd_task(const std::vector<std::string>& args) {
  if (wants_help(args, kTaskUsage)) return 0;
  auto f = parse_flags(args, {"out", "digits", "test", "seed"});
  DEW_CHECK(f.positional.size() == 1 && f.positional[0] == "sums",
            "task: expected the task name sums (dew task --help)");
  const std::string out = required(f, "out");
  const int64_t seed = f.get_int("seed", 0);
  DEW_CHECK(seed >= 0, "--seed: must be >= 0, got ", seed);
  const int64_t n = data::write_sums_task(out, f.get_int("digits", 2), f.get_int("test", 500), uint64_t(seed));
  std::cout << "sums task: " << n << " training pairs, " << f.get_int("test", 500) << " held out -> " << out
            << "/{sft,train_prompts,test_prompts}.jsonl\n";
  return 0;
}

}  // namespace dew::cli
