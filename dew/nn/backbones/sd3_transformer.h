// SD3Transformer (docs/backbones/sd3_transformer.md): diffusers' SD3Transformer2DModel, the MM-DiT denoiser of
// Stable Diffusion 3 / 3.5, with its module tree and parameter names, so a diffusers checkpoint loads as it is;
// also built from a diffusers config.json (models::fields_from_reference_config).
//
//   auto m = dew::nn::SD3Transformer(dew::nn::SD3TransformerOptions());  // diffusers' defaults
//   dew::Conditioning c;  c.context = text;  c.pooled = pooled;          // [B, L, 4096], [B, 2048]
//   at::Tensor v = m->forward(latents, sigma * 1000, c);                 // [B, 16, H, W] -> same
//
// Layout: pos_embed (patchify conv + the cropped 2D sin-cos table), time_text_embed (sinusoid(t) through an
// MLP, plus an MLP of the pooled text), context_embedder (text -> model width); num_layers joint blocks over
// [image tokens; text tokens] with separate weights per stream (adaLN-Zero modulations from the time/text
// vector; SD3.5's dual-attention blocks add a second, image-only attention; the last block's text stream
// gives keys and values only); norm_out (continuous adaLN) and proj_out back to patches.
#pragma once
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <utility>
#include <vector>

#include "dew/nn/attention.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/unet_2d_condition.h"
#include "dew/nn/option_fields.h"

namespace dew::nn {

/// Fields of `sd3_transformer`. Defaults are diffusers' SD3Transformer2DModel defaults; names follow its
/// config where the shared fields allow (out_channels -> output_channels, joint_attention_dim ->
/// context_features; caption_projection_dim is the model width num_attention_heads x attention_head_dim).
struct SD3TransformerOptions {
#define DEW_SD3_TRANSFORMER_FIELDS(F, C)                                                                           \
  F(int64_t, sample_size, 128,                                                                                     \
    "latent side the position table was made for: positions are scaled to sample_size / patch_size")               \
  F(int64_t, patch_size, 2, "patch side in latent pixels")                                                         \
  F(int64_t, in_channels, 16, "latent channels in")                                                                \
  F(int64_t, output_channels, 16, "channels of the prediction (out_channels)")                                     \
  F(int64_t, num_layers, 18, "joint transformer blocks; the last one's text stream gives keys and values only")    \
  F(int64_t, attention_head_dim, 64, "width of each head")                                                         \
  F(int64_t, num_attention_heads, 18, "heads; the model width is heads x attention_head_dim")                      \
  F(int64_t, context_features, 4096, "width of the text context, joint_attention_dim (> 0: the model needs text)") \
  F(int64_t, pooled_projection_dim, 2048, "width of the pooled text vector (pooled_projections)")                  \
  F(int64_t, pos_embed_max_size, 96,                                                                               \
    "side of the stored position table, centre-cropped to the patch grid (0: a table per grid, not stored)")       \
  F(std::vector<int64_t>, dual_attention_layers, (std::vector<int64_t>{}),                                         \
    "blocks with SD3.5's second, image-only attention (attn2)")                                                    \
  C(qk_norm, "none", ({"none", "rms_norm", "layer_norm"}), "normalisation of queries and keys per head (SD3.5)")   \
  F(int64_t, num_classes, 0,                                                                                       \
    "label classes (0 = none; not in diffusers): a class_embedding row added to the time/text vector; label "      \
    "num_classes is the null class")                                                                               \
  F(bool, force_fp32_for_softmax, true, "softmax in fp32 under bf16/fp16 compute")                                 \
  DEW_COMPUTE_FIELDS(F, C, "block")
  DEW_OPTIONS(DEW_SD3_TRANSFORMER_FIELDS)
#undef DEW_SD3_TRANSFORMER_FIELDS
};

/// diffusers' PatchEmbed with SD3's cropping: proj (a patch_size-strided conv) and, with a max size, the
/// buffer pos_embed [1, M * M, dim] (M = pos_embed_max_size), stored in checkpoints.
class SD3PatchEmbedImpl : public torch::nn::Module {
 public:
  /// base_size = sample_size / patch_size scales the positions (diffusers' base_size); max_size 0: no buffer
  SD3PatchEmbedImpl(int64_t in_channels, int64_t dim, int64_t patch_size, int64_t base_size, int64_t max_size);
  void reset();
  /// x: [B, C, H, W] (H, W multiples of patch_size, H / p and W / p <= max_size) -> tokens [B, H/p * W/p, dim]
  /// in raster order with their positions added.
  at::Tensor forward(const at::Tensor& x);
  int64_t dim, patch_size, base_size, max_size;
  torch::nn::Conv2d proj{nullptr};
  at::Tensor pos_embed;  // [1, M * M, dim] float32 (max_size > 0)
};
TORCH_MODULE(SD3PatchEmbed);

/// diffusers' get_2d_sincos_pos_embed for an h x w grid at base_size (interpolation scale 1): row-major
/// positions, each [sin-cos of the column, sin-cos of the row] with coordinates i / (n / base_size).
/// -> [h * w, dim] float32 (computed in float64 as diffusers does).
at::Tensor sd3_position_table(int64_t dim, int64_t h, int64_t w, int64_t base_size);

/// diffusers' Attention with JointAttnProcessor2_0: the image stream's to_q/to_k/to_v/to_out.0 and, when
/// joint, the text stream's add_q_proj/add_k_proj/add_v_proj/to_add_out; qk_norm per head as norm_q/norm_k
/// (norm_added_q/norm_added_k for the text). A pre-only text stream (the last block) has keys and values
/// only: its queries would feed nothing but the discarded text output.
class SD3AttentionImpl : public torch::nn::Module {
 public:
  /// qk_norm: "none", "rms_norm" or "layer_norm" (eps 1e-6); joint: a text stream; pre_only: that stream gives
  /// keys and values only
  SD3AttentionImpl(int64_t dim, int64_t heads, int64_t head_dim, std::string qk_norm, bool joint, bool pre_only,
                   std::string impl, bool force_fp32_for_softmax);
  void reset();
  /// x: [B, N, dim]; text: [B, L, dim] (joint) or undefined; mask: [B, N + L] bool key mask or undefined.
  /// Returns {image output [B, N, dim], text output [B, L, dim] (undefined when pre-only or not joint)}.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& text = {},
                                            const at::Tensor& mask = {});
  int64_t dim, heads, head_dim;
  std::string qk_norm, impl;
  bool joint, pre_only, force_fp32_for_softmax;
  torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr}, to_out_0{nullptr};
  torch::nn::Linear add_q_proj{nullptr}, add_k_proj{nullptr}, add_v_proj{nullptr}, to_add_out{nullptr};
  HeadNorm norm_q{nullptr}, norm_k{nullptr}, norm_added_q{nullptr}, norm_added_k{nullptr};  // qk_norm only
};
TORCH_MODULE(SD3Attention);

/// diffusers' JointTransformerBlock. Parameters: norm1.linear (6 or, dual, 9 x dim), norm1_context.linear (6 x
/// dim, or 2 x dim for the pre-only last block: AdaLayerNormContinuous), attn.*, attn2.* (dual), ff.net.0.proj,
/// ff.net.2, ff_context.* (not pre-only).
class SD3JointBlockImpl : public torch::nn::Module {
 public:
  SD3JointBlockImpl(int64_t dim, int64_t heads, int64_t head_dim, bool pre_only, bool dual, std::string qk_norm,
                    std::string impl, bool force_fp32_for_softmax);
  /// x: [B, N, dim], text: [B, L, dim], temb: [B, dim], mask: [B, N + L] bool or undefined.
  /// Returns {x', text'} (text' undefined for the pre-only block).
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& text, const at::Tensor& temb,
                                            const at::Tensor& mask = {});
  int64_t dim;
  bool pre_only, dual;
  torch::nn::Linear norm1{nullptr}, norm1_context{nullptr};  // the .linear of each (the norms have no weights)
  SD3Attention attn{nullptr}, attn2{nullptr};
  torch::nn::Linear ff_in{nullptr}, ff_out{nullptr}, ff_context_in{nullptr}, ff_context_out{nullptr};
};
TORCH_MODULE(SD3JointBlock);

/// The SD3Transformer backbone. Parameters (diffusers' names): pos_embed.proj, pos_embed.pos_embed (buffer),
/// time_text_embed.{timestep_embedder, text_embedder}.linear_{1,2}, context_embedder, class_embedding
/// (num_classes > 0), transformer_blocks.N.*, norm_out.linear, proj_out.
class SD3TransformerImpl : public BackboneImpl {
 public:
  explicit SD3TransformerImpl(SD3TransformerOptions options = {});
  void reset();
  /// x: [B, in_channels, H, W] latents (H, W multiples of patch_size); time: [B] or a scalar, the model time on
  /// diffusers' 0..1000 scale (sigma x 1000 under the flow preset); cond: context [B, L, context_features]
  /// (+ context_mask [B, L], true = real token: padded tokens are masked out as keys; diffusers has no mask),
  /// pooled [B, pooled_projection_dim], labels [B] when num_classes > 0.
  /// Returns [B, output_channels, H, W] float32 (float64 for a float64 model).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) override;
  bool requires_text() const override { return true; }
  bool takes_pooled() const override { return true; }

  SD3TransformerOptions options;
  SD3PatchEmbed pos_embed{nullptr};
  TimestepMLP timestep_embedder{nullptr}, text_embedder{nullptr};  // under time_text_embed
  torch::nn::Linear context_embedder{nullptr}, norm_out{nullptr}, proj_out{nullptr};
  torch::nn::Embedding class_embedding{nullptr};
  std::vector<SD3JointBlock> blocks;  // transformer_blocks.N

 private:
  at::ScalarType dtype_ = at::kFloat;
};
TORCH_MODULE(SD3Transformer);

/// The fields of a diffusers SD3Transformer2DModel config.json (bookkeeping keys already removed); a setting
/// this implementation does not support is a dew::Error naming the key, its value and what is accepted.
json sd3_transformer_fields_from_diffusers(const json& config);

/// The key map from a diffusers checkpoint to the module of `fields`: names as they are, except the pre-only
/// last block's add_q_proj / norm_added_q, which diffusers holds but never uses for the output, are dropped.
io::KeyMap sd3_transformer_key_map(const SD3TransformerOptions& options);

}  // namespace dew::nn
