// The model roles besides the denoiser (backbone.h), the causal language model (causal_transformer.h) and
// the text encoder (text_encoder.h): the autoencoder of latent diffusion and the encoder of token subsets
// (JEPA). Families implementing them register like every other (docs/architecture.md).
//
//   DiagonalGaussian q = vae->encode(x);                       // x: [B, 3, H, W] in [-1, 1]
//   at::Tensor z = vae->to_latent(q.sample(gen));   // scaling_factor * (z - shift_factor): what the denoiser sees
//   at::Tensor x_hat = vae->decode(vae->from_latent(z));
#pragma once
#include <ATen/core/Generator.h>
#include <torch/nn/module.h>

#include <nlohmann/json.hpp>

#include "dew/data/masks.h"  // TokenGrid

namespace dew {

/// A diagonal Gaussian over latents (diffusers' DiagonalGaussianDistribution): mean and log-variance of
/// one shape, e.g. [B, c, h, w]; the log-variance is clamped to [-30, 20] as diffusers does.
struct DiagonalGaussian {
  at::Tensor mean;
  at::Tensor logvar;
  DiagonalGaussian(at::Tensor mean, at::Tensor logvar);
  /// exp(logvar / 2).
  at::Tensor std() const;
  /// mean + std * eps, eps ~ N(0, 1) drawn on the CPU from `gen` and moved to mean's device.
  at::Tensor sample(at::Generator gen) const;
  /// KL(q || N(0, I)) per row: 0.5 sum over non-batch dims of (mean^2 + var - 1 - logvar). [B]
  at::Tensor kl() const;
};

/// An autoencoder: images <-> latents.
class AutoencoderImpl : public torch::nn::Module {
 public:
  /// x: [B, C, H, W] in [-1, 1] -> the posterior over latents [B, c, h, w].
  virtual DiagonalGaussian encode(const at::Tensor& x) = 0;
  /// z: [B, c, h, w] -> [B, C, H, W].
  virtual at::Tensor decode(const at::Tensor& z) = 0;
  /// The denoiser sees scaling_factor * (z - shift_factor) (SD 0.18215; SDXL 0.13025; SD3/Flux with a shift).
  virtual double scaling_factor() const = 0;
  virtual double shift_factor() const { return 0.0; }
  /// z -> what the denoiser sees: scaling_factor * (z - shift_factor) unless a family says otherwise.
  virtual at::Tensor to_latent(const at::Tensor& z) const;
  /// The inverse of to_latent: what decode() takes.
  virtual at::Tensor from_latent(const at::Tensor& latent) const;
  /// The {architecture, fields} record that rebuilds this autoencoder.
  const nlohmann::json& config() const { return config_; }
  void set_config(nlohmann::json c) { config_ = std::move(c); }

 private:
  nlohmann::json config_;
};

/// An encoder of token subsets (JEPA's context and target encoders).
class TokenEncoderImpl : public torch::nn::Module {
 public:
  /// x: [B, C, H, W] (or [B, C, T, H, W]); keep: [B, K] int64 token indices (undefined = every token)
  /// -> features of the kept tokens [B, K, D].
  virtual at::Tensor forward(const at::Tensor& x, const at::Tensor& keep = {}) = 0;
  /// The token grid of one input.
  virtual TokenGrid grid() const = 0;
  /// Feature width D.
  virtual int64_t features() const = 0;
  /// The {architecture, fields} record that rebuilds this encoder.
  const nlohmann::json& config() const { return config_; }
  void set_config(nlohmann::json c) { config_ = std::move(c); }

 private:
  nlohmann::json config_;
};

/// A predictor of the features of hidden tokens from the visible ones (JEPA's predictor).
class TokenPredictorImpl : public torch::nn::Module {
 public:
  /// context: [B, Kc, D] encoder features of the visible tokens at indices context_idx [B, Kc] int64;
  /// targets: [M, B, Kt] int64 indices of M target blocks -> predicted features [M * B, Kt, D], block-major
  /// (row m * B + b is block m of item b), as I-JEPA concatenates its target masks.
  virtual at::Tensor forward(const at::Tensor& context, const at::Tensor& context_idx, const at::Tensor& targets) = 0;
  const nlohmann::json& config() const { return config_; }
  void set_config(nlohmann::json c) { config_ = std::move(c); }

 private:
  nlohmann::json config_;
};

}  // namespace dew
