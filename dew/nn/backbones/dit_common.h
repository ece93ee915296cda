// Pieces shared by the DiT-family backbones (simple_dit and the models on its stem, video_dit,
// simple_mmdit, hierarchical_mmdit): the field checks their constructors have in common, the block
// options, the embedders (patch, time, label, text) with DiT's initialisation, the conditioning vector,
// and the per-grid constants of a patch-token model. Each model keeps its own checks (context_features, scan
// orders, stage lists) next to these calls, in the same order as before, so a config with several bad
// fields reports the same one first.
#pragma once
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <mutex>
#include <string>
#include <vector>

#include "dew/core/error.h"
#include "dew/nn/attention.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/blocks.h"
#include "dew/nn/embeddings.h"
#include "dew/nn/scan.h"

namespace dew::nn {

/// in_channels and output_channels > 0; `arch` names the model in the errors.
template <class O>
void check_channel_fields(const O& o, const std::string& arch) {
  DEW_CHECK(o.in_channels() > 0, arch, ": in_channels must be > 0, got ", o.in_channels());
  DEW_CHECK(o.output_channels() > 0, arch, ": output_channels must be > 0, got ", o.output_channels());
}

/// mlp_ratio > 0, dropout_rate in [0, 1), norm_epsilon > 0, num_classes >= 0.
template <class O>
void check_block_fields(const O& o, const std::string& arch) {
  DEW_CHECK(o.mlp_ratio() > 0, arch, ": mlp_ratio must be > 0, got ", o.mlp_ratio());
  DEW_CHECK(o.dropout_rate() >= 0 && o.dropout_rate() < 1, arch, ": dropout_rate must be in [0, 1), got ",
            o.dropout_rate());
  DEW_CHECK(o.norm_epsilon() > 0, arch, ": norm_epsilon must be > 0, got ", o.norm_epsilon());
  DEW_CHECK(o.num_classes() >= 0, arch, ": num_classes must be >= 0, got ", o.num_classes());
}

/// The fields every single-width DiT checks: patch_size, the channels, num_layers, num_heads, emb_features
/// (a positive multiple of 4, as the 2D sin-cos table splits D in four; D / num_heads even, as RoPE rotates
/// pairs within each head), then check_block_fields.
template <class O>
void check_dit_fields(const O& o, const std::string& arch) {
  DEW_CHECK(o.patch_size() > 0, arch, ": patch_size must be > 0, got ", o.patch_size());
  check_channel_fields(o, arch);
  DEW_CHECK(o.num_layers() > 0, arch, ": num_layers must be > 0, got ", o.num_layers());
  DEW_CHECK(o.num_heads() > 0, arch, ": num_heads must be > 0, got ", o.num_heads());
  DEW_CHECK(o.emb_features() > 0 && o.emb_features() % 4 == 0, arch,
            ": emb_features must be a positive multiple of 4, got ", o.emb_features());
  DEW_CHECK(o.emb_features() % o.num_heads() == 0 && (o.emb_features() / o.num_heads()) % 2 == 0, arch,
            ": emb_features / num_heads must be an even integer, got ", o.emb_features(), " / ", o.num_heads());
  check_block_fields(o, arch);
}

/// Checks attention_impl and returns the compute dtype named by `dtype` (errors name arch.dtype and
/// arch.attention_impl).
template <class O>
at::ScalarType checked_compute_fields(const O& o, const std::string& arch) {
  const at::ScalarType dtype = parse_compute_dtype(o.dtype(), arch + ".dtype");
  check_attention_impl(o.attention_impl(), arch + ".attention_impl");
  return dtype;
}

// ---- blocks and embedders ----

/// Block options (DiTBlockOptions, MMDiTBlockOptions) of width dim with num_heads heads, carrying the
/// model's mlp_ratio, dropout_rate, norm_epsilon, qk_norm, attention_impl and force_fp32_for_softmax.
template <class BlockOptions, class O>
BlockOptions dit_block_options(const O& o, int64_t dim, int64_t num_heads) {
  BlockOptions b(dim, num_heads);
  b.mlp_ratio(o.mlp_ratio())
      .dropout(o.dropout_rate())
      .norm_eps(o.norm_epsilon())
      .qk_norm(o.qk_norm())
      .attention_impl(o.attention_impl())
      .force_fp32_for_softmax(o.force_fp32_for_softmax());
  return b;
}

/// The patch embedding: a p x p convolution with stride p, in_channels -> dim.
inline torch::nn::Conv2d patch_embedder(int64_t in_channels, int64_t dim, int64_t patch_size) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in_channels, dim, patch_size).stride(patch_size));
}

/// The label table: num_classes + 1 rows, the last being the null class.
inline torch::nn::Embedding label_embedder(int64_t num_classes, int64_t dim) {
  return torch::nn::Embedding(num_classes + 1, dim);
}

/// Registers on m, in this order, x_embedder (patch embedding), t_embedder, y_embedder (when
/// num_classes > 0) and context_embedder (when context_features > 0), all of width emb_features.
template <class M, class O>
void register_dit_embedders(M& m, const O& o) {
  const int64_t d = o.emb_features();
  m.x_embedder = m.register_module("x_embedder", patch_embedder(o.in_channels(), d, o.patch_size()));
  m.t_embedder = m.register_module("t_embedder", TimeEmbedding(d));
  if (o.num_classes() > 0) m.y_embedder = m.register_module("y_embedder", label_embedder(o.num_classes(), d));
  if (o.context_features() > 0)
    m.context_embedder = m.register_module("context_embedder", torch::nn::Linear(o.context_features(), d));
}

/// DiT's initialisation of the embedders: xavier-uniform over the patch kernel flattened to [D, C p p]
/// (as a Linear) with a zero bias; the label table (when present) N(0, 0.02); then each dense layer
/// (empty holders skipped), in order, xavier-uniform with a zero bias.
void init_dit_embedders(const torch::nn::Conv2d& x_embedder, const torch::nn::Embedding& y_embedder,
                        const std::vector<torch::nn::Linear>& dense_layers);

// ---- inputs and conditioning ----

/// Checks x: [B, in_channels, H, W] with H and W multiples of patch_size; `who` names the model.
void check_patch_input(const at::Tensor& x, int64_t in_channels, int64_t patch_size, const std::string& who);

/// The conditioning vector without text: t_embedder(time) + y_embedder(labels) (when num_classes > 0;
/// absent labels = the null class num_classes): [B, D] in `dtype`. time: [batch] or a scalar.
at::Tensor time_label_condition(TimeEmbedding& t_embedder, const torch::nn::Embedding& y_embedder, int64_t num_classes,
                                const at::Tensor& time, const Conditioning& cond, int64_t batch, at::ScalarType dtype,
                                const std::string& who);

/// time_label_condition + context_embedder(masked mean of the text context) when a context is given
/// (optional text: context_features 0 refuses one).
at::Tensor dit_condition(TimeEmbedding& t_embedder, const torch::nn::Embedding& y_embedder,
                         const torch::nn::Linear& context_embedder, int64_t num_classes, int64_t context_features,
                         const at::Tensor& time, const Conditioning& cond, int64_t batch, at::ScalarType dtype,
                         const std::string& who);

// ---- per-grid constants ----

/// The constants of a gh x gw patch grid on one device: the scan, its permutation on the device, the MAE
/// 2D sin-cos table indexed by each token's true grid position (so in scan order) and the RoPE tables
/// over the sequence index. RoPE is a 1D position only in raster order; under hilbert and zigzag the
/// tables stay undefined (the identity) and the 2D table carries the geometry.
struct PatchGrid {
  int64_t h = -1, w = -1;
  at::Device device{at::kCPU};
  Scan scan;
  at::Tensor perm;  // scan.perm on the device
  at::Tensor pos;   // [N, dim] float32, in scan order
  Rope rope;        // raster only
};

/// Builds the PatchGrid of a gh x gw grid in `scan_order` for width `dim` and RoPE over `head_dim`.
PatchGrid make_patch_grid(const std::string& scan_order, int64_t gh, int64_t gw, int64_t dim, int64_t head_dim,
                          const at::Device& device);

/// Patch tokens of x (checked by check_patch_input): [B, N, D] in `dtype`, in g's scan order, with g's
/// position table added.
at::Tensor embed_patches(const at::Tensor& x, const torch::nn::Conv2d& x_embedder, const PatchGrid& g,
                         at::ScalarType dtype);

/// The last PatchGrid built, so a model builds its constants once per (grid, device) rather than
/// recomputing them and copying them to the device on every step. Thread-safe.
class PatchGridCache {
 public:
  /// The grid for (gh, gw, device); scan_order, dim and head_dim must be the same on every call.
  PatchGrid get(const std::string& scan_order, int64_t gh, int64_t gw, int64_t dim, int64_t head_dim,
                const at::Device& device);

 private:
  std::mutex mutex_;
  PatchGrid last_;
};

}  // namespace dew::nn
