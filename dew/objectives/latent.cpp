#include "dew/objectives/latent.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cmath>

#include "dew/core/device.h"
#include "dew/data/dataset.h"
#include "dew/nn/roles.h"

namespace dew {

void validate(const LatentOptions& o) {
  DEW_CHECK(o.sample == "mean" || o.sample == "posterior", "latent.sample: got \"", o.sample,
            "\", accepted: mean, posterior");
  DEW_CHECK(o.scale == "auto" || o.scale == "autoencoder" || o.scale == "std", "latent.scale: got \"", o.scale,
            "\", accepted: auto, autoencoder, std");
  DEW_CHECK(o.scale_items >= 1, "latent.scale_items: must be >= 1, got ", o.scale_items);
  DEW_CHECK(o.batch_size >= 1, "latent.batch_size: must be >= 1, got ", o.batch_size);
}

json LatentScaling::to_json() const {
  return {{"source", source}, {"scaling_factor", scaling_factor}, {"shift_factor", shift_factor}};
}

LatentScaling LatentScaling::from_json(const json& j, const std::string& where) {
  DEW_CHECK(j.is_object() && j.value("source", json()).is_string() && j.value("scaling_factor", json()).is_number() &&
                j.value("shift_factor", json()).is_number(),
            where, ": expected {\"source\": autoencoder|std, \"scaling_factor\": x, \"shift_factor\": y}, got ",
            j.dump());
  LatentScaling s;
  s.source = j["source"];
  s.scaling_factor = j["scaling_factor"];
  s.shift_factor = j["shift_factor"];
  DEW_CHECK(s.source == "autoencoder" || s.source == "std", where, ".source: got \"", s.source,
            "\", accepted: autoencoder, std");
  DEW_CHECK(std::isfinite(s.scaling_factor) && s.scaling_factor != 0, where,
            ".scaling_factor: must be finite and non-zero, got ", s.scaling_factor);
  return s;
}

LatentScaling scaling_by_std(const at::Tensor& z) {
  DEW_CHECK(z.numel() >= 2, "latent scale: needs at least two latent values, got ", z.numel());
  const double sd = z.to(at::kDouble).flatten().std().item<double>();
  DEW_CHECK(std::isfinite(sd) && sd > 0, "latent scale: the latents' std is ", sd,
            " (the autoencoder maps every image to one point); use latent.scale autoencoder");
  LatentScaling s;
  s.source = "std";
  s.scaling_factor = 1.0 / sd;
  return s;
}

LatentSpace::LatentSpace(std::shared_ptr<AutoencoderImpl> autoencoder, LatentOptions options, LatentScaling scaling)
    : autoencoder_(std::move(autoencoder)), o_(std::move(options)), scaling_(std::move(scaling)) {
  DEW_CHECK(autoencoder_, "latent space: no autoencoder");
  validate(o_);
  for (auto& p : autoencoder_->parameters()) p.set_requires_grad(false);
  autoencoder_->eval();
}

at::Tensor LatentSpace::encode_raw(const at::Tensor& images, at::Generator gen) const {
  at::NoGradGuard ng;
  at::Tensor x = images.scalar_type() == at::kByte ? data::to_model_range(images) : images.to(at::kFloat);
  const DiagonalGaussian q = autoencoder_->encode(x.to(module_device(*autoencoder_)));
  return o_.sample == "posterior" ? q.sample(gen) : q.mean;
}

at::Tensor LatentSpace::to_latent(const at::Tensor& z) const {
  if (scaling_.source == "autoencoder") return autoencoder_->to_latent(z);
  return (z - scaling_.shift_factor) * scaling_.scaling_factor;
}

at::Tensor LatentSpace::from_latent(const at::Tensor& latent) const {
  if (scaling_.source == "autoencoder") return autoencoder_->from_latent(latent);
  return latent / scaling_.scaling_factor + scaling_.shift_factor;
}

at::Tensor LatentSpace::encode(const at::Tensor& images, at::Generator gen) const {
  at::NoGradGuard ng;
  return to_latent(encode_raw(images, gen));
}

at::Tensor LatentSpace::decode(const at::Tensor& latents) const {
  at::NoGradGuard ng;
  const auto device = module_device(*autoencoder_);
  std::vector<at::Tensor> out;
  for (int64_t b = 0; b < latents.size(0); b += o_.batch_size) {
    const at::Tensor z = from_latent(latents.slice(0, b, b + o_.batch_size).to(device).to(at::kFloat));
    out.push_back(autoencoder_->decode(z).to(at::kFloat).clamp(-1, 1).to(at::kCPU));
  }
  return at::cat(out);
}

at::Tensor LatentSpace::encode_raw_all(const at::Tensor& images, at::Generator gen) const {
  std::vector<at::Tensor> out;
  for (int64_t b = 0; b < images.size(0); b += o_.batch_size)
    out.push_back(encode_raw(images.slice(0, b, b + o_.batch_size), gen).to(at::kFloat).to(at::kCPU));
  return at::cat(out);
}

std::vector<int64_t> LatentSpace::latent_shape(const std::vector<int64_t>& image_shape,
                                               const std::string& where) const {
  DEW_CHECK(image_shape.size() == 3, where, ": latent diffusion takes images [C, H, W], got ", image_shape.size(),
            " dims per item");
  const json fields = autoencoder_->config().value("fields", json::object());
  const int64_t in = fields.value("in_channels", int64_t(-1));
  DEW_CHECK(in < 0 || in == image_shape[0], where, ": the images have ", image_shape[0],
            " channels, the autoencoder takes ", in);
  at::NoGradGuard ng;
  std::vector<int64_t> probe = {1};
  probe.insert(probe.end(), image_shape.begin(), image_shape.end());
  const at::Tensor z =
      autoencoder_->encode(at::zeros(probe, at::TensorOptions().device(module_device(*autoencoder_)))).mean;
  const at::Tensor back = autoencoder_->decode(z);
  DEW_CHECK(back.sizes() == at::IntArrayRef(probe), where, ": images ", image_shape[1], "x", image_shape[2],
            " come back from the autoencoder as ", back.size(-2), "x", back.size(-1),
            "; pad or resize them to a multiple of its downsampling (",
            image_shape[1] / std::max<int64_t>(1, z.size(-2)), ")");
  return {z.size(1), z.size(2), z.size(3)};
}

}  // namespace dew
