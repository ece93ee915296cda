#include "dew/objectives/autoencoder.h"

#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>

#include "dew/core/device.h"
#include "dew/io/image.h"
#include "dew/io/stops.h"
#include "dew/metrics/metrics.h"
#include "dew/training/run_dir.h"

namespace dew {

AutoencoderLoss autoencoder_loss(const at::Tensor& x, const at::Tensor& x_hat, const DiagonalGaussian& q,
                                 const std::string& reconstruction, double kl_weight) {
  DEW_CHECK(x.sizes() == x_hat.sizes(), "autoencoder loss: the reconstruction has shape ", x_hat.sizes(),
            ", the images ", x.sizes());
  DEW_CHECK(reconstruction == "l1" || reconstruction == "mse", "objective.reconstruction: got \"", reconstruction,
            "\", accepted: l1, mse");
  const at::Tensor diff = x_hat.to(at::kFloat) - x.to(at::kFloat);
  AutoencoderLoss out;
  out.reconstruction = reconstruction == "l1" ? diff.abs().mean() : diff.square().mean();
  out.kl = q.kl().mean();  // DiagonalGaussian::kl is the per-row sum
  const double elements = double(x[0].numel());
  out.loss = out.reconstruction + (kl_weight / elements) * out.kl;
  return out;
}

ReconstructionScores score_reconstructions(AutoencoderImpl& autoencoder, const at::Tensor& images, int64_t batch) {
  DEW_CHECK(images.dim() == 4 && images.size(0) >= 1, "reconstruction scores: expected images [N, C, H, W], got ",
            images.sizes());
  DEW_CHECK(batch >= 1, "reconstruction scores: batch must be >= 1, got ", batch);
  at::NoGradGuard ng;
  const bool was_training = autoencoder.is_training();
  autoencoder.eval();
  const c10::Device device = module_device(autoencoder);
  ReconstructionScores s;
  s.items = images.size(0);
  double psnr_sum = 0, ssim_sum = 0, l1_sum = 0, kl_sum = 0;
  for (int64_t b = 0; b < s.items; b += batch) {
    io::check_stop();  // `dew eval` stopped by a signal (a no-op during training)
    const at::Tensor chunk = images.slice(0, b, b + batch);
    const at::Tensor x = (chunk.scalar_type() == at::kByte ? data::to_model_range(chunk) : chunk.to(at::kFloat));
    const DiagonalGaussian q = autoencoder.encode(x.to(device));
    const at::Tensor x_hat = autoencoder.decode(q.mean).to(at::kFloat).clamp(-1, 1).to(at::kCPU);
    const int64_t n = x.size(0);
    for (int64_t i = 0; i < n; ++i) psnr_sum += metrics::psnr(x_hat[i], x[i], 2.0);
    ssim_sum += metrics::ssim(x_hat, x, 2.0) * double(n);
    l1_sum += (x_hat - x).abs().to(at::kDouble).sum().item<double>();
    kl_sum += q.kl().to(at::kDouble).sum().item<double>();
  }
  if (was_training) autoencoder.train();
  s.psnr = psnr_sum / double(s.items);
  s.ssim = ssim_sum / double(s.items);
  s.l1 = l1_sum / double(images.numel());
  s.kl = kl_sum / double(s.items);
  return s;
}

AutoencoderObjective::AutoencoderObjective(std::shared_ptr<AutoencoderImpl> autoencoder,
                                           AutoencoderObjectiveOptions options, data::DatasetPtr held_out)
    : autoencoder_(std::move(autoencoder)), o_(std::move(options)), held_out_(std::move(held_out)) {
  DEW_CHECK(autoencoder_, "autoencoder objective: no autoencoder");
  DEW_CHECK(o_.reconstruction == "l1" || o_.reconstruction == "mse", "objective.reconstruction: got \"",
            o_.reconstruction, "\", accepted: l1, mse");
  DEW_CHECK(o_.posterior == "sample" || o_.posterior == "mean", "objective.posterior: got \"", o_.posterior,
            "\", accepted: sample, mean");
  DEW_CHECK(std::isfinite(o_.kl_weight) && o_.kl_weight >= 0, "objective.kl_weight: must be >= 0, got ", o_.kl_weight);
  DEW_CHECK(o_.ema_decay >= 0 && o_.ema_decay <= 1, "objective.ema_decay: must be in [0, 1], got ", o_.ema_decay);
  DEW_CHECK(o_.val_items >= 0, "objective.val_items: must be >= 0, got ", o_.val_items);
  DEW_CHECK(o_.preview_count >= 0, "objective.preview_count: must be >= 0, got ", o_.preview_count);
  if (held_out_)
    DEW_CHECK(held_out_->contains(o_.image_field), "objective.image_field: the held-out set ", held_out_->name(),
              " has no field \"", o_.image_field, "\"");
}

LossOutput AutoencoderObjective::loss(const data::Batch& batch, int64_t step, at::Generator gen) {
  auto it = batch.find(o_.image_field);
  DEW_CHECK(it != batch.end(), "autoencoder objective: batch has no field \"", o_.image_field, "\"");
  return loss_of_rows(batch, 0, it->second.size(0), step, gen);
}

LossOutput AutoencoderObjective::loss_of_rows(const data::Batch& batch, int64_t begin, int64_t end, int64_t step,
                                              at::Generator gen) {
  auto it = batch.find(o_.image_field);
  DEW_CHECK(it != batch.end(), "autoencoder objective: batch has no field \"", o_.image_field, "\"");
  const auto device = module_device(*autoencoder_);
  const at::Tensor x = data::to_model_range(it->second.narrow(0, begin, end - begin)).to(device);
  const DiagonalGaussian q = autoencoder_->encode(x);
  at::Tensor z = q.mean;
  if (o_.posterior == "sample") {
    // The whole batch's noise, as DiagonalGaussian::sample draws it for all rows; this rank's rows of it.
    std::vector<int64_t> shape = q.mean.sizes().vec();
    shape[0] = it->second.size(0);
    const at::Tensor eps = at::randn(shape, gen, at::TensorOptions().dtype(q.mean.scalar_type()));
    z = q.mean + q.std() * eps.narrow(0, begin, end - begin).to(q.mean.device());
  }
  const at::Tensor x_hat = autoencoder_->decode(z);
  const AutoencoderLoss l = autoencoder_loss(x, x_hat, q, o_.reconstruction, o_.kl_weight);
  return {l.loss, {{"reconstruction", l.reconstruction.item<double>()}, {"kl", l.kl.item<double>()}}};
}

std::map<std::string, double> AutoencoderObjective::validate(int64_t step, const std::string& run_dir) {
  if (!held_out_ || o_.val_items == 0) return {};
  const at::Tensor& all = held_out_->field(o_.image_field);
  const at::Tensor images = all.slice(0, 0, std::min(o_.val_items, all.size(0)));
  const ReconstructionScores s = score_reconstructions(*autoencoder_, images);
  if (o_.preview_count > 0) {
    // Rows of 8 originals, each over the row of their reconstructions.
    at::NoGradGuard ng;
    const at::Tensor x = data::to_model_range(images.slice(0, 0, std::min(o_.preview_count, images.size(0))));
    const auto device = module_device(*autoencoder_);
    const at::Tensor x_hat =
        autoencoder_->decode(autoencoder_->encode(x.to(device)).mean).to(at::kFloat).clamp(-1, 1).cpu();
    std::vector<at::Tensor> rows;
    const int64_t nrow = 8;
    for (int64_t b = 0; b < x.size(0); b += nrow) {
      rows.push_back(x.slice(0, b, b + nrow));
      rows.push_back(x_hat.slice(0, b, b + nrow));
    }
    // A last partial row pads its reconstruction row with blanks, so every reconstruction sits under its image.
    const int64_t tail = x.size(0) % nrow;
    if (tail != 0) {
      const auto blank = at::full({nrow - tail, x.size(1), x.size(2), x.size(3)}, -1.0);
      rows[rows.size() - 2] = at::cat({rows[rows.size() - 2], blank});
      rows.back() = at::cat({rows.back(), blank});
    }
    namespace fs = std::filesystem;
    fs::create_directories(training::RunDir(run_dir).samples());
    io::save_png(training::RunDir(run_dir).sample(step, ".png"), io::make_grid(at::cat(rows), nrow, 2));
  }
  // The count names what the scores were computed on (the first val_items held-out images).
  return {{"val/psnr", s.psnr},
          {"val/ssim", s.ssim},
          {"val/l1", s.l1},
          {"val/kl", s.kl},
          {"val/images", double(images.size(0))}};
}

}  // namespace dew
