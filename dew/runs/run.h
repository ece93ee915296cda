// Runs (docs/training.md): the set-up of a training run, written once for every kind, and the
// opening of a trained run. A kind (diffusion, lm, and those later objectives add) contributes its
// default recipe and how a recipe becomes a model, data and an objective; the rest — checking every
// field before anything is written, seeding, the run directory, run.json, the resume check, the trainer —
// lives here.
//
//   json recipe = dew::runs::default_recipe("diffusion");
//   recipe["run"] = "runs/x";
//   recipe["trainer"]["steps"] = 100;
//   auto run = dew::runs::prepare("diffusion", recipe);   // validates and builds; writes nothing
//   auto result = dew::runs::train(run);                   // creates runs/x, or resumes it
//   auto trained = dew::runs::open_diffusion_run("runs/x");  // EMA weights of the latest checkpoint
#pragma once
#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dew/core/options.h"
#include "dew/data/dataset.h"
#include "dew/io/weights.h"
#include "dew/runs/record.h"
#include "dew/training/trainer.h"

namespace dew {
class Objective;
namespace data {
class DataLoader;
}
}  // namespace dew

namespace dew::runs {

/// The recipe fields every kind has at its top level.
struct RunOptions {
  std::string run;
  int64_t seed = 0;
  int64_t threads = 0;
  std::string device = "auto";
  template <class V>
  void visit(V& v) {
    v("run", run, "run directory, e.g. runs/fashion_mnist");
    v("seed", seed, "seed of every random draw (initialisation, data order, noise, dropout)");
    v("threads", threads, "intra-op threads (0 = the measured default for the model)");
    v("device", device, "auto (CUDA when present, else CPU) | cpu | cuda | cuda:N");
  }
};

/// A recipe's `model` (and JEPA's `predictor`) section: a registered architecture and its fields, which the
/// architecture's own registry checks when the model is built.
struct ModelSpec {
  std::string architecture;
  json fields = json::object();
  template <class V>
  void visit(V& v) {
    v("architecture", architecture, "a registered architecture (dew models)");
    v("fields", fields, "the architecture's fields (--help lists them); unset ones take its defaults");
  }
};

/// The sections every kind's recipe has: the top-level fields, the loader, the optimizer, the trainer and the
/// data-parallel settings. A kind's recipe is a struct deriving from it that adds its own sections (model,
/// data, objective, ...) in its visit.
struct RecipeBase : RunOptions {
  data::LoaderOptions loader;
  training::OptimOptions optim;
  training::TrainerOptions trainer;
  training::DistOptions dist;
  template <class V>
  void visit(V& v) {
    RunOptions::visit(v);
    v("loader", loader, "the data loader");
    v("optim", optim, "the optimizer and its learning-rate schedule");
    v("trainer", trainer, "steps, logging, validation, checkpoints");
    v("dist", dist, "data-parallel training (docs/distributed.md)");
  }
};

/// What a kind builds from a recipe. Nothing is written while it is built.
struct Built {
  std::shared_ptr<Objective> objective;
  std::shared_ptr<data::DataLoader> loader;
  json derived = json::object();  // facts of the data the run records (sample_shape, class_names, tokenizer, ...)
  std::string summary;            // one line: what trains on what
  std::string preview;            // what validation writes as RUN/samples/step_N + this (".png", ".txt"; "" = none)
  /// Starts a fresh run's weights from recipe.init_from (absent: none); not called when the run resumes,
  /// except in a LoRA run, whose checkpoints do not hold the base.
  std::function<void()> init_weights;
  /// A LoRA run (docs/lora.md): {"options", "base", ...} of runs::apply_lora_to_run; null = none. Its
  /// checkpoints hold only the adapters and this record.
  json lora = nullptr;
};

/// A recipe parsed once into a kind's typed sections (runs::make_run_kind gives each kind its own).
class ParsedRecipe {
 public:
  virtual ~ParsedRecipe() = default;
  /// The sections every kind has.
  virtual const RecipeBase& base() const = 0;
  /// Completes the data-dependent fields (model channels, vocabulary) and builds everything on `device`. The
  /// default generators are seeded from (seed, "init") while it runs.
  virtual Built build(const c10::Device& device) = 0;
  /// The recipe as the run records it: every section, as build() completed it.
  virtual json to_json() const = 0;
};

/// A kind of training run.
struct RunKind {
  std::string name;
  std::string doc;
  std::function<json()> defaults;      // the recipe with its defaults
  std::vector<std::string> open_keys;  // recipe objects whose keys are free ("model.fields", "data")
  std::vector<std::string> identity;   // recipe keys a resumed run must keep ("model", "seed", "data", ...)
  /// Extra --help text for a recipe (model fields, data sources).
  std::function<std::string(const json& recipe)> help;
  /// Parses a recipe into the kind's sections: dew::Error naming an unknown field or a value of the wrong type.
  std::function<std::unique_ptr<ParsedRecipe>(const json& recipe)> parse;
};

/// The registered kinds: diffusion, autoencoder, lm, jepa, sft, dpo, grpo.
const RunKind& run_kind(const std::string& name);
std::vector<std::string> run_kinds();

/// The default recipe of a kind.
json default_recipe(const std::string& kind);

/// A run ready to train: every field checked, modules built, nothing written yet.
struct PreparedRun {
  std::string kind;
  RunOptions options;
  c10::Device device{c10::kCPU};
  json record;  // run.json as it will be written
  Built built;
  training::OptimOptions optim;
  training::TrainerOptions trainer;
  training::DistOptions dist;  // the recipe's `dist` section
  training::DistEnv dist_env;  // torchrun's variables (world_size 1 when unset)
  bool resumes = false;        // the directory holds a checkpoint of this run
};

/// Checks `recipe` (a kind's default recipe with the user's changes) and builds the run. dew::Error before
/// any file is written when a field is wrong or an existing run directory holds a different run.
PreparedRun prepare(const std::string& kind, const json& recipe);

/// Writes run.json, starts the weights from init_from (fresh runs), trains to trainer.steps (resuming
/// from the latest checkpoint) and returns how it ended.
training::TrainResult train(PreparedRun& run);

/// RUN/run.json in the current shape (format-1 records converted); dew::Error naming the file.
json read_record(const std::string& run_dir);

/// read_record() of a run that must be of `kind` (`what` names it in the error, e.g. "a language-model run").
json read_record_of_kind(const std::string& run_dir, const std::string& kind, const std::string& what);

/// A recipe's data spec as an object: a bare name such as "fashion_mnist" becomes {"name": "fashion_mnist"}.
json data_spec(const json& d);

/// The held-out set of a recipe: `test_data` when it is not null, else `data` with split "test" when its source
/// has splits; null when there is none.
json held_out_data(const json& data, const json& test_data);

/// Parameter count of a module, for the run's summary line.
int64_t parameter_count(torch::nn::Module& m);

/// Which weights to open, from which checkpoint, where.
struct OpenOptions {
  /// ema | live | reference. In a post-training run (sft, dpo, grpo) the EMA is the frozen starting model:
  /// there "ema" opens the trained (live) weights and "reference" the frozen ones.
  std::string weights = "ema";
  int64_t step = -1;           // a checkpoint's step (-1 = the latest)
  std::string device = "cpu";  // auto | cpu | cuda | cuda:N
};

/// The weights of one checkpoint of RUN by module path: its live state (parameters and buffers), with, for
/// "ema", the EMA averages in place of the parameters the run averaged (the live ones where the EMA is a
/// frozen reference), for "reference", the frozen reference (dew::Error for a run without one). A LoRA
/// run's checkpoint gives its base's weights with the adapters merged in (runs::merged_lora_weights). `step`
/// (optional) receives the step.
training::TensorMap run_weights(const std::string& run_dir, const OpenOptions& o, int64_t* step = nullptr);

/// run_weights() as a weight source (io::load_weights), described as "RUN step_N (ema weights)".
io::WeightSource run_weight_source(const std::string& run_dir, const OpenOptions& o, int64_t* step = nullptr);

/// What every open_*_run ends with: `module` moved to o.device, run_weights() loaded strictly, eval mode.
/// Returns the step loaded.
int64_t place_and_load(torch::nn::Module& module, const std::string& run_dir, const OpenOptions& o);

/// Loads run_weights() into `module` strictly (every parameter and buffer present, shapes checked); returns
/// the step loaded.
int64_t load_run_weights(torch::nn::Module& module, const std::string& run_dir, const OpenOptions& o);

}  // namespace dew::runs
