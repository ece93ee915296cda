// Diffusion runs: the `diffusion` run kind and a trained run opened for sampling and evaluation.
//
//   auto run = dew::runs::open_diffusion_run("runs/fashion_mnist");     // EMA weights, latest step
//   dew::DiffusionSampleOptions g;  g.shape = run.shape;  g.count = 10;  g.labels = at::arange(10);
//   at::Tensor images = dew::sample_diffusion(*run.model, *run.process, g);     // [10, 1, 28, 28] in [-1, 1]
#pragma once
#include "dew/diffusion/process.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/objectives/diffusion.h"
#include "dew/runs/run.h"

namespace dew::runs {

/// A trained diffusion run: its model with checkpoint weights, its process and what it was trained on.
struct DiffusionRun {
  std::string dir;
  json record;                                          // run.json (current shape)
  BackbonePtr model;                                    // in eval mode, on the device asked for
  std::shared_ptr<diffusion::DiffusionProcess> process;
  std::vector<int64_t> shape;                           // one sample, e.g. [1, 28, 28]
  int64_t num_classes = 0;                              // of the model's label table (0 for text runs)
  int64_t step = 0;                                     // the checkpoint's step
  std::shared_ptr<TextConditioner> text;                // text runs
  std::vector<std::string> class_names;                 // of the training data
  /// Classes the run can be conditioned on: by label, or by the caption of a label.
  int64_t conditioning_classes() const { return text ? int64_t(class_names.size()) : num_classes; }
};

/// Opens RUN (dew::Error when it is not a diffusion run or holds no such checkpoint).
DiffusionRun open_diffusion_run(const std::string& run_dir, const OpenOptions& o = {});

}  // namespace dew::runs
