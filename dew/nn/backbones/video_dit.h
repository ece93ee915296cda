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
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>

#include <mutex>

#include "dew/nn/backbones/backbone.h"
#include "dew/nn/blocks.h"
#include "dew/nn/option_fields.h"
#include "dew/nn/scan.h"

namespace dew::nn {

/// Fields of `video_dit`. Example: VideoDiTOptions().patch_size(2).emb_features(256).num_layers(4)
struct VideoDiTOptions {
#define DEW_VIDEO_DIT_FIELDS(F, C)                                                                  \
  F(int64_t, output_channels, 3, "channels of the prediction")                                      \
  F(int64_t, patch_size, 16, "patch side in pixels (H and W must be multiples of it)")              \
  F(int64_t, emb_features, 768, "transformer width D (divisible by 4 and by num_heads)")            \
  F(int64_t, num_layers, 12, "number of factorised (spatial, temporal, MLP) blocks")                \
  F(int64_t, num_heads, 12, "attention heads, spatial and temporal (D / num_heads even, for RoPE)") \
  F(double, mlp_ratio, 4.0, "MLP hidden width = mlp_ratio * D")                                     \
  F(double, dropout_rate, 0.0, "dropout in attention outputs and MLPs")                             \
  F(bool, force_fp32_for_softmax, true, "softmax in fp32 under bf16/fp16 compute")                  \
  F(double, norm_epsilon, 1e-5, "LayerNorm epsilon")                                                \
  F(bool, qk_norm, false, "RMSNorm on queries and keys (spatial and temporal attention)")           \
  DEW_COMPUTE_FIELDS(F, C, "block")                                                                 \
  DEW_DENOISER_INPUT_FIELDS(F, 0, "0 = no text")
  DEW_OPTIONS(DEW_VIDEO_DIT_FIELDS)
#undef DEW_VIDEO_DIT_FIELDS
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
