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
#include "dew/metrics/fashion_classifier.h"
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
              << format_tree(defaults) << "\n"
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
  if (!run.built.preview.empty()) std::cout << "preview:    " << dir.sample(res.step, run.built.preview) << "\n";
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
  auto f = parse_flags(
      args, {"solvers", "steps", "guidance", "count", "seed", "weights", "threads", "batch", "step", "device"},
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
    DEW_CHECK(count >= 10 && count % 10 == 0, "--count: must be a positive multiple of 10, got ", count);
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
  set_threads(f.get_int("threads", 0), Workload::kIntraOp);  // the classifier is a small CNN
  auto clf = metrics::fashion_classifier();
  std::cout << "classifier test accuracy " << clf.test_accuracy << (clf.trained_now ? " (trained now)" : " (cached)")
            << "\n";
  if (!run) return 0;
  const std::string dir = run->dir;
  const std::string weights = f.get("weights", "ema");
  set_threads(f.get_int("threads", 0), workload_of(run->model->config().value("architecture", "")));
  auto test = data::load_fashion_mnist("test");
  auto [test_feats, test_pred] = metrics::classify(clf.model, data::to_model_range(test.field("image")));
  std::cout << "| solver | steps | guidance | samples | accuracy | frechet distance | seconds "
               "|\n|---|---|---|---|---|---|---|\n";
  for (const auto& g : plans) {
    const std::string& solver = g.solver;
    const auto t0 = std::chrono::steady_clock::now();
    auto images = run->images(sample_diffusion(*run->model, *run->process, g)).cpu();
    if (pad > 0) images = images.narrow(2, pad, 28).narrow(3, pad, 28);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    auto [feats, pred] = metrics::classify(clf.model, images);
    const double acc = (pred == g.labels).to(at::kDouble).mean().item<double>();
    const double fd = metrics::frechet_distance(feats, test_feats);
    std::cout << "| " << solver << " | " << g.steps << " | " << g.guidance.scale << " | " << count << " | " << acc
              << " | " << fd << " | " << secs << " |\n";
    json line = {{"step", run->step}, {"weights", weights},           {"solver", solver},
                 {"steps", g.steps},  {"guidance", g.guidance.scale}, {"samples", count},
                 {"accuracy", acc},   {"frechet_distance", fd},       {"classifier_test_accuracy", clf.test_accuracy},
                 {"seconds", secs}};
    append_eval_row(dir, line, args);
  }
  std::cout << "rows appended to " << training::RunDir(dir).eval_log() << "\n";
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
