// `dew train KIND`, `dew sample RUN`, `dew eval RUN`, `dew models`: flags in, a library call, a report out.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "dew/cli/commands.h"
#include "dew/cli/help.h"
#include "dew/cli/recipe.h"
#include "dew/core/device.h"
#include "dew/core/threads.h"
#include "dew/io/files.h"
#include "dew/io/image.h"
#include "dew/metrics/clip_score.h"
#include "dew/metrics/fashion_classifier.h"
#include "dew/metrics/inception.h"
#include "dew/metrics/metrics.h"
#include "dew/nn/backbones/causal_transformer.h"
#include "dew/runs/diffusion_run.h"
#include "dew/runs/post_training_run.h"
#include "dew/training/run_dir.h"

namespace fs = std::filesystem;

namespace dew::cli {

namespace {

std::string kind_list() {
  std::string out;
  for (const auto& k : runs::run_kinds()) out += (out.empty() ? "" : ", ") + k;
  return out;
}

// --clip DIR: the CLIP scorer (a transformers CLIPModel folder) for a caption-conditioned run, loaded before any
// sampling; null without the flag.
std::unique_ptr<metrics::ClipScorer> clip_scorer_from_flags(const Flags& f, const runs::DiffusionRun& run) {
  if (!f.has("clip")) return nullptr;
  DEW_CHECK(run.text != nullptr, "--clip: ", run.dir,
            " is class-conditional; CLIP score needs a caption-conditioned (text) run");
  return std::make_unique<metrics::ClipScorer>(f.get("clip", ""));
}

}  // namespace

int cmd_train(const std::vector<std::string>& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    std::cout << train_usage();
    return 0;
  }
  DEW_CHECK(!args.empty(), "train: expected a kind: ", kind_list(), " (dew train --help)");
  const runs::RunKind& kind = runs::run_kind(args[0]);
  const json defaults = kind.defaults();
  auto parsed = parse_recipe_args(defaults, std::vector<std::string>(args.begin() + 1, args.end()), kind.open_keys);
  if (parsed.help) {
    std::cout << "usage: dew train " << kind.name << " [--config run.json] [--a.b value ...]\n"
              << kind.doc << "\n\nfields and defaults:\n"
              << format_tree(defaults)
              << (defaults.contains("trainer")
                      ? "  --tensorboard off   short for --trainer.tensorboard off: no TensorBoard "
                        "event files (RUN/tensorboard, docs/tensorboard.md)\n"
                        "  --strict-resume     short for --trainer.strict_resume true: refuse to resume when the "
                        "latest checkpoint is damaged (docs/reliability.md)\n"
                      : "")
              << "\n"
              << kind.help(defaults);
    return 0;
  }
  DEW_CHECK(parsed.positional.empty(), "train ", kind.name, ": unexpected argument \"", parsed.positional[0], "\"");
  auto run = runs::prepare(kind.name, parsed.recipe);  // every field checked; nothing written yet
  auto res = runs::train(run);
  if (run.dist_env.rank != 0) return 0;  // a data-parallel run's report is rank 0's
  const training::RunDir dir(run.options.run);
  std::cout << "run:        " << dir.path() << "\n"
            << "checkpoint: " << res.last_checkpoint << "\n"
            << "metrics:    " << dir.metrics() << "\n";
  const std::string preview = run.built.preview.empty() ? "" : dir.sample(res.step, run.built.preview);
  if (!preview.empty() && std::filesystem::exists(preview)) std::cout << "preview:    " << preview << "\n";
  std::cout << "steps:      " << res.step << (res.interrupted ? " (stopped early)" : "") << "\n";
  if (res.stopped_by_signal)
    std::cout << "stopped by a signal after step " << res.step << ", checkpointed; rerun the same command to resume\n";
  for (const auto& [k, v] : res.last_metrics)
    if (k.rfind("val/", 0) == 0) std::cout << k << ": " << v << "\n";
  return 0;
}

int cmd_sample(const std::vector<std::string>& args) {
  if (asks_help(args)) {
    std::cout << sample_usage();
    return 0;
  }
  for (const auto& a : args)
    if (a == "--pipeline" || a.rfind("--pipeline=", 0) == 0) return cmd_sample_pipeline(args);
  auto f = parse_flags(args, {"solver", "steps", "guidance", "interval", "rescale", "labels", "prompt", "count", "seed",
                              "weights", "out", "nrow", "threads", "eta", "churn", "step", "device"});
  DEW_CHECK(f.positional.size() == 1, "sample: expected one RUN directory, got ", f.positional.size(), " arguments");
  const auto open = open_options(f);
  const std::string& weights = open.weights;
  auto run = runs::open_diffusion_run(f.positional[0], open);
  set_threads(f.get_int("threads", 0), workload_of(run.model->config().value("architecture", "")));
  DiffusionSampleOptions g;
  g.shape = run.shape;
  g.solver = f.get("solver", "euler");
  g.steps = f.get_int("steps", 30);
  g.seed = uint64_t(f.get_int("seed", 0));
  g.text = run.text.get();
  const int64_t classes = run.conditioning_classes();
  g.guidance.scale = f.get_double("guidance", classes > 0 || run.text ? 3.0 : 1.0);
  g.guidance.rescale = f.get_double("rescale", 0.0);
  if (f.has("eta")) g.solver_fields["eta"] = f.get_double("eta", 0);
  if (f.has("churn")) g.solver_fields["s_churn"] = f.get_double("churn", 0);
  if (f.has("interval")) {
    auto s = f.get("interval", "");
    auto comma = s.find(',');
    DEW_CHECK(comma != std::string::npos, "--interval: expected START,STOP, got \"", s, "\"");
    try {
      g.guidance.start = std::stod(s.substr(0, comma));
      g.guidance.stop = std::stod(s.substr(comma + 1));
    } catch (const std::exception&) {
      fail("--interval: expected two numbers START,STOP, got \"", s, "\"");
    }
  }
  int64_t nrow = 8;
  const bool video = run.shape.size() == 4;
  if (f.has("prompt")) {
    DEW_CHECK(run.text, "--prompt: ", f.positional[0], " has no text encoder (it was trained on labels; use --labels)");
    DEW_CHECK(!f.has("labels"), "--prompt and --labels: give one of them");
    g.count = f.get_int("count", video ? 4 : 16);
    DEW_CHECK(g.count >= 1, "--count: must be >= 1, got ", g.count);
    g.prompts.assign(size_t(g.count), f.get("prompt", ""));
  } else if (classes > 0) {
    // The label list (all classes by default) repeated to fill --count; one grid row per repetition.
    std::vector<int64_t> list;
    const std::string spec = f.get("labels", "all");
    if (spec == "all") {
      for (int64_t c = 0; c < classes; ++c) list.push_back(c);
    } else {
      std::stringstream ss(spec);
      std::string item;
      while (std::getline(ss, item, ',')) {
        int64_t c = -1;
        try {
          c = std::stoll(item);
        } catch (const std::exception&) {}
        DEW_CHECK(c >= 0 && c < classes, "--labels: \"", item, "\" is not a class id in [0, ", classes, ")");
        list.push_back(c);
      }
    }
    const int64_t n = int64_t(list.size());
    const int64_t reps = f.get_int("count", n * (video ? 1 : 4)) / n;
    DEW_CHECK(reps >= 1, "--count: must be at least the number of labels ", n);
    std::vector<int64_t> labels;
    for (int64_t i = 0; i < reps; ++i) labels.insert(labels.end(), list.begin(), list.end());
    nrow = n;
    g.labels = at::tensor(labels, at::TensorOptions().dtype(at::kLong));
    g.count = int64_t(labels.size());
  } else {
    g.count = f.get_int("count", 64);
  }
  nrow = f.get_int("nrow", nrow);
  DEW_CHECK(nrow >= 1, "--nrow: must be >= 1, got ", nrow);
  validate(g, *run.process);  // before the sampling work
  g.clamp = !run.latent;      // a latent run's samples are decoded
  std::cout << "sampling " << g.count << (video ? " videos" : " samples") << " from " << f.positional[0] << " step "
            << run.step << " (Ctrl-C stops without writing them)" << std::endl;
  auto images = run.images(sample_diffusion(*run.model, *run.process, g)).cpu();
  const std::string out = f.get("out", (fs::path(training::RunDir(f.positional[0]).samples()) /
                                        ("sample_step_" + std::to_string(run.step) + ".png"))
                                           .string());
  if (fs::path(out).has_parent_path()) fs::create_directories(fs::path(out).parent_path());
  save_samples(out, images, nrow);
  std::cout << "wrote " << g.count << (video ? " videos" : " samples") << " (" << g.solver << ", " << g.steps
            << " steps, guidance " << g.guidance.scale << ", " << weights << " weights of step " << run.step << ") to "
            << out << (video ? " (one video per row) and its animated .gif" : "") << "\n";
  return 0;
}

int cmd_eval(const std::vector<std::string>& args) {
  if (asks_help(args)) {  // with or without RUN: every kind's flags
    std::cout << eval_usage();
    return 0;
  }
  // A diffusers pipeline folder scored by CLIP: no run, nothing written.
  if (std::find(args.begin(), args.end(), "--pipeline") != args.end()) return cmd_eval_pipeline(args);
  // eval writes into the run (eval.jsonl, eval/): one writer at a time, as training is.
  std::unique_ptr<io::FileLock> lock;
  // A JEPA run is probed, a language-model run scored on prompts; a diffusion run is sampled.
  if (!args.empty() && args[0].rfind("--", 0) != 0 && training::RunDir::holds_run(args[0])) {
    lock = training::RunDir(args[0]).lock_for_writing();
    const std::string kind = runs::read_record(args[0]).value("kind", "");
    if (kind == "jepa") return cmd_eval_jepa(args);
    if (kind == "autoencoder") return cmd_eval_autoencoder(args);
    const auto& lm = runs::language_model_kinds();
    if (std::find(lm.begin(), lm.end(), kind) != lm.end()) return cmd_eval_policy(args);
  }
  auto f = parse_flags(args,
                       {"solvers", "steps", "guidance", "count", "seed", "weights", "threads", "batch", "step",
                        "device", "clip", "inception", "fid-ref", "fid-mode"},
                       {"classifier"});
  DEW_CHECK(f.has("classifier") || f.positional.size() == 1, "eval: expected one RUN directory (or --classifier), got ",
            f.positional.size(), " arguments");
  // Everything is checked before the classifier trains (minutes, once) or a sample is drawn.
  std::optional<runs::DiffusionRun> run;
  std::vector<DiffusionSampleOptions> plans;
  int64_t pad = 0;  // pixels cropped from every side of the samples
  const int64_t count = f.get_int("count", 1000);
  if (!f.has("classifier")) {
    const std::string dir = f.positional[0];
    if (!lock && training::RunDir::holds_run(dir)) lock = training::RunDir(dir).lock_for_writing();
    run = runs::open_diffusion_run(dir, open_options(f));
    // Fashion-MNIST padded to 32 x 32 (a latent run's VAE size) is cropped back for the classifier.
    const json data = run->record.value("data", json::object());
    pad = data.is_object() && data.value("name", "") == "fashion_mnist" ? data.value("pad", int64_t(0)) : 0;
    DEW_CHECK(
        run->conditioning_classes() == 10 && run->image_shape == std::vector<int64_t>({1, 28 + 2 * pad, 28 + 2 * pad}),
        "eval: ", dir, " is not a class- or caption-conditional 1x28x28 Fashion-MNIST run (classes ",
        run->conditioning_classes(), ")");
    DEW_CHECK(count >= 10 && count % 10 == 0 && count <= 60000,
              "--count: must be a positive multiple of 10 of at most 60000 (the training images the floor uses), got ",
              count);
    std::stringstream ss(f.get("solvers", "euler"));
    std::string solver;
    while (std::getline(ss, solver, ',')) {
      DiffusionSampleOptions g;
      g.shape = run->shape;
      g.solver = solver;
      g.steps = f.get_int("steps", 30);
      g.seed = uint64_t(f.get_int("seed", 0));
      g.guidance.scale = f.get_double("guidance", 3.0);
      g.batch_size = f.get_int("batch", 100);
      g.count = count;
      g.labels = at::arange(10).repeat({count / 10});
      g.text = run->text.get();  // text runs: the labels' captions
      g.clamp = !run->latent;
      try {
        validate(g, *run->process);
      } catch (const Error& e) {
        fail("--solvers: ", e.what());
      }
      plans.push_back(g);
    }
    DEW_CHECK(!plans.empty(), "--solvers: expected a comma-separated list of solvers (dew list solvers)");
  }
  // FID (Inception) when its weights are given or cached: every file and count is checked here, before the
  // classifier trains or any feature is extracted.
  const bool fid_asked = f.has("inception") || f.has("fid-ref") || f.has("fid-mode");
  const std::string inception_path = metrics::find_inception(f.get("inception", ""));
  const auto fid_mode = metrics::fid_mode_from_string(f.get("fid-mode", "pytorch-fid"));
  bool fid = run && (fid_asked || !inception_path.empty());
  if (fid && count <= metrics::kInceptionDims) {
    if (fid_asked) metrics::check_fid_count(count, metrics::kInceptionDims, "--count");
    std::cout << "FID (Inception) skipped: --count " << count << " gives a singular covariance of its "
              << metrics::kInceptionDims << "-d features (needs at least " << metrics::kInceptionDims + 1 << ")\n";
    fid = false;
  }
  metrics::InceptionV3 inception{nullptr};
  std::optional<metrics::FidStats> fid_ref;
  const std::string fid_ref_arg = f.get("fid-ref", "");
  if (fid) {
    inception = metrics::load_inception(inception_path);  // refuses a missing or wrong file by name
    if (!fid_ref_arg.empty() && std::filesystem::path(fid_ref_arg).extension() == ".npz")
      fid_ref = metrics::read_fid_stats(fid_ref_arg);
    else if (!fid_ref_arg.empty())
      metrics::check_fid_count(int64_t(metrics::fid_image_files(fid_ref_arg).size()), metrics::kInceptionDims,
                               "--fid-ref " + fid_ref_arg);
  }
  set_threads(f.get_int("threads", 0), Workload::kIntraOp);  // the classifier is a small CNN
  auto clf = metrics::fashion_classifier();
  std::cout << "classifier test accuracy " << clf.test_accuracy << (clf.trained_now ? " (trained now)" : " (cached)")
            << "\n";
  if (!run) return 0;
  const std::string dir = run->dir;
  const auto clip = clip_scorer_from_flags(f, *run);
  const std::string weights = f.get("weights", "ema");
  set_threads(f.get_int("threads", 0), workload_of(run->model->config().value("architecture", "")));
  auto test = data::load_fashion_mnist("test");
  auto [test_feats, test_pred] = metrics::classify(clf.model, data::to_model_range(test.field("image")));
  // The floor: real training images (the first `count`) against the real test images, same features and
  // count as the samples get; a sample set cannot be expected to score below it.
  auto train = data::load_fashion_mnist("train");
  const auto train_images = data::to_model_range(train.field("image").narrow(0, 0, count));
  const double fd_floor = metrics::frechet_distance(metrics::classify(clf.model, train_images).first, test_feats);
  std::cout << "classifier FD floor (" << count << " real training vs " << test_feats.size(0)
            << " real test images): " << fd_floor << "\n";
  double fid_floor = NAN;
  if (fid) {
    // Reference statistics: --fid-ref's .npz or folder, else the Fashion-MNIST test set; both cached.
    const std::string mode = metrics::to_string(fid_mode);
    auto cached = [&](const std::string& name, const at::Tensor& images01) {
      const std::string path = metrics::cache_dir() + "/fid_stats_" + name + "_" + mode + ".npz";
      if (std::filesystem::exists(path)) return metrics::read_fid_stats(path);
      std::cout << "computing Inception statistics of " << images01.size(0) << " images (" << name << "), cached as "
                << path << "\n";
      auto s = metrics::fid_stats(metrics::inception_features(inception, images01, fid_mode));
      metrics::write_fid_stats(path, s);
      return s;
    };
    if (!fid_ref && !fid_ref_arg.empty()) fid_ref = metrics::folder_fid_stats(inception, fid_ref_arg, fid_mode);
    if (!fid_ref) fid_ref = cached("fashion_mnist_test", test.field("image").to(at::kFloat) / 255);
    const auto floor_stats = cached("fashion_mnist_train" + std::to_string(count),
                                    train.field("image").narrow(0, 0, count).to(at::kFloat) / 255);
    fid_floor = metrics::frechet_distance(floor_stats.mu, floor_stats.sigma, fid_ref->mu, fid_ref->sigma);
    std::cout << "FID floor (" << count << " real training images vs the reference, " << mode << "): " << fid_floor
              << "\n";
  }
  std::ostringstream md;  // RUN/eval.md: this evaluation's tables
  md << "# dew eval of " << dir << " (step " << run->step << ", " << weights << " weights)\n\n"
     << "Classifier test accuracy " << clf.test_accuracy << ". Floors (" << count
     << " real training images in place of the samples): classifier FD " << fd_floor;
  if (fid) md << ", FID (Inception, " << metrics::to_string(fid_mode) << ") " << fid_floor;
  md << ".\n\n| solver | steps | guidance | samples | accuracy | frechet distance | FD floor |"
     << (fid ? " FID | FID floor |" : "") << " seconds |\n|---|---|---|---|---|---|---|" << (fid ? "---|---|" : "")
     << "---|\n";
  std::ostringstream per_class;
  per_class << "\n## Per-class accuracy\n\n| solver |";
  for (int c = 0; c < 10; ++c) per_class << " " << c << " |";
  per_class << "\n|---|";
  for (int c = 0; c < 10; ++c) per_class << "---|";
  per_class << "\n";
  std::cout << "| solver | steps | guidance | samples | accuracy | frechet distance | FD floor |"
            << (fid ? " FID | FID floor |" : "") << " seconds |\n|---|---|---|---|---|---|---|"
            << (fid ? "---|---|" : "") << "---|\n";
  std::vector<json> rows;  // eval.jsonl's, one per plan
  for (const auto& g : plans) {
    const std::string& solver = g.solver;
    const auto t0 = std::chrono::steady_clock::now();
    auto images = run->images(sample_diffusion(*run->model, *run->process, g)).cpu();
    if (pad > 0) images = images.narrow(2, pad, 28).narrow(3, pad, 28);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    auto [feats, pred] = metrics::classify(clf.model, images);
    const double acc = (pred == g.labels).to(at::kDouble).mean().item<double>();
    const double fd = metrics::frechet_distance(feats, test_feats);
    std::vector<double> class_acc(10);
    for (int64_t c = 0; c < 10; ++c) {
      const auto mask = g.labels == c;
      class_acc[size_t(c)] = (pred.index({mask}) == c).to(at::kDouble).mean().item<double>();
    }
    double fid_value = NAN;
    if (fid) {
      // The samples as their PNGs hold them (uint8), which is what pytorch-fid reads from a folder.
      const auto png = io::to_uint8(images).to(at::kFloat) / 255;
      const auto s = metrics::fid_stats(metrics::inception_features(inception, png, fid_mode));
      fid_value = metrics::frechet_distance(s.mu, s.sigma, fid_ref->mu, fid_ref->sigma);
    }
    std::ostringstream row;
    row << "| " << solver << " | " << g.steps << " | " << g.guidance.scale << " | " << count << " | " << acc << " | "
        << fd << " | " << fd_floor << " |";
    if (fid) row << " " << fid_value << " | " << fid_floor << " |";
    row << " " << secs << " |\n";
    std::cout << row.str();
    md << row.str();
    per_class << "| " << solver << " |";
    for (double a : class_acc) per_class << " " << a << " |";
    per_class << "\n";
    json line = {{"step", run->step},
                 {"weights", weights},
                 {"solver", solver},
                 {"steps", g.steps},
                 {"guidance", g.guidance.scale},
                 {"samples", count},
                 {"accuracy", acc},
                 {"per_class_accuracy", class_acc},
                 {"frechet_distance", fd},
                 {"frechet_distance_floor", fd_floor},
                 {"classifier_test_accuracy", clf.test_accuracy},
                 {"seconds", secs}};
    if (fid) {
      line["fid_inception"] = fid_value;
      line["fid_floor"] = fid_floor;
      line["fid_mode"] = metrics::to_string(fid_mode);
      line["fid_reference"] = fid_ref_arg.empty() ? "fashion_mnist test" : fid_ref_arg;
    }
    if (clip) {
      // torchmetrics' CLIPScore of each sample against the caption it was drawn for
      line["clip_score"] = clip->score(images, run->text->captions(g.labels));
      std::cout << "CLIP score (torchmetrics CLIPScore, " << f.get("clip", "") << "): " << line["clip_score"] << "\n";
    }
    rows.push_back(line);
  }
  // Written once every plan is measured: a stopped eval (io::Stopped) leaves the run as it was.
  for (const json& line : rows) append_eval_row(dir, line, args);
  md << per_class.str();
  io::write_file_atomic(dir + "/eval.md", md.str());
  std::cout << "rows appended to " << training::RunDir(dir).eval_log() << ", tables in " << dir << "/eval.md\n";
  return 0;
}

int cmd_models(const std::vector<std::string>& args) {
  if (asks_help(args)) {
    std::cout << models_usage();
    return 0;
  }
  DEW_CHECK(args.empty(), "models: takes no arguments (dew models --help)");
  std::cout << format_registry(models::registry()) << format_registry(models::language_models());
  return 0;
}

}  // namespace dew::cli
