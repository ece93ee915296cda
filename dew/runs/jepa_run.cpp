// The `jepa` run kind and the opening and probing of a trained JEPA run.
#include "dew/runs/jepa_run.h"

#include <filesystem>

#include "dew/core/device.h"
#include "dew/core/log.h"
#include "dew/core/rng.h"
#include "dew/core/threads.h"
#include "dew/data/dataset.h"
#include "dew/io/files.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/objectives/jepa.h"
#include "dew/runs/kinds.h"
#include "dew/training/checkpoint.h"
#include "dew/training/run_dir.h"

namespace fs = std::filesystem;

namespace dew::runs {

namespace {

// The `jepa` recipe.
struct JepaRecipe : RecipeBase {
  ModelSpec model;
  ModelSpec predictor;
  json data = json::object();
  json test_data = nullptr;
  JEPAObjectiveOptions objective;
  template <class V>
  void visit(V& v) {
    RecipeBase::visit(v);
    v("model", model, "the encoder (auto: jepa_encoder for images, jepa_video_encoder for clips)");
    v("predictor", predictor, "the predictor (grid fields and encoder_features from the encoder unless given)");
    v("data", data, "the images or clips: a source of `dew list datasets`");
    v("test_data", test_data, "the held-out set the probes score on; null = the data, split test");
    v("objective", objective, "masks, EMA momentum and the validation probes");
  }
};

// Sized by measured runs on 2-core CPUs (docs/jepa.md). lr 1e-3 (I-JEPA's peak at batch 2048) collapsed a
// width-192 encoder here; width 128 trains fast enough to see several epochs in 15 minutes. 4 x 4 tokens (patch
// 7 on Fashion-MNIST) train 2.4 times as many steps as 7 x 7 in the time, and with 6 encoder layers their
// features beat the pixels and the initialisation on both probes after 15 minutes; 4 layers did not on the kNN.
// On a 4 x 4 grid I-JEPA's target range (0.15, 0.2) with min_keep 4 cannot be drawn (docs/jepa.md, Masks): one
// target block of 2 x 2 or 2 x 1 tokens leaves the context (at most 3 x 3) about 5 tokens.
// 15000 steps set the learning-rate and momentum schedules; the 15-minute limit stops the run at about 8500-9500
// on a 2-core Xeon, with a checkpoint, and the same command resumes it.
JepaRecipe jepa_defaults() {
  JepaRecipe r;
  r.run = "runs/jepa_fashion";
  // "auto": jepa_encoder for images, jepa_video_encoder for clips. image_size, in_channels and frames
  // come from the data unless given, and patch_size from default_jepa_patch (7 for Fashion-MNIST).
  r.model = {"auto", {{"emb_features", 128}, {"num_layers", 6}, {"num_heads", 4}}};
  // The grid fields and encoder_features are the encoder's.
  r.predictor = {"jepa_predictor", {{"emb_features", 64}, {"num_layers", 6}, {"num_heads", 4}}};
  r.data = {{"name", "fashion_mnist"}, {"split", "train"}};
  r.loader.batch_size = 64;
  r.loader.num_workers = 1;
  r.loader.drop_last = true;
  r.optim.lr = 5e-4;
  r.optim.weight_decay = 0.04;  // I-JEPA's
  r.optim.warmup_steps = 500;
  r.optim.grad_clip = 0;  // I-JEPA clips nothing
  r.trainer.steps = 15000;
  r.trainer.log_every = 50;
  r.trainer.val_every = 2000;
  r.trainer.checkpoint_every = 500;
  r.trainer.time_limit_minutes = 15;
  r.trainer.best_metric = "val/linear_acc";
  r.trainer.best_mode_max = true;
  r.objective.masks.targets = 1;
  r.objective.masks.target_scale = {0.2, 0.25};
  r.objective.masks.min_keep = 1;
  // Every token's features: the layout of a 4 x 4 grid matters to Fashion-MNIST classes.
  r.objective.probe_pool = "tokens";
  return r;
}

std::string registry_names(const RegistryBase& reg) {
  std::string s;
  for (const auto& e : reg.entries()) s += (s.empty() ? "" : ", ") + e.name;
  return s;
}

// Resolves "auto" and the input-dependent fields of the encoder; checks the predictor's architecture.
void complete_models(ModelSpec& m, ModelSpec& p, at::IntArrayRef s, const std::string& data_name) {
  const bool video = s.size() == 5;
  DEW_CHECK(s.size() == 4 || video, "data: JEPA trains on images [N, C, H, W] or clips [N, C, T, H, W], got ", s);
  DEW_CHECK(s[s.size() - 1] == s[s.size() - 2], "data: JEPA encoders take square inputs, got ", s[s.size() - 2], " x ",
            s[s.size() - 1]);
  if (m.architecture == "auto") m.architecture = video ? "jepa_video_encoder" : "jepa_encoder";
  const std::string& arch = m.architecture;
  DEW_CHECK(models::token_encoders().contains(arch), "model.architecture: unknown \"", arch, "\"; accepted: auto, ",
            registry_names(models::token_encoders()));
  DEW_CHECK((arch == "jepa_video_encoder") == video, "model.architecture: ", arch, " does not take ",
            video ? "clips" : "images", " (dataset ", data_name, " holds ", s, ")");
  json& f = m.fields;
  if (!f.is_object()) f = json::object();
  if (!f.contains("image_size")) f["image_size"] = s.back();
  // A non-integer image_size is left to the family's field check, which names it.
  if (!f.contains("patch_size") && f["image_size"].is_number_integer())
    f["patch_size"] = default_jepa_patch(f["image_size"].get<int64_t>());
  if (!f.contains("in_channels")) f["in_channels"] = s[1];
  if (video && !f.contains("frames")) f["frames"] = s[2];
  DEW_CHECK(models::token_predictors().contains(p.architecture), "predictor.architecture: unknown ",
            json(p.architecture).dump(), "; accepted: ", registry_names(models::token_predictors()));
  if (!p.fields.is_object()) p.fields = json::object();
}

std::string jepa_help(const JepaRecipe&) {
  return "encoder fields (jepa_encoder; jepa_video_encoder adds frames, tubelet_size):\n" +
         format_fields(models::token_encoders().info("jepa_video_encoder").fields, "  ") + "\npredictor fields:\n" +
         format_fields(models::token_predictors().info("jepa_predictor").fields, "  ") + "\nobjective fields:\n" +
         format_fields(fields_of<JEPAObjectiveOptions>(), "  ");
}

Built build_jepa(JepaRecipe& r, const c10::Device& device) {
  set_threads(r.threads, workload_of("jepa_encoder"));
  const JEPAObjectiveOptions& obj_opts = r.objective;
  r.data = data_spec(r.data);
  auto train = data::datasets().build(r.data);
  DEW_CHECK(train->contains("image"), "data: dataset ", train->name(), " has no \"image\" field");
  auto [encoder, predictor] = build_jepa_models(r.model, r.predictor, train->field("image").sizes(), train->name());
  data::DatasetPtr test;
  const int64_t classes = int64_t(train->class_names().size());
  const json held_out = held_out_data(r.data, r.test_data);
  if (obj_opts.probe_train > 0 && train->contains("label") && classes >= 2) {
    if (held_out.is_null())
      log::warn("no validation probe: dataset ", train->name(), " has no test split (give --test_data)");
    else test = data::datasets().build(held_out);
  }
  encoder->to(device);
  predictor->to(device);
  Built b;
  b.objective = std::make_shared<JEPAObjective>(encoder, predictor, obj_opts, test ? train : nullptr, test, classes);
  data::LoaderOptions lo = r.loader;
  lo.seed = r.seed;
  b.loader = std::make_shared<data::DataLoader>(train, lo);
  b.derived = {{"class_names", train->class_names()}, {"test_data", held_out}};
  b.summary = "training " + r.model.architecture + " (" + std::to_string(parameter_count(*encoder)) +
              " parameters) with jepa_predictor (" + std::to_string(parameter_count(*predictor)) + ") on " +
              train->name() + " (" + std::to_string(train->size()) + " items), " +
              std::to_string(encoder->grid().tokens()) + " tokens, batch " + std::to_string(lo.batch_size);
  return b;
}

// The "encoder." part of a run's weights, as the encoder's own names.
io::WeightSource encoder_weights(const std::string& run_dir, const OpenOptions& o, int64_t* step) {
  training::TensorMap all = run_weights(run_dir, o, step), enc;
  for (auto& [k, v] : all)
    if (k.rfind("encoder.", 0) == 0) enc[k.substr(8)] = v;
  return io::WeightSource::of_tensors(
      std::move(enc), run_dir + " step_" + std::to_string(*step) + " (" + o.weights + " encoder weights)");
}

}  // namespace

JEPAModels build_jepa_models(ModelSpec& model, ModelSpec& predictor, at::IntArrayRef sizes,
                             const std::string& data_name) {
  complete_models(model, predictor, sizes, data_name);
  // The encoder first: its initial weights are the first draws of the run's (seed, "init") generators,
  // which initial_jepa_encoder() replays.
  JEPAModels m;
  m.encoder = models::build_token_encoder(to_json(model));
  model = from_json<ModelSpec>(m.encoder->config());
  json& pf = predictor.fields;
  const json& ef = model.fields;
  for (const char* k : {"image_size", "patch_size", "frames", "tubelet_size"})
    if (!pf.contains(k) && ef.contains(k)) pf[k] = ef[k];
  if (!pf.contains("encoder_features")) pf["encoder_features"] = m.encoder->features();
  m.predictor = models::build_token_predictor(to_json(predictor));
  predictor = from_json<ModelSpec>(m.predictor->config());
  return m;
}

int64_t default_jepa_patch(int64_t image_size) {
  DEW_CHECK(
      image_size > 0 && image_size % 4 == 0, "model.fields.patch_size: not given, and the recipe cuts images into ",
      "4 x 4 tokens, which needs a side that is a multiple of 4, got ", image_size, "; give --model.fields.patch_size");
  return image_size / 4;
}

RunKind jepa_kind() {
  KindDefinition<JepaRecipe> k;
  k.name = "jepa";
  k.doc =
      "I-JEPA / V-JEPA representation learning (default: Fashion-MNIST images; --data moving_fashion_mnist for video)";
  k.defaults = jepa_defaults;
  k.open_keys = {"model.fields", "predictor.fields", "data", "test_data"};
  k.identity = {"model", "predictor", "seed", "data"};
  k.help = jepa_help;
  k.build = build_jepa;
  return make_run_kind(std::move(k));
}

JEPARun open_jepa_run(const std::string& run_dir, const OpenOptions& o) {
  JEPARun out;
  out.dir = run_dir;
  out.record = read_record_of_kind(run_dir, "jepa", "a JEPA run");
  const auto device = parse_device(o.device, "device");  // before the model is built
  out.encoder = models::build_token_encoder(out.record["model"]);
  out.encoder->to(device);
  io::load_weights(*out.encoder, encoder_weights(run_dir, o, &out.step));
  out.encoder->eval();
  return out;
}

std::shared_ptr<TokenEncoderImpl> initial_jepa_encoder(const json& record) {
  rng::DefaultGeneratorScope init(record.value("seed", uint64_t(0)), 0, "init");
  return models::build_token_encoder(record.at("model"));
}

ProbeOptions probe_options_of(const json& record) {
  const auto obj = from_json<JEPAObjectiveOptions>(record.value("objective", json::object()), "objective");
  ProbeOptions p;
  p.pool = obj.probe_pool;
  p.knn = {obj.knn_k, obj.knn_prep, obj.knn_vote, obj.knn_temperature};
  p.linear.epochs = obj.probe_epochs;
  return p;
}

ProbeReport probe_jepa_run(const std::string& run_dir, const ProbeOptions& p, const OpenOptions& o) {
  DEW_CHECK(p.train_items >= 0 && p.test_items >= 0, "probe: train_items and test_items must be >= 0, got ",
            p.train_items, " and ", p.test_items);
  DEW_CHECK(p.knn.k >= 1, "probe: knn_k must be >= 1, got ", p.knn.k);
  JEPARun run = open_jepa_run(run_dir, o);
  pool_regions(p.pool, run.encoder->grid(), "--pool");
  const json& r = run.record;
  auto train = data::datasets().build(r["data"]);
  const json held_out = held_out_data(r["data"], r.value("test_data", json()));
  DEW_CHECK(!held_out.is_null(), "probe: ", run_dir, " trained on ", r["data"].dump(),
            ", which has no test split; rerun with --test_data to name a held-out set");
  auto test = data::datasets().build(held_out);
  const int64_t classes = int64_t(train->class_names().size());
  DEW_CHECK(train->contains("label") && classes >= 2, "probe: dataset ", train->name(), " has no class labels");
  const auto first = [](const data::DatasetPtr& d, int64_t n) {
    if (n == 0 || n >= d->size()) return *d;
    return data::TensorDataset(
        {{"image", d->field("image").slice(0, 0, n)}, {"label", d->field("label").slice(0, 0, n)}}, d->name());
  };
  const data::TensorDataset tr = first(train, p.train_items), te = first(test, p.test_items);
  std::vector<ProbeRow> rows;
  auto add = [&](const std::string& name, TokenEncoderImpl* enc) {
    log::info("probing ", name, " features: ", tr.size(), " training / ", te.size(), " test items");
    const ProbeResult res = probe(enc, tr, te, classes, p.knn, p.linear, p.pool);
    rows.push_back({name, res.linear, res.knn});
  };
  add("trained (" + o.weights + ", step " + std::to_string(run.step) + ")", run.encoder.get());
  if (p.baselines) {
    auto init = initial_jepa_encoder(r);
    init->to(parse_device(o.device, "device"));
    add("initialisation", init.get());
    add("pixels", nullptr);
  }
  json out = {{"run", run_dir},           {"step", run.step},
              {"weights", o.weights},     {"pool", p.pool},
              {"train_items", tr.size()}, {"test_items", te.size()},
              {"knn_k", p.knn.k},         {"knn_prep", p.knn.prep},
              {"knn_vote", p.knn.vote},   {"knn_temperature", p.knn.temperature},
              {"rows", json::array()}};
  for (const auto& row : rows)
    out["rows"].push_back({{"features", row.features}, {"linear", row.linear}, {"knn", row.knn}});
  const fs::path dir = training::RunDir(run_dir).eval_dir();
  fs::create_directories(dir);
  const std::string file = (dir / ("probes_step_" + std::to_string(run.step) + ".json")).string();
  io::write_file_atomic(file, out.dump(2));
  return {rows, out, file};
}

}  // namespace dew::runs
