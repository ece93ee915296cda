// The blocks diffusers' UNet2DConditionModel and AutoencoderKL are made of, with diffusers' module names,
// so SD / SDXL checkpoints load without renaming. ResnetBlock2D is dew::nn::ResBlock (blocks.h), which
// already carries diffusers' names.
//
//   dew::nn::Transformer2D t(dew::nn::Transformer2DOptions(320, 8).context_features(768));
//   auto y = t(x, context);                  // x: [B, 320, H, W], context: [B, 77, 768] -> [B, 320, H, W]
//   dew::nn::Downsample2D down(dew::nn::Downsample2DOptions(320));
//   auto z = down(x);                         // [B, 320, H/2, W/2]
//
// Numerics follow diffusers: attention scale dim_head^-0.5, GEGLU feed-forward (exact or tanh GELU),
// GroupNorm (eps 1e-6) before the spatial transformer, LayerNorm (eps 1e-5) inside its blocks.
#pragma once
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <vector>

#include "dew/nn/blocks.h"

namespace dew::nn {

/// Options of Downsample2D. Example: Downsample2DOptions(320).padding(0)
struct Downsample2DOptions {
  explicit Downsample2DOptions(int64_t channels) : channels_(channels) {}
  TORCH_ARG(int64_t, channels);
  /// 1: a 3x3 stride-2 conv with padding 1 (UNet); 0: zero-pad right and bottom by one, then the conv with
  /// no padding (AutoencoderKL's encoder)
  TORCH_ARG(int64_t, padding) = 1;
};

/// Stride-2 3x3 convolution. Parameters: conv.{weight,bias}.
class Downsample2DImpl : public torch::nn::Module {
 public:
  explicit Downsample2DImpl(Downsample2DOptions options);
  void reset();
  /// x: [B, C, H, W] -> [B, C, ceil(H/2), ceil(W/2)] (padding 1) or [B, C, floor(H/2), floor(W/2)] (0).
  at::Tensor forward(const at::Tensor& x);
  Downsample2DOptions options;
  torch::nn::Conv2d conv{nullptr};
};
TORCH_MODULE(Downsample2D);

/// Nearest 2x upsampling (or to a given size) followed by a 3x3 conv. Parameters: conv.{weight,bias}.
class Upsample2DImpl : public torch::nn::Module {
 public:
  explicit Upsample2DImpl(int64_t channels);
  void reset();
  /// x: [B, C, H, W] -> [B, C, 2H, 2W], or [B, C, size[0], size[1]] when `size` is given (the UNet passes the
  /// skip's size when the input is not a multiple of its total downsampling).
  at::Tensor forward(const at::Tensor& x, at::IntArrayRef size = {});
  int64_t channels;
  torch::nn::Conv2d conv{nullptr};
};
TORCH_MODULE(Upsample2D);

/// Options of DiffusersAttention. Example: DiffusersAttentionOptions(320, 8).context_features(768)
struct DiffusersAttentionOptions {
  DiffusersAttentionOptions(int64_t features, int64_t heads) : features_(features), heads_(heads) {}
  /// query width
  TORCH_ARG(int64_t, features);
  TORCH_ARG(int64_t, heads);
  /// width of each head; 0 = features / heads
  TORCH_ARG(int64_t, head_features) = 0;
  /// width of the keys' and values' source; 0 = self-attention
  TORCH_ARG(int64_t, context_features) = 0;
  /// bias on to_q, to_k, to_v (false in the UNet's transformer blocks, true in the VAE's mid-block)
  TORCH_ARG(bool, qkv_bias) = false;
  TORCH_ARG(std::string, impl) = "auto";
  TORCH_ARG(bool, force_fp32_for_softmax) = true;
};

/// diffusers' Attention: to_out.0(softmax(q k^T dim_head^-0.5) v) with q = to_q(x), k = to_k(c), v = to_v(c),
/// c = context or x. Parameters: to_q, to_k, to_v, to_out.0.
class DiffusersAttentionImpl : public torch::nn::Module {
 public:
  explicit DiffusersAttentionImpl(DiffusersAttentionOptions options);
  void reset();
  /// x: [B, S, features]; context: [B, L, context_features] or undefined; mask: [B, L] bool (true = attend)
  /// or undefined -> [B, S, features].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context = {}, const at::Tensor& mask = {});
  DiffusersAttentionOptions options;
  torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  torch::nn::ModuleList to_out{nullptr};  // to_out.0: Linear (to_out.1 is a parameterless dropout)
  torch::nn::Linear out{nullptr};         // view of to_out.0
};
TORCH_MODULE(DiffusersAttention);

/// The VAE's mid-block attention over the H x W positions (one head over all channels, bias on q, k, v):
/// x + to_out.0(attention(group_norm(x))). Parameters: group_norm, to_q, to_k, to_v, to_out.0.
class SpatialSelfAttentionImpl : public torch::nn::Module {
 public:
  /// channels must be a multiple of groups
  SpatialSelfAttentionImpl(int64_t channels, int64_t groups, double eps, std::string impl = "auto");
  void reset();
  /// x: [B, C, H, W] -> [B, C, H, W]
  at::Tensor forward(const at::Tensor& x);
  int64_t channels, groups;
  double eps;
  std::string impl;
  torch::nn::GroupNorm group_norm{nullptr};
  DiffusersAttention attn{nullptr};  // holds to_q .. to_out, registered under this module's own names
};
TORCH_MODULE(SpatialSelfAttention);

/// Options of BasicTransformerBlock. Example: BasicTransformerBlockOptions(320, 8).context_features(768)
struct BasicTransformerBlockOptions {
  BasicTransformerBlockOptions(int64_t features, int64_t heads) : features_(features), heads_(heads) {}
  TORCH_ARG(int64_t, features);
  TORCH_ARG(int64_t, heads);
  /// text context width for attn2; 0 = no cross-attention (attn2 and norm2 are absent)
  TORCH_ARG(int64_t, context_features) = 0;
  /// attn1 attends to the context instead of itself (diffusers' only_cross_attention)
  TORCH_ARG(bool, cross_only) = false;
  /// LayerNorm epsilon of norm1-3
  TORCH_ARG(double, norm_eps) = 1e-5;
  /// GEGLU with the tanh GELU instead of the exact one
  TORCH_ARG(bool, approximate_gelu) = false;
  TORCH_ARG(double, dropout) = 0.0;
  TORCH_ARG(std::string, impl) = "auto";
  TORCH_ARG(bool, force_fp32_for_softmax) = true;
};

/// x += attn1(norm1(x)); x += attn2(norm2(x), context); x += ff(norm3(x)), ff = net.2(geglu(net.0.proj(.))).
/// Parameters: norm1, attn1.*, norm2, attn2.* (with a context), norm3, ff.net.0.proj, ff.net.2.
class BasicTransformerBlockImpl : public torch::nn::Module {
 public:
  explicit BasicTransformerBlockImpl(BasicTransformerBlockOptions options);
  void reset();
  /// x: [B, S, features]; context: [B, L, context_features] (required when context_features > 0);
  /// mask: [B, L] bool or undefined.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context = {}, const at::Tensor& mask = {});
  BasicTransformerBlockOptions options;
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr}, norm3{nullptr};
  DiffusersAttention attn1{nullptr}, attn2{nullptr};
  torch::nn::Linear ff_in{nullptr}, ff_out{nullptr};  // ff.net.0.proj [2 * 4 features, features], ff.net.2
};
TORCH_MODULE(BasicTransformerBlock);

/// Options of Transformer2D. Example: Transformer2DOptions(640, 10).depth(2).linear_projection(true)
struct Transformer2DOptions {
  Transformer2DOptions(int64_t channels, int64_t heads) : channels_(channels), heads_(heads) {}
  TORCH_ARG(int64_t, channels);
  TORCH_ARG(int64_t, heads);
  /// transformer blocks (transformer_layers_per_block)
  TORCH_ARG(int64_t, depth) = 1;
  TORCH_ARG(int64_t, context_features) = 0;
  TORCH_ARG(bool, cross_only) = false;
  /// proj_in / proj_out as Linear (SD 2.x, SDXL) instead of 1x1 convs (SD 1.x)
  TORCH_ARG(bool, linear_projection) = false;
  TORCH_ARG(int64_t, norm_groups) = 32;
  /// epsilon of the GroupNorm in front (diffusers: 1e-6)
  TORCH_ARG(double, norm_eps) = 1e-6;
  /// epsilon of the blocks' LayerNorms (1e-5)
  TORCH_ARG(double, block_norm_eps) = 1e-5;
  TORCH_ARG(bool, approximate_gelu) = false;
  TORCH_ARG(double, dropout) = 0.0;
  TORCH_ARG(std::string, impl) = "auto";
  TORCH_ARG(bool, force_fp32_for_softmax) = true;
  /// recompute each block's activations in backward
  TORCH_ARG(bool, remat) = false;
};

/// diffusers' Transformer2DModel over an image: x + proj_out(blocks(proj_in(norm(x)))), tokens = positions.
/// Parameters: norm, proj_in, transformer_blocks.N.*, proj_out.
class Transformer2DImpl : public torch::nn::Module {
 public:
  explicit Transformer2DImpl(Transformer2DOptions options);
  void reset();
  /// x: [B, channels, H, W]; context: [B, L, context_features]; mask: [B, L] bool or undefined.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context = {}, const at::Tensor& mask = {});
  Transformer2DOptions options;
  torch::nn::GroupNorm norm{nullptr};
  // proj_in / proj_out: the convs, or the linears under linear_projection (the other pair is empty)
  torch::nn::Conv2d proj_in_conv{nullptr}, proj_out_conv{nullptr};
  torch::nn::Linear proj_in_linear{nullptr}, proj_out_linear{nullptr};
  torch::nn::ModuleList transformer_blocks{nullptr};
  std::vector<BasicTransformerBlock> blocks;
};
TORCH_MODULE(Transformer2D);

/// diffusers' sinusoidal time projection (Timesteps / get_timestep_embedding): half = dim / 2,
/// f_i = exp(-ln(10000) i / (half - shift)), emb = [sin(scale t f), cos(scale t f)] ([cos, sin] when
/// cosine_first; scale multiplies the product t f, as diffusers' `scale`), zero-padded to an odd dim. Computed in
/// float32 as diffusers does, or in float64 throughout when `wide` (a float64 model's, whose float32 sinusoid would
/// differ between CPUs in its last bits).
/// t: [B] -> [B, dim] float32 (float64 when wide).
at::Tensor timestep_embedding(const at::Tensor& t, int64_t dim, bool cosine_first, double shift, bool wide = false,
                              double scale = 1.0);

}  // namespace dew::nn
