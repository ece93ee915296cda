// The `lm` run kind (a causal_transformer on token streams) and the opening of a trained LM run.
#include "dew/runs/lm_run.h"

#include "dew/core/device.h"
#include "dew/core/threads.h"
#include "dew/data/lm_data.h"
#include "dew/data/tokenizer.h"
#include "dew/objectives/lm.h"
#include "dew/runs/kinds.h"
#include "dew/runs/post_training_run.h"

namespace dew::runs {

namespace {

// The `lm` recipe: the common sections, the model, the token data and the objective.
struct LmRecipe : RecipeBase {
  ModelSpec model;
  json data = json::object();
  LMObjectiveOptions objective;
  template <class V>
  void visit(V& v) {
    RecipeBase::visit(v);
    v("model", model, "the causal_transformer (vocab_size from the data unless given)");
    v("data", data, "the token stream: a source of `dew list lm_datasets`");
    v("objective", objective, "the next-token objective");
  }
};

LmRecipe lm_defaults() {
  // Sized by measured runs on a 2-core CPU (docs/lm.md): a byte-level model that reaches validation
  // perplexity <= 5 per byte on the fortunes corpus within 15 minutes (the time limit).
  LmRecipe r;
  r.run = "runs/fortunes";
  r.model = {"causal_transformer", {{"emb_features", 128}, {"num_layers", 4}, {"num_heads", 4}, {"max_seq_len", 512}}};
  r.data = {{"name", "fortunes"}};
  r.loader.batch_size = 32;
  r.loader.num_workers = 1;
  r.loader.drop_last = true;
  r.optim.lr = 3e-3;
  r.optim.warmup_steps = 100;
  r.optim.weight_decay = 0.1;
  r.optim.beta2 = 0.95;
  r.trainer.steps = 1500;  // what 15 minutes hold on a quiet 2-core machine (~55 samples/s), so the cosine completes
  r.trainer.log_every = 50;
  r.trainer.val_every = 500;
  r.trainer.checkpoint_every = 500;
  r.trainer.time_limit_minutes = 15;
  r.trainer.best_metric = "val/perplexity";
  r.objective.seq_len = 128;
  r.objective.val_windows = 0;
  r.objective.val_batch = 64;
  return r;
}

std::string lm_help(const LmRecipe&) {
  return "model fields (causal_transformer):\n" +
         format_fields(models::language_models().info("causal_transformer").fields, "  ") + "\ndata sources:\n" +
         format_registry(data::lm_datasets()) + "objective fields:\n" +
         format_fields(fields_of<LMObjectiveOptions>(), "  ");
}

Built build_lm(LmRecipe& r, const c10::Device& device) {
  DEW_CHECK(r.model.architecture == "causal_transformer",
            "model.architecture: dew train lm trains a \"causal_transformer\", got ",
            json(r.model.architecture).dump());
  set_threads(r.threads, workload_of("causal_transformer"));
  auto lm = data::lm_datasets().build(r.data, r.objective.seq_len);
  json& fields = r.model.fields;
  if (!fields.is_object()) fields = json::object();
  if (!fields.contains("vocab_size")) fields["vocab_size"] = lm->vocab_size;
  DEW_CHECK(fields["vocab_size"].is_number_integer() && fields["vocab_size"].get<int64_t>() >= lm->vocab_size,
            "model.fields.vocab_size: must be >= the data's vocab_size ", lm->vocab_size, ", got ",
            fields["vocab_size"].dump());
  auto model = models::build_language_model(to_json(r.model));
  data::LoaderOptions lo = r.loader;
  lo.seed = r.seed;
  Built b;
  b.loader = std::make_shared<data::DataLoader>(lm->windows, lo, lm->transform);
  b.objective = std::make_shared<LMObjective>(model, lm, r.objective);
  model->to(device);
  r.model = from_json<ModelSpec>(model->config());  // every field resolved, as the run record has always held it
  b.preview = ".txt";
  b.derived = {{"tokenizer", lm->tokenizer}, {"eos_id", lm->eos_id}, {"data_spec", lm->spec}};
  b.summary = "training causal_transformer (" + std::to_string(parameter_count(*model)) + " parameters) on " +
              lm->spec.value("name", "?") + " (" + std::to_string(lm->train_tokens) + " train / " +
              std::to_string(lm->val_tokens) + " val tokens, vocab " + std::to_string(lm->vocab_size) + "), batch " +
              std::to_string(lo.batch_size) + " x " + std::to_string(r.objective.seq_len);
  return b;
}

}  // namespace

RunKind lm_kind() {
  KindDefinition<LmRecipe> k;
  k.name = "lm";
  k.doc = "a causal language model on token streams (default: bytes of Debian's fortunes)";
  k.defaults = lm_defaults;
  k.open_keys = {"model.fields", "data"};
  k.identity = {"model", "seed", "data"};
  k.help = lm_help;
  k.build = build_lm;
  return make_run_kind(std::move(k));
}

LMRun open_lm_run(const std::string& run_dir, const OpenOptions& o) {
  LMRun out;
  out.dir = run_dir;
  out.record = read_record(run_dir);
  const std::string kind = out.record.value("kind", "");
  const auto& kinds = language_model_kinds();
  DEW_CHECK(std::find(kinds.begin(), kinds.end(), kind) != kinds.end(), run_dir,
            "/run.json: not a language-model run (kind ", out.record.value("kind", json("missing")).dump(),
            "; accepted: lm, sft, dpo, grpo)");
  DEW_CHECK(out.record.contains("model") && out.record["model"].is_object(), run_dir,
            "/run.json: missing the model record {architecture, fields}");
  const json& r = out.record;
  parse_device(o.device, "device");  // before the model is built
  const json derived = r.value("derived", json::object());
  out.tokenizer = derived.value("tokenizer", json());
  out.eos_id = derived.value("eos_id", int64_t(-1));
  out.model = models::build_language_model(r["model"]);
  out.options = out.model->options;
  out.step = place_and_load(*out.model, run_dir, o);
  return out;
}

}  // namespace dew::runs
