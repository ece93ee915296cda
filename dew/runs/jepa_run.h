// JEPA runs: the `jepa` run kind (an I-JEPA image or V-JEPA video encoder with its predictor) and the
// opening and probing of a trained run.
//
//   auto run = dew::runs::open_jepa_run("runs/jepa_fashion");      // the target encoder (EMA), latest step
//   auto f = dew::pooled_features(*run.encoder, images);              // [N, D]
//   auto report = dew::runs::probe_jepa_run("runs/jepa_fashion", {}); // trained vs initial vs pixels
#pragma once
#include "dew/metrics/probes.h"
#include "dew/nn/roles.h"
#include "dew/runs/run.h"

namespace dew::runs {

/// A trained JEPA run rebuilt from RUN/run.json and one checkpoint.
struct JEPARun {
  std::string dir;
  json record;                                // run.json (current shape)
  std::shared_ptr<TokenEncoderImpl> encoder;  // "ema": the target encoder; "live": the context encoder
  int64_t step = 0;
};

/// Opens RUN (dew::Error when it is not a JEPA run or holds no such checkpoint).
JEPARun open_jepa_run(const std::string& run_dir, const OpenOptions& o = {});

/// The run's encoder as it was before the first step: rebuilt from run.json under the run's (seed, "init")
/// generators, which give every fresh run its initial weights.
std::shared_ptr<TokenEncoderImpl> initial_jepa_encoder(const json& record);

/// The encoder and predictor of a JEPA recipe's `model` and `predictor` sections for inputs shaped `sizes`
/// ([N, C, H, W] images or [N, C, T, H, W] clips of `data_name`), as `dew train jepa` builds them: architecture
/// "auto" resolved, image_size, in_channels, frames and patch_size (default_jepa_patch) filled in unless given,
/// the encoder built first (from the current default generator), then the predictor with the encoder's grid
/// fields and width unless given. The two sections become the two models' configs.
struct JEPAModels {
  std::shared_ptr<TokenEncoderImpl> encoder;
  std::shared_ptr<TokenPredictorImpl> predictor;
};
JEPAModels build_jepa_models(ModelSpec& model, ModelSpec& predictor, at::IntArrayRef sizes,
                             const std::string& data_name);

/// The patch side of `dew train jepa` when model.fields gives none: a quarter of the image side, the 4 x 4 tokens
/// the recipe's masks are sized for (7 for Fashion-MNIST's 28, 8 for 32-pixel clips); a dew::Error naming
/// model.fields.patch_size when 4 does not divide the side.
int64_t default_jepa_patch(int64_t image_size);

struct ProbeOptions {
  int64_t train_items = 10000;  // items of the training split the probes fit on (0 = all)
  int64_t test_items = 0;       // items of the test split they score (0 = all)
  metrics::KnnOptions knn;      // k 20, prep none, vote weighted (DINO), temperature 0.07
  metrics::LinearProbeOptions linear;
  bool baselines = true;      // also the encoder at its initialisation and the raw pixels
  std::string pool = "mean";  // mean | tokens | gridK (dew::feature_pools)
};

/// The probes the run records (objective.probe_pool, knn_k, knn_prep, knn_vote, knn_temperature, probe_epochs):
/// `dew eval RUN` starts from these, so its full probe is the one validation runs, on more items.
ProbeOptions probe_options_of(const json& record);

/// Probe accuracies of one feature source.
struct ProbeRow {
  std::string features;  // "trained (ema, step N)", "initialisation", "pixels"
  double linear = 0;
  double knn = 0;
};

/// What probe_jepa_run measured: the rows, and the record it wrote to `file` (RUN/eval/probes_step_N.json:
/// the run, step, weights, probe settings and rows).
struct ProbeReport {
  std::vector<ProbeRow> rows;
  json record;
  std::string file;
};

/// Linear and kNN probes of the run's frozen encoder features on the run's data (the training split) and its
/// test split, with the baselines; writes RUN/eval/probes_step_N.json.
ProbeReport probe_jepa_run(const std::string& run_dir, const ProbeOptions& p, const OpenOptions& o = {});

}  // namespace dew::runs
