// HybridSSMAttentionDiT (docs/backbones/hybrid_dit.md): SimpleDiT whose blocks mix tokens either by
// attention or by a bidirectional S5 state-space scan along the scan order.
//
//   dew::nn::HybridDiTOptions o;
//   o.ssm_state_dim(32).ssm_attention_ratio("3:1");   // hybrid fields first: the SimpleDiT setters
//   o.patch_size(2).emb_features(384).num_layers(8);   // return SimpleDiTOptions&
//   auto model = dew::nn::HybridDiT(o);
//   at::Tensor F = model->forward(x, t, {labels});     // x: [B, 3, H, W], t: [B] -> [B, 3, H, W]
//
// Everything but the blocks is SimpleDiT's (patch embedding, 2D sin-cos table, Fourier time MLP, labels,
// pooled text, final layer, scan orders, same parameter names). Layer i is an attention block (SimpleDiT's
// adaLN-Zero DiTBlock with RoPE) or an SSM block (the same adaLN-Zero block with the attention replaced
// by S5, optionally followed by the 2D state fusion), as block_pattern or ssm_attention_ratio say:
// "3:1" lays out ssm, ssm, ssm, attn, ssm, ssm, ssm, attn, ... cut to num_layers.
#pragma once
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <vector>

#include "dew/nn/backbones/simple_dit.h"
#include "dew/nn/blocks.h"
#include "dew/nn/s5.h"

namespace dew::nn {

// ---- the SSM block ----

/// Options of SSMDiTBlock. Example: SSMDiTBlockOptions(768, 64).use_2d_fusion(true)
struct SSMDiTBlockOptions {
  SSMDiTBlockOptions(int64_t dim, int64_t state_dim) : dim_(dim), state_dim_(state_dim) {}
  /// width, e.g. 768
  TORCH_ARG(int64_t, dim);
  /// S5 state size per direction, e.g. 64
  TORCH_ARG(int64_t, state_dim);
  /// MLP hidden width = mlp_ratio * dim
  TORCH_ARG(double, mlp_ratio) = 4.0;
  /// dropout in the MLP
  TORCH_ARG(double, dropout) = 0.0;
  /// epsilon of the two LayerNorms (no affine)
  TORCH_ARG(double, norm_eps) = 1e-5;
  /// S5 forward and backward (see S5Options)
  TORCH_ARG(bool, bidirectional) = true;
  /// 2D state fusion of the S5 output on the token grid
  TORCH_ARG(bool, use_2d_fusion) = false;
};

/// DiTBlock with the attention replaced by S5: adaLN-Zero modulation (shift, scale, gate) x 2 from a
/// zero-initialised Linear of SiLU(c), so the block starts as the identity; the RoPE tables do not apply.
/// Parameters: adaLN_modulation.{weight,bias} [6 dim, dim], ssm.* (S5), spatial_fusion.* (when
/// use_2d_fusion), mlp.fc1.*, mlp.fc2.*.
class SSMDiTBlockImpl : public torch::nn::Module {
 public:
  explicit SSMDiTBlockImpl(SSMDiTBlockOptions options);
  void reset();
  void reset_parameters();
  /// x: [B, h*w, dim] tokens in scan order; c: [B, dim]; perm/inverse: the scan permutation on x's
  /// device (undefined for raster order), read only by the 2D fusion. Returns [B, h*w, dim] in x's dtype.
  Tensor forward(const Tensor& x, const Tensor& c, int64_t h, int64_t w, const Tensor& perm = {},
                 const Tensor& inverse = {});

  SSMDiTBlockOptions options;
  torch::nn::Linear adaLN_modulation{nullptr};
  S5 ssm{nullptr};
  SpatialFusion spatial_fusion{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(SSMDiTBlock);

// ---- the model ----

/// Fields of `hybrid_dit`: SimpleDiT's, then the hybrid ones.
struct HybridDiTOptions : SimpleDiTOptions {
#define DEW_HYBRID_DIT_FIELDS(F, C)                                                                                    \
  F(int64_t, ssm_state_dim, 64, "S5 state size N per direction")                                                       \
  F(std::string, ssm_attention_ratio, "3:1", "\"N:M\" SSM:attention blocks repeating (e.g. 3:1), all-ssm or all-attn") \
  F(std::vector<std::string>, block_pattern, {},                                                                       \
    "mixer of each layer, ssm or attn (length num_layers; empty = use the ratio; set, it needs the ratio 3:1)")        \
  F(bool, bidirectional_ssm, true, "S5 forward and backward along the scan, concatenated and projected")               \
  F(bool, use_2d_fusion, false, "depthwise 3x3 convs (dilations 1, 2, 3) on the token grid after each S5")
  DEW_OPTION_MEMBERS(DEW_HYBRID_DIT_FIELDS)

 public:
  template <class V>
  void visit(V& v) {
    SimpleDiTOptions::visit(v);
    DEW_VISIT_FIELDS(DEW_HYBRID_DIT_FIELDS)
  }
#undef DEW_HYBRID_DIT_FIELDS
};

/// The layer kinds ("ssm" / "attn") of `o`, from block_pattern or the ratio; dew::Error for a bad ratio,
/// a bad entry, a pattern whose length is not num_layers, or both set.
std::vector<std::string> hybrid_block_pattern(const HybridDiTOptions& o);

/// The HybridSSMAttentionDiT backbone. Parameters (names stable across dtype, attention_impl and remat):
///   x_embedder.*, t_embedder.*, y_embedder.weight, context_embedder.*, final_layer.*   as SimpleDiT
///   blocks.N.*  attention layers: as SimpleDiT's blocks.N.* (adaLN_modulation, attn.qkv, attn.proj,
///               attn.{q,k}_norm, mlp.fc1, mlp.fc2)
///               SSM layers: adaLN_modulation, ssm.s5_forward.{log_A_real, A_imag, B_re, B_im, C_re, C_im,
///               D, log_dt}, ssm.s5_backward.* and ssm.out_proj.* (bidirectional),
///               spatial_fusion.dwconv_dil{1,2,3}.weight (use_2d_fusion), mlp.fc1, mlp.fc2
class HybridDiTImpl : public SimpleDiTImpl {
 public:
  explicit HybridDiTImpl(HybridDiTOptions options = {});
  /// x: [B, in_channels, H, W]; time: [B] (or a scalar); cond as SimpleDiT. Returns [B, output_channels,
  /// H, W] float32.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) override;
  /// The mixer of each layer: "ssm" or "attn".
  const std::vector<std::string>& pattern() const { return pattern_; }

  HybridDiTOptions hybrid_options;
  std::vector<DiTBlock> attn_list;    // per layer; empty holders at SSM layers
  std::vector<SSMDiTBlock> ssm_list;  // per layer; empty holders at attention layers

 private:
  std::vector<std::string> pattern_;
};
TORCH_MODULE(HybridDiT);

}  // namespace dew::nn
