// JEPA models (docs/jepa.md): the I-JEPA image encoder, the V-JEPA video encoder and the predictor, with
// the parameter names of facebookresearch/ijepa and facebookresearch/jepa (their checkpoints' "encoder",
// "target_encoder" and "predictor" state dicts load with no renaming).
//
//   auto enc = dew::nn::JepaEncoder(dew::nn::JepaEncoderOptions().image_size(28).patch_size(4).in_channels(1));
//   at::Tensor all = enc->forward(x);                 // x: [B, 1, 28, 28] -> [B, 49, 384]
//   at::Tensor ctx = enc->forward(x, keep);           // keep: [B, K] int64 token indices -> [B, K, 384]
//   auto pred = dew::nn::JepaPredictor(dew::nn::JepaPredictorOptions().image_size(28).patch_size(4));
//   at::Tensor z = pred->forward(ctx, keep, targets); // targets: [M, B, Kt] -> [M * B, Kt, 384]
//
// Encoder: patch embedding (conv p x p, stride p; video: conv tubelet x p x p), plus a fixed sin-cos
// position table, pre-norm ViT blocks x += attn(norm1 x); x += mlp(norm2 x) (exact GELU), a final
// LayerNorm. Images use I-JEPA's 2D table (first half of each row: the column, second half: the row);
// video uses V-JEPA's 3D table ([time: D/2, row: D/4, column: D/4]). Tokens are in raster order (t, h, w).
#pragma once
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "dew/nn/attention.h"
#include "dew/nn/blocks.h"
#include "dew/nn/roles.h"

namespace dew::nn {

/// Fields of `jepa_encoder` (and, with frames and tubelet_size, of `jepa_video_encoder`).
/// Example: JepaEncoderOptions().image_size(28).patch_size(4).in_channels(1).emb_features(192)
struct JepaEncoderOptions {
#define DEW_JEPA_ENCODER_FIELDS(F, C)                                                                 \
  F(int64_t, image_size, 224, "input side in pixels (square; a multiple of patch_size)")              \
  F(int64_t, patch_size, 16, "patch side in pixels")                                                  \
  F(int64_t, in_channels, 3, "input channels")                                                        \
  F(int64_t, emb_features, 384, "encoder width D (video: divisible by 8, for the 3D position table)") \
  F(int64_t, num_layers, 12, "ViT blocks")                                                            \
  F(int64_t, num_heads, 6, "attention heads (D divisible by it)")                                     \
  F(double, mlp_ratio, 4.0, "MLP hidden width = mlp_ratio * D")                                       \
  F(double, norm_eps, 1e-6, "LayerNorm epsilon (I-JEPA: 1e-6)")                                       \
  C(attention_impl, "auto", ({"auto", "reference", "chunked", "sdpa"}), "attention implementation")   \
  F(double, init_std, 0.02, "std of the initial (truncated normal) linear and conv weights")
  DEW_OPTIONS(DEW_JEPA_ENCODER_FIELDS)
#undef DEW_JEPA_ENCODER_FIELDS

  // Video only; frames 0 = an image encoder.
#define DEW_JEPA_CLIP_FIELDS(F, C)                                      \
  F(int64_t, frames, 0, "frames per clip (a multiple of tubelet_size)") \
  F(int64_t, tubelet_size, 2, "frames per tubelet (the temporal patch)")
  DEW_OPTION_MEMBERS(DEW_JEPA_CLIP_FIELDS)

 public:
  /// The clip fields, visited by jepa_video_encoder only.
  template <class V>
  void visit_clip(V& v) {
    DEW_VISIT_FIELDS(DEW_JEPA_CLIP_FIELDS)
  }
#undef DEW_JEPA_CLIP_FIELDS
};

/// Fields of `jepa_video_encoder`: the encoder's plus the clip length.
struct JepaVideoEncoderOptions : JepaEncoderOptions {
  JepaVideoEncoderOptions() { frames(16); }
  template <class V>
  void visit(V& v) {
    JepaEncoderOptions::visit(v);
    visit_clip(v);
  }
};

/// Fields of `jepa_predictor`. The grid fields must be the encoder's (a JEPA run copies them).
struct JepaPredictorOptions {
#define DEW_JEPA_PREDICTOR_FIELDS(F, C)                                                             \
  F(int64_t, image_size, 224, "the encoder's input side in pixels")                                 \
  F(int64_t, patch_size, 16, "the encoder's patch side")                                            \
  F(int64_t, frames, 0, "the encoder's frames per clip (0 = images)")                               \
  F(int64_t, tubelet_size, 2, "the encoder's frames per tubelet")                                   \
  F(int64_t, encoder_features, 384, "the encoder's width (input and output)")                       \
  F(int64_t, emb_features, 192, "predictor width")                                                  \
  F(int64_t, num_layers, 6, "ViT blocks")                                                           \
  F(int64_t, num_heads, 6, "attention heads")                                                       \
  F(double, mlp_ratio, 4.0, "MLP hidden width = mlp_ratio * width")                                 \
  F(double, norm_eps, 1e-6, "LayerNorm epsilon")                                                    \
  C(attention_impl, "auto", ({"auto", "reference", "chunked", "sdpa"}), "attention implementation") \
  F(double, init_std, 0.02, "std of the initial linear weights and the mask token")
  DEW_OPTIONS(DEW_JEPA_PREDICTOR_FIELDS)
#undef DEW_JEPA_PREDICTOR_FIELDS
};

/// The token grid of an encoder or predictor of these fields (dew::Error naming a bad field).
TokenGrid jepa_grid(int64_t image_size, int64_t patch_size, int64_t frames, int64_t tubelet_size,
                    const std::string& where);

/// The fixed position table of a grid: [N, dim] float32 (2D I-JEPA table for t == 1 with frames == 0, else 3D).
at::Tensor jepa_position_table(int64_t dim, const TokenGrid& grid, bool video);

/// A pre-norm ViT block. Parameters: norm1.*, attn.qkv.*, attn.proj.*, norm2.*, mlp.fc1.*, mlp.fc2.*.
class ViTBlockImpl : public torch::nn::Module {
 public:
  ViTBlockImpl(int64_t dim, int64_t heads, double mlp_ratio, double eps, const std::string& impl);
  /// x: [B, S, dim] -> [B, S, dim]
  at::Tensor forward(const at::Tensor& x);
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  SelfAttention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(ViTBlock);

/// The patch embedding: `proj` is a Conv2d (images) or a Conv3d (video tubelets).
class PatchEmbedImpl : public torch::nn::Module {
 public:
  PatchEmbedImpl(int64_t in_channels, int64_t dim, int64_t patch, int64_t tubelet, bool video);
  /// [B, C, H, W] or [B, C, T, H, W] -> tokens [B, N, dim] in raster order
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Conv2d proj2d{nullptr};
  torch::nn::Conv3d proj3d{nullptr};
};
TORCH_MODULE(PatchEmbed);

/// The JEPA encoder. Parameters: patch_embed.proj.{weight, bias}, pos_embed [1, N, D] (a fixed buffer),
/// blocks.N.*, norm.{weight, bias}.
class JepaEncoderImpl : public TokenEncoderImpl {
 public:
  explicit JepaEncoderImpl(JepaEncoderOptions options = {});
  void reset();
  void reset_parameters();
  at::Tensor forward(const at::Tensor& x, const at::Tensor& keep = {}) override;
  TokenGrid grid() const override { return grid_; }
  int64_t features() const override { return options.emb_features(); }
  bool video() const { return options.frames() > 0; }

  JepaEncoderOptions options;
  PatchEmbed patch_embed{nullptr};
  at::Tensor pos_embed;
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm norm{nullptr};

 private:
  TokenGrid grid_;
};
TORCH_MODULE(JepaEncoder);

/// The JEPA predictor. Parameters: predictor_embed.*, mask_token [1, 1, P], predictor_pos_embed [1, N, P]
/// (a fixed buffer), predictor_blocks.N.*, predictor_norm.*, predictor_proj.*.
class JepaPredictorImpl : public TokenPredictorImpl {
 public:
  explicit JepaPredictorImpl(JepaPredictorOptions options = {});
  void reset();
  void reset_parameters();
  at::Tensor forward(const at::Tensor& context, const at::Tensor& context_idx, const at::Tensor& targets) override;

  JepaPredictorOptions options;
  torch::nn::Linear predictor_embed{nullptr}, predictor_proj{nullptr};
  at::Tensor mask_token, predictor_pos_embed;
  torch::nn::ModuleList predictor_blocks{nullptr};
  torch::nn::LayerNorm predictor_norm{nullptr};

 private:
  TokenGrid grid_;
};
TORCH_MODULE(JepaPredictor);

/// Rows of tokens [B, N, D] at indices [B, K] int64 -> [B, K, D] (I-JEPA's apply_masks for one mask).
at::Tensor gather_tokens(const at::Tensor& tokens, const at::Tensor& idx);

}  // namespace dew::nn
