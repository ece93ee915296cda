// Unet (docs/backbones.md): a convolutional U-Net with time injection and attention stages.
//
//   auto model = dew::nn::Unet(dew::nn::UnetOptions().feature_depths({32, 64}).attention_configs({{}, 4}));
//   at::Tensor F = model->forward(x, t, {});   // x: [B, 3, H, W], H and W multiples of 2^(levels - 1)
//
// Layout (ADM-style): conv_in; per level num_res_blocks residual blocks to feature_depths[i] (attention
// after the last one where the level has heads), then a stride-2 conv (except at the last level); every
// block output and downsample output is kept as a skip. Middle: (res, [attention on the last], res) x
// num_middle_res_blocks at the deepest width. Up, deepest first: num_res_blocks + 1 residual blocks per
// level, each consuming one skip (in reverse), attention after the last, nearest 2x + conv upsampling.
// Out: GroupNorm, activation, zero-initialised 3x3 conv, so the prediction is 0 at initialisation.
#pragma once
#include <torch/arg.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <functional>
#include <optional>
#include <string>

#include "dew/nn/backbones/backbone.h"
#include "dew/nn/blocks.h"
#include "dew/nn/option_fields.h"

namespace dew::nn {

/// Fields of `unet`. Example: UnetOptions().feature_depths({64, 128}).attention_configs({{}, 4})
struct UnetOptions {
#define DEW_UNET_FIELDS(F, C)                                                                                  \
  F(int64_t, output_channels, 3, "channels of the prediction")                                                 \
  F(int64_t, emb_features, 256, "width of the time embedding")                                                 \
  F(std::vector<int64_t>, feature_depths, (std::vector<int64_t>{64, 128, 256, 512}),                           \
    "channels per level (multiples of norm_groups)")                                                           \
  F(std::vector<std::optional<int64_t>>, attention_configs, (std::vector<std::optional<int64_t>>{8, 8, 8, 8}), \
    "attention heads per level, null for none")                                                                \
  F(int64_t, num_res_blocks, 2, "residual blocks per level on the way down (one more on the way up)")          \
  F(int64_t, num_middle_res_blocks, 1, "(res, attention, res) groups in the middle")                           \
  C(activation, "swish", ({"swish", "silu", "gelu", "gelu_tanh", "relu", "mish"}),                             \
    "activation of the residual blocks")                                                                       \
  F(int64_t, norm_groups, 8, "GroupNorm groups")                                                               \
  DEW_DENOISER_INPUT_FIELDS(F, 0, "0 = no text")                                                               \
  F(double, dropout_rate, 0.0, "dropout inside residual blocks")                                               \
  F(bool, force_fp32_for_softmax, true, "softmax in fp32 under bf16/fp16 compute")                             \
  DEW_COMPUTE_FIELDS(F, C, "block")
  DEW_OPTIONS(DEW_UNET_FIELDS)
#undef DEW_UNET_FIELDS
};

/// Options of UnetAttention. Example: UnetAttentionOptions(256, 8).context_dim(768)
struct UnetAttentionOptions {
  UnetAttentionOptions(int64_t channels, int64_t num_heads) : channels_(channels), num_heads_(num_heads) {}
  TORCH_ARG(int64_t, channels);
  TORCH_ARG(int64_t, num_heads);
  /// width of the text context; 0 = self-attention only
  TORCH_ARG(int64_t, context_dim) = 0;
  TORCH_ARG(std::string, impl) = "auto";
  TORCH_ARG(bool, force_fp32_for_softmax) = true;
};

/// Attention stage over the H x W positions: x + attn1(norm1(x)), then x + attn2(norm2(x), context)
/// when a context is configured and given. Parameters: norm1.*, attn1.{qkv,proj}.*, and with a context
/// norm2.*, attn2.{q,kv,proj}.*.
class UnetAttentionImpl : public torch::nn::Module {
 public:
  explicit UnetAttentionImpl(UnetAttentionOptions options);
  void reset();
  /// x: [B, C, H, W]; context: [B, L, context_dim] or undefined; mask: [B, L] bool or undefined.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context = {}, const at::Tensor& context_mask = {});

  UnetAttentionOptions options;
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  SelfAttention attn1{nullptr};
  CrossAttention attn2{nullptr};
};
TORCH_MODULE(UnetAttention);

/// The Unet backbone. Parameters (names stable across dtype, attention_impl and remat):
///   t_embedder.*, y_embedder.weight (num_classes > 0), conv_in.*,
///   down_blocks.I.resnets.J.*, down_blocks.I.attention.*, down_blocks.I.downsample.*,
///   mid_block.resnets.K.*, mid_block.attention.*,
///   up_blocks.I.resnets.J.*, up_blocks.I.attention.*, up_blocks.I.upsample.*  (I = 0 is the deepest level),
///   norm_out.*, conv_out.*
class UnetImpl : public BackboneImpl {
 public:
  explicit UnetImpl(UnetOptions options = {});
  void reset();
  /// x: [B, in_channels, H, W] with H, W multiples of 2^(levels - 1); time: [B] (or a scalar);
  /// cond: optional labels [B], context [B, L, context_features] + context_mask [B, L].
  /// Returns [B, output_channels, H, W] float32.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) override;

  UnetOptions options;
  TimeEmbedding t_embedder{nullptr};
  torch::nn::Embedding y_embedder{nullptr};
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::GroupNorm norm_out{nullptr};

  // Typed views of the registered blocks, in execution order.
  struct Level {
    std::vector<ResBlock> resnets;
    UnetAttention attention{nullptr};     // after the last resnet; empty when the level has no heads
    torch::nn::Conv2d resample{nullptr};  // downsample (stride 2) or upsample conv; empty at the ends
  };
  std::vector<Level> down, up;
  Level mid;  // resnets in pairs (before, after) around the attention of the last pair

 protected:
  /// Where a level hook runs: after down level `index`'s blocks (before its last skip is kept and before
  /// its downsample), after the middle blocks (index 0), after up level `index`'s blocks (index 0 is the
  /// deepest level; before its upsample).
  enum class Site { down, mid, up };
  /// Transforms the hidden state h: [B', C, h, w] at a site; UNet3D's temporal blocks are such hooks.
  using LevelHook = std::function<at::Tensor(const at::Tensor& h, Site site, int64_t index)>;
  /// For models built on this body (unet_3d): `arch` names the architecture in error messages.
  UnetImpl(UnetOptions options, std::string arch);
  /// forward with `hook` (may be empty) applied at every site; forward(x, t, c) = run(x, t, c, {}).
  at::Tensor run(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond, const LevelHook& hook);

  std::string arch_;
  at::ScalarType dtype_ = at::kFloat;

 private:
  at::Tensor run_res(ResBlock block, const at::Tensor& h, const at::Tensor& temb);
  at::Tensor run_attention(UnetAttention block, const at::Tensor& h, const Conditioning& cond);
};
TORCH_MODULE(Unet);

}  // namespace dew::nn
