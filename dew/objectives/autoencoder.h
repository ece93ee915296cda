// AutoencoderObjective (docs/training.md, docs/evaluation.md): trains a KL autoencoder (autoencoder_kl) on images, as the
// first stage of latent diffusion. Loss = reconstruction + kl_weight * KL, both per image element:
//
//   reconstruction = mean over every element of |x_hat - x| (l1) or (x_hat - x)^2 (mse), x in [-1, 1]
//   kl             = mean over the batch of sum over latent elements of KL(q(z|x) || N(0, I)),
//                    divided by the image's element count C H W
//
// so the loss is LDM's (a per-image sum of the reconstruction error plus kl_weight times the per-image KL
// sum, kl_weight 1e-6 in its VAE configs) divided by C H W, and kl_weight means what it means there. The
// decoder reconstructs from a posterior sample (posterior "sample", LDM's) or the mean. Validation scores
// held-out reconstructions (of the posterior mean, clipped to [-1, 1]): val/psnr (mean of per-image PSNR,
// range 2), val/ssim, val/l1, val/kl, and writes RUN/samples/step_N.png (rows of originals over their
// reconstructions).
//
//   auto obj = std::make_shared<dew::AutoencoderObjective>(vae, dew::AutoencoderObjectiveOptions{}, test_set);
//   auto out = obj->loss(batch, step, gen);   // out.metrics: reconstruction, kl (per-image sum)
#pragma once
#include "dew/data/dataset.h"
#include "dew/nn/roles.h"
#include "dew/training/objective.h"

namespace dew {

struct AutoencoderObjectiveOptions {
  std::string reconstruction = "l1";
  double kl_weight = 1e-6;
  std::string posterior = "sample";
  double ema_decay = 0.999;
  int64_t val_items = 1000;
  int64_t preview_count = 16;
  std::string image_field = "image";
  template <class V>
  void visit(V& v) {
    v.choice("reconstruction", reconstruction, {"l1", "mse"},
             "reconstruction error, mean over the elements of [-1, 1] images");
    v("kl_weight", kl_weight, "weight of the KL term (per-image KL sum / (C H W): LDM's kl_weight, 1e-6 there)");
    v.choice("posterior", posterior, {"sample", "mean"}, "the decoder reconstructs a posterior sample or the mean");
    v("ema_decay", ema_decay, "EMA decay of the parameters");
    v("val_items", val_items, "held-out images scored at validation (0 = none)");
    v("preview_count", preview_count, "images in the reconstruction grid (rows of 8 over their reconstructions)");
    v("image_field", image_field, "batch field holding uint8 images");
  }
};

/// The terms of the loss (see the file comment): loss = reconstruction + kl_weight * kl_per_element.
struct AutoencoderLoss {
  at::Tensor loss;            // scalar
  at::Tensor reconstruction;  // scalar, mean over elements
  at::Tensor kl;              // scalar, the per-image KL sum averaged over the batch
};

/// x, x_hat: [B, C, H, W] in [-1, 1]; q: the posterior over the latents of x.
AutoencoderLoss autoencoder_loss(const at::Tensor& x, const at::Tensor& x_hat, const DiagonalGaussian& q,
                                 const std::string& reconstruction, double kl_weight);

/// Scores of an autoencoder's reconstructions of held-out images.
struct ReconstructionScores {
  int64_t items = 0;
  double psnr = 0;  // dB, mean over images of 10 log10(2^2 / MSE_image) (metrics::psnr, range 2)
  double ssim = 0;  // metrics::ssim (11x11 Gaussian window), mean over images
  double l1 = 0;    // mean absolute error over every element
  double kl = 0;    // the per-image KL sum, mean over images
};

/// Reconstructs uint8 images [N, C, H, W] (H, W >= 11) through the posterior mean, batch at a time, without
/// gradients, and scores them against the originals (both in [-1, 1], reconstructions clipped).
ReconstructionScores score_reconstructions(AutoencoderImpl& autoencoder, const at::Tensor& images, int64_t batch = 250);

class AutoencoderObjective : public Objective {
 public:
  /// `held_out` (optional): the set validation scores (its first val_items images).
  AutoencoderObjective(std::shared_ptr<AutoencoderImpl> autoencoder, AutoencoderObjectiveOptions options,
                       data::DatasetPtr held_out = nullptr);
  std::string name() const override { return "autoencoder"; }
  torch::nn::Module& module() override { return *autoencoder_; }
  /// batch: "image" uint8 [B, C, H, W]. Metrics: reconstruction, kl.
  LossOutput loss(const data::Batch& batch, int64_t step, at::Generator gen) override;
  /// Data-parallel: the draws (the posterior sample's noise) are made for the whole batch and this rank keeps its rows', so every row
  /// gets what a one-process run gives it; the loss is a mean over rows, which the trainer's row share weighs.
  LossOutput loss_of_rows(const data::Batch& batch, int64_t begin, int64_t end, int64_t step,
                          at::Generator gen) override;
  /// val/psnr, val/ssim, val/l1, val/kl of the held-out images; the reconstruction grid.
  std::map<std::string, double> validate(int64_t step, const std::string& run_dir) override;
  training::EmaSpec ema() const override { return {o_.ema_decay}; }
  std::vector<std::string> batch_fields() const override { return {o_.image_field}; }

 private:
  std::shared_ptr<AutoencoderImpl> autoencoder_;
  AutoencoderObjectiveOptions o_;
  data::DatasetPtr held_out_;
};

}  // namespace dew
