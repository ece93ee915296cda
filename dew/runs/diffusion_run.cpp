// The `diffusion` run kind (class-conditional, unconditional or caption-conditional image and video
// diffusion) and the opening of a trained diffusion run.
#include "dew/runs/diffusion_run.h"

#include <filesystem>

#include <chrono>
#include <optional>

#include "dew/core/device.h"
#include "dew/core/log.h"
#include "dew/core/rng.h"
#include "dew/core/threads.h"
#include "dew/data/dataset.h"
#include "dew/interop/diffusers_forward.h"
#include "dew/io/weights.h"
#include "dew/runs/autoencoder_run.h"
#include "dew/runs/kinds.h"
#include "dew/runs/lora_run.h"
#include "dew/training/run_dir.h"

namespace fs = std::filesystem;

namespace dew::runs {

namespace {

// The `text_encoder` section: an encoder from `dew list text_encoders` that turns each label's caption
// (objective.caption_template) into the model's context; "none" = class labels.
struct TextEncoderSection {
  std::string architecture = "none";
  json fields = json::object();
  bool trainable = true;
  template <class V>
  void visit(V& v) {
    v("architecture", architecture, "a text encoder of `dew list text_encoders`, or none (class labels)");
    v("fields", fields, "the encoder's fields");
    v("trainable", trainable, "false freezes it (a pretrained clip_text with weights)");
  }
  json encoder_record() const { return {{"architecture", architecture}, {"fields", fields}}; }
};

// The `diffusion` recipe.
struct DiffusionRecipe : RecipeBase {
  ModelSpec model;
  json preset = json::object();
  TextEncoderSection text_encoder;
  std::string init_from;
  Omittable<LoraRecipe> lora;
  Omittable<AutoencoderSource> autoencoder;
  Omittable<LatentOptions> latent;
  json data = json::object();
  DiffusionObjectiveOptions objective;
  template <class V>
  void visit(V& v) {
    RecipeBase::visit(v);
    v("model", model, "the denoiser (channels, classes and context width from the data unless given)");
    v("preset", preset, "the diffusion process: a preset of `dew list presets` with its fields");
    v("text_encoder", text_encoder, "captions of the labels as the model's context (none = class labels)");
    v("init_from", init_from, "a run directory, a .safetensors file or a diffusers model folder to start from");
    v("lora", lora, "LoRA adapters on the init_from model (docs/lora.md); a run without adapters records none");
    v("autoencoder", autoencoder, "latent diffusion: the frozen autoencoder; a pixel run records none");
    v("latent", latent, "latent diffusion: how the latents are taken; a pixel run records none");
    v("data", data, "the images: a source of `dew list datasets`");
    v("objective", objective, "the diffusion objective, validation sampling and EMA");
  }
};

// The default recipe: class-conditional diffusion on Fashion-MNIST, sized for a 2-core CPU.
DiffusionRecipe diffusion_defaults() {
  DiffusionRecipe r;
  r.run = "runs/fashion_mnist";
  r.model = {"unet",
             {{"emb_features", 64},
              {"feature_depths", {32, 64}},
              {"attention_configs", {nullptr, nullptr}},
              {"num_res_blocks", 1},
              {"num_middle_res_blocks", 1},
              {"norm_groups", 8}}};
  // flow beat edm (pixel) at the same 2400 steps: accuracy 0.950 vs 0.936, Frechet distance 26.3 vs 33.7
  // (euler, 20 steps, guidance 3; docs/training.md has the table).
  r.preset = {{"name", "flow"}};
  // A run directory, a .safetensors file or a diffusers model folder (e.g. a pipeline's unet/, whose config.json
  // then sets model.architecture and model.fields) to start the model from (unet -> unet_3d inflates).
  r.init_from = "";
  // LoRA adapters on the init_from model (docs/lora.md): empty targets = every parameter trains.
  r.lora = LoraRecipe{};
  // Latent diffusion: the frozen autoencoder (a `dew train autoencoder` run or a diffusers AutoencoderKL
  // folder; both empty = pixel space) and how its latents are taken. A pixel run's record has neither.
  r.autoencoder = AutoencoderSource{};
  r.latent = LatentOptions{};
  r.data = {{"name", "fashion_mnist"}, {"split", "train"}};
  r.loader.batch_size = 32;
  r.loader.num_workers = 1;
  r.optim.lr = 2e-3;  // measured against 1e-3: accuracy 0.937 vs 0.923 after 2400 steps (docs/diffusion.md)
  r.optim.warmup_steps = 100;
  r.optim.weight_decay = 0.0;
  r.trainer.steps = 2400;  // about what 12 minutes fit on a 2-core CPU (2 threads), so the cosine decay completes
  r.trainer.log_every = 100;
  r.trainer.checkpoint_every = 500;
  r.trainer.time_limit_minutes = 0;
  r.objective.ema_decay = 0.995;
  r.objective.sampler = "euler";
  r.objective.steps = 30;
  r.objective.guidance.scale = 3.0;
  return r;
}

// Fills the data-dependent model fields the architecture has: in/output channels, class count and the
// width of the text context and pooled text vector (a text run conditions on captions, so its model takes no
// labels).
json complete_model_fields(const std::string& arch, json fields, int64_t channels, int64_t num_classes,
                           int64_t context_features) {
  for (const auto& f : models::registry().info(arch).fields) {
    if ((f.name == "in_channels" || f.name == "output_channels") && !fields.contains(f.name)) fields[f.name] = channels;
    if (f.name == "num_classes" && !fields.contains(f.name)) fields[f.name] = context_features > 0 ? 0 : num_classes;
    if (f.name == "context_features" && !fields.contains(f.name) && context_features > 0)
      fields[f.name] = context_features;
    // The text encoder's pooled vector has the context's width (SD3's pooled_projections).
    if (f.name == "pooled_projection_dim" && !fields.contains(f.name) && context_features > 0)
      fields[f.name] = context_features;
  }
  return fields;
}

// The run's text encoder, or null when the section says "none"; frozen unless "trainable".
TextEncoderPtr build_text_encoder(const TextEncoderSection& section) {
  if (section.architecture == "none") return nullptr;
  auto enc = text_encoders::build(section.encoder_record());
  if (!section.trainable)
    for (auto& p : enc->parameters()) p.set_requires_grad(false);
  return enc;
}

// Starts `model` (architecture `arch`) from a run directory (its checkpoint `step`, EMA weights) or a
// .safetensors file, strictly (LoRA adapters already attached excepted); a family that inflates another's
// weights (unet_3d from a 2D unet) reads them through its inflation key map (what it adds stays at its
// initialisation).
void init_model_from(BackboneImpl& model, const std::string& arch, const std::string& source, int64_t step) {
  if (interop::is_model_folder(source)) {
    // A diffusers folder: its names through the family's key map. The folder holds the denoiser alone: a text
    // encoder in the model's tree has its own weights (its fields), adapters theirs.
    const auto weights = io::WeightSource::open(source);
    io::KeyMap map = models::family(arch).reference_key_map(model.config()["fields"], weights);
    map.allow_missing(R"(.*\.lora_[AB]\.weight)").allow_missing(R"(text_encoder\..*)");
    io::LoadOptions lo;
    lo.require_buffers = false;
    log::info("init_from ", source, ": ", io::load_weights(model, weights, map, lo).summary());
    return;
  }
  OpenOptions o;
  o.step = step;
  const auto weights = fs::is_directory(source) ? run_weight_source(source, o) : io::WeightSource::open(source);
  const models::Family& family = models::family(arch);
  io::KeyMap map = lora_base_key_map();
  io::LoadOptions lo;
  if (family.inflation_map) {
    map = family.inflation_map();
    lo.require_buffers = false;
  }
  auto report = io::load_weights(model, weights, map, lo);
  log::info("init_from ", source, ": ",
            family.inflation_map ? family.inflates_from + " inflated into " + arch + ", " : std::string(),
            report.summary());
}

// Whether the recipe names an autoencoder (latent diffusion).
bool is_latent(const DiffusionRecipe& r) {
  return r.autoencoder && (!r.autoencoder->run.empty() || !r.autoencoder->folder.empty());
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out;
  for (auto d : s) out += (out.empty() ? "" : "x") + std::to_string(d);
  return out;
}

// The frozen autoencoder of a latent recipe (resolving autoencoder.step -1 to the step it opens) and the
// latent shape of the data's images. The autoencoder is built under its own generators, so the model's
// initialisation does not depend on whether the run is latent.
LatentSpacePtr open_latent_space(DiffusionRecipe& r, const c10::Device& device) {
  AutoencoderSource& src = *r.autoencoder;
  if (!r.latent) r.latent = LatentOptions{};
  validate(*r.latent);
  int64_t step = -1;
  std::shared_ptr<AutoencoderImpl> ae;
  {
    rng::DefaultGeneratorScope own(uint64_t(r.seed), 0, "autoencoder/init");
    ae = open_autoencoder_source(src, device, &step);
  }
  if (!src.run.empty()) src.step = step;
  return std::make_shared<LatentSpace>(ae, *r.latent, LatentScaling{});
}

// The latent scaling a run started from `init_from` (a dew diffusion run) keeps under latent.scale auto: the
// base's own, when the base saw latents of the same autoencoder (its record's section equals `autoencoder`),
// so the fine-tuned model is fed latents on the scale it learned, not one estimated anew from other data.
std::optional<LatentScaling> base_latent_scaling(const std::string& init_from, const json& autoencoder) {
  const json base = read_record(init_from);
  const json scaling = base.value(json::json_pointer("/derived/latent_scaling"), json());
  if (!scaling.is_object() || base.value("autoencoder", json()) != autoencoder) return std::nullopt;
  return LatentScaling::from_json(scaling, init_from + "/run.json derived.latent_scaling");
}

// Fixes the scaling of the latents (`inherited`, a fine-tuned base's; else LDM's scale_by_std from the first
// scale_items images when the autoencoder is a dew run (`from_run`), or the autoencoder's own) and, with latent.cache, encodes every image once: the returned
// dataset holds "latent" (float32 [N, c, h, w], what the denoiser sees) in place of the images. Deterministic:
// posterior samples draw from (seed, "latents/cache") and, for the scale without a cache, (seed, "latents/scale").
data::DatasetPtr prepare_latents(LatentSpace& space, uint64_t seed, bool from_run, const data::DatasetPtr& dataset,
                                 const std::string& image_field, const std::optional<LatentScaling>& inherited) {
  const LatentOptions& o = space.options();
  const std::string mode = o.scale == "auto" ? (inherited ? "inherited" : from_run ? "std" : "autoencoder") : o.scale;
  const at::Tensor& images = dataset->field(image_field);
  at::Tensor z;
  if (o.cache) {
    const auto t0 = std::chrono::steady_clock::now();
    z = space.encode_raw_all(images, rng::generator(seed, 0, "latents/cache"));
    log::info("latent.cache: encoded ", images.size(0), " images into latents ", shape_text(z.sizes().slice(1).vec()),
              " in ", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), " s");
  }
  if (mode == "inherited") {
    space.set_scaling(*inherited);
  } else if (mode == "std") {
    const int64_t k = std::min(o.scale_items, images.size(0));
    space.set_scaling(scaling_by_std(
        z.defined() ? z.slice(0, 0, k)
                    : space.encode_raw_all(images.slice(0, 0, k), rng::generator(seed, 0, "latents/scale"))));
  } else {
    space.set_scaling(LatentScaling{});
  }
  if (!o.cache) return dataset;
  data::Batch fields;
  for (const auto& [name, t] : dataset->fields())
    if (name != image_field) fields[name] = t;
  fields[DiffusionObjective::kLatentField] = space.to_latent(z).contiguous();
  auto cached = std::make_shared<data::TensorDataset>(std::move(fields), dataset->name());
  cached->set_class_names(dataset->class_names());
  cached->set_spec(dataset->spec());
  return cached;
}

std::string diffusion_help(const DiffusionRecipe& recipe) {
  const std::string& arch = recipe.model.architecture;
  return "model fields (" + arch + "):\n" + format_fields(models::registry().info(arch).fields, "  ") +
         "\nlora fields (docs/lora.md):\n" + format_fields(fields_of<LoraRecipe>(), "  ") +
         "\n(dew models lists every architecture; dew list presets/solvers the rest.)\n";
}

Built build_diffusion(DiffusionRecipe& r, const c10::Device& device) {
  // init_from a diffusers model folder: the model is that folder's (architecture and fields from its config.json).
  const std::string init_from = r.init_from;
  const bool from_folder = interop::is_model_folder(init_from);
  if (from_folder) {
    const auto spec = interop::diffusers_model_spec(init_from);
    DEW_CHECK(models::registry().contains(spec.family), "init_from: ", init_from, " holds a ", spec.class_name, " (",
              spec.family, "), which is not a denoiser");
    r.model = {spec.family, spec.fields};
    log::info("init_from ", init_from, ": model ", spec.family, " from its config.json (", spec.class_name, ")");
  }
  const std::string arch = r.model.architecture;
  DEW_CHECK(models::registry().contains(arch), "model.architecture: unknown \"", arch, "\"; registered: ", [] {
    std::string s;
    for (const auto& n : models::registry().names()) s += (s.empty() ? "" : ", ") + n;
    return s;
  }());
  set_threads(r.threads, workload_of(arch));
  const data::LoaderOptions& lo = r.loader;
  const DiffusionObjectiveOptions& obj_opts = r.objective;
  auto preset = diffusion::presets().build(r.preset);
  auto text_encoder = build_text_encoder(r.text_encoder);
  int64_t init_step = -1;  // fixed now: the run it starts from may go on training
  if (!init_from.empty()) {
    DEW_CHECK(fs::is_directory(init_from) || fs::is_regular_file(init_from), "init_from: ", init_from,
              " is neither a run directory nor a file");
    if (fs::is_directory(init_from) && !from_folder)
      init_step = training::latest_checkpoint(init_from);  // it must hold one
  }
  const auto lora = lora_options_of(r.lora, init_from);
  // The adapters' base is the folder's denoiser and, in the model's tree, the text encoder: one that loads its
  // weights (fields.weights) is rebuilt from them to open the run; one initialised at random could not be.
  const json& te_fields = r.text_encoder.fields;
  DEW_CHECK(!lora || !from_folder || !text_encoder ||
                (te_fields.is_object() && te_fields.value("weights", json("")) != json("")),
            "lora: init_from ", init_from, " gives the denoiser's weights; the text encoder ",
            r.text_encoder.architecture,
            " must load its own (text_encoder.fields.weights), or the adapters' base could not be rebuilt");
  DEW_CHECK(!lora || !models::family(arch).inflation_map, "lora: ", arch, " starts from ",
            models::family(arch).inflates_from,
            " weights inflated (init_from), which are not its own base weights; LoRA needs a base of the "
            "same architecture");
  auto dataset = data::datasets().build(r.data);
  const int64_t num_classes = dataset->contains(obj_opts.label_field) ? int64_t(dataset->class_names().size()) : 0;
  DEW_CHECK(!text_encoder || num_classes > 0, "text_encoder: captions are made from class labels, but dataset ",
            dataset->name(), " has no \"", obj_opts.label_field, "\" field");
  DEW_CHECK(dataset->contains(obj_opts.image_field), "objective.image_field: dataset ", dataset->name(),
            " has no field \"", obj_opts.image_field, "\"");
  auto sizes = dataset->field(obj_opts.image_field).sizes();
  const std::vector<int64_t> image_shape(sizes.begin() + 1, sizes.end());
  std::vector<int64_t> shape = image_shape;  // what the model sees: the images, or their latents
  LatentSpacePtr latent;
  if (is_latent(r)) {
    latent = open_latent_space(r, device);
    shape = latent->latent_shape(image_shape, "autoencoder");
    DEW_CHECK(!latent->options().cache || !lo.augments(),
              "loader.hflip / loader.crop_padding / loader.crop_scale: latent.cache encodes the images once, without "
              "augmentation (set --latent.cache false to augment them as they are encoded)");
  } else {
    // A pixel run's record keeps its old shape (and old runs resume): no latent sections.
    if (r.latent) validate(*r.latent);
    r.autoencoder.reset();
    r.latent.reset();
  }
  r.model.fields = complete_model_fields(arch, r.model.fields.is_object() ? r.model.fields : json::object(), shape[0],
                                         num_classes, text_encoder ? text_encoder->features() : 0);
  if (latent) {
    const json& f = r.model.fields;
    const std::string from = r.autoencoder->run.empty() ? "autoencoder.folder " + r.autoencoder->folder
                                                        : "autoencoder.run " + r.autoencoder->run;
    for (const char* k : {"in_channels", "output_channels"})
      if (f.contains(k))
        DEW_CHECK(f[k] == shape[0], "model.fields.", k, ": ", f[k].dump(), ", but the latents of ", from, " have ",
                  shape[0], " channels (", shape_text(shape), ")");
  }
  auto model = models::build(arch, r.model.fields);
  DEW_CHECK(!model->requires_text() || text_encoder, "model ", arch,
            " needs a text context: add --text_encoder.architecture byte_text_encoder (or clip_text)");

  data::LoaderOptions loader = lo;
  loader.seed = r.seed;
  Built b;
  b.loader = std::make_shared<data::DataLoader>(dataset, loader);
  b.objective = std::make_shared<DiffusionObjective>(model, *preset, obj_opts, num_classes, shape, text_encoder,
                                                     dataset->class_names(), latent);
  model->to(device);  // with the text encoder the objective attached to its tree
  json lora_record = nullptr;
  if (lora)  // after the objective attached the text encoder (its layers may be targets), before any weight loads
    lora_record = apply_lora_to_run(*model, *lora,
                                    from_folder      ? lora_base("diffusers", init_from, -1, to_json(r.text_encoder))
                                    : init_step >= 0 ? lora_base("run", init_from, init_step)
                                                     : lora_base("file", init_from));
  b.preview = ".png";
  b.derived = {{"sample_shape", shape}, {"class_names", dataset->class_names()}};
  b.summary = "training " + arch + " (" + std::to_string(parameter_count(*model)) + " parameters) on " +
              dataset->name() + " (" + std::to_string(dataset->size()) + " items), preset " + preset->name +
              ", batch " + std::to_string(lo.batch_size);
  if (latent) {
    // Every field is checked by now; the encoding of the training set comes last.
    const auto inherited =
        init_step >= 0 ? base_latent_scaling(init_from, to_json(*r.autoencoder)) : std::optional<LatentScaling>{};
    b.loader =
        std::make_shared<data::DataLoader>(prepare_latents(*latent, uint64_t(r.seed), !r.autoencoder->run.empty(),
                                                           dataset, obj_opts.image_field, inherited),
                                           loader);
    b.derived["image_shape"] = image_shape;
    b.derived["latent_scaling"] = latent->scaling().to_json();
    b.derived["autoencoder"] = latent->autoencoder().config();
    b.summary += ", latents " + shape_text(shape) + " of the frozen " +
                 latent->autoencoder().config().value("architecture", std::string("autoencoder")) + " (" +
                 std::to_string(parameter_count(latent->autoencoder())) + " parameters, scale " +
                 std::to_string(latent->scaling().scaling_factor) + (inherited ? " of init_from" : "") +
                 (latent->options().cache ? ", cached" : "") + ")";
  }
  if (!init_from.empty())
    b.init_weights = [model, arch, init_from, init_step] { init_model_from(*model, arch, init_from, init_step); };
  if (lora) {
    b.lora = lora_record;
    b.derived["lora"] = b.lora;
    b.summary += ", LoRA on " + b.lora["adapted"].dump() + " modules (" + b.lora["trainable"].dump() +
                 " trainable parameters, the base's " + b.lora["frozen"].dump() + " frozen)";
  }
  return b;
}

}  // namespace

std::shared_ptr<AutoencoderImpl> open_autoencoder_source(const AutoencoderSource& s, const c10::Device& device,
                                                         int64_t* step) {
  DEW_CHECK(s.run.empty() != s.folder.empty(),
            "autoencoder: give one of run (a dew autoencoder run) and folder (a "
            "diffusers AutoencoderKL folder), got run \"",
            s.run, "\" and folder \"", s.folder, "\"");
  if (!s.run.empty()) {
    DEW_CHECK(training::RunDir::holds_run(s.run), "autoencoder.run: ", s.run,
              " is not a run directory (no run.json; train one with `dew train autoencoder --run ", s.run, "`)");
    OpenOptions o;
    o.weights = s.weights;
    o.step = s.step;
    o.device = device.str();
    try {
      auto run = open_autoencoder_run(s.run, o);
      if (step) *step = run.step;
      return run.autoencoder;
    } catch (const Error& e) {
      fail("autoencoder.run: ", e.what());
    }
  }
  DEW_CHECK(fs::is_directory(s.folder), "autoencoder.folder: ", s.folder, " is not a directory");
  interop::DiffusersLoadOptions lo;
  lo.device = device;
  try {
    return interop::load_diffusers_folder(s.folder, lo).autoencoder();
  } catch (const Error& e) {
    fail("autoencoder.folder: ", e.what());
  }
}

RunKind diffusion_kind() {
  KindDefinition<DiffusionRecipe> k;
  k.name = "diffusion";
  k.doc = "diffusion / flow matching on images or video (default: class-conditional Fashion-MNIST)";
  k.defaults = diffusion_defaults;
  k.open_keys = {"model.fields", "preset", "data", "text_encoder.fields"};
  k.identity = {"model", "text_encoder", "seed", "data", "preset", "autoencoder", "latent", "lora"};
  k.help = diffusion_help;
  k.build = build_diffusion;
  return make_run_kind(std::move(k));
}

DiffusionRun open_diffusion_run(const std::string& run_dir, const OpenOptions& o) {
  DiffusionRun out;
  out.dir = run_dir;
  out.record = read_record_of_kind(run_dir, "diffusion", "a diffusion run");
  const json& r = out.record;
  parse_device(o.device, "device");  // before the model is built
  const json derived = r.value("derived", json::object());
  DEW_CHECK(derived.contains("sample_shape") && derived["sample_shape"].is_array(), run_dir,
            "/run.json: missing sample_shape");
  out.shape = derived["sample_shape"].get<std::vector<int64_t>>();
  out.class_names = derived.value("class_names", std::vector<std::string>{});
  out.model = models::build(r["model"]["architecture"], r["model"]["fields"]);
  if (auto enc = build_text_encoder(
          from_json<TextEncoderSection>(r.value("text_encoder", json::object()), run_dir + "/run.json text_encoder"))) {
    attach_text_encoder(*out.model, enc);
    out.text = std::make_shared<TextConditioner>();
    out.text->encoder = enc;
    out.text->class_names = out.class_names;
    out.text->caption_template = r["objective"].value("caption_template", out.text->caption_template);
  }
  out.step = place_and_load(*out.model, run_dir, o);
  out.process = std::make_shared<diffusion::DiffusionProcess>(*diffusion::presets().build(r["preset"]));
  out.num_classes = r["model"]["fields"].value("num_classes", int64_t(0));
  out.image_shape = out.shape;
  if (r.contains("autoencoder")) {
    const std::string where = run_dir + "/run.json";
    const auto src = from_json<AutoencoderSource>(r["autoencoder"], where + " autoencoder");
    const auto options = from_json<LatentOptions>(r.value("latent", json::object()), where + " latent");
    const auto scaling =
        LatentScaling::from_json(derived.value("latent_scaling", json()), where + " derived.latent_scaling");
    DEW_CHECK(derived.contains("image_shape") && derived["image_shape"].is_array(), where, ": missing image_shape");
    out.image_shape = derived["image_shape"].get<std::vector<int64_t>>();
    out.latent =
        std::make_shared<LatentSpace>(open_autoencoder_source(src, parse_device(o.device, "device")), options, scaling);
  }
  return out;
}

}  // namespace dew::runs
