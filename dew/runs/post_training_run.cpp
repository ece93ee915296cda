// The `sft`, `dpo` and `grpo` run kinds.
#include "dew/runs/post_training_run.h"

#include <filesystem>
#include <fstream>

#include "dew/core/device.h"
#include "dew/core/log.h"
#include "dew/core/threads.h"
#include "dew/interop/hf_decoder.h"
#include "dew/objectives/dpo.h"
#include "dew/objectives/grpo.h"
#include "dew/objectives/sft.h"
#include "dew/runs/kinds.h"
#include "dew/runs/lora_run.h"
#include "dew/training/run_dir.h"
#include "dew/training/trainer.h"

namespace fs = std::filesystem;

namespace dew::runs {

namespace {

// Whether a model folder ships a chat template (chat_template.jinja or tokenizer_config.json's).
bool has_chat_template(const fs::path& dir) {
  if (fs::exists(dir / "chat_template.jinja")) return true;
  std::ifstream f(dir / "tokenizer_config.json");
  if (!f.good()) return false;
  try {
    const json c = json::parse(f);
    return c.contains("chat_template") && !c["chat_template"].is_null();
  } catch (const std::exception&) {
    return false;
  }
}

data::ChatTemplate template_for(const std::string& asked, const data::Tokenizer& tok, const std::string& what) {
  if (asked != "auto") return data::parse_chat_template(asked);
  DEW_CHECK(tok.name() == "byte", "chat_template: ", what, " records no chat template and its tokenizer is ",
            tok.name(), "; pass --chat_template NAME (llama3, llama3.1, qwen2.5, qwen3, gemma3, plain)");
  return data::ChatTemplate::plain;  // Dew's template for byte models
}

// The `sft` recipe: chat conversations, the loss on assistant tokens.
struct SftRecipe : PolicyRecipe {
  std::string data;
  std::string val_data;
  SFTObjectiveOptions objective;
  template <class V>
  void visit(V& v) {
    PolicyRecipe::visit(v);
    v("data", data, "a chat JSON-lines file");
    v("val_data", val_data, "held-out chat JSON-lines (validation loss); empty = none");
    v("objective", objective, "the SFT loss");
  }
};

// The `dpo` recipe: preference pairs against a frozen reference.
struct DpoRecipe : PolicyRecipe {
  std::string data;
  std::string reference;
  DPOObjectiveOptions objective;
  template <class V>
  void visit(V& v) {
    PolicyRecipe::visit(v);
    v("data", data, "a JSON-lines file of {prompt, chosen, rejected}");
    v("reference", reference, "the frozen reference: empty = the starting weights, or a run / Hugging Face folder");
    v("objective", objective, "the DPO loss");
  }
};

// The `grpo` recipe: prompts, rewards, and the frozen reference of the KL term.
struct GrpoRecipe : PolicyRecipe {
  std::string prompts;
  std::string reward;
  std::string reward_command;
  post_training::RewardOptions reward_options;
  std::string reference;
  GRPOObjectiveOptions objective;
  template <class V>
  void visit(V& v) {
    PolicyRecipe::visit(v);
    v("prompts", prompts, "a JSON-lines file of {\"prompt\", ...}");
    v("reward", reward,
      "built-in rewards, comma-separated (exact, format, length); at least one of reward and "
      "reward_command");
    v("reward_command", reward_command, "a command scoring completions (docs/post_training.md)");
    v("reward_options", reward_options, "the built-in rewards' settings");
    v("reference", reference, "the frozen reference: empty = the starting weights, or a run / Hugging Face folder");
    v("objective", objective, "the GRPO loss and rollouts");
  }
};

// The fields every post-training kind has (each adds its data fields).
template <class R>
R post_training_defaults(const std::string& run, training::TrainerOptions to, training::OptimOptions oo,
                         data::LoaderOptions lo) {
  // The fresh model: a byte-level causal_transformer sized for the sums task (docs/post_training.md).
  R r;
  r.run = run;
  r.model = {"causal_transformer", {{"emb_features", 128}, {"num_layers", 4}, {"num_heads", 4}, {"max_seq_len", 64}}};
  r.lora = LoraRecipe{};
  r.eval.max_new_tokens = 12;  // a sum and the end-of-turn marker
  r.eval.count = 500;
  r.loader = lo;
  r.optim = oo;
  r.trainer = to;
  return r;
}

std::string post_training_help(const std::string& objective_fields) {
  return "model fields (causal_transformer, used when init_from is empty):\n" +
         format_fields(models::language_models().info("causal_transformer").fields, "  ") + "\neval fields:\n" +
         format_fields(fields_of<post_training::EvalOptions>(), "  ") + "\nlora fields (docs/lora.md):\n" +
         format_fields(fields_of<LoraRecipe>(), "  ") + "\nobjective fields:\n" + objective_fields;
}

// A recipe's file field (`key` names it in errors): given, and a file.
std::string data_path(const std::string& path, const char* key, const char* what) {
  DEW_CHECK(!path.empty(), key, ": expected ", what, " (--", key, " FILE)");
  DEW_CHECK(fs::is_regular_file(path), key, ": ", path, " is not a file");
  return path;
}

std::shared_ptr<post_training::ChatEvaluator> evaluator(const PolicyRecipe& r, const Policy& p,
                                                        const post_training::RewardOptions& ro = {}) {
  const auto& eo = r.eval;
  if (!eo.prompts.empty()) DEW_CHECK(fs::is_regular_file(eo.prompts), "eval.prompts: ", eo.prompts, " is not a file");
  return std::make_shared<post_training::ChatEvaluator>(eo, p.format, p.model->options.max_seq_len(), ro);
}

// recipe.reference: empty (the frozen reference is the starting weights: the trainer's reference EMA), or a
// language-model run (its latest checkpoint) or a Hugging Face folder whose weights `set` receives.
json resolve_reference(const std::string& dir, bool lora,
                       const std::function<void(const training::TensorMap&, const std::string&)>& set) {
  if (dir.empty()) return json::object({{"reference", "starting weights"}});
  DEW_CHECK(!lora, "reference: ", dir,
            "; a LoRA policy's reference is its base with the adapters as they start, --reference is not taken "
            "with lora.targets");
  if (training::RunDir::holds_run(dir)) {
    const std::string kind = read_record(dir).value("kind", "");
    DEW_CHECK(
        std::find(language_model_kinds().begin(), language_model_kinds().end(), kind) != language_model_kinds().end(),
        "reference: ", dir, " is a ", kind, " run; the reference is a language-model run (lm, sft, dpo, grpo)");
    OpenOptions o;
    o.step = training::latest_checkpoint(dir);
    set(run_weights(dir, o), dir + " step_" + std::to_string(o.step));
    return {{"reference", dir}, {"step", o.step}};
  }
  DEW_CHECK(fs::is_regular_file(fs::path(dir) / "config.json"), "reference: ", dir,
            " is neither a dew run (run.json) nor a Hugging Face folder (config.json)");
  auto model = interop::load_pretrained_decoder(dir);
  set(training::module_state(*model), dir);
  return {{"reference", dir}};
}

Built finish(Built b, PolicyRecipe& r, const Policy& p, const std::string& what) {
  r.model = from_json<ModelSpec>(p.model->config());
  b.derived = {{"tokenizer", p.tokenizer_spec},
               {"eos_id", p.format.tokenizer->eos_id()},
               {"chat_template", data::chat_template_name(p.format.templ)},
               {"init", p.source}};
  b.init_weights = p.init;
  b.preview = ".txt";
  b.summary = "training causal_transformer (" + std::to_string(parameter_count(*p.model.ptr())) + " parameters, from " +
              (p.source.value("kind", "none") == "none" ? std::string("its initialisation")
                                                        : p.source["init_from"].get<std::string>()) +
              ") on " + what;
  if (p.lora.is_object()) {
    b.lora = p.lora;
    b.derived["lora"] = p.lora;
    b.summary += ", LoRA on " + p.lora["adapted"].dump() + " modules (" + p.lora["trainable"].dump() +
                 " trainable parameters, the base's " + p.lora["frozen"].dump() + " frozen)";
  }
  return b;
}

Built build_sft(SftRecipe& r, const c10::Device& device) {
  set_threads(r.threads, workload_of("causal_transformer"));
  const SFTObjectiveOptions& oo = r.objective;
  const std::string train = data_path(r.data, "data", "a chat JSON-lines file");
  const std::string val = r.val_data;
  if (!val.empty()) DEW_CHECK(fs::is_regular_file(val), "val_data: ", val, " is not a file");
  // The SFT loss (the LM objective's chunked cross-entropy) reads the output head's weight directly.
  Policy p = resolve_policy(r, device, /*loss_reads_head_weight=*/true);
  const int64_t max_len = p.model->options.max_seq_len() + 1;
  data::Batch rows = data::sft_rows(train, p.format, max_len, oo.pack);
  data::Batch val_rows;
  if (!val.empty()) {
    val_rows = data::sft_rows(val, p.format, max_len, oo.pack, rows.at("tokens").size(1));
    if (val_rows.at("tokens").size(1) > rows.at("tokens").size(1))  // the longer of the two sets the rows' length
      rows = data::sft_rows(train, p.format, max_len, oo.pack, val_rows.at("tokens").size(1));
  }
  const int64_t n = rows.at("tokens").size(0), len = rows.at("tokens").size(1);
  auto eval = evaluator(r, p);
  Built b;
  b.objective = std::make_shared<SFTObjective>(p.model, len - 1, oo, val_rows, eval);
  data::LoaderOptions lo = r.loader;
  lo.seed = r.seed;
  b.loader = std::make_shared<data::DataLoader>(std::make_shared<data::TensorDataset>(rows, "sft"), lo);
  return finish(std::move(b), r, p,
                train + " (" + std::to_string(n) + (oo.pack ? " packed rows" : " conversations") + " of " +
                    std::to_string(len) + " tokens), batch " + std::to_string(lo.batch_size));
}

Built build_dpo(DpoRecipe& r, const c10::Device& device) {
  set_threads(r.threads, workload_of("causal_transformer"));
  const DPOObjectiveOptions& oo = r.objective;
  const std::string train = data_path(r.data, "data", "a JSON-lines file of {prompt, chosen, rejected}");
  Policy p = resolve_policy(r, device);
  data::Batch rows = data::preference_rows(train, p.format, p.model->options.max_seq_len());
  const int64_t n = rows.at("ids").size(0);
  Built b;
  auto obj = std::make_shared<DPOObjective>(p.model, oo, rows, evaluator(r, p));
  const json ref =
      resolve_reference(r.reference, bool(r.lora),
                        [&](const training::TensorMap& w, const std::string& what) { obj->set_reference(w, what); });
  b.objective = obj;
  data::LoaderOptions lo = r.loader;
  lo.seed = r.seed;
  b.loader = std::make_shared<data::DataLoader>(std::make_shared<data::TensorDataset>(rows, "dpo"), lo);
  b = finish(std::move(b), r, p,
             train + " (" + std::to_string(n) + " pairs), beta " + std::to_string(oo.beta) + ", batch " +
                 std::to_string(lo.batch_size));
  b.derived["reference"] = ref;
  return b;
}

Built build_grpo(GrpoRecipe& r, const c10::Device& device) {
  set_threads(r.threads, workload_of("causal_transformer"));
  const GRPOObjectiveOptions& oo = r.objective;
  const post_training::RewardOptions& ro = r.reward_options;
  const data::LoaderOptions& lo = r.loader;
  DEW_CHECK(r.trainer.accumulation == 1,
            "trainer.accumulation: grpo takes one mini-batch of a "
            "rollout per step (use objective.mini_batches and loader.batch_size), got ",
            r.trainer.accumulation);
  // The rollout of batch_size prompts x group_size completions is split into mini_batches equal parts: checked
  // here, before anything is built or written, not at the first rollout.
  DEW_CHECK(oo.mini_batches >= 1, "objective.mini_batches: must be >= 1, got ", oo.mini_batches);
  // (A batch_size or group_size below 1 is refused by the loader's and the objective's own checks.)
  DEW_CHECK(lo.batch_size < 1 || oo.group_size < 1 || (__int128(lo.batch_size) * oo.group_size) % oo.mini_batches == 0,
            "objective.mini_batches: ", oo.mini_batches, " does not divide a rollout's ", lo.batch_size, " x ",
            oo.group_size,
            " completions (loader.batch_size x objective.group_size); accepted: a divisor of their product");
  const std::string prompts_file = data_path(r.prompts, "prompts", "a JSON-lines file of {\"prompt\", ...}");
  // Every reward is checked (names, regexes) before the model is built.
  DEW_CHECK(
      !r.reward.empty() || !r.reward_command.empty(), "reward: none given; pass --reward NAME[,NAME] (",
      [] {
        std::string s;
        for (const auto& n : post_training::builtin_rewards()) s += (s.empty() ? "" : ", ") + n;
        return s;
      }(),
      ") or --reward-command CMD");
  auto rewards = post_training::make_rewards(r.reward, r.reward_command, ro);
  Policy p = resolve_policy(r, device);
  auto prompts = data::read_prompts(prompts_file, p.format, p.model->options.max_seq_len());
  const int64_t n = int64_t(prompts.size());
  DEW_CHECK(n >= lo.batch_size, "loader.batch_size: ", lo.batch_size, " prompts per rollout, but ", prompts_file,
            " holds ", n);
  Built b;
  auto obj = std::make_shared<GRPOObjective>(p.model, oo, p.format, std::move(prompts), rewards, evaluator(r, p, ro));
  const json ref =
      resolve_reference(r.reference, bool(r.lora),
                        [&](const training::TensorMap& w, const std::string& what) { obj->set_reference(w, what); });
  b.objective = obj;
  data::LoaderOptions loader = lo;
  loader.seed = r.seed;
  loader.drop_last = true;  // every rollout holds batch_size prompts
  data::Batch index = {{"index", at::arange(n, at::kLong)}};
  b.loader = std::make_shared<data::DataLoader>(std::make_shared<data::TensorDataset>(index, "prompts"), loader);
  std::string names;
  for (const auto& rw : rewards) names += (names.empty() ? "" : ", ") + rw->name();
  b = finish(std::move(b), r, p,
             prompts_file + " (" + std::to_string(n) + " prompts), " + std::to_string(lo.batch_size) + " x " +
                 std::to_string(oo.group_size) + " completions per rollout, rewards " + names);
  b.derived["reference"] = ref;
  return b;
}

training::TrainerOptions trainer_options(int64_t steps, int64_t val_every) {
  training::TrainerOptions to;
  to.steps = steps;
  to.log_every = 10;
  to.val_every = val_every;
  to.checkpoint_every = val_every;
  to.time_limit_minutes = 15;
  to.best_metric = "val/reward";
  to.best_mode_max = true;
  return to;
}

data::LoaderOptions loader_options(int64_t batch) {
  data::LoaderOptions lo;
  lo.batch_size = batch;
  lo.num_workers = 1;
  lo.drop_last = true;
  return lo;
}

}  // namespace

const std::vector<std::string>& language_model_kinds() {
  static const std::vector<std::string> k = {"lm", "sft", "dpo", "grpo"};
  return k;
}

Policy resolve_policy(PolicyRecipe& r, const c10::Device& device, bool loss_reads_head_weight) {
  const std::string from = r.init_from, asked = r.chat_template;
  if (asked != "auto") data::parse_chat_template(asked);  // a wrong name fails before anything loads
  const auto lora = lora_options_of(r.lora, from);        // so do the LoRA settings
  json base;
  Policy p;
  p.source = {{"init_from", from}, {"kind", "none"}};
  if (from.empty()) {
    DEW_CHECK(r.model.architecture == "causal_transformer",
              "model.architecture: post-training trains a \"causal_transformer\", got ",
              json(r.model.architecture).dump());
    auto tok = data::load_tokenizer(r.tokenizer);
    json& fields = r.model.fields;
    if (!fields.is_object()) fields = json::object();
    if (!fields.contains("vocab_size")) fields["vocab_size"] = tok->vocab_size();
    p.model = models::build_language_model(to_json(r.model));
    p.tokenizer_spec = tok->spec();
    p.format = {tok, template_for(asked, *tok, "a fresh model"), {}};
  } else if (training::RunDir::holds_run(from)) {
    const json rec = read_record(from);
    const std::string kind = rec.value("kind", "");
    DEW_CHECK(
        std::find(language_model_kinds().begin(), language_model_kinds().end(), kind) != language_model_kinds().end(),
        "init_from: ", from, " is a ", kind, " run; a policy starts from a language-model run (lm, sft, dpo, grpo)");
    const json derived = rec.value("derived", json::object());
    DEW_CHECK(!derived.value("tokenizer", json()).is_null(), "init_from: ", from, "/run.json records no tokenizer");
    const int64_t step = training::latest_checkpoint(from);  // fixed now: the run may go on training
    p.model = models::build_language_model(rec.at("model"));
    p.tokenizer_spec = derived["tokenizer"];
    auto tok = data::load_tokenizer(p.tokenizer_spec);
    const std::string recorded = derived.value("chat_template", "");
    p.format = {
        tok,
        asked == "auto" && !recorded.empty() ? data::parse_chat_template(recorded) : template_for(asked, *tok, from),
        {}};
    p.source = {{"init_from", from}, {"kind", "run"}, {"step", step}};
    if (lora) base = lora_base("run", from, step);
    auto model = p.model;
    p.init = [model, from, step]() mutable {
      OpenOptions o;
      o.step = step;
      // A LoRA policy's adapters are attached by now; they are not in the base.
      io::load_weights(*model, run_weight_source(from, o), lora_base_key_map());
      log::info("init_from ", from, " step ", step);
    };
  } else if (fs::is_regular_file(fs::path(from) / "config.json")) {
    p.model = interop::load_pretrained_decoder(from);  // weights too: a folder holds one set
    p.model->train();
    auto tok = data::load_tokenizer(from);
    p.tokenizer_spec = tok->spec();
    data::ChatTemplate t;
    if (asked == "auto" && has_chat_template(from)) t = data::recognise_chat_template(from);
    else t = template_for(asked, *tok, from);
    p.format = {tok, t, {}};
    p.source = {{"init_from", from}, {"kind", "hf"}};
    if (lora) base = lora_base("hf", from);
  } else {
    fail("init_from: ", from, " is neither a dew run (run.json) nor a Hugging Face folder (config.json)");
  }
  DEW_CHECK(p.format.tokenizer->vocab_size() <= p.model->options.vocab_size(), "tokenizer: its vocabulary of ",
            p.format.tokenizer->vocab_size(), " ids exceeds the model's vocab_size ", p.model->options.vocab_size());
  p.model->to(device);
  if (lora) {
    DEW_CHECK(
        !loss_reads_head_weight || p.model->options.tie_embeddings() || !nn::lora_target_matches(*lora, "lm_head"),
        "lora.targets: lm_head is read directly by the SFT loss (the chunked cross-entropy), so its adapter "
        "would not train; leave it out (PEFT's all-linear does too)");
    p.lora = apply_lora_to_run(*p.model, *lora, base);
  }
  return p;
}

data::ChatFormat chat_format_of(const json& record, const std::string& run_dir) {
  const json derived = record.value("derived", json::object());
  DEW_CHECK(!derived.value("tokenizer", json()).is_null(), run_dir, "/run.json: the run records no tokenizer");
  auto tok = data::load_tokenizer(derived["tokenizer"]);
  const std::string recorded = derived.value("chat_template", "");
  return {tok, recorded.empty() ? template_for("auto", *tok, run_dir) : data::parse_chat_template(recorded), {}};
}

RunKind sft_kind() {
  KindDefinition<SftRecipe> k;
  k.name = "sft";
  k.doc = "supervised fine-tuning of a causal language model on chat data (loss on assistant tokens)";
  k.defaults = [] {
    training::OptimOptions oo;
    oo.lr = 1e-3;
    oo.warmup_steps = 50;
    oo.weight_decay = 0.1;
    oo.beta2 = 0.95;
    return post_training_defaults<SftRecipe>("runs/sft", trainer_options(1000, 250), oo, loader_options(64));
  };
  k.open_keys = {"model.fields"};
  k.identity = {"model", "seed", "data", "init_from", "lora"};
  k.help = [](const SftRecipe&) { return post_training_help(format_fields(fields_of<SFTObjectiveOptions>(), "  ")); };
  k.build = build_sft;
  return make_run_kind(std::move(k));
}

RunKind dpo_kind() {
  KindDefinition<DpoRecipe> k;
  k.name = "dpo";
  k.doc = "direct preference optimisation of a causal language model against its frozen starting weights";
  k.defaults = [] {
    // Measured on the sums task (docs/post_training.md): at lr 1e-4, or 1e-5 held constant, the policy
    // loses its end-of-turn marker; 1e-5 with a cosine decay does not.
    training::OptimOptions oo;
    oo.lr = 1e-5;
    oo.warmup_steps = 30;
    oo.weight_decay = 0.0;
    oo.schedule = "cosine";
    return post_training_defaults<DpoRecipe>("runs/dpo", trainer_options(300, 100), oo, loader_options(32));
  };
  k.open_keys = {"model.fields"};
  k.identity = {"model", "seed", "data", "init_from", "reference", "lora"};
  k.help = [](const DpoRecipe&) { return post_training_help(format_fields(fields_of<DPOObjectiveOptions>(), "  ")); };
  k.build = build_dpo;
  return make_run_kind(std::move(k));
}

RunKind grpo_kind() {
  KindDefinition<GrpoRecipe> k;
  k.name = "grpo";
  k.doc = "group-relative policy optimisation of a causal language model on prompts with rewards";
  k.defaults = [] {
    // Measured on the sums task (docs/post_training.md): lr 1e-4 without warm-up first loses half the SFT
    // model's accuracy; 3e-5 after 50 warm-up steps gains 35 points in 1200 steps (8.5 minutes here).
    training::OptimOptions oo;
    oo.lr = 3e-5;
    oo.warmup_steps = 50;
    oo.weight_decay = 0.0;
    oo.schedule = "constant";
    auto r = post_training_defaults<GrpoRecipe>("runs/grpo", trainer_options(1200, 100), oo, loader_options(16));
    r.objective.max_new_tokens = 12;
    return r;
  };
  k.open_keys = {"model.fields"};
  k.identity = {"model", "seed", "prompts", "init_from", "reference", "reward", "reward_command", "lora"};
  k.help = [](const GrpoRecipe&) {
    return post_training_help(format_fields(fields_of<GRPOObjectiveOptions>(), "  ")) + "reward_options fields:\n" +
           format_fields(fields_of<post_training::RewardOptions>(), "  ");
  };
  k.build = build_grpo;
  return make_run_kind(std::move(k));
}

}  // namespace dew::runs
