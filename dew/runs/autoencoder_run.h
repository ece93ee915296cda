// Autoencoder runs: the `autoencoder` run kind (an autoencoder_kl trained on images with reconstruction + KL,
// the first stage of latent diffusion) and the opening and scoring of a trained run.
//
//   auto run = dew::runs::open_autoencoder_run("runs/fashion_vae");           // EMA weights, latest step
//   dew::DiagonalGaussian q = run.autoencoder->encode(x);                      // x: [B, 1, 32, 32] in [-1, 1]
//   auto scores = dew::runs::score_autoencoder_run("runs/fashion_vae", {});   // PSNR / SSIM on the test split
#pragma once
#include "dew/metrics/lpips.h"
#include "dew/nn/roles.h"
#include "dew/objectives/autoencoder.h"
#include "dew/runs/run.h"

namespace dew::runs {

/// A trained autoencoder run rebuilt from RUN/run.json and one checkpoint.
struct AutoencoderRun {
  std::string dir;
  json record;                                   // run.json (current shape)
  std::shared_ptr<AutoencoderImpl> autoencoder;  // in eval mode, on the device asked for
  std::vector<int64_t> image_shape;              // one image, e.g. [1, 32, 32]
  int64_t step = 0;
};

/// Opens RUN (dew::Error when it is not an autoencoder run or holds no such checkpoint).
AutoencoderRun open_autoencoder_run(const std::string& run_dir, const OpenOptions& o = {});

/// Reconstruction scores of RUN's autoencoder on the first `items` (0 = all) images of its held-out set.
ReconstructionScores score_autoencoder_run(const std::string& run_dir, const OpenOptions& o = {}, int64_t items = 0,
                                           int64_t* step = nullptr);

/// Mean LPIPS (metrics::Lpips, lpips 0.1.4's distance) between the first `items` (0 = all) held-out images of RUN
/// and their reconstructions through the posterior mean (clipped to [-1, 1]), `batch` images at a time. The
/// images must be large enough for the LPIPS backbone (alex: >= 31 px); grayscale is repeated to RGB.
double lpips_autoencoder_run(const std::string& run_dir, metrics::LpipsImpl& lpips, const OpenOptions& o = {},
                             int64_t items = 0, int64_t batch = 100);

}  // namespace dew::runs
