// SimpleDiT (docs/backbones.md): a DiT with adaLN-Zero blocks over image patches.
//
//   auto model = dew::nn::SimpleDiT(dew::nn::SimpleDiTOptions().patch_size(2).emb_features(384)
//                                       .num_layers(6).num_heads(6).num_classes(10));
//   at::Tensor F = model->forward(x, t, {labels});   // x: [B, 3, H, W], t: [B] -> [B, 3, H, W]
//
// Tokens: patch embedding (conv p x p, stride p), reordered by the scan order, plus the fixed MAE 2D
// sin-cos table indexed by each token's true grid position. Conditioning c = MLP(Fourier(t)) + label
// embedding + projected masked mean of the text context. RoPE runs over the sequence index in raster
// order; under hilbert and zigzag the sequence index is not a grid coordinate, so no rotation is applied.
#pragma once
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>

#include <string>

#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/dit_common.h"
#include "dew/nn/blocks.h"
#include "dew/nn/option_fields.h"
#include "dew/nn/scan.h"

namespace dew::nn {

/// Fields of `simple_dit`. Example: SimpleDiTOptions().patch_size(2).emb_features(256).num_layers(4)
struct SimpleDiTOptions {
#define DEW_SIMPLE_DIT_FIELDS(F, C)                                                           \
  F(int64_t, output_channels, 3, "channels of the prediction")                                \
  F(int64_t, patch_size, 16, "patch side in pixels (H and W must be multiples of it)")        \
  F(int64_t, emb_features, 768, "transformer width D (divisible by 4 and by num_heads)")      \
  F(int64_t, num_layers, 12, "number of DiT blocks")                                          \
  F(int64_t, num_heads, 12, "attention heads (D / num_heads even, for RoPE)")                 \
  F(double, mlp_ratio, 4.0, "MLP hidden width = mlp_ratio * D")                               \
  F(double, dropout_rate, 0.0, "dropout in attention outputs and MLPs")                       \
  F(bool, force_fp32_for_softmax, true, "softmax in fp32 under bf16/fp16 compute")            \
  F(double, norm_epsilon, 1e-5, "LayerNorm epsilon")                                          \
  F(bool, qk_norm, false, "RMSNorm on queries and keys")                                      \
  C(scan_order, "raster", ({"raster", "hilbert", "zigzag"}), "token order of the patch grid") \
  DEW_COMPUTE_FIELDS(F, C, "block")                                                           \
  DEW_DENOISER_INPUT_FIELDS(F, 0, "0 = no text")
  DEW_OPTIONS(DEW_SIMPLE_DIT_FIELDS)
#undef DEW_SIMPLE_DIT_FIELDS
};

/// The SimpleDiT backbone. Parameters (names stable across dtype, attention_impl and remat):
///   x_embedder.{weight [D, C, p, p], bias}          patch embedding
///   t_embedder.fourier.freqs (buffer), t_embedder.linear_1.*, t_embedder.linear_2.*
///   y_embedder.weight [num_classes + 1, D]           when num_classes > 0
///   context_embedder.{weight [D, context_features], bias}   when context_features > 0
///   blocks.N.adaLN_modulation.*, blocks.N.attn.qkv.*, blocks.N.attn.proj.*, blocks.N.attn.{q,k}_norm.weight,
///   blocks.N.mlp.fc1.*, blocks.N.mlp.fc2.*
///   final_layer.adaLN_modulation.*, final_layer.linear.{weight [p*p*out, D], bias}
class SimpleDiTImpl : public BackboneImpl {
 public:
  explicit SimpleDiTImpl(SimpleDiTOptions options = {});
  void reset();
  void reset_parameters();
  /// x: [B, in_channels, H, W]; time: [B] (or a scalar); cond: optional labels [B] (value num_classes =
  /// null class; absent = null class), context [B, L, context_features] with context_mask [B, L].
  /// Returns [B, output_channels, H, W] float32.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) override;
  /// The conditioning vector c: [B, D] in the compute dtype.
  at::Tensor condition(const at::Tensor& time, const Conditioning& cond, int64_t batch);

  SimpleDiTOptions options;
  torch::nn::Conv2d x_embedder{nullptr};
  TimeEmbedding t_embedder{nullptr};
  torch::nn::Embedding y_embedder{nullptr};
  torch::nn::Linear context_embedder{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  std::vector<DiTBlock> block_list;  // typed view of `blocks`
  FinalLayer final_layer{nullptr};

 protected:
  // For models built on SimpleDiT's stem (simple_udit): `arch` names the model in errors; with
  // build_blocks false `blocks` stays unregistered and the derived class lays out its own DiT blocks.
  SimpleDiTImpl(SimpleDiTOptions options, std::string arch, bool build_blocks);
  /// One DiT block configured from the options.
  DiTBlock make_block() const;

  // Per-grid constants (scan, position table, RoPE tables), built once per (grid, device) rather than
  // recomputed and copied to the device on every step.
  using Grid = PatchGrid;
  Grid grid(int64_t h, int64_t w, const at::Device& device);
  /// Checks x and returns its tokens [B, N, D] (compute dtype, scan order, position table added) and grid.
  at::Tensor embed(const at::Tensor& x, Grid& g);
  /// One block over h under the conditioning c, recomputed in backward when remat is on.
  at::Tensor run_block(DiTBlock& block, const at::Tensor& h, const at::Tensor& c, const Rope& rope);
  /// Final layer and unpatchify: tokens [B, N, D] -> [B, output_channels, H, W] float32.
  at::Tensor output(const at::Tensor& h, const at::Tensor& c, const Grid& g);

  std::string arch_ = "simple_dit";
  bool build_blocks_ = true;
  at::ScalarType dtype_ = at::kFloat;
  PatchGridCache grid_cache_;
};
TORCH_MODULE(SimpleDiT);

}  // namespace dew::nn
