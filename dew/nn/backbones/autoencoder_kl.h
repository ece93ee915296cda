// AutoencoderKL (docs/stable_diffusion.md): diffusers' AutoencoderKL, the VAE of Stable Diffusion,
// SDXL and (16 latent channels, with a shift) SD3 / Flux, with diffusers' module tree and parameter names,
// so their `vae/` checkpoints load without renaming; also built from a diffusers config.json.
//
//   auto vae = dew::nn::AutoencoderKL(dew::nn::AutoencoderKLOptions());      // SD's VAE layout
//   dew::DiagonalGaussian q = vae->encode(x);        // x: [B, 3, 512, 512] in [-1, 1] -> [B, 4, 64, 64]
//   at::Tensor z = vae->to_latent(q.sample(gen));    // scaling_factor * (z - shift_factor): the denoiser's space
//   at::Tensor x_hat = vae->decode(vae->from_latent(z));                     // [B, 3, 512, 512]
//   at::Tensor big = vae->tiled_decode(vae->from_latent(z_large));           // bounded activation memory
//
// Layout (diffusers' Encoder / Decoder with DownEncoderBlock2D / UpDecoderBlock2D / UNetMidBlock2D):
//   encoder.conv_in; encoder.down_blocks.N.resnets.M (layers_per_block per level) and, except at the last
//   level, encoder.down_blocks.N.downsamplers.0.conv (pad right and bottom by one, stride-2 3x3 conv);
//   encoder.mid_block.{resnets.0, attentions.0, resnets.1}; encoder.conv_norm_out, SiLU, encoder.conv_out
//   to 2 x latent_channels (mean, logvar); quant_conv (1x1, absent when use_quant_conv is false);
//   post_quant_conv (1x1, absent when use_post_quant_conv is false); decoder.conv_in; decoder.mid_block;
//   decoder.up_blocks.N.resnets.M (layers_per_block + 1 per level, deepest level first) and, except at the
//   last, decoder.up_blocks.N.upsamplers.0.conv (nearest 2x, 3x3 conv); decoder.conv_norm_out, SiLU,
//   decoder.conv_out. The resnets are diffusers' ResnetBlock2D without time input (dew::nn::ResBlock); the
//   mid-block attention is one head over all channels with bias on q, k, v (dew::nn::SpatialSelfAttention).
//
// Numerics: normalisations in float32 (float64 stays float64), convolutions in the compute dtype. A model
// whose parameters are float64 (module->to(at::kDouble)) computes in float64 throughout.
#pragma once
#include <torch/arg.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>
#include <vector>

#include "dew/core/options.h"
#include "dew/io/weights.h"
#include "dew/nn/diffusers_blocks.h"
#include "dew/nn/option_fields.h"
#include "dew/nn/roles.h"

namespace dew::nn {

/// Fields of `autoencoder_kl`. Defaults are Stable Diffusion 1.x / 2.x's VAE.
/// Example: AutoencoderKLOptions().latent_channels(16).scaling_factor(1.5305).shift_factor(0.0609)  // SD3
struct AutoencoderKLOptions {
  // remat checkpoints each down / up block and the mid-block; a float64 model runs float64 whatever dtype says.
#define DEW_AUTOENCODER_KL_FIELDS(F, C)                                                                               \
  F(int64_t, in_channels, 3, "image channels in")                                                                     \
  F(int64_t, out_channels, 3, "image channels out")                                                                   \
  F(std::vector<int64_t>, block_out_channels, (std::vector<int64_t>{128, 256, 512, 512}),                             \
    "channels per level, shallowest first (multiples of norm_groups); the image is downsampled 2^(levels - 1) times") \
  F(int64_t, layers_per_block, 2, "resnets per encoder level (the decoder has one more)")                             \
  F(int64_t, latent_channels, 4, "latent channels (SD 4, SD3/Flux 16)")                                               \
  F(int64_t, norm_groups, 32, "GroupNorm groups of every normalisation (diffusers' norm_num_groups)")                 \
  F(double, norm_eps, 1e-6, "GroupNorm epsilon (diffusers fixes 1e-6)")                                               \
  F(double, scaling_factor, 0.18215,                                                                                  \
    "the denoiser sees scaling_factor * (z - shift_factor): SD 0.18215, SDXL 0.13025, SD3 1.5305")                    \
  F(std::optional<double>, shift_factor, std::nullopt,                                                                \
    "subtracted from z before scaling: SD3 0.0609, Flux 0.1159 (null: none)")                                         \
  F(std::optional<std::vector<double>>, latents_mean, std::nullopt,                                                   \
    "per-channel latent mean some VAEs carry: to_latent = (z - mean) * scaling_factor / std (null: unused)")          \
  F(std::optional<std::vector<double>>, latents_std, std::nullopt, "per-channel latent std (with latents_mean)")      \
  F(bool, use_quant_conv, true, "1x1 conv after the encoder")                                                         \
  F(bool, use_post_quant_conv, true, "1x1 conv before the decoder")                                                   \
  F(bool, mid_block_attention, true,                                                                                  \
    "attention in the encoder's and decoder's mid-blocks (diffusers' mid_block_add_attention)")                       \
  F(int64_t, sample_size, 512, "training image side: the default tile of tiled decoding / encoding")                  \
  F(bool, force_upcast, true, "recorded from diffusers' config (normalisations always run in fp32)")                  \
  F(bool, force_fp32_for_softmax, true, "softmax of the mid-block attention in fp32 under bf16/fp16 compute")         \
  DEW_COMPUTE_FIELDS(F, C, "block")
  DEW_OPTIONS(DEW_AUTOENCODER_KL_FIELDS)
#undef DEW_AUTOENCODER_KL_FIELDS
};

/// Tiles of AutoencoderKLImpl::tiled_decode / tiled_encode (diffusers' enable_tiling()).
/// Example: VaeTileOptions().sample_size(256)
struct VaeTileOptions {
  /// tile side in image pixels (diffusers' tile_sample_min_size); 0 = the model's sample_size. The latent tile
  /// is sample_size / 2^(levels - 1) (tile_latent_min_size)
  TORCH_ARG(int64_t, sample_size) = 0;
  /// fraction of a tile shared with its neighbour, blended linearly (tile_overlap_factor)
  TORCH_ARG(double, overlap) = 0.25;
};

/// UNetMidBlock2D without time input: resnets.0, attentions.0 (when attention), resnets.1.
class VaeMidBlockImpl : public torch::nn::Module {
 public:
  VaeMidBlockImpl(int64_t channels, const AutoencoderKLOptions& o);
  /// x: [B, C, H, W] -> [B, C, H, W]
  at::Tensor forward(const at::Tensor& x);
  std::vector<ResBlock> resnets;
  SpatialSelfAttention attention{nullptr};  // empty without mid_block_attention
};
TORCH_MODULE(VaeMidBlock);

/// DownEncoderBlock2D (resnets.M, downsamplers.0.conv) or UpDecoderBlock2D (resnets.M, upsamplers.0.conv).
class VaeLevelImpl : public torch::nn::Module {
 public:
  /// `blocks` resnets in -> out then out -> out; a downsampler (encoder) or upsampler (decoder) after them
  /// unless `resample` is false.
  VaeLevelImpl(int64_t in, int64_t out, int64_t blocks, bool decoder, bool resample, const AutoencoderKLOptions& o);
  /// x: [B, in, H, W] -> [B, out, H', W'] (H' = floor(H / 2) down, 2 H up, H without resampling)
  at::Tensor forward(const at::Tensor& x);
  std::vector<ResBlock> resnets;
  Downsample2D down{nullptr};
  Upsample2D up{nullptr};
};
TORCH_MODULE(VaeLevel);

/// diffusers' Encoder (double_z): image -> moments [B, 2 latent_channels, H / 2^(L-1), W / 2^(L-1)].
/// Parameters: conv_in, down_blocks.N.*, mid_block.*, conv_norm_out, conv_out.
class VaeEncoderImpl : public torch::nn::Module {
 public:
  explicit VaeEncoderImpl(const AutoencoderKLOptions& o);
  /// x: [B, in_channels, H, W] in the compute dtype.
  at::Tensor forward(const at::Tensor& x);
  bool remat = false;
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  std::vector<VaeLevel> down_blocks;
  VaeMidBlock mid_block{nullptr};
  torch::nn::GroupNorm conv_norm_out{nullptr};
};
TORCH_MODULE(VaeEncoder);

/// diffusers' Decoder: latents [B, latent_channels, h, w] -> image [B, out_channels, h 2^(L-1), w 2^(L-1)].
/// Parameters: conv_in, mid_block.*, up_blocks.N.* (N = 0 the deepest level), conv_norm_out, conv_out.
class VaeDecoderImpl : public torch::nn::Module {
 public:
  explicit VaeDecoderImpl(const AutoencoderKLOptions& o);
  at::Tensor forward(const at::Tensor& z);
  bool remat = false;
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  VaeMidBlock mid_block{nullptr};
  std::vector<VaeLevel> up_blocks;
  torch::nn::GroupNorm conv_norm_out{nullptr};
};
TORCH_MODULE(VaeDecoder);

/// The `autoencoder_kl` model. Parameters: encoder.*, quant_conv.* (use_quant_conv), post_quant_conv.*
/// (use_post_quant_conv), decoder.*: diffusers' names exactly.
class AutoencoderKLImpl : public AutoencoderImpl {
 public:
  explicit AutoencoderKLImpl(AutoencoderKLOptions options = {});
  void reset();

  /// x: [B, in_channels, H, W] -> the posterior over [B, latent_channels, H / f, W / f] (f = downsampling()):
  /// mean and logvar (clamped to [-30, 20]) in float32 (float64 for a float64 model).
  DiagonalGaussian encode(const at::Tensor& x) override;
  /// quant_conv(encoder(x)): the 2 x latent_channels moments, mean first, before the clamp.
  at::Tensor moments(const at::Tensor& x);
  /// z: [B, latent_channels, h, w] -> decoder(post_quant_conv(z)) [B, out_channels, h f, w f] float32
  /// (float64 for a float64 model).
  at::Tensor decode(const at::Tensor& z) override;
  /// decode(encode(x).mean), or of a posterior sample when `gen` is given (diffusers' forward).
  at::Tensor reconstruct(const at::Tensor& x, std::optional<at::Generator> gen = std::nullopt);

  /// diffusers' tiled_decode: overlapping latent tiles of tile_latent = tile.sample_size / f, stepped by
  /// tile_latent (1 - overlap), each decoded alone; every tile blended linearly into its upper and left
  /// neighbours over tile.sample_size * overlap pixels, then cropped to sample_size (1 - overlap). Activation
  /// memory is one tile's; only the previous row of decoded tiles is kept. Not equal to decode() (each tile
  /// sees only its own context), but equal to diffusers' with enable_tiling().
  at::Tensor tiled_decode(const at::Tensor& z, const VaeTileOptions& tile = {});
  /// diffusers' _tiled_encode, the same scheme over image tiles of tile.sample_size.
  DiagonalGaussian tiled_encode(const at::Tensor& x, const VaeTileOptions& tile = {});

  double scaling_factor() const override { return options.scaling_factor(); }
  double shift_factor() const override { return options.shift_factor().value_or(0.0); }
  /// scaling_factor * (z - shift_factor), or (z - latents_mean) * scaling_factor / latents_std when the
  /// config has per-channel statistics. z: [B, latent_channels, h, w].
  at::Tensor to_latent(const at::Tensor& z) const override;
  /// The inverse of to_latent.
  at::Tensor from_latent(const at::Tensor& latent) const override;
  /// The image side per latent side: 2^(levels - 1), e.g. 8.
  int64_t downsampling() const;
  /// The dtype the model computes in: float64 when its parameters are, else the `dtype` field.
  at::ScalarType compute_dtype() const;

  AutoencoderKLOptions options;
  VaeEncoder encoder{nullptr};
  VaeDecoder decoder{nullptr};
  torch::nn::Conv2d quant_conv{nullptr}, post_quant_conv{nullptr};

 private:
  at::ScalarType dtype_ = at::kFloat;
};
TORCH_MODULE(AutoencoderKL);

/// diffusers' AutoencoderKL config.json (bookkeeping "_" keys already removed) -> `autoencoder_kl` fields.
/// Accepted: in_channels, out_channels, down_block_types (all DownEncoderBlock2D), up_block_types (all
/// UpDecoderBlock2D), block_out_channels, layers_per_block, act_fn (silu), latent_channels, norm_num_groups,
/// sample_size, scaling_factor, shift_factor, latents_mean, latents_std, force_upcast, use_quant_conv,
/// use_post_quant_conv, mid_block_add_attention; absent keys take diffusers' defaults. Anything else is a
/// dew::Error naming it.
json autoencoder_kl_fields_from_diffusers(const json& config);
/// The diffusers config.json of a model of `options` (with "_class_name": "AutoencoderKL").
json autoencoder_kl_diffusers_config(const AutoencoderKLOptions& options);
/// The checkpoint names -> module names: diffusers' names as they are; also the deprecated attention names
/// (query, key, value, proj_attn) of older diffusers files, and the original LDM / CompVis layout
/// (encoder.down.N.block.M, mid.attn_1.q with [C, C, 1, 1] weights, nin_shortcut, norm_out, the decoder's
/// up.N in reverse order, a full SD checkpoint's first_stage_model. prefix).
io::KeyMap autoencoder_kl_key_map(const AutoencoderKLOptions& options, const io::WeightSource& source);

}  // namespace dew::nn
