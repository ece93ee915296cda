// `dew train lm`, `dew generate RUN`.
#include "dew/cli/lm_cmds.h"

#include <filesystem>
#include <iostream>

#include "dew/cli/recipe.h"
#include "dew/core/log.h"
#include "dew/core/threads.h"
#include "dew/data/lm_data.h"
#include "dew/data/tokenizer.h"
#include "dew/objectives/lm.h"
#include "dew/objectives/registry.h"
#include "dew/sampling/generate.h"
#include "dew/training/trainer.h"

namespace fs = std::filesystem;

namespace dew::cli {

json lm_recipe() {
  // Sized by measured runs on a 2-core CPU (docs/lm.md): a byte-level model that reaches validation
  // perplexity <= 5 per byte on the fortunes corpus within 15 minutes (the time limit).
  data::LoaderOptions lo;
  lo.batch_size = 32;
  lo.num_workers = 1;
  lo.drop_last = true;
  training::OptimOptions oo;
  oo.lr = 3e-3;
  oo.warmup_steps = 100;
  oo.weight_decay = 0.1;
  oo.beta2 = 0.95;
  training::TrainerOptions to;
  to.steps = 1500;  // what 15 minutes hold on a quiet 2-core machine (~55 samples/s), so the cosine completes
  to.log_every = 50;
  to.val_every = 500;
  to.checkpoint_every = 500;
  to.time_limit_minutes = 15;
  to.best_metric = "val/perplexity";
  LMObjectiveOptions obj;
  obj.seq_len = 128;
  obj.val_windows = 0;
  obj.val_batch = 64;
  return json{
      {"run", "runs/fortunes"},
      {"seed", 0},
      {"threads", 0},
      {"model",
       {{"architecture", "causal_transformer"},
        {"fields",
         {{"emb_features", 128},
          {"num_layers", 4},
          {"num_heads", 4},
          {"max_seq_len", 512}}}}},
      {"data", {{"name", "fortunes"}}},
      {"loader", to_json(lo)},
      {"optim", to_json(oo)},
      {"trainer", to_json(to)},
      {"objective", to_json(obj)},
  };
}

namespace {

const std::vector<std::string> kOpen = {"model.fields", "data"};

}  // namespace

int cmd_train_lm(const std::vector<std::string>& args) {
  auto defaults = lm_recipe();
  auto parsed = parse_recipe_args(defaults, args, kOpen);
  if (parsed.help) {
    std::cout << "usage: dew train lm [--config run.json] [--a.b value ...]\n\nfields and defaults:\n"
              << format_tree(defaults) << "\nmodel fields (causal_transformer):\n"
              << format_fields(models::registry().info("causal_transformer").fields, "  ") << "\ndata sources:\n"
              << format_registry(data::lm_datasets()) << "objective fields:\n"
              << format_fields(fields_of<LMObjectiveOptions>(), "  ");
    return 0;
  }
  DEW_CHECK(parsed.positional.empty(), "train lm: unexpected argument \"", parsed.positional[0], "\"");
  json r = parsed.recipe;
  DEW_CHECK(r["run"].is_string() && !r["run"].get<std::string>().empty(), "run: expected a directory name");
  const std::string run_dir = r["run"];
  DEW_CHECK(r["seed"].is_number_integer(), "seed: expected an integer, got ", r["seed"].dump());
  DEW_CHECK(r["threads"].is_number_integer(), "threads: expected an integer, got ", r["threads"].dump());
  DEW_CHECK(r["model"].is_object() && r["model"].value("architecture", json()) == "causal_transformer",
            "model.architecture: dew train lm trains a \"causal_transformer\", got ",
            r["model"].value("architecture", json()).dump());
  set_threads(r["threads"].get<int64_t>(), workload_of("causal_transformer"));
  const uint64_t seed = r["seed"].get<uint64_t>();

  auto lo = from_json<data::LoaderOptions>(r["loader"], "loader");
  auto oo = from_json<training::OptimOptions>(r["optim"], "optim");
  auto to = from_json<training::TrainerOptions>(r["trainer"], "trainer");
  auto obj_opts = from_json<LMObjectiveOptions>(r["objective"], "objective");
  training::validate(oo);
  training::validate(to);
  auto lm = data::lm_datasets().build(r["data"], obj_opts.seq_len);
  json& fields = r["model"]["fields"];
  if (!fields.is_object()) fields = json::object();
  if (!fields.contains("vocab_size")) fields["vocab_size"] = lm->vocab_size;
  DEW_CHECK(fields["vocab_size"].is_number_integer() && fields["vocab_size"].get<int64_t>() >= lm->vocab_size,
            "model.fields.vocab_size: must be >= the data's vocab_size ", lm->vocab_size, ", got ",
            fields["vocab_size"].dump());

  auto model = models::build(r["model"]);  // bad model fields fail before the run directory exists
  const fs::path run_json = fs::path(run_dir) / "run.json";
  if (fs::exists(run_json)) {
    json old = training::read_run_json(run_dir);
    DEW_CHECK(old.value("recipe", json::object()).value("model", json()) == r["model"], "run ", run_dir,
              " was trained with model ", old["recipe"]["model"].dump(), "; this command asks for ", r["model"].dump(),
              " (use another --run, or delete the directory)");
  }
  fs::create_directories(run_dir);
  json record = {{"kind", "lm"},
                 {"dew_version", DEW_VERSION},
                 {"model", model->config()},
                 {"data", lm->spec},
                 {"tokenizer", lm->tokenizer},
                 {"eos_id", lm->eos_id},
                 {"recipe", r}};
  training::write_file_atomic(run_json.string(), record.dump(2));

  lo.seed = int64_t(seed);
  auto loader = std::make_shared<data::DataLoader>(lm->windows, lo, lm->transform);
  ObjectiveContext ctx;
  ctx.model = model;
  ctx.lm_data = lm;
  auto objective = objectives().build("lm", r["objective"], ctx);
  int64_t nparams = 0;
  for (const auto& p : model->parameters()) nparams += p.numel();
  log::info("training causal_transformer (", nparams, " parameters) on ", lm->spec.value("name", "?"), " (",
            lm->train_tokens, " train / ", lm->val_tokens, " val tokens, vocab ", lm->vocab_size, "), ", to.steps,
            " steps, batch ", lo.batch_size, " x ", obj_opts.seq_len, ", run ", run_dir);
  training::Trainer trainer(objective, loader, oo, to, run_dir, seed);
  auto res = trainer.fit();
  std::cout << "run:        " << run_dir << "\n"
            << "checkpoint: " << res.last_checkpoint << "\n"
            << "metrics:    " << (fs::path(run_dir) / "metrics.jsonl").string() << "\n"
            << "sample:     " << (fs::path(run_dir) / "samples" / ("step_" + std::to_string(res.step) + ".txt")).string()
            << "\n"
            << "steps:      " << res.step << (res.interrupted ? " (stopped early)" : "") << "\n";
  for (const auto& [k, v] : res.last_metrics)
    if (k.rfind("val/", 0) == 0) std::cout << k << ": " << v << "\n";
  return 0;
}

LoadedLMRun load_lm_run(const std::string& run_dir, const std::string& weights) {
  DEW_CHECK(weights == "ema" || weights == "live", "weights: got \"", weights, "\", accepted: ema, live");
  json record = training::read_run_json(run_dir);
  DEW_CHECK(record.value("kind", "") == "lm", run_dir, "/run.json: not a language-model run (kind ",
            record.value("kind", json("missing")).dump(), ")");
  DEW_CHECK(record.contains("model") && record["model"].is_object(), run_dir, "/run.json: missing the model record");
  LoadedLMRun out;
  out.recipe = record.value("recipe", json::object());
  out.tokenizer = record.value("tokenizer", json());
  out.eos_id = record.value("eos_id", int64_t(-1));
  out.step = training::latest_checkpoint(run_dir);
  auto base = models::build(record["model"]);
  auto lm = std::dynamic_pointer_cast<nn::CausalTransformerImpl>(base);
  DEW_CHECK(lm, run_dir, "/run.json: the model is not a causal_transformer");
  out.model = nn::CausalTransformer(lm);
  out.options = lm->options;
  auto ck = training::load_checkpoint(run_dir, out.step, /*load_optimizer=*/false);
  training::load_module_state(*lm, ck.model, run_dir + " step_" + std::to_string(out.step) + "/model.safetensors");
  if (weights == "ema") {
    at::NoGradGuard ng;
    for (auto& kv : lm->named_parameters()) {
      auto it = ck.ema.find(kv.key());
      DEW_CHECK(it != ck.ema.end(), run_dir, " step_", out.step, "/ema.safetensors: missing \"", kv.key(), "\"");
      kv.value().copy_(it->second);
    }
  }
  lm->eval();
  return out;
}

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
      std::cout << "usage: dew generate RUN [--prompt TEXT ...] [--max-new-tokens 200] [--temperature 0.8 (0 = greedy)]\n"
                   "       [--top-k 0] [--top-p 1] [--min-p 0] [--repetition-penalty 1] [--seed 0] [--weights ema|live]\n"
                   "       [--stop S ...] [--padding left|right] [--threads N] [--no-eos] [--json]\n"
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
                        "weights", "padding", "threads"},
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
  auto run = load_lm_run(f.positional[0], f.get("weights", "ema"));
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
      json line = {{"prompt", prompts[i]}, {"text", text}, {"tokens", res.tokens[i]}, {"length", res.lengths[i]},
                   {"logprobs", res.logprobs[i]}, {"raw_logprobs", res.raw_logprobs[i]},
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
