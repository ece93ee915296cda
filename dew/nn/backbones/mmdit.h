// SimpleMMDiT (docs/backbones/simple_mmdit.md): an SD3-style dual-stream diffusion transformer, and its
// joint block, which `hierarchical_mmdit` reuses.
//
//   auto model = dew::nn::SimpleMMDiT(dew::nn::SimpleMMDiTOptions().patch_size(2).emb_features(256)
//                                         .num_layers(6).num_heads(4).context_features(768));
//   at::Tensor F = model->forward(x, t, {labels, context, context_mask});  // context is required
//
// Two token streams, image patches and text tokens, each with its own adaLN modulation, q/k/v projections,
// output projection and MLP; one joint attention over [text; image] in every block (Esser et al. 2024,
// "Scaling Rectified Flow Transformers"). The conditioning vector c = MLP(Fourier(t)) + label embedding +
// projected masked mean of the text drives both streams' modulation. Image tokens carry the MAE 2D sin-cos
// table and, in raster order, RoPE over the sequence index; text tokens carry no position (as Flux's text
// ids of zero: their rotation is the identity), so the model is invariant to the order of the text tokens.
#pragma once
#include <torch/arg.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <utility>
#include <vector>

#include "dew/nn/backbones/backbone.h"
#include "dew/nn/backbones/dit_common.h"
#include "dew/nn/backbones/simple_dit.h"
#include "dew/nn/blocks.h"
#include "dew/nn/scan.h"

namespace dew::nn {

// ---- the joint (MM-DiT) block ----

/// Options of MMDiTBlock. Example: MMDiTBlockOptions(768, 12).qk_norm(true)
struct MMDiTBlockOptions {
  MMDiTBlockOptions(int64_t dim, int64_t num_heads) : dim_(dim), num_heads_(num_heads) {}
  /// width of both streams, e.g. 768
  TORCH_ARG(int64_t, dim);
  /// heads of the joint attention; dim must be divisible by it
  TORCH_ARG(int64_t, num_heads);
  /// MLP hidden width = mlp_ratio * dim
  TORCH_ARG(double, mlp_ratio) = 4.0;
  /// dropout on the attention output projections and in the MLPs
  TORCH_ARG(double, dropout) = 0.0;
  /// epsilon of the LayerNorms (no affine)
  TORCH_ARG(double, norm_eps) = 1e-5;
  /// RMSNorm over head_dim on the queries and keys of both streams
  TORCH_ARG(bool, qk_norm) = false;
  /// one of attention_impls()
  TORCH_ARG(std::string, attention_impl) = "auto";
  TORCH_ARG(bool, force_fp32_for_softmax) = true;
  /// SD3's context_pre_only: the text stream only supplies keys and values (its output would be
  /// discarded), so it has no queries, output projection or MLP. Used for the last block of a stack.
  TORCH_ARG(bool, context_pre_only) = false;
};

/// One stream of an MM-DiT block. Parameters: adaLN_modulation.{weight,bias} [6 dim, dim] (zero-initialised;
/// [2 dim, dim] when pre_only: shift and scale only), qkv.{weight,bias} [3 dim, dim] (kv [2 dim, dim] when
/// pre_only), q_norm.weight, k_norm.weight (qk_norm), proj.* and mlp.fc1.*, mlp.fc2.* (not when pre_only).
class MMDiTStreamImpl : public torch::nn::Module {
 public:
  MMDiTStreamImpl(MMDiTBlockOptions options, bool pre_only);
  void reset();
  void reset_parameters();
  /// The modulation of this stream from c [B, dim]: 6 (or 2 when pre_only) tensors [B, dim]:
  /// shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp.
  std::vector<at::Tensor> modulation(const at::Tensor& c);
  /// Heads of the modulated tokens x_mod [B, S, dim]: {q, k, v} (or {k, v} when pre_only), each
  /// [B, H, S, dim / H], qk-normalised when asked.
  std::vector<at::Tensor> heads(const at::Tensor& x_mod);
  /// Residual update after the joint attention: x + gate_msa proj(o), then the gated MLP.
  /// x: [B, S, dim]; o: [B, H, S, dim / H] this stream's rows of the attention output.
  at::Tensor finish(const at::Tensor& x, const at::Tensor& o, const std::vector<at::Tensor>& mod);

  MMDiTBlockOptions options;
  bool pre_only;
  torch::nn::Linear adaLN_modulation{nullptr}, qkv{nullptr}, kv{nullptr}, proj{nullptr};
  HeadNorm q_norm{nullptr}, k_norm{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(MMDiTStream);

/// SD3's joint block: image and text streams with their own weights, one attention over [text; image].
/// Parameters: image.* and text.* (MMDiTStream each; text is pre_only when options.context_pre_only).
class MMDiTBlockImpl : public torch::nn::Module {
 public:
  explicit MMDiTBlockImpl(MMDiTBlockOptions options);
  void reset();
  /// x: [B, N, dim] image tokens; text: [B, L, dim] text tokens; c: [B, dim]; rope: tables for the N image
  /// positions (undefined = no rotation; text is never rotated); text_mask: [B, L] bool (true = real token)
  /// or undefined (all real): masked text tokens are never attended to.
  /// Returns (x', text') in x's dtype; text' is undefined when context_pre_only.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& text, const at::Tensor& c,
                                            const Rope& rope = {}, const at::Tensor& text_mask = {});

  MMDiTBlockOptions options;
  MMDiTStream image{nullptr}, text{nullptr};
};
TORCH_MODULE(MMDiTBlock);

/// Runs `blocks` in order over (x, text) and returns the image tokens. With remat each block's
/// activations are recomputed in backward. The last block may be context_pre_only; no other may.
at::Tensor run_mmdit_blocks(const std::vector<MMDiTBlock>& blocks, at::Tensor x, at::Tensor text, const at::Tensor& c,
                            const Rope& rope, const at::Tensor& text_mask, bool remat);

/// Checks that cond carries the text context the MM-DiT models need ([batch, L >= 1, context_features]) and
/// returns its mask as bool [batch, L] (undefined when absent = all tokens real). `who` names the model.
at::Tensor checked_text_mask(const Conditioning& cond, int64_t batch, int64_t context_features, const std::string& who);

/// The conditioning vector of the MM-DiT models: t_embedder(time) + y_embedder(labels) (when num_classes > 0;
/// absent labels = the null class) + pooled(masked mean of the context): [B, D] in `dtype`.
at::Tensor mmdit_condition(TimeEmbedding& t_embedder, const torch::nn::Embedding& y_embedder,
                           const torch::nn::Linear& pooled, int64_t num_classes, const at::Tensor& time,
                           const Conditioning& cond, const at::Tensor& text_mask, int64_t batch, at::ScalarType dtype,
                           const std::string& who);

// ---- SimpleMMDiT ----

/// Fields of `simple_mmdit`: SimpleDiT's fields (dew/nn/backbones/simple_dit.h) with the same meaning, for
/// both streams; scan_order raster or hilbert (the original's use_hilbert; zigzag is refused), and
/// context_features defaults to 768 (CLIP ViT-L/14) because the model cannot run without text.
/// Example: SimpleMMDiTOptions().patch_size(2).emb_features(256).context_features(768)
struct SimpleMMDiTOptions : SimpleDiTOptions {
  SimpleMMDiTOptions() { context_features(768); }
  /// The SimpleDiT setters return SimpleDiTOptions&; this takes such a chain back.
  /* implicit */ SimpleMMDiTOptions(const SimpleDiTOptions& o) : SimpleDiTOptions(o) {}
};

/// The SimpleMMDiT backbone. Parameters (names stable across dtype, attention_impl and remat):
///   x_embedder.{weight [D, C, p, p], bias}                 patch embedding
///   context_embedder.{weight [D, context_features], bias}  text tokens -> the text stream
///   t_embedder.fourier.freqs (buffer), t_embedder.linear_1.*, t_embedder.linear_2.*
///   y_embedder.weight [num_classes + 1, D]                 when num_classes > 0
///   pooled_text_embedder.{weight [D, context_features], bias}   masked mean of the text -> c
///   blocks.N.image.{adaLN_modulation, qkv, q_norm, k_norm, proj, mlp.fc1, mlp.fc2}.*
///   blocks.N.text.* the same, except the last block: blocks.{last}.text.{adaLN_modulation [2D, D], kv, k_norm}
///   final_layer.adaLN_modulation.*, final_layer.linear.{weight [p*p*out, D], bias}   (image stream only)
class SimpleMMDiTImpl : public BackboneImpl {
 public:
  explicit SimpleMMDiTImpl(SimpleMMDiTOptions options = {});
  void reset();
  void reset_parameters();
  /// x: [B, in_channels, H, W]; time: [B] (or a scalar); cond: context [B, L, context_features] (required)
  /// with optional context_mask [B, L]; optional labels [B] (value num_classes = null class; absent = null).
  /// Returns [B, output_channels, H, W] float32.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) override;
  bool requires_text() const override { return true; }

  SimpleMMDiTOptions options;
  torch::nn::Conv2d x_embedder{nullptr};
  torch::nn::Linear context_embedder{nullptr};
  TimeEmbedding t_embedder{nullptr};
  torch::nn::Embedding y_embedder{nullptr};
  torch::nn::Linear pooled_text_embedder{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  std::vector<MMDiTBlock> block_list;  // typed view of `blocks`
  FinalLayer final_layer{nullptr};

 private:
  // Per-grid constants (scan, position table, RoPE tables), built once per (grid, device).
  using Grid = PatchGrid;
  Grid grid(int64_t h, int64_t w, const at::Device& device);

  at::ScalarType dtype_ = at::kFloat;
  PatchGridCache grid_cache_;
};
TORCH_MODULE(SimpleMMDiT);

}  // namespace dew::nn
