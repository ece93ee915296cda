// QwenImageVae (docs/backbones/qwen_image_transformer.md): diffusers' AutoencoderKLQwenImage21, the VAE of Qwen-Image 2.1, with its module
// tree and parameter names (a diffusers vae/ checkpoint loads with an identity key map); also built from a diffusers
// config.json (models::fields_from_reference_config).
//
//   auto vae = dew::nn::QwenImageVae(dew::nn::QwenImageVaeOptions());    // the release: 4 channels in, z_dim 64
//   dew::DiagonalGaussian q = vae->encode(x);          // x: [B, 4, 1024, 1024] in [-1, 1] -> [B, 64, 64, 64]
//   at::Tensor latent = vae->to_latent(q.mean);        // (z - latents_mean) / latents_std: what the transformer sees
//   at::Tensor image = vae->decode(vae->from_latent(latent));   // [B, 4, 1024, 1024], clamped to [-1, 1]
//
// The reference is Wan 2.2's causal video VAE specialised to one frame: its causal convolutions are 2-D, so an
// image is its only input (diffusers refuses a second frame too). dew runs the image in [B, C, H, W]; the
// reference's [B, C, 1, H, W] is what `dew forward` reads and writes. With one frame the feature cache of the
// reference never holds a previous frame, so the temporal convolutions (time_conv of the temporally resampling
// levels) are never reached: they are kept as buffers, loaded and saved with the checkpoint, not trained.
//
// Layout (is_residual, the release's): encoder.conv_in (3x3); encoder.down_blocks.N: resnets.M (num_res_blocks,
// in -> out then out -> out), downsampler.resample.1 (pad right and bottom by one, stride-2 3x3) except at the last
// level, and the parameter-free shortcut (AvgDown3D: the input's 2x2 pixels, and with the level's temporal factor a
// zero frame before it, folded into channels and averaged in groups to the level's width) added to the output;
// encoder.mid_block.{resnets.0, attentions.0, resnets.1}; encoder.norm_out, SiLU, encoder.conv_out to 2 z_dim;
// quant_conv (1x1); post_quant_conv (1x1); decoder.conv_in; decoder.mid_block; decoder.up_blocks.N (deepest level
// first): resnets.M (num_res_blocks + 1), upsampler.resample.1 (nearest 2x, 3x3) except at the last, and the
// shortcut (DupUp3D: channels repeated and unfolded into 2x2 pixels, the last frame of a temporal pair kept);
// decoder.norm_out, SiLU, decoder.conv_out; the decoded image clamped to [-1, 1]. Resnets: RMS norm (x / |x| over
// channels x sqrt(C) x gamma), SiLU, 3x3 conv, RMS norm, SiLU, dropout, 3x3 conv, plus the input (1x1
// conv_shortcut when the width changes). Mid-block attention: RMS norm, one head over all channels (to_qkv 1x1,
// proj 1x1), plus the input.
#pragma once
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/pimpl.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dew/core/options.h"
#include "dew/nn/family.h"
#include "dew/nn/option_fields.h"
#include "dew/nn/roles.h"

namespace dew::nn {

/// Fields of `autoencoder_kl_qwen_image`. Defaults are diffusers' AutoencoderKLQwenImage21 defaults (Qwen-Image
/// 2.1's VAE), its 64 latent statistics included.
struct QwenImageVaeOptions {
  // remat checkpoints each down / up block and the mid-blocks; a float64 model runs float64 whatever dtype says.
#define DEW_QWEN_IMAGE_VAE_FIELDS(F, C)                                                                           \
  F(int64_t, in_channels, 4, "image channels in (the release: 4, RGBA)")                                          \
  F(int64_t, out_channels, 4, "image channels out")                                                               \
  F(int64_t, base_dim, 96, "encoder width of the first level; level N is base_dim x dim_mult[N]")                 \
  F(int64_t, decoder_base_dim, 144, "decoder width unit (diffusers' decoder_base_dim)")                           \
  F(int64_t, z_dim, 64, "latent channels")                                                                        \
  F(std::vector<int64_t>, dim_mult, (std::vector<int64_t>{1, 2, 4, 8, 8}),                                        \
    "width multipliers per level; the image is downsampled 2^(levels - 1) times (the release: 16)")               \
  F(int64_t, num_res_blocks, 2, "resnets per encoder level (the decoder has one more)")                           \
  F(std::vector<bool>, temperal_downsample, (std::vector<bool>{false, true, true, true}),                         \
    "per downsampling level: its shortcut folds a zero frame in (the decoder's, reversed, keeps the last frame)") \
  F(double, dropout, 0.0, "dropout in every resnet (training only)")                                              \
  F(std::optional<std::vector<double>>, latents_mean, std::nullopt,                                               \
    "per-channel latent mean: to_latent = (z - mean) / std (null: 0; a config without it takes diffusers' 64)")   \
  F(std::optional<std::vector<double>>, latents_std, std::nullopt, "per-channel latent std (null: 1)")            \
  F(bool, force_fp32_for_softmax, true, "softmax of the mid-block attention in fp32 under bf16/fp16 compute")     \
  DEW_COMPUTE_FIELDS(F, C, "block")
  DEW_OPTIONS(DEW_QWEN_IMAGE_VAE_FIELDS)
#undef DEW_QWEN_IMAGE_VAE_FIELDS
};

/// QwenImage21RMS_norm: x / max(|x|, 1e-12) over channels, times sqrt(C) and gamma (normalised in float32 under
/// half compute). Parameter: gamma [C, 1, 1, 1] (`images` false, the resnets') or [C, 1, 1] (the attention's).
class QwenVaeRmsNormImpl : public torch::nn::Module {
 public:
  QwenVaeRmsNormImpl(int64_t channels, bool images);
  /// x: [B, C, H, W] -> [B, C, H, W]
  at::Tensor forward(const at::Tensor& x);
  at::Tensor gamma;
};
TORCH_MODULE(QwenVaeRmsNorm);

/// QwenImage21ResidualBlock: norm1, conv1, norm2, conv2, conv_shortcut (when in != out).
class QwenVaeResBlockImpl : public torch::nn::Module {
 public:
  QwenVaeResBlockImpl(int64_t in, int64_t out, double dropout);
  /// x: [B, in, H, W] -> [B, out, H, W]
  at::Tensor forward(const at::Tensor& x);
  QwenVaeRmsNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv_shortcut{nullptr};
  double dropout = 0.0;
};
TORCH_MODULE(QwenVaeResBlock);

/// QwenImage21MidBlock: resnets.0, attentions.0 (norm, to_qkv, proj), resnets.1.
class QwenVaeMidBlockImpl : public torch::nn::Module {
 public:
  QwenVaeMidBlockImpl(int64_t channels, const QwenImageVaeOptions& o);
  /// x: [B, C, H, W] -> [B, C, H, W]
  at::Tensor forward(const at::Tensor& x);
  std::vector<QwenVaeResBlock> resnets;
  QwenVaeRmsNorm norm{nullptr};
  torch::nn::Conv2d to_qkv{nullptr}, proj{nullptr};
  std::string attention_impl;
  bool force_fp32_for_softmax = true;
};
TORCH_MODULE(QwenVaeMidBlock);

/// QwenImage21ResidualDownBlock (encoder) or QwenImage21ResidualUpBlock (decoder): resnets.M, the resampler
/// (downsampler / upsampler: resample.1 and the unused time_conv buffers of a temporal level) and the
/// parameter-free shortcut.
class QwenVaeLevelImpl : public torch::nn::Module {
 public:
  /// `blocks` resnets in -> out then out -> out; `resample`: a 2x down (encoder) or up (decoder) step after them;
  /// `temporal`: the level's temporal factor 2 (time_conv buffers, the shortcut's frame fold).
  QwenVaeLevelImpl(int64_t in, int64_t out, int64_t blocks, bool decoder, bool resample, bool temporal, double dropout);
  /// x: [B, in, H, W] -> [B, out, H', W'] (H' = H / 2 down, 2 H up, H without resampling)
  at::Tensor forward(const at::Tensor& x);
  std::vector<QwenVaeResBlock> resnets;
  torch::nn::Conv2d resample{nullptr};
  int64_t in = 0, out = 0;
  bool decoder = false, resampling = false, temporal = false;
};
TORCH_MODULE(QwenVaeLevel);

/// QwenImage21Encoder3d (image -> 2 z_dim moments) or QwenImage21Decoder3d (z_dim latents -> image): conv_in,
/// down_blocks.N then mid_block (encoder) or mid_block then up_blocks.N (decoder), norm_out, SiLU, conv_out.
class QwenVaeCoderImpl : public torch::nn::Module {
 public:
  QwenVaeCoderImpl(const QwenImageVaeOptions& o, bool decoder);
  /// x: [B, C, H, W] in the compute dtype.
  at::Tensor forward(const at::Tensor& x);
  bool remat = false;
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  std::vector<QwenVaeLevel> levels;  // down_blocks / up_blocks
  QwenVaeMidBlock mid_block{nullptr};
  QwenVaeRmsNorm norm_out{nullptr};
  bool decoder = false;
};
TORCH_MODULE(QwenVaeCoder);

/// The `autoencoder_kl_qwen_image` model. Parameters: encoder.*, quant_conv.*, post_quant_conv.*, decoder.*:
/// diffusers' names exactly (the time_conv tensors as buffers).
class QwenImageVaeImpl : public AutoencoderImpl {
 public:
  explicit QwenImageVaeImpl(QwenImageVaeOptions options = {});
  void reset();

  /// x: [B, in_channels, H, W] (H, W multiples of downsampling()) -> the posterior over [B, z_dim, H / f, W / f]:
  /// mean and logvar (clamped to [-30, 20]) in float32 (float64 for a float64 model).
  DiagonalGaussian encode(const at::Tensor& x) override;
  /// z: [B, z_dim, h, w] -> the image [B, out_channels, h f, w f] clamped to [-1, 1], float32 (float64 for a
  /// float64 model).
  at::Tensor decode(const at::Tensor& z) override;
  /// 1: the latent normalisation is per channel (to_latent).
  double scaling_factor() const override { return 1.0; }
  /// (z - latents_mean) / latents_std per channel, what QwenImage21Pipeline feeds the transformer. z: [B, z_dim, h, w].
  at::Tensor to_latent(const at::Tensor& z) const override;
  /// z = latent x latents_std + latents_mean, what the pipeline decodes.
  at::Tensor from_latent(const at::Tensor& latent) const override;
  /// The image side per latent side: 2^(levels - 1) (the release: 16).
  int64_t downsampling() const;
  /// The dtype the model computes in: float64 when its parameters are, else the `dtype` field.
  at::ScalarType compute_dtype() const;

  QwenImageVaeOptions options;
  QwenVaeCoder encoder{nullptr}, decoder{nullptr};
  torch::nn::Conv2d quant_conv{nullptr}, post_quant_conv{nullptr};

 private:
  at::Tensor statistics(const std::optional<std::vector<double>>& values, double fallback,
                        const at::Tensor& like) const;
  at::ScalarType dtype_ = at::kFloat;
};
TORCH_MODULE(QwenImageVae);

/// diffusers' AutoencoderKLQwenImage21 config.json (bookkeeping "_" keys already removed) -> the fields. Accepted:
/// base_dim, decoder_base_dim, z_dim, dim_mult, num_res_blocks, attn_scales (unused by the residual layout, as in
/// diffusers), temperal_downsample, dropout, latents_mean, latents_std (absent: diffusers' defaults), is_residual
/// (true only), in_channels, out_channels, patch_size (null or 1), scale_factor_temporal and scale_factor_spatial
/// (recorded by diffusers, unused); absent keys take diffusers' defaults. Anything else is a dew::Error naming it.
json qwen_image_vae_fields_from_diffusers(const json& config);

/// The reference methods `dew forward` runs: encode (sample [B, C, 1, H, W] or [B, C, H, W] -> latent_mean,
/// latent_logvar in the same rank), decode (z -> sample, clamped) and forward (sample -> the decode of the
/// posterior mean). A sample of more than one frame is refused (the model is image-only, as diffusers').
std::vector<models::ReferenceMethod> qwen_image_vae_methods();

}  // namespace dew::nn
