// HierarchicalMMDiT (docs/backbones/hierarchical_mmdit.md): MM-DiT stages in a U shape over a patch pyramid.
//
//   auto model = dew::nn::HierarchicalMMDiT(dew::nn::HierarchicalMMDiTOptions().base_patch_size(2)
//                    .emb_features({64, 128}).num_layers({2, 4}).num_heads({4, 8}).context_features(768));
//   at::Tensor F = model->forward(x, t, {labels, context, context_mask});  // context is required
//
// Stage 0 works on the base_patch_size grid at width emb_features[0]. Going down, each stage s < S-1 runs
// num_layers[s] / 2 joint blocks, keeps its output as a skip, and merges every 2x2 neighbourhood of tokens
// (their features concatenated) with a dense layer to the next width. The deepest stage runs all its
// num_layers[S-1] blocks in the middle. Going up, each stage expands every token into a 2x2 neighbourhood
// of the finer width (a dense layer to 4 tokens), fuses the skip with a dense layer over the concatenation,
// and runs its other num_layers[s] / 2 blocks. This is the original's split: every stage's num_layers is
// halved between its encoder and decoder blocks, which for the deepest stage meet without a resolution
// change in between. Each stage has its own text projection and its own conditioning vector (c, computed at
// the deepest width, projected to the stage width). Raster order only: 2x2 merging needs the grid layout.
#pragma once
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <mutex>
#include <vector>

#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/mmdit.h"
#include "dew/nn/blocks.h"
#include "dew/nn/option_fields.h"

namespace dew::nn {

/// Tokens [B, h*w, C] of an h x w raster grid -> [B, (h/2)(w/2), 4C]: each output token holds its 2x2
/// neighbourhood (row-major within it: (0,0), (0,1), (1,0), (1,1)), features concatenated. h, w even.
at::Tensor merge_2x2(const at::Tensor& x, int64_t h, int64_t w);
/// The inverse layout: tokens [B, h*w, 4C] -> [B, (2h)(2w), C], each token's features becoming its 2x2
/// neighbourhood on the finer grid.
at::Tensor expand_2x2(const at::Tensor& x, int64_t h, int64_t w);

/// Fields of `hierarchical_mmdit`. Example: HierarchicalMMDiTOptions().base_patch_size(2).emb_features({64, 128})
struct HierarchicalMMDiTOptions {
#define DEW_HIERARCHICAL_MMDIT_FIELDS(F, C)                                                                          \
  F(int64_t, output_channels, 3, "channels of the prediction")                                                       \
  F(int64_t, base_patch_size, 8, "patch side of the finest stage (H, W multiples of it * 2^(stages-1))")             \
  F(std::vector<int64_t>, emb_features, (std::vector<int64_t>{512, 768, 1024}), "width of each stage, finest first") \
  F(std::vector<int64_t>, num_layers, (std::vector<int64_t>{4, 4, 14}),                                              \
    "joint blocks per stage (even except the deepest: half down, half up)")                                          \
  F(std::vector<int64_t>, num_heads, (std::vector<int64_t>{8, 12, 16}),                                              \
    "attention heads per stage (width / heads even, for RoPE)")                                                      \
  F(double, mlp_ratio, 4.0, "MLP hidden width = mlp_ratio * stage width")                                            \
  F(double, dropout_rate, 0.0, "dropout in attention outputs and MLPs")                                              \
  F(bool, force_fp32_for_softmax, true, "softmax in fp32 under bf16/fp16 compute")                                   \
  F(double, norm_epsilon, 1e-5, "LayerNorm epsilon")                                                                 \
  F(bool, qk_norm, false, "RMSNorm on queries and keys of both streams")                                             \
  C(scan_order, "raster", ({"raster", "hilbert", "zigzag"}),                                                         \
    "token order (raster only: 2x2 patch merging needs the grid layout)")                                            \
  DEW_COMPUTE_FIELDS(F, C, "block")                                                                                  \
  DEW_DENOISER_INPUT_FIELDS(F, 768, "must be > 0: text is required")
  DEW_OPTIONS(DEW_HIERARCHICAL_MMDIT_FIELDS)
#undef DEW_HIERARCHICAL_MMDIT_FIELDS
};

/// The HierarchicalMMDiT backbone (S stages, D_s = emb_features[s], D = D_{S-1} the deepest width).
/// Parameters (names stable across dtype, attention_impl and remat):
///   x_embedder.{weight [D_0, C, p, p], bias}            patch embedding at the finest grid
///   t_embedder.*, y_embedder.weight [num_classes + 1, D] (num_classes > 0),
///   pooled_text_embedder.{weight [D, context_features], bias}    c at the deepest width
///   cond_projections.s.{weight [D_s, D], bias}          c for stage s < S-1
///   context_embedders.s.{weight [D_s, context_features], bias}   text tokens of stage s
///   down_blocks.s.N.*, up_blocks.s.N.* (s < S-1), mid_blocks.N.*   MMDiTBlock (mmdit.h); the last block of
///       each of these stacks has a pre-only text stream
///   merges.s.{weight [D_{s+1}, 4 D_s], bias}            2x2 patch merging from stage s down to s+1
///   expands.s.{weight [4 D_s, D_{s+1}], bias}           expansion from stage s+1 up to s
///   fusions.s.{weight [D_s, 2 D_s], bias}               skip fusion over [expanded; skip]
///   final_layer.adaLN_modulation.*, final_layer.linear.{weight [p*p*out, D_0], bias}
class HierarchicalMMDiTImpl : public BackboneImpl {
 public:
  explicit HierarchicalMMDiTImpl(HierarchicalMMDiTOptions options = {});
  void reset();
  void reset_parameters();
  /// x: [B, in_channels, H, W]; time: [B] (or a scalar); cond: context [B, L, context_features] (required)
  /// with optional context_mask [B, L]; optional labels [B]. Returns [B, output_channels, H, W] float32.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) override;
  bool requires_text() const override { return true; }
  /// Number of stages S.
  int64_t stages() const { return static_cast<int64_t>(options.emb_features().size()); }

  HierarchicalMMDiTOptions options;
  torch::nn::Conv2d x_embedder{nullptr};
  TimeEmbedding t_embedder{nullptr};
  torch::nn::Embedding y_embedder{nullptr};
  torch::nn::Linear pooled_text_embedder{nullptr};
  torch::nn::ModuleList cond_projections{nullptr}, context_embedders{nullptr};
  torch::nn::ModuleList down_blocks{nullptr}, mid_blocks{nullptr}, up_blocks{nullptr};
  torch::nn::ModuleList merges{nullptr}, expands{nullptr}, fusions{nullptr};
  FinalLayer final_layer{nullptr};
  // Typed views of the module lists above.
  std::vector<std::vector<MMDiTBlock>> down_list, up_list;
  std::vector<MMDiTBlock> mid_list;
  std::vector<torch::nn::Linear> cond_list, context_list, merge_list, expand_list, fusion_list;

 private:
  // Per-grid constants: the finest stage's position table and each stage's RoPE tables.
  struct Grid {
    int64_t h = -1, w = -1;  // finest patch grid
    at::Device device{at::kCPU};
    at::Tensor pos;           // [h*w, D_0] float32
    std::vector<Rope> ropes;  // per stage, over that stage's raster grid
  };
  Grid grid(int64_t h, int64_t w, const at::Device& device);

  at::ScalarType dtype_ = at::kFloat;
  std::mutex grid_mutex_;
  Grid grid_;
};
TORCH_MODULE(HierarchicalMMDiT);

}  // namespace dew::nn
