// QwenImage1Transformer (docs/backbones/qwen_image_transformer.md#qwen-image-1): diffusers'
// QwenImageTransformer2DModel, the dual-stream denoiser of Qwen-Image (1) and Qwen-Image-Edit, with its module tree
// and parameter names (a diffusers checkpoint loads with an identity key map); also built from a diffusers
// config.json (models::fields_from_reference_config).
//
//   auto qwen = dew::nn::QwenImage1Transformer(dew::nn::QwenImage1TransformerOptions());   // Qwen-Image's
//   dew::Conditioning c;
//   c.context = text_states;          // [B, L, 3584], Qwen2.5-VL's states, right-padded
//   c.context_mask = mask;            // [B, L] bool, true = a real token
//   at::Tensor v = qwen->forward(latents, sigma * 1000, c);   // [B, 16, H, W] -> [B, 16, H, W] (H, W even)
//
// Layout: the latents packed into 2 x 2 patches (QwenImagePipeline._pack_latents, Flux's packing), img_in
// projects them; the text goes through txt_norm (RMSNorm) and txt_in; temb = timestep_embedder(sinusoid of 1000 t,
// t the timestep in [0, 1]). num_layers dual-stream blocks: each stream its own modulation (img_mod / txt_mod:
// SiLU, Linear D -> 6 D: shift, scale, gate for the attention and for the MLP), LayerNorm without affine, one joint
// attention over [text; image] (q / k RMS-normalised per head, padded text keys excluded), GELU-tanh MLPs of 4 D.
// RoPE (QwenEmbedRope, scale_rope): three axes (frame, height, width) as complex rotations; an image's rows and
// columns are centred (positions -ceil(h / 2) .. floor(h / 2) - 1), the frame axis counts the images, and the text
// takes positions m, m + 1, ... on every axis after m = the largest half side. Then AdaLayerNormContinuous
// (scale, shift) and proj_out on the image tokens, unpacked back to [B, C, H, W].
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <utility>
#include <vector>

#include "dew/io/weights.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/flux_transformer.h"
#include "dew/nn/backbones/qwen_image_transformer.h"
#include "dew/nn/option_fields.h"

namespace dew::nn {

/// Fields of `qwen_image1_transformer`. Defaults are Qwen-Image's (diffusers' QwenImageTransformer2DModel).
struct QwenImage1TransformerOptions {
#define DEW_QWEN_IMAGE1_TRANSFORMER_FIELDS(F, C)                                                                 \
  F(int64_t, in_channels, 16, "latent channels C of x [B, C, H, W] (diffusers' in_channels / 4: 2 x 2 packing)") \
  F(int64_t, output_channels, 16, "channels of the prediction (diffusers' out_channels)")                        \
  F(int64_t, num_classes, 0, "must be 0: Qwen-Image conditions on text, not on class labels")                    \
  F(int64_t, context_features, 3584, "width of the text states (joint_attention_dim; Qwen2.5-VL's 3584)")        \
  F(int64_t, num_layers, 60, "dual-stream blocks (transformer_blocks)")                                          \
  F(int64_t, num_attention_heads, 24, "attention heads; the model width is num_attention_heads x head dim")      \
  F(int64_t, attention_head_dim, 128, "width of each head")                                                      \
  F(std::vector<int64_t>, axes_dims_rope, (std::vector<int64_t>{16, 56, 56}),                                    \
    "RoPE widths of the frame, height and width axes (even, summing to attention_head_dim)")                     \
  F(bool, force_fp32_for_softmax, true, "softmax in fp32 under bf16/fp16 compute")                               \
  DEW_COMPUTE_FIELDS(F, C, "block")
  DEW_OPTIONS(DEW_QWEN_IMAGE1_TRANSFORMER_FIELDS)
#undef DEW_QWEN_IMAGE1_TRANSFORMER_FIELDS
};

/// QwenEmbedRope (scale_rope) of one forward: the image tokens' tables (each image of img_shapes in turn, frame
/// index = its place) and the text's (positions m .. m + text_len - 1 on every axis, m the largest half side).
struct QwenImage1Rope {
  QwenRope image, text;
};
/// img_shapes: (frames, height, width) of each image in packed tokens. A shape that is not three positive values
/// is a dew::Error naming `where`.
QwenImage1Rope qwen_image1_rope(const std::vector<std::vector<int64_t>>& img_shapes, int64_t text_len,
                                const std::vector<int64_t>& axes_dims, const std::string& where,
                                const at::Device& device = at::kCPU);

/// diffusers' QwenImageTransformerBlock. Parameters: img_mod.1 [6 D, D], txt_mod.1 [6 D, D], attn.* (to_q / to_k /
/// to_v, add_q_proj / add_k_proj / add_v_proj with bias, norm_q / norm_k / norm_added_q / norm_added_k, to_out.0,
/// to_add_out), img_mlp.net.{0.proj, 2}, txt_mlp.net.{0.proj, 2}. `text_out` false (the last block): the text
/// stream gives only keys and values, so add_q_proj, norm_added_q, to_add_out and txt_mlp, whose outputs diffusers
/// computes and discards, are not built (the checkpoint's are skipped: qwen_image1_transformer_key_map).
class QwenImage1BlockImpl : public torch::nn::Module {
 public:
  QwenImage1BlockImpl(FluxBlockOptions options, bool text_out);
  /// x: [B, N, D] image tokens; txt: [B, L, D] text tokens; temb: [B, D]; key_mask: [B, L + N] bool or undefined.
  /// Returns {x, txt} updated (txt unchanged without text_out).
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& txt, const at::Tensor& temb,
                                            const QwenImage1Rope& rope, const at::Tensor& key_mask);
  FluxBlockOptions options;
  torch::nn::Linear img_mod{nullptr}, txt_mod{nullptr};  // img_mod.1, txt_mod.1
  FluxAttention attn{nullptr};
  FluxFeedForward img_mlp{nullptr}, txt_mlp{nullptr};
  bool text_out = true;
};
TORCH_MODULE(QwenImage1Block);

/// The QwenImage1Transformer backbone. Parameters (diffusers' names): img_in [D, 4 in_channels], txt_norm.weight,
/// txt_in [D, context_features], time_text_embed.timestep_embedder.linear_{1,2}, transformer_blocks.I.*,
/// norm_out.linear [2 D, D], proj_out [4 output_channels, D].
class QwenImage1TransformerImpl : public BackboneImpl {
 public:
  explicit QwenImage1TransformerImpl(QwenImage1TransformerOptions options = {});
  void reset();
  /// x: [B, in_channels, H, W] latents (H, W even); time: [B] or a scalar, the model time sigma x 1000; cond:
  /// context [B, L, context_features] (required), context_mask [B, L] (optional; false = a padded token, not
  /// attended). Packs x, runs forward_packed with timestep time / 1000 (what QwenImagePipeline passes) and one
  /// image of (1, H / 2, W / 2), unpacks: [B, output_channels, H, W] float32 (float64 for a float64 model).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) override;
  /// diffusers' forward: tokens [B, S, 4 in_channels] (packed; the images of img_shapes in turn); context
  /// [B, L, context_features]; context_mask [B, L] bool or undefined; timestep [B], diffusers' scale [0, 1];
  /// img_shapes (frames, height, width) in packed tokens of each image, their tokens summing to S ->
  /// [B, S, 4 output_channels] float32 (float64 for a float64 model).
  at::Tensor forward_packed(const at::Tensor& tokens, const at::Tensor& context, const at::Tensor& context_mask,
                            const at::Tensor& timestep, const std::vector<std::vector<int64_t>>& img_shapes);
  bool requires_text() const override { return true; }

  QwenImage1TransformerOptions options;
  torch::nn::Linear img_in{nullptr}, txt_in{nullptr}, proj_out{nullptr};
  HeadNorm txt_norm{nullptr};
  TimestepMLP timestep_embedder{nullptr};  // time_text_embed.timestep_embedder
  FluxAdaNorm norm_out{nullptr};
  std::vector<QwenImage1Block> blocks;  // transformer_blocks, in order

 private:
  at::ScalarType dtype_ = at::kFloat;
};
TORCH_MODULE(QwenImage1Transformer);

/// The checkpoint names -> module names: diffusers' names as they are, the last block's text-output tensors
/// (attn.add_q_proj, attn.norm_added_q, attn.to_add_out, txt_mlp) skipped.
io::KeyMap qwen_image1_transformer_key_map(const QwenImage1TransformerOptions& options);

/// The fields of a diffusers QwenImageTransformer2DModel config.json (bookkeeping keys already removed). Refused by
/// name: patch_size other than 2, in_channels not 4 x a channel count, guidance_embeds, zero_cond_t,
/// use_additional_t_cond and use_layer3d_rope (the edit-plus and layered variants' options), an unknown key.
json qwen_image1_transformer_fields_from_diffusers(const json& config);

/// The reference method "forward" of QwenImageTransformer2DModel as `dew forward` runs it: hidden_states
/// [B, S, in_channels] (packed), encoder_hidden_states [B, L, joint_attention_dim], timestep in [0, 1] (a scalar
/// or [B]), img_shapes int64 [n, 3] or [B, n, 3] (every sample's the same, as diffusers reads the first), optional
/// encoder_hidden_states_mask [B, L] -> sample [B, S, 4 out_channels] (packed).
models::ReferenceMethod qwen_image1_transformer_forward_method();

}  // namespace dew::nn
