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
#include <torch/arg.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>

#include <string>

#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/dit_common.h"
#include "dew/nn/blocks.h"
#include "dew/nn/scan.h"

namespace dew::nn {

/// Fields of `simple_dit`. Example: SimpleDiTOptions().patch_size(2).emb_features(256).num_layers(4)
struct SimpleDiTOptions {
  /// channels of the prediction, e.g. 3
  TORCH_ARG(int64_t, output_channels) = 3;
  /// patch side in pixels; H and W must be multiples of it, e.g. 16
  TORCH_ARG(int64_t, patch_size) = 16;
  /// transformer width D (divisible by 4 and by num_heads), e.g. 768
  TORCH_ARG(int64_t, emb_features) = 768;
  /// number of DiT blocks
  TORCH_ARG(int64_t, num_layers) = 12;
  /// attention heads; D / num_heads must be even (RoPE)
  TORCH_ARG(int64_t, num_heads) = 12;
  /// MLP hidden width = mlp_ratio * D
  TORCH_ARG(double, mlp_ratio) = 4.0;
  /// dropout in attention outputs and MLPs
  TORCH_ARG(double, dropout_rate) = 0.0;
  /// softmax in fp32 under bf16/fp16 compute
  TORCH_ARG(bool, force_fp32_for_softmax) = true;
  /// epsilon of the LayerNorms
  TORCH_ARG(double, norm_epsilon) = 1e-5;
  /// RMSNorm on queries and keys
  TORCH_ARG(bool, qk_norm) = false;
  /// token order: raster, hilbert or zigzag
  TORCH_ARG(std::string, scan_order) = "raster";
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
    v("num_layers", num_layers_, "number of DiT blocks");
    v("num_heads", num_heads_, "attention heads (D / num_heads even)");
    v("mlp_ratio", mlp_ratio_, "MLP hidden width = mlp_ratio * D");
    v("dropout_rate", dropout_rate_, "dropout in attention outputs and MLPs");
    v("force_fp32_for_softmax", force_fp32_for_softmax_, "softmax in fp32 under bf16/fp16 compute");
    v("norm_epsilon", norm_epsilon_, "LayerNorm epsilon");
    v("qk_norm", qk_norm_, "RMSNorm on queries and keys");
    v.choice("scan_order", scan_order_, {"raster", "hilbert", "zigzag"}, "token order of the patch grid");
    v.choice("dtype", dtype_, {"float32", "bfloat16", "float16"}, "compute dtype (parameters stay float32)");
    v.choice("attention_impl", attention_impl_, {"auto", "reference", "chunked", "sdpa"}, "attention implementation");
    v("remat", remat_, "recompute block activations in backward (gradient checkpointing)");
    v("in_channels", in_channels_, "channels of the input");
    v("num_classes", num_classes_, "label classes (0 = unconditional); label num_classes is the null class");
    v("context_features", context_features_, "width of text context features (0 = no text)");
  }
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
