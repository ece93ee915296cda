// SimpleUDiT (docs/backbones/simple_udit.md): SimpleDiT with U-Net long skips between its blocks.
//
//   auto model = dew::nn::SimpleUDiT(dew::nn::SimpleDiTOptions().patch_size(2).emb_features(384)
//                                        .num_layers(6).num_heads(6));
//   at::Tensor F = model->forward(x, t, {});   // x: [B, 3, H, W], t: [B] -> [B, 3, H, W]
//
// The stem, conditioning and final layer are SimpleDiT's (same fields, same parameter names). The
// blocks are laid out as FlaxDiff's SimpleUDiT: num_layers / 2 down blocks, one mid block and
// num_layers / 2 up blocks (num_layers + 1 DiT blocks in all). Before up block i the stream is fused with
// the output of down block num_layers/2 - 1 - i (the mirror, innermost first):
//   h = up_dense_i([h, skip]),  a Linear 2D -> D over the feature concatenation (h first, skip second).
#pragma once
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include <vector>

#include "dew/nn/backbones/simple_dit.h"

namespace dew::nn {

/// The SimpleUDiT backbone; its fields are SimpleDiTOptions (num_layers must be even and > 0).
/// Parameters (names stable across dtype, attention_impl and remat):
///   x_embedder.*, t_embedder.*, y_embedder.weight, context_embedder.*, final_layer.*   as SimpleDiT
///   down_blocks.N.*, mid_block.*, up_blocks.N.*        DiT blocks (N < num_layers / 2), names as SimpleDiT's
///                                                      blocks.N.* (adaLN_modulation, attn.qkv, attn.proj, mlp.fc1/fc2)
///   up_dense.N.{weight [D, 2 D], bias [D]}             skip fusion before up block N (LeCun normal, zero bias)
class SimpleUDiTImpl : public SimpleDiTImpl {
 public:
  explicit SimpleUDiTImpl(SimpleDiTOptions options = {});
  /// x: [B, in_channels, H, W]; time: [B] (or a scalar); cond as SimpleDiT. Returns [B, output_channels,
  /// H, W] float32.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) override;

  torch::nn::ModuleList down_blocks{nullptr}, up_blocks{nullptr}, up_dense{nullptr};
  DiTBlock mid_block{nullptr};
  std::vector<DiTBlock> down_list, up_list;      // typed views of down_blocks and up_blocks
  std::vector<torch::nn::Linear> up_dense_list;  // typed view of up_dense

 private:
  void build_unet();
};
TORCH_MODULE(SimpleUDiT);

}  // namespace dew::nn
