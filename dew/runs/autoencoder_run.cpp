// The `autoencoder` run kind and the opening and scoring of a trained autoencoder run.
#include "dew/runs/autoencoder_run.h"

#include "dew/core/device.h"
#include "dew/core/log.h"
#include "dew/core/threads.h"
#include "dew/data/dataset.h"
#include "dew/io/stops.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/runs/kinds.h"

namespace dew::runs {

namespace {

// The `autoencoder` recipe.
struct AutoencoderRecipe : RecipeBase {
  ModelSpec model;
  json data = json::object();
  json test_data = nullptr;
  AutoencoderObjectiveOptions objective;
  template <class V>
  void visit(V& v) {
    RecipeBase::visit(v);
    v("model", model, "the autoencoder (in_channels, out_channels and sample_size from the data unless given)");
    v("data", data, "the images: a source of `dew list datasets`");
    v("test_data", test_data, "the held-out set validation and `dew eval` reconstruct; null = the data, split test");
    v("objective", objective, "reconstruction + KL");
  }
};

// A small KL autoencoder on Fashion-MNIST padded to 32 x 32 (two 2x levels: 4 x 16 x 16 latents), sized
// for a 2-core CPU (docs/stable_diffusion.md has the measured run).
AutoencoderRecipe autoencoder_defaults() {
  AutoencoderRecipe r;
  r.run = "runs/fashion_vae";
  r.model = {"autoencoder_kl",
             {{"block_out_channels", {32, 64}}, {"layers_per_block", 1}, {"latent_channels", 4}, {"norm_groups", 8}}};
  r.data = {{"name", "fashion_mnist"}, {"split", "train"}, {"pad", 2}};
  r.loader.batch_size = 32;
  r.loader.num_workers = 1;
  r.optim.lr = 1e-3;
  r.optim.warmup_steps = 100;
  r.optim.weight_decay = 0.0;
  r.trainer.steps = 1500;
  r.trainer.log_every = 50;
  r.trainer.val_every = 500;
  r.trainer.checkpoint_every = 500;
  return r;
}

std::string autoencoder_help(const AutoencoderRecipe& recipe) {
  const std::string& arch = recipe.model.architecture;
  return "model fields (" + arch + "):\n" + format_fields(models::autoencoders().info(arch).fields, "  ") +
         "\nobjective fields:\n" + format_fields(fields_of<AutoencoderObjectiveOptions>(), "  ");
}

// Encodes zeros of one item's shape and decodes them: the autoencoder must give back the image's size.
void check_round_trip(AutoencoderImpl& ae, const std::vector<int64_t>& shape, const std::string& data_name) {
  at::NoGradGuard ng;
  std::vector<int64_t> probe = {1};
  probe.insert(probe.end(), shape.begin(), shape.end());
  const auto z = ae.encode(at::zeros(probe)).mean;
  const auto back = ae.decode(z);
  DEW_CHECK(back.sizes() == at::IntArrayRef(probe), "data: ", data_name, " images ", shape[1], "x", shape[2],
            " come back from the autoencoder as ", back.size(-2), "x", back.size(-1),
            "; pad or resize them to a multiple of its downsampling (", shape[1] / std::max<int64_t>(1, z.size(-2)),
            ", e.g. --data.pad 2 for Fashion-MNIST)");
}

Built build_autoencoder_run(AutoencoderRecipe& r, const c10::Device& device) {
  const std::string arch = r.model.architecture;
  DEW_CHECK(models::autoencoders().contains(arch), "model.architecture: unknown \"", arch, "\"; accepted: ", [] {
    std::string s;
    for (const auto& e : models::autoencoders().entries()) s += (s.empty() ? "" : ", ") + e.name;
    return s;
  }());
  set_threads(r.threads, Workload::kIntraOp);
  const AutoencoderObjectiveOptions& obj = r.objective;
  r.data = data_spec(r.data);
  auto train = data::datasets().build(r.data);
  DEW_CHECK(train->contains(obj.image_field), "objective.image_field: dataset ", train->name(), " has no field \"",
            obj.image_field, "\"");
  const auto sizes = train->field(obj.image_field).sizes();
  DEW_CHECK(sizes.size() == 4, "data: an autoencoder trains on images [N, C, H, W], dataset ", train->name(), " holds ",
            sizes);
  const std::vector<int64_t> shape(sizes.begin() + 1, sizes.end());
  json& f = r.model.fields;
  if (!f.is_object()) f = json::object();
  if (!f.contains("in_channels")) f["in_channels"] = shape[0];
  if (!f.contains("out_channels")) f["out_channels"] = shape[0];
  if (!f.contains("sample_size")) f["sample_size"] = shape[1];
  DEW_CHECK(f["in_channels"] == shape[0], "model.fields.in_channels: ", f["in_channels"].dump(), ", but dataset ",
            train->name(), " has ", shape[0], "-channel images");
  auto ae = models::build_autoencoder(to_json(r.model));
  r.model = from_json<ModelSpec>(ae->config());
  check_round_trip(*ae, shape, train->name());
  data::DatasetPtr test;
  const json held_out = held_out_data(r.data, r.test_data);
  if (obj.val_items > 0) {
    if (held_out.is_null())
      log::warn("no validation scores: dataset ", train->name(), " has no test split (give --test_data)");
    else test = data::datasets().build(held_out);
  }
  if (test)
    DEW_CHECK(test->contains(obj.image_field) && test->field(obj.image_field).sizes().slice(1) == sizes.slice(1),
              "test_data: its images must have the training images' shape ", sizes.slice(1));
  ae->to(device);
  Built b;
  b.objective = std::make_shared<AutoencoderObjective>(ae, obj, test);
  data::LoaderOptions lo = r.loader;
  lo.seed = r.seed;
  b.loader = std::make_shared<data::DataLoader>(train, lo);
  b.preview = ".png";
  b.derived = {{"sample_shape", shape}, {"test_data", held_out}};
  b.summary = "training " + arch + " (" + std::to_string(parameter_count(*ae)) + " parameters) on " + train->name() +
              " (" + std::to_string(train->size()) + " items), batch " + std::to_string(lo.batch_size);
  return b;
}

}  // namespace

RunKind autoencoder_kind() {
  KindDefinition<AutoencoderRecipe> k;
  k.name = "autoencoder";
  k.doc =
      "a KL autoencoder (autoencoder_kl) on images: reconstruction + KL, the first stage of latent diffusion "
      "(default: Fashion-MNIST padded to 32 x 32)";
  k.defaults = autoencoder_defaults;
  k.open_keys = {"model.fields", "data", "test_data"};
  k.identity = {"model", "seed", "data"};
  k.help = autoencoder_help;
  k.build = build_autoencoder_run;
  return make_run_kind(std::move(k));
}

AutoencoderRun open_autoencoder_run(const std::string& run_dir, const OpenOptions& o) {
  AutoencoderRun out;
  out.dir = run_dir;
  out.record = read_record_of_kind(run_dir, "autoencoder", "an autoencoder run");
  parse_device(o.device, "device");  // before the model is built
  const json derived = out.record.value("derived", json::object());
  DEW_CHECK(derived.contains("sample_shape") && derived["sample_shape"].is_array(), run_dir,
            "/run.json: missing sample_shape");
  out.image_shape = derived["sample_shape"].get<std::vector<int64_t>>();
  out.autoencoder = models::build_autoencoder(out.record["model"]);
  out.step = place_and_load(*out.autoencoder, run_dir, o);
  return out;
}

namespace {
// The first `items` (0 = all) images of the run's held-out set, as stored (uint8).
at::Tensor autoencoder_held_out_images(const AutoencoderRun& run, const std::string& run_dir, int64_t items) {
  DEW_CHECK(items >= 0, "count: must be >= 0 (0 = the whole held-out set), got ", items);
  const json held_out = held_out_data(run.record.at("data"), run.record.value("test_data", json()));
  DEW_CHECK(!held_out.is_null(), "eval: ", run_dir, " trained on ", run.record["data"].dump(),
            ", which has no test split; rerun the training with --test_data to name a held-out set");
  auto test = data::datasets().build(held_out);
  const std::string field = run.record.value("objective", json::object()).value("image_field", "image");
  const at::Tensor& all = test->field(field);
  return items > 0 ? all.slice(0, 0, std::min(items, all.size(0))) : all;
}
}  // namespace

ReconstructionScores score_autoencoder_run(const std::string& run_dir, const OpenOptions& o, int64_t items,
                                           int64_t* step) {
  DEW_CHECK(items >= 0, "count: must be >= 0 (0 = the whole held-out set), got ", items);
  AutoencoderRun run = open_autoencoder_run(run_dir, o);
  const at::Tensor images = autoencoder_held_out_images(run, run_dir, items);
  if (step) *step = run.step;
  log::info("reconstructing ", images.size(0), " held-out images of ", run_dir, " (step ", run.step, ")");
  return score_reconstructions(*run.autoencoder, images);
}

double lpips_autoencoder_run(const std::string& run_dir, metrics::LpipsImpl& lpips, const OpenOptions& o, int64_t items,
                             int64_t batch) {
  DEW_CHECK(batch >= 1, "lpips: batch must be >= 1, got ", batch);
  AutoencoderRun run = open_autoencoder_run(run_dir, o);
  const at::Tensor images = autoencoder_held_out_images(run, run_dir, items);
  DEW_CHECK(images.dim() == 4 && (images.size(1) == 1 || images.size(1) == 3), "lpips: ", run_dir,
            "'s held-out images are ", images.sizes(), "; LPIPS takes 1 (repeated) or 3 channels");
  DEW_CHECK(images.size(2) >= lpips.min_image_size() && images.size(3) >= lpips.min_image_size(), "lpips (net ",
            lpips.options.net(), "): ", run_dir, "'s held-out images are ", images.size(2), " x ", images.size(3),
            ", smaller than the backbone takes (", lpips.min_image_size(), " x ", lpips.min_image_size(),
            "; --lpips-net vgg takes 16 x 16)");
  at::NoGradGuard ng;
  lpips.eval();
  const c10::Device device = module_device(*run.autoencoder);
  lpips.to(device);
  double sum = 0;
  for (int64_t b = 0; b < images.size(0); b += batch) {
    io::check_stop();
    const at::Tensor x = data::to_model_range(images.slice(0, b, b + batch)).to(device);
    const at::Tensor x_hat = run.autoencoder->decode(run.autoencoder->encode(x).mean).to(at::kFloat).clamp(-1, 1);
    sum += lpips.forward(x_hat, x).to(at::kDouble).sum().item<double>();
  }
  return sum / double(images.size(0));
}

}  // namespace dew::runs
