// Latent diffusion (docs/backbones.md, docs/training.md): a frozen autoencoder between the images and the denoiser. The
// denoiser trains on and samples latents scaling_factor * (z - shift_factor); sampling decodes them back to
// images. The autoencoder is never trained here: its parameters are frozen, outside the denoiser's module
// tree (so out of the optimizer, the EMA and the checkpoints), in eval mode.
//
//   auto space = std::make_shared<dew::LatentSpace>(vae, dew::LatentOptions{}, dew::LatentScaling{});
//   at::Tensor z = space->encode(images_uint8, gen);        // [B, 1, 32, 32] -> [B, 4, 16, 16], scaled
//   at::Tensor x = space->decode(z);                        // -> [B, 1, 32, 32] in [-1, 1]
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "dew/core/options.h"

namespace dew {

class AutoencoderImpl;

/// The `latent` section of a latent-diffusion recipe.
struct LatentOptions {
  std::string sample = "mean";
  bool cache = true;
  std::string scale = "auto";
  int64_t scale_items = 1000;
  int64_t batch_size = 256;
  template <class V>
  void visit(V& v) {
    v.choice("sample", sample, {"mean", "posterior"},
             "the posterior's mean, or a sample of it (from (seed, \"latents/cache\") when cached, the step's "
             "generator otherwise)");
    v("cache", cache, "encode the training set once at the start and keep the latents in memory");
    v.choice(
        "scale", scale, {"auto", "autoencoder", "std"},
        "autoencoder: its scaling_factor / shift_factor (a diffusers VAE's); std: 1 / std of the first "
        "scale_items latents (LDM's scale_by_std); auto: std for a dew run, autoencoder for a folder, and the base's "
        "scaling when init_from is a diffusion run on the same autoencoder");
    v("scale_items", scale_items, "std: the first training items, whose latents set the scale");
    v("batch_size", batch_size, "items per encoder / decoder call");
  }
};

/// Checks the fields (dew::Error naming "latent.FIELD").
void validate(const LatentOptions& o);

/// How the autoencoder's z becomes what the denoiser sees.
struct LatentScaling {
  std::string source = "autoencoder";  // autoencoder: its own to_latent / from_latent; std: the factors below
  double scaling_factor = 1.0;         // std: latent = scaling_factor * (z - shift_factor)
  double shift_factor = 0.0;
  json to_json() const;
  static LatentScaling from_json(const json& j, const std::string& where);
};

/// LDM's scale_by_std: scaling_factor = 1 / std over every element of z (raw latents [N, c, h, w]), no shift.
LatentScaling scaling_by_std(const at::Tensor& z);

/// A frozen autoencoder with the scaling of its latents.
class LatentSpace {
 public:
  /// Freezes `autoencoder` (requires_grad false, eval mode).
  LatentSpace(std::shared_ptr<AutoencoderImpl> autoencoder, LatentOptions options, LatentScaling scaling);

  /// Images [B, C, H, W] (uint8, or float in [-1, 1]) -> raw z [B, c, h, w] on the autoencoder's device: the
  /// posterior mean, or (options.sample "posterior") a sample of it drawn from `gen`. No gradient.
  at::Tensor encode_raw(const at::Tensor& images, at::Generator gen) const;
  /// z -> what the denoiser sees, and back.
  at::Tensor to_latent(const at::Tensor& z) const;
  at::Tensor from_latent(const at::Tensor& latent) const;
  /// to_latent(encode_raw(images, gen)).
  at::Tensor encode(const at::Tensor& images, at::Generator gen) const;
  /// Latents [N, c, h, w] -> images float32 [N, C, H, W] in [-1, 1] on the CPU, options.batch_size at a time.
  at::Tensor decode(const at::Tensor& latents) const;
  /// Raw z of every image (uint8 [N, C, H, W]), options.batch_size at a time, float32 on the CPU; posterior
  /// samples draw from `gen` in order, so the result is a function of the images and the generator's seed.
  at::Tensor encode_raw_all(const at::Tensor& images, at::Generator gen) const;
  /// The latent shape [c, h, w] of one image of shape [C, H, W] (one encoder call on zeros). dew::Error
  /// naming `where` when the autoencoder does not take such images or does not decode back to their size.
  std::vector<int64_t> latent_shape(const std::vector<int64_t>& image_shape, const std::string& where) const;

  AutoencoderImpl& autoencoder() const { return *autoencoder_; }
  const std::shared_ptr<AutoencoderImpl>& autoencoder_ptr() const { return autoencoder_; }
  const LatentOptions& options() const { return o_; }
  const LatentScaling& scaling() const { return scaling_; }
  void set_scaling(LatentScaling s) { scaling_ = std::move(s); }

 private:
  std::shared_ptr<AutoencoderImpl> autoencoder_;
  LatentOptions o_;
  LatentScaling scaling_;
};
using LatentSpacePtr = std::shared_ptr<LatentSpace>;

}  // namespace dew
