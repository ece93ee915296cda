// Diffusion runs: the `diffusion` run kind and a trained run opened for sampling and evaluation.
//
//   auto run = dew::runs::open_diffusion_run("runs/fashion_mnist");     // EMA weights, latest step
//   dew::DiffusionSampleOptions g;  g.shape = run.shape;  g.count = 10;  g.labels = at::arange(10);
//   at::Tensor images = dew::sample_diffusion(*run.model, *run.process, g);     // [10, 1, 28, 28] in [-1, 1]
//
// A latent run (recipe `autoencoder: {run: DIR}` or `{folder: DIR}`) trains on a frozen autoencoder's scaled
// latents; its samples are latents that run.images() decodes:
//   g.shape = run.shape;  g.clamp = !run.latent;                                 // [4, 16, 16]
//   at::Tensor images = run.images(dew::sample_diffusion(*run.model, *run.process, g));   // [10, 1, 32, 32]
#pragma once
#include "dew/diffusion/process.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/objectives/diffusion.h"
#include "dew/objectives/latent.h"
#include "dew/runs/run.h"

namespace dew::runs {

/// The `autoencoder` section of a diffusion recipe: where the frozen autoencoder of latent diffusion comes
/// from. Both empty = pixel space.
struct AutoencoderSource {
  std::string run;
  std::string folder;
  std::string weights = "ema";
  int64_t step = -1;
  template <class V>
  void visit(V& v) {
    v("run", run, "a `dew train autoencoder` run whose autoencoder the model trains on (latent diffusion)");
    v("folder", folder, "or a diffusers AutoencoderKL folder (config.json + diffusion_pytorch_model.safetensors)");
    v.choice("weights", weights, {"ema", "live"}, "run: which weights of its checkpoint");
    v("step", step, "run: the checkpoint (-1 = the latest, recorded as its step)");
  }
};

/// Opens the autoencoder `source` names on `device` (`step`, optional, receives the run checkpoint's step);
/// dew::Error naming "autoencoder.FIELD".
std::shared_ptr<AutoencoderImpl> open_autoencoder_source(const AutoencoderSource& source, const c10::Device& device,
                                                         int64_t* step = nullptr);

/// A trained diffusion run: its model with checkpoint weights, its process and what it was trained on.
struct DiffusionRun {
  std::string dir;
  json record;        // run.json (current shape)
  BackbonePtr model;  // in eval mode, on the device asked for
  std::shared_ptr<diffusion::DiffusionProcess> process;
  std::vector<int64_t> shape;             // one sample, e.g. [1, 28, 28] (a latent run: [4, 16, 16])
  int64_t num_classes = 0;                // of the model's label table (0 for text runs)
  int64_t step = 0;                       // the checkpoint's step
  std::shared_ptr<TextConditioner> text;  // text runs
  std::vector<std::string> class_names;   // of the training data
  LatentSpacePtr latent;                  // latent runs: the frozen autoencoder (null in pixel space)
  std::vector<int64_t> image_shape;       // one image, e.g. [1, 32, 32] (= shape in pixel space)
  /// Samples -> images in [-1, 1]: latents decoded by the autoencoder, pixel samples as they are.
  at::Tensor images(const at::Tensor& samples) const { return latent ? latent->decode(samples) : samples; }
  /// Classes the run can be conditioned on: by label, or by the caption of a label.
  int64_t conditioning_classes() const { return text ? int64_t(class_names.size()) : num_classes; }
};

/// Opens RUN (dew::Error when it is not a diffusion run or holds no such checkpoint).
DiffusionRun open_diffusion_run(const std::string& run_dir, const OpenOptions& o = {});

}  // namespace dew::runs
