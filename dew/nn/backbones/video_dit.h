// VideoDiT (docs/backbones/video_dit.md): a DiT over the patches of every frame of a video with
// factorised attention: per layer, spatial attention within each frame, then temporal attention across
// the frames at each patch position, then the MLP, each an adaLN-Zero residual branch.
//
//   auto model = dew::nn::VideoDiT(dew::nn::VideoDiTOptions().patch_size(2).emb_features(384)
//                                      .num_layers(6).num_heads(6));
//   at::Tensor F = model->forward(x, t, {});   // x: [B, 3, T, H, W], t: [B] -> [B, 3, T, H, W]
//
// Tokens: every frame is patch-embedded (conv p x p, stride p) in raster order; the position of token n of
// frame f is the fixed MAE 2D sin-cos table of n plus a 1D sin-cos table of f (both computed for the
// input's grid and T, so any T and any H, W that are multiples of p work). Spatial attention applies RoPE
// over the raster index within the frame, temporal attention RoPE over the frame index. Conditioning as
// SimpleDiT: c = MLP(Fourier(t)) + label embedding + projected masked mean of the text context, shared by
// all frames. The final layer (adaLN + zero-initialised linear) makes the output exactly 0 at init.
#pragma once
#include <torch/arg.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>

#include <mutex>

#include "dew/nn/backbones/backbone.h"
#include "dew/nn/blocks.h"
#include "dew/nn/scan.h"

namespace dew::nn {

/// Fields of `video_dit`. Example: VideoDiTOptions().patch_size(2).emb_features(256).num_layers(4)
struct VideoDiTOptions {
  /// channels of the prediction, e.g. 3
  TORCH_ARG(int64_t, output_channels) = 3;
  /// patch side in pixels; H and W must be multiples of it, e.g. 16
  TORCH_ARG(int64_t, patch_size) = 16;
  /// transformer width D (divisible by 4 and by num_heads), e.g. 768
  TORCH_ARG(int64_t, emb_features) = 768;
  /// number of factorised blocks
  TORCH_ARG(int64_t, num_layers) = 12;
  /// attention heads (spatial and temporal); D / num_heads must be even (RoPE)
  TORCH_ARG(int64_t, num_heads) = 12;
  /// MLP hidden width = mlp_ratio * D
  TORCH_ARG(double, mlp_ratio) = 4.0;
  /// dropout in attention outputs and MLPs
  TORCH_ARG(double, dropout_rate) = 0.0;
  /// softmax in fp32 under bf16/fp16 compute
  TORCH_ARG(bool, force_fp32_for_softmax) = true;
  /// epsilon of the LayerNorms
  TORCH_ARG(double, norm_epsilon) = 1e-5;
  /// RMSNorm on queries and keys (spatial and temporal attention)
  TORCH_ARG(bool, qk_norm) = false;
  /// compute dtype: float32, bfloat16 or float16 (parameters stay float32)
  TORCH_ARG(std::string, dtype) = "float32";
  /// auto, reference, chunked or sdpa
  TORCH_ARG(std::string, attention_impl) = "auto";
  /// recompute each block's activations in backward
  TORCH_ARG(bool, remat) = false;
  /// channels of the input, e.g. 3 (4 for SD latents)
  TORCH_ARG(int64_t, in_channels) = 3;
  /// classes of the label embedding; 0 = unconditional. The table has num_classes + 1 rows, the last
  /// being the null class
  TORCH_ARG(int64_t, num_classes) = 0;
  /// width of text context features; 0 = no text
  TORCH_ARG(int64_t, context_features) = 0;

 public:
  template <class V>
  void visit(V& v) {
    v("output_channels", output_channels_, "channels of the prediction");
    v("patch_size", patch_size_, "patch side in pixels (H and W must be multiples)");
    v("emb_features", emb_features_, "transformer width D");
    v("num_layers", num_layers_, "number of factorised (spatial, temporal, MLP) blocks");
    v("num_heads", num_heads_, "attention heads (D / num_heads even)");
    v("mlp_ratio", mlp_ratio_, "MLP hidden width = mlp_ratio * D");
    v("dropout_rate", dropout_rate_, "dropout in attention outputs and MLPs");
    v("force_fp32_for_softmax", force_fp32_for_softmax_, "softmax in fp32 under bf16/fp16 compute");
    v("norm_epsilon", norm_epsilon_, "LayerNorm epsilon");
    v("qk_norm", qk_norm_, "RMSNorm on queries and keys");
    v.choice("dtype", dtype_, {"float32", "bfloat16", "float16"}, "compute dtype (parameters stay float32)");
    v.choice("attention_impl", attention_impl_, {"auto", "reference", "chunked", "sdpa"}, "attention implementation");
    v("remat", remat_, "recompute block activations in backward (gradient checkpointing)");
    v("in_channels", in_channels_, "channels of the input");
    v("num_classes", num_classes_, "label classes (0 = unconditional); label num_classes is the null class");
    v("context_features", context_features_, "width of text context features (0 = no text)");
  }
};

/// One factorised block with adaLN-Zero: (shift, scale, gate) x 3 from a zero-initialised Linear of
/// SiLU(c) for the spatial attention, the temporal attention and the MLP, so the block starts as the
/// identity. Parameters: adaLN_modulation.{weight,bias} [9 dim, dim], attn.* (spatial), temporal_attn.*,
/// mlp.fc1.*, mlp.fc2.*.
class VideoDiTBlockImpl : public torch::nn::Module {
 public:
  explicit VideoDiTBlockImpl(DiTBlockOptions options);
  void reset();
  void reset_parameters();
  /// x: [B, T*N, dim] (frame-major: token f N + n is patch n of frame f); c: [B, dim]; rope_spatial:
  /// tables for N positions, rope_temporal: for T positions (undefined = no rotation). Returns x's shape.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& c, int64_t frames, const Rope& rope_spatial = {},
                     const Rope& rope_temporal = {});

  DiTBlockOptions options;
  torch::nn::Linear adaLN_modulation{nullptr};
  SelfAttention attn{nullptr}, temporal_attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(VideoDiTBlock);

/// The VideoDiT backbone. Parameters (names stable across dtype, attention_impl and remat):
///   x_embedder.{weight [D, C, p, p], bias}          per-frame patch embedding
///   t_embedder.fourier.freqs (buffer), t_embedder.linear_1.*, t_embedder.linear_2.*
///   y_embedder.weight [num_classes + 1, D]           when num_classes > 0
///   context_embedder.{weight [D, context_features], bias}   when context_features > 0
///   blocks.N.adaLN_modulation.* [9 D, D], blocks.N.attn.{qkv,proj}.*, blocks.N.temporal_attn.{qkv,proj}.*,
///   blocks.N.{attn,temporal_attn}.{q,k}_norm.weight (qk_norm), blocks.N.mlp.fc1.*, blocks.N.mlp.fc2.*
///   final_layer.adaLN_modulation.*, final_layer.linear.{weight [p*p*out, D], bias}
class VideoDiTImpl : public BackboneImpl {
 public:
  explicit VideoDiTImpl(VideoDiTOptions options = {});
  void reset();
  void reset_parameters();
  /// x: [B, in_channels, T, H, W] (T >= 1; H, W multiples of patch_size); time: [B] (or a scalar); cond:
  /// optional labels [B] (value num_classes = null class; absent = null class), context
  /// [B, L, context_features] with context_mask [B, L]. Returns [B, output_channels, T, H, W] float32.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) override;
  /// The conditioning vector c: [B, D] in the compute dtype.
  at::Tensor condition(const at::Tensor& time, const Conditioning& cond, int64_t batch);

  VideoDiTOptions options;
  torch::nn::Conv2d x_embedder{nullptr};
  TimeEmbedding t_embedder{nullptr};
  torch::nn::Embedding y_embedder{nullptr};
  torch::nn::Linear context_embedder{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  std::vector<VideoDiTBlock> block_list;  // typed view of `blocks`
  FinalLayer final_layer{nullptr};

 private:
  // Per-(grid, frames, device) constants, built once rather than on every step.
  struct Grid {
    int64_t h = -1, w = -1, t = -1;
    at::Device device{at::kCPU};
    Scan scan;       // raster scan of the patch grid (for unpatchify)
    at::Tensor pos;  // [T*N, D] float32: 2D table of the patch + 1D table of the frame
    Rope rope_spatial, rope_temporal;
  };
  Grid grid(int64_t h, int64_t w, int64_t t, const at::Device& device);

  at::ScalarType dtype_ = at::kFloat;
  std::mutex grid_mutex_;
  Grid grid_;
};
TORCH_MODULE(VideoDiT);

}  // namespace dew::nn
