#include "dew/runs/run.h"

#include <filesystem>

#include "dew/core/device.h"
#include "dew/core/log.h"
#include "dew/core/rng.h"
#include "dew/data/dataset.h"
#include "dew/io/files.h"
#include "dew/io/weights.h"
#include "dew/runs/kinds.h"
#include "dew/runs/lora_run.h"
#include "dew/training/distributed.h"
#include "dew/training/objective.h"
#include "dew/training/run_dir.h"

namespace fs = std::filesystem;

namespace dew::runs {

namespace {

const std::map<std::string, RunKind>& kinds_map() {
  static const auto* m = [] {
    auto* m = new std::map<std::string, RunKind>();
    for (auto k : {diffusion_kind(), autoencoder_kind(), lm_kind(), jepa_kind(), sft_kind(), dpo_kind(), grpo_kind()})
      (*m)[k.name] = std::move(k);
    return m;
  }();
  return *m;
}

}  // namespace

const RunKind& run_kind(const std::string& name) {
  auto it = kinds_map().find(name);
  if (it == kinds_map().end()) {
    std::string valid;
    for (const auto& k : run_kinds()) valid += (valid.empty() ? "" : ", ") + k;
    fail("train: unknown kind \"", name, "\"; accepted: ", valid);
  }
  return it->second;
}

std::vector<std::string> run_kinds() {
  std::vector<std::string> out;
  for (const auto& kv : kinds_map()) out.push_back(kv.first);
  return out;
}

json default_recipe(const std::string& kind) { return run_kind(kind).defaults(); }

json read_record(const std::string& run_dir) {
  json r = training::read_run_json(run_dir);
  const std::string where = training::RunDir(run_dir).record();
  DEW_CHECK(r.is_object() && r.contains("kind") && r["kind"].is_string(), where,
            ": no \"kind\" (not a dew run record)");
  const int format = r.value("format", 1);
  if (format == kRunFormat) return r;
  DEW_CHECK(format == 1, where, ": run format ", format, ", this dew reads formats 1 and ", kRunFormat,
            "; use the dew version that wrote it");
  // Format 1: diffusion nested the recipe under "recipe" beside sample_shape and class_names; lm wrote the
  // resolved model, the data spec, tokenizer and eos_id at the top beside the recipe.
  DEW_CHECK(r.contains("recipe") && r["recipe"].is_object(), where, ": a format-1 record without \"recipe\"");
  json out = r["recipe"];
  out["kind"] = r["kind"];
  out["format"] = kRunFormat;
  out["dew_version"] = r.value("dew_version", "?");
  json derived = json::object();
  for (const char* k : {"sample_shape", "class_names", "tokenizer", "eos_id"})
    if (r.contains(k)) derived[k] = r[k];
  if (r["kind"] == "lm") {
    if (r.contains("model")) out["model"] = r["model"];
    if (r.contains("data")) derived["data_spec"] = r["data"];
  }
  out["derived"] = derived;
  return out;
}

json read_record_of_kind(const std::string& run_dir, const std::string& kind, const std::string& what) {
  json r = read_record(run_dir);
  DEW_CHECK(r.value("kind", "") == kind, run_dir, "/run.json: not ", what, " (kind ",
            r.value("kind", json("missing")).dump(), ")");
  DEW_CHECK(r.contains("model") && r["model"].is_object() && r["model"].contains("fields"), run_dir,
            "/run.json: missing the model record {architecture, fields}");
  return r;
}

json data_spec(const json& d) { return d.is_string() ? json{{"name", d}} : d; }

json held_out_data(const json& data, const json& test_data) {
  if (!test_data.is_null()) return data_spec(test_data);
  json t = data_spec(data);
  const std::string name = t.value("name", "");
  if (!data::datasets().contains(name)) return nullptr;
  for (const auto& f : data::datasets().info(name).fields)
    if (f.name == "split") {
      t["split"] = "test";
      return t;
    }
  return nullptr;
}

int64_t parameter_count(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

PreparedRun prepare(const std::string& kind_name, const json& recipe) {
  const RunKind& kind = run_kind(kind_name);
  DEW_CHECK(recipe.is_object(), "recipe: expected a JSON object");
  io::check_json_utf8(recipe, "recipe");  // run.json could not be written after the build
  PreparedRun p;
  p.kind = kind.name;
  // Every section parsed once, into the kind's recipe type: an unknown field or a wrong type fails here.
  const std::unique_ptr<ParsedRecipe> parsed = kind.parse(recipe);
  const RecipeBase& base = parsed->base();
  p.options = base;
  DEW_CHECK(!p.options.run.empty(), "run: expected a directory name");
  DEW_CHECK(p.options.seed >= 0, "seed: must be >= 0, got ", p.options.seed);
  DEW_CHECK(p.options.threads >= 0, "threads: must be >= 0 (0 = the measured default), got ", p.options.threads);
  p.device = parse_device(p.options.device, "device");
  p.optim = base.optim;
  p.trainer = base.trainer;
  p.dist = base.dist;
  training::validate(p.optim);
  training::validate(p.trainer);
  training::validate(p.dist);
  p.dist_env = training::read_dist_env();
  // One GPU per local rank: a bare `cuda` (or `auto`) becomes cuda:LOCAL_RANK.
  if (p.dist_env.world_size > 1 && p.device.is_cuda() && p.options.device.find(':') == std::string::npos)
    p.device = parse_device("cuda:" + std::to_string(p.dist_env.local_rank), "device");
  training::check_autocast(p.trainer.autocast, p.device);  // before the model is built
  const std::string dir = p.options.run;
  DEW_CHECK(!fs::exists(dir) || fs::is_directory(dir), "run: ", dir, " exists and is not a directory");
  // Before the model is built; only rank 0 takes the lock (the others never write the run).
  if (p.dist_env.rank == 0) training::RunDir(dir).check_not_being_written();
  // A resumed run's checkpoint is checked before anything is built or written: a damaged latest one is
  // refused here under trainer.strict_resume, and a run whose every checkpoint is damaged always.
  p.resumes = fs::is_directory(dir) && !training::list_checkpoints(dir).empty();
  if (p.resumes) training::resume_point(dir, p.trainer.strict_resume);
  // A directory holding a run record, even one killed before its first checkpoint, is trained again only by
  // its own kind (checked below), and only while the record reads: train() rewrites it, so a broken one is
  // refused here, before anything is built.
  const bool has_record = training::RunDir::holds_run(dir);
  json old;
  if (has_record || p.resumes) old = read_record(dir);

  {
    // Parameter initialisation draws from the default generators: from the run's seed, not the process.
    rng::DefaultGeneratorScope init(uint64_t(p.options.seed), 0, "init");
    p.built = parsed->build(p.device);
  }
  p.record = parsed->to_json();
  p.record["kind"] = kind.name;
  p.record["format"] = kRunFormat;
  p.record["dew_version"] = DEW_VERSION;
  p.record["derived"] = p.built.derived;

  // Resume: a directory with checkpoints continues only the run that wrote them.
  if (has_record || p.resumes)
    DEW_CHECK(old.value("kind", "") == kind.name, "run ", dir, " is a ", old.value("kind", json("?")).dump(),
              " run; this command trains ", kind.name, " (use another --run)");
  if (p.resumes) {
    for (const auto& key : kind.identity) {
      const json was = old.value(key, json()), now = p.record.value(key, json());
      DEW_CHECK(was == now, "run ", dir, " was trained with ", key, " ", was.dump(), "; this command asks for ",
                now.dump(), " (rerun with the same ", key, " to resume, or use another --run)");
    }
    // A LoRA run's checkpoints hold adapters of one base: refuse to resume them on another.
    const json was = old.value("derived", json::object()).value("lora", json());
    if (was.is_object() && p.built.lora.is_object()) {
      const std::string change = lora_base_change(was.value("base", json()), p.built.lora.value("base", json()));
      DEW_CHECK(change.empty(), "run ", dir, ": its adapters were trained on the base ",
                was.value("base", json::object()).value("path", "?"), ", which has changed since (", change,
                "); resume on the same base, or use another --run");
    }
  }
  return p;
}

training::TrainResult train(PreparedRun& p) {
  const std::string dir = p.options.run;
  // Data-parallel (WORLD_SIZE > 1, from `dew launch` or torchrun): the process group forms before anything is
  // written, so a rendezvous failure leaves the run directory as it was.
  std::shared_ptr<training::Distributed> dist;
  if (p.dist_env.world_size > 1) {
    const int64_t batch = p.built.loader->options().batch_size, world = p.dist_env.world_size;
    training::check_global_batch(batch, world);
    if (p.kind == "grpo") {
      // Every rank takes an equal slice of every mini-batch of a rollout: each needs at least one completion.
      const json& o = p.record.at("objective");
      const int64_t per_mini_batch = batch * o.at("group_size").get<int64_t>() / o.at("mini_batches").get<int64_t>();
      DEW_CHECK(per_mini_batch >= world, "objective.mini_batches: a mini-batch of ", per_mini_batch,
                " completions (loader.batch_size x objective.group_size / objective.mini_batches) leaves some of the ",
                world, " ranks none; accepted: at most ", batch * o.at("group_size").get<int64_t>() / world,
                " mini-batches on ", world, " ranks");
    }
    dist = std::make_shared<training::Distributed>(p.dist_env, p.dist, p.device);
  }
  const bool main = !dist || dist->is_main();
  // What can still fail without writing (init_from's weights, the trainer's checks) goes first: a refused
  // command leaves no new run directory behind and an existing run's run.json as it was.
  // A LoRA run's base is not in its checkpoints: it loads on every start, the adapters then from the checkpoint.
  const bool lora = p.built.lora.is_object();
  if (p.built.init_weights && (!p.resumes || lora)) p.built.init_weights();
  training::Trainer trainer(p.built.objective, p.built.loader, p.optim, p.trainer, dir, uint64_t(p.options.seed));
  trainer.set_distributed(dist);
  if (lora) trainer.set_adapter_checkpoints(p.built.lora);
  std::unique_ptr<io::FileLock> lock;
  if (main) {
    fs::create_directories(dir);
    lock = training::RunDir(dir).lock_for_writing();  // one writer per run, released at exit
    io::write_file_atomic(training::RunDir(dir).record(), p.record.dump(2));
  }
  if (main)
    log::info(p.built.summary, ", ", p.trainer.steps, " steps, run ", dir, " on ", p.device.str(),
              dist ? ", " + std::to_string(dist->world_size()) + " ranks (" + dist->backend() + ")" : "");
  return trainer.fit();
}

training::TensorMap run_weights(const std::string& run_dir, const OpenOptions& o, int64_t* step_out) {
  DEW_CHECK(o.weights == "ema" || o.weights == "live" || o.weights == "reference", "weights: got \"", o.weights,
            "\", accepted: ema, live, reference");
  int64_t step = o.step;
  if (step < 0) {
    step = training::latest_checkpoint(run_dir);
  } else {
    auto steps = training::list_checkpoints(run_dir);
    if (std::find(steps.begin(), steps.end(), step) == steps.end()) {
      std::string have;
      for (auto s : steps) have += (have.empty() ? "" : ", ") + std::to_string(s);
      fail("step: ", run_dir, " has no checkpoint of step ", step, "; it has: ", have.empty() ? "none" : have);
    }
  }
  auto ck = training::load_checkpoint(run_dir, step, /*load_optimizer=*/false);
  const bool reference = ck.state.value("ema_role", "average") == "reference";
  DEW_CHECK(o.weights != "reference" || reference, "weights: ", run_dir, " step_", step,
            " holds no frozen reference model (only dpo and grpo runs have one); accepted: ema, live");
  if (o.weights == "reference" || (o.weights == "ema" && !reference)) {
    for (const auto& [name, avg] : ck.ema) {
      auto it = ck.model.find(name);
      DEW_CHECK(it != ck.model.end(), run_dir, " step_", step, "/ema.safetensors: \"", name,
                "\" is not in model.safetensors");
      DEW_CHECK(it->second.sizes() == avg.sizes(), run_dir, " step_", step, "/ema.safetensors: \"", name,
                "\" has shape ", avg.sizes(), ", model.safetensors ", it->second.sizes());
      it->second = avg.to(it->second.scalar_type());
    }
  }
  if (step_out) *step_out = step;
  if (ck.state.contains("lora"))
    return merged_lora_weights(ck.model, ck.state["lora"], run_dir + " step_" + std::to_string(step));
  return std::move(ck.model);
}

io::WeightSource run_weight_source(const std::string& run_dir, const OpenOptions& o, int64_t* step_out) {
  int64_t step = 0;
  auto weights = run_weights(run_dir, o, &step);
  if (step_out) *step_out = step;
  return io::WeightSource::of_tensors(std::move(weights),
                                      run_dir + " step_" + std::to_string(step) + " (" + o.weights + " weights)");
}

int64_t place_and_load(torch::nn::Module& module, const std::string& run_dir, const OpenOptions& o) {
  module.to(parse_device(o.device, "device"));
  const int64_t step = load_run_weights(module, run_dir, o);
  module.eval();
  return step;
}

int64_t load_run_weights(torch::nn::Module& module, const std::string& run_dir, const OpenOptions& o) {
  int64_t step = 0;
  io::load_weights(module, run_weight_source(run_dir, o, &step));
  return step;
}

}  // namespace dew::runs
