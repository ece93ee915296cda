// UViT (docs/backbones/uvit.md): a U-shaped ViT with the time, the label and the text as tokens beside the
// patches, and long skips from the first half of the blocks into the second (FlaxDiff's UViT).
//
//   auto model = dew::nn::UViT(dew::nn::UViTOptions().patch_size(2).emb_features(256).num_layers(6)
//                                  .num_heads(4).image_size(64));
//   at::Tensor F = model->forward(x, t, {});   // x: [B, 3, H, W], t: [B] -> [B, 3, H, W]
//
// Sequence: [patches (raster order, + the learned position table's first H/p * W/p rows), time token,
// label token (num_classes > 0), text tokens (one per context token, projected to D)]. Blocks: num_layers/2
// down blocks, a mid block, num_layers/2 up blocks; before up block i the stream is fused with the output of
// down block num_layers/2 - 1 - i by up_dense_i([h, skip]) (Linear 2D -> D). Then a LayerNorm and a
// zero-initialised linear read the patch tokens back to pixels (exactly zero output at initialisation),
// optionally refined by two 3x3 convs over [input, prediction] (add_residualblock_output).
//
// Each block is FlaxDiff's TransformerBlock (pre-norm, RMSNorm, bias-free attention, GEGLU MLP):
//   x = RMSNorm_in(x)                       if norm_inputs
//   h = project_in(x)                       if use_projection (else h = x)
//   ctx = h
//   h = h + attn1(norm1(h))                 if use_self_and_cross (self-attention)
//   h = h + attn2(norm2(h), ctx)            queries from norm2(h), keys/values from ctx (the un-normed input)
//   h = h + ff(norm3(h))                    ff = net_2(a * gelu(g)), [a, g] = net_0(.)
//   h = project_out(h)                      if use_projection
//   return explicitly_add_residual ? x + h : h
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <vector>

#include "dew/nn/attention.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/blocks.h"
#include "dew/nn/option_fields.h"

namespace dew::nn {

/// Fields of `uvit`. Example: UViTOptions().patch_size(2).emb_features(256).num_layers(6).image_size(64)
struct UViTOptions {
#define DEW_UVIT_FIELDS(F, C)                                                                                   \
  F(int64_t, output_channels, 3, "channels of the prediction")                                                  \
  F(int64_t, patch_size, 16, "patch side in pixels (H and W must be multiples of it)")                          \
  F(int64_t, emb_features, 768, "transformer width D (even, divisible by num_heads)")                           \
  F(int64_t, num_layers, 12, "down + up blocks (even); a mid block is added")                                   \
  F(int64_t, num_heads, 12, "attention heads")                                                                  \
  F(double, mlp_ratio, 4.0, "GEGLU hidden width = mlp_ratio * D")                                               \
  F(double, dropout_rate, 0.0,                                                                                  \
    "dropout on attention outputs and the MLP output (the original declares 0.1 but never applies it)")         \
  F(bool, force_fp32_for_softmax, true, "softmax in fp32 under bf16/fp16 compute")                              \
  F(double, norm_epsilon, 1e-5, "RMSNorm / LayerNorm epsilon")                                                  \
  F(bool, use_projection, false, "bias-free D -> D projections around each block body")                         \
  F(bool, use_self_and_cross, false, "self-attention before the input-keyed attention in each block")           \
  F(bool, norm_inputs, false, "RMSNorm on each block's input (the residual adds the normed input)")             \
  F(bool, explicitly_add_residual, true, "outer residual: block output + block input")                          \
  F(bool, add_residualblock_output, false, "refine the prediction with two 3x3 convs over [input, prediction]") \
  C(activation, "swish", (activations()), "activation of the output refinement")                                \
  F(int64_t, image_size, 512, "largest image side the position table covers ((image_size/patch_size)^2 rows)")  \
  DEW_COMPUTE_FIELDS(F, C, "block")                                                                             \
  DEW_DENOISER_INPUT_FIELDS(F, 0, "0 = no text")
  DEW_OPTIONS(DEW_UVIT_FIELDS)
#undef DEW_UVIT_FIELDS
};

/// Bias-free multi-head attention: queries from x, keys and values from a context (x itself for
/// self-attention). Parameters: to_q.weight, to_k.weight, to_v.weight, to_out.weight, all [D, D].
class UViTAttentionImpl : public torch::nn::Module {
 public:
  UViTAttentionImpl(int64_t dim, int64_t num_heads, std::string impl, bool force_fp32_for_softmax, double dropout);
  void reset();
  void reset_parameters();
  /// x: [B, S, D], context: [B, S', D], key_mask: [B, S'] bool or undefined -> [B, S, D].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context, const at::Tensor& key_mask = {});

  int64_t dim, num_heads;
  std::string impl;
  bool force_fp32_for_softmax;
  double dropout;
  torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr}, to_out{nullptr};
};
TORCH_MODULE(UViTAttention);

/// GEGLU MLP: net_2(a * gelu_tanh(g)) with [a, g] = net_0(x) split in halves.
/// Parameters: net_0.{weight [2 hidden, D], bias}, net_2.{weight [D, hidden], bias}.
class GegluMlpImpl : public torch::nn::Module {
 public:
  GegluMlpImpl(int64_t dim, int64_t hidden, double dropout);
  void reset();
  void reset_parameters();
  /// x: [B, S, D] -> [B, S, D]
  at::Tensor forward(const at::Tensor& x);

  int64_t dim, hidden;
  double dropout;
  torch::nn::Linear net_0{nullptr}, net_2{nullptr};
};
TORCH_MODULE(GegluMlp);

/// FlaxDiff's TransformerBlock (see the file comment). Parameters: norm_in.weight (norm_inputs),
/// project_in.weight / project_out.weight (use_projection), norm1.weight + attn1.* (use_self_and_cross),
/// norm2.weight, attn2.*, norm3.weight, ff.net_0.{weight [2 hidden, D], bias}, ff.net_2.{weight, bias}.
class UViTBlockImpl : public torch::nn::Module {
 public:
  explicit UViTBlockImpl(const UViTOptions& options);
  void reset();
  void reset_parameters();
  /// x: [B, S, D]; key_mask: [B, S] bool (true = attend) or undefined -> [B, S, D].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& key_mask = {});

  UViTOptions options;
  HeadNorm norm_in{nullptr}, norm1{nullptr}, norm2{nullptr}, norm3{nullptr};
  torch::nn::Linear project_in{nullptr}, project_out{nullptr};
  UViTAttention attn1{nullptr}, attn2{nullptr};
  GegluMlp ff{nullptr};
};
TORCH_MODULE(UViTBlock);

/// The UViT backbone. Parameters (names stable across dtype, attention_impl and remat):
///   x_embedder.{weight [D, C, p, p], bias}       patch embedding
///   pos_encoding [(image_size / p)^2, D]          learned position table over the raster index
///   t_embedder.fourier.freqs (buffer), t_embedder.linear_1.*, t_embedder.linear_2.*   time token
///   y_embedder.weight [num_classes + 1, D]        label token, when num_classes > 0
///   context_embedder.{weight [D, context_features], bias}   text tokens, when context_features > 0
///   down_blocks.N.*, mid_block.*, up_blocks.N.*   UViTBlocks (N < num_layers / 2)
///   up_dense.N.{weight [D, 2 D], bias}            skip fusion before up block N
///   final_norm.{weight, bias} [D], final_proj.{weight [p*p*out, D], bias}   (final_proj zero-initialised)
///   final_conv1.*, final_norm_conv.{weight, bias} [64], final_conv2.*          when add_residualblock_output
class UViTImpl : public BackboneImpl {
 public:
  explicit UViTImpl(UViTOptions options = {});
  void reset();
  void reset_parameters();
  /// x: [B, in_channels, H, W] with (H/p)(W/p) <= (image_size/p)^2; time: [B] (or a scalar); cond:
  /// optional labels [B] (num_classes = null class; absent = null class), context [B, L, context_features]
  /// with context_mask [B, L] (masked text tokens are not attended to). Returns [B, output_channels, H, W]
  /// float32.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) override;

  UViTOptions options;
  torch::nn::Conv2d x_embedder{nullptr};
  at::Tensor pos_encoding;
  TimeEmbedding t_embedder{nullptr};
  torch::nn::Embedding y_embedder{nullptr};
  torch::nn::Linear context_embedder{nullptr};
  torch::nn::ModuleList down_blocks{nullptr}, up_blocks{nullptr}, up_dense{nullptr};
  UViTBlock mid_block{nullptr};
  std::vector<UViTBlock> down_list, up_list;     // typed views
  std::vector<torch::nn::Linear> up_dense_list;  // typed view
  torch::nn::LayerNorm final_norm{nullptr}, final_norm_conv{nullptr};
  torch::nn::Linear final_proj{nullptr};
  torch::nn::Conv2d final_conv1{nullptr}, final_conv2{nullptr};

 private:
  at::Tensor run_block(UViTBlock& block, const at::Tensor& h, const at::Tensor& key_mask);
  at::ScalarType dtype_ = at::kFloat;
};
TORCH_MODULE(UViT);

}  // namespace dew::nn
