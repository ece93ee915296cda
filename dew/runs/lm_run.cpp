// The `lm` run kind (a causal_transformer on token streams) and the opening of a trained LM run.
#include "dew/runs/lm_run.h"

#include "dew/core/device.h"
#include "dew/core/threads.h"
#include "dew/data/lm_data.h"
#include "dew/data/tokenizer.h"
#include "dew/objectives/lm.h"
#include "dew/objectives/registry.h"
#include "dew/runs/kinds.h"
#include "dew/runs/post_training_run.h"

namespace dew::runs {

namespace {

json lm_defaults() {
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
  json r = to_json(RunOptions{});
  r["run"] = "runs/fortunes";
  r.update(json{
      {"model",
       {{"architecture", "causal_transformer"},
        {"fields", {{"emb_features", 128}, {"num_layers", 4}, {"num_heads", 4}, {"max_seq_len", 512}}}}},
      {"data", {{"name", "fortunes"}}},
      {"loader", to_json(lo)},
      {"optim", to_json(oo)},
      {"trainer", to_json(to)},
      {"objective", to_json(obj)},
  });
  return r;
}

std::string lm_help(const json&) {
  return "model fields (causal_transformer):\n" +
         format_fields(models::language_models().info("causal_transformer").fields, "  ") + "\ndata sources:\n" +
         format_registry(data::lm_datasets()) + "objective fields:\n" +
         format_fields(fields_of<LMObjectiveOptions>(), "  ");
}

Built build_lm(json& r, const c10::Device& device) {
  DEW_CHECK(r["model"].is_object() && r["model"].value("architecture", json()) == "causal_transformer",
            "model.architecture: dew train lm trains a \"causal_transformer\", got ",
            r["model"].value("architecture", json()).dump());
  set_threads(r["threads"].get<int64_t>(), workload_of("causal_transformer"));
  auto lo = from_json<data::LoaderOptions>(r["loader"], "loader");
  auto obj_opts = from_json<LMObjectiveOptions>(r["objective"], "objective");
  auto lm = data::lm_datasets().build(r["data"], obj_opts.seq_len);
  json& fields = r["model"]["fields"];
  if (!fields.is_object()) fields = json::object();
  if (!fields.contains("vocab_size")) fields["vocab_size"] = lm->vocab_size;
  DEW_CHECK(fields["vocab_size"].is_number_integer() && fields["vocab_size"].get<int64_t>() >= lm->vocab_size,
            "model.fields.vocab_size: must be >= the data's vocab_size ", lm->vocab_size, ", got ",
            fields["vocab_size"].dump());
  auto model = models::build_language_model(r["model"]);
  lo.seed = r["seed"].get<int64_t>();
  Built b;
  b.loader = std::make_shared<data::DataLoader>(lm->windows, lo, lm->transform);
  ObjectiveContext ctx;
  ctx.language_model = model;
  ctx.lm_data = lm;
  b.objective = objectives().build("lm", r["objective"], ctx);
  model->to(device);
  r["model"] = model->config();  // every field resolved, as the run record has always held it
  b.preview = ".txt";
  b.derived = {{"tokenizer", lm->tokenizer}, {"eos_id", lm->eos_id}, {"data_spec", lm->spec}};
  b.summary = "training causal_transformer (" + std::to_string(parameter_count(*model)) + " parameters) on " +
              lm->spec.value("name", "?") + " (" + std::to_string(lm->train_tokens) + " train / " +
              std::to_string(lm->val_tokens) + " val tokens, vocab " + std::to_string(lm->vocab_size) + "), batch " +
              std::to_string(lo.batch_size) + " x " + std::to_string(obj_opts.seq_len);
  return b;
}

}  // namespace

RunKind lm_kind() {
  RunKind k;
  k.name = "lm";
  k.doc = "a causal language model on token streams (default: bytes of Debian's fortunes)";
  k.defaults = lm_defaults;
  k.open_keys = {"model.fields", "data"};
  k.identity = {"model", "seed", "data"};
  k.help = lm_help;
  k.build = build_lm;
  return k;
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
