// UNet2DCondition (docs/stable_diffusion.md): diffusers' UNet2DConditionModel, the denoiser of
// Stable Diffusion 1.x / 2.x / SDXL, with its module tree and parameter names, so their checkpoints load
// without renaming; also built from a diffusers config.json (models::fields_from_reference_config).
//
//   auto unet = dew::nn::UNet2DCondition(dew::nn::UNet2DConditionOptions());      // SD 1.5's layout
//   dew::Conditioning c;  c.context = text;                                      // [B, 77, 768]
//   at::Tensor eps = unet->forward(latents, timesteps, c);                       // [B, 4, 64, 64] -> same
//
// Layout: conv_in; time_embedding(sinusoid(t)) (+ class_embedding(label)) (+ add_embedding([pooled,
// sinusoid(time_ids)]) for SDXL); per level blocks_per_level resnets, each followed by a spatial
// transformer on cross-attention levels, then a stride-2 conv except at the last level; every resnet /
// transformer output and every downsample is kept as a skip. mid_block: resnet, transformer, resnet (or
// one resnet). Up, deepest first: blocks_per_level + 1 resnets per level, each consuming one skip in
// reverse (concatenated on channels), transformers on cross-attention levels, nearest 2x + conv. Out:
// GroupNorm, SiLU, conv_out.
#pragma once
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <string>
#include <vector>

#include "dew/nn/backbones/backbone.h"
#include "dew/nn/diffusers_blocks.h"
#include "dew/nn/option_fields.h"

namespace dew::nn {

/// One resolution level of UNet2DCondition. Example: UNetStage{640, 10, 2} (SDXL's middle level)
struct UNetStage {
  int64_t features = 320;
  int64_t heads = 8;
  int64_t depth = 1;
  bool cross_attention = true;
  bool cross_only = false;
  template <class V>
  void visit(V& v) {
    v("features", features, "channels of the level (block_out_channels[i])");
    v("heads", heads, "attention heads of its transformers (diffusers' attention_head_dim / num_attention_heads)");
    v("depth", depth, "transformer blocks per spatial transformer (transformer_layers_per_block[i])");
    v("cross_attention", cross_attention,
      "the level has spatial transformers, self + cross-attention (CrossAttnDownBlock2D / CrossAttnUpBlock2D); "
      "false: resnets only");
    v("cross_only", cross_only, "attn1 attends to the text instead of the image (only_cross_attention)");
  }
};

/// Fields of `unet_2d_condition`. Defaults are SD 1.5's UNet.
struct UNet2DConditionOptions {
#define DEW_UNET_2D_CONDITION_FIELDS(F, C)                                                                           \
  F(int64_t, in_channels, 4, "latent channels in (without inpaint channels)")                                        \
  F(int64_t, output_channels, 4, "channels of the prediction")                                                       \
  F(std::vector<UNetStage>, stages,                                                                                  \
    (std::vector<UNetStage>{                                                                                         \
        {320, 8, 1, true, false}, {640, 8, 1, true, false}, {1280, 8, 1, true, false}, {1280, 8, 1, false, false}}), \
    "levels, shallowest first: {features, heads, depth, cross_attention, cross_only}")                               \
  F(int64_t, blocks_per_level, 2, "resnets per level on the way down (one more on the way up)")                      \
  F(int64_t, context_features, 768,                                                                                  \
    "width of the text context, cross_attention_dim (0 = none: the transformers self-attend)")                       \
  F(bool, linear_projection, false, "transformer proj_in/proj_out as Linear instead of 1x1 conv (SD 2.x, SDXL)")     \
  F(int64_t, additional_time_features, 0, "SDXL: sinusoid width per time id, addition_time_embed_dim (0 = none)")    \
  F(int64_t, additional_embedding_features, 0,                                                                       \
    "SDXL: width of [pooled text, time id sinusoids] (projection_class_embeddings_input_dim)")                       \
  F(bool, middle_attention, true, "middle block: resnet, transformer, resnet (false: one resnet)")                   \
  F(double, frequency_shift, 0.0, "downscale_freq_shift of the time sinusoid (freq_shift)")                          \
  F(bool, cosine_first, true, "time sinusoid as [cos, sin] (flip_sin_to_cos)")                                       \
  F(double, dropout, 0.0, "dropout in resnets and transformer blocks")                                               \
  F(int64_t, norm_groups, 32, "GroupNorm groups of resnets, transformers and the output norm")                       \
  F(double, norm_epsilon, 1e-5, "epsilon of the resnets' and output GroupNorms (norm_eps)")                          \
  F(double, attention_norm_epsilon, 1e-6, "epsilon of the GroupNorm before each transformer")                        \
  F(bool, approximate_gelu, false, "GEGLU with the tanh GELU")                                                       \
  F(int64_t, inpaint_channels, 0,                                                                                    \
    "extra inpainting input channels (5 for SD): cond.extra mask [B, 1, H, W] and masked_image_latents "             \
    "[B, inpaint_channels - 1, H, W], concatenated after x")                                                         \
  F(int64_t, num_classes, 0, "label classes (0 = none); label num_classes is the null class")                        \
  F(bool, upcast_attention, false, "attention scores in float32 under half precision")                               \
  F(bool, force_fp32_for_softmax, true, "softmax in fp32 under bf16/fp16 compute")                                   \
  DEW_COMPUTE_FIELDS(F, C, "block")
  DEW_OPTIONS(DEW_UNET_2D_CONDITION_FIELDS)
#undef DEW_UNET_2D_CONDITION_FIELDS
};

/// diffusers' TimestepEmbedding: linear_2(SiLU(linear_1(x))). Parameters: linear_1, linear_2.
class TimestepMLPImpl : public torch::nn::Module {
 public:
  TimestepMLPImpl(int64_t in, int64_t out);
  /// x: [B, in] -> [B, out]
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear linear_1{nullptr}, linear_2{nullptr};
};
TORCH_MODULE(TimestepMLP);

/// The UNet2DCondition backbone. Parameters (diffusers' names): conv_in, time_embedding.linear_{1,2},
/// class_embedding (num_classes > 0), add_embedding.linear_{1,2} (SDXL), down_blocks.I.{resnets.J,
/// attentions.J, downsamplers.0.conv}, mid_block.{resnets.K, attentions.0}, up_blocks.I.{resnets.J,
/// attentions.J, upsamplers.0.conv} (I = 0 deepest), conv_norm_out, conv_out.
class UNet2DConditionImpl : public BackboneImpl {
 public:
  explicit UNet2DConditionImpl(UNet2DConditionOptions options = {});
  void reset();
  /// x: [B, in_channels, H, W] (any H, W: the upsamplers follow the skips' sizes); time: [B] or a scalar
  /// (diffusers' timestep); cond: context [B, L, context_features] (+ context_mask [B, L]), labels [B],
  /// pooled [B, P] = SDXL's text_embeds with extra "time_ids" [B, n], inpaint extra "mask" and
  /// "masked_image_latents". Returns [B, output_channels, H, W] float32 (float64 for a float64 model).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) override;
  bool requires_text() const override;

  UNet2DConditionOptions options;
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  TimestepMLP time_embedding{nullptr}, add_embedding{nullptr};
  torch::nn::Embedding class_embedding{nullptr};
  torch::nn::GroupNorm conv_norm_out{nullptr};

  // Typed views of the registered blocks, in execution order.
  struct Level {
    std::vector<ResBlock> resnets;
    std::vector<Transformer2D> attentions;  // one per resnet on cross-attention levels, else empty
    Downsample2D downsample{nullptr};
    Upsample2D upsample{nullptr};
  };
  std::vector<Level> down, up;
  Level mid;

 private:
  at::Tensor run_res(ResBlock& block, const at::Tensor& h, const at::Tensor& temb);
  at::ScalarType dtype_ = at::kFloat;
};
TORCH_MODULE(UNet2DCondition);

/// The fields of a diffusers UNet2DConditionModel config.json (bookkeeping keys already removed); a
/// setting this implementation does not support is a dew::Error naming it.
json unet_2d_condition_fields_from_diffusers(const json& config);

}  // namespace dew::nn
