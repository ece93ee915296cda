// UNet3D (docs/backbones/unet_3d.md): the Unet body applied to every frame of a video, plus a
// zero-initialised TemporalBlock at every level, so a 2D Unet checkpoint inflates directly.
//
//   dew::nn::UNet3DOptions o;
//   o.feature_depths({32, 64}).attention_configs({{}, 4});
//   auto model = dew::nn::UNet3D(o);
//   at::Tensor F = model->forward(x, t, {});   // x: [B, 3, T, H, W] -> [B, 3, T, H, W]
//   auto loaded = dew::nn::load_unet_weights(*model, unet_state);   // a trained `unet`'s parameters
//
// Frames are folded into the batch ([B T, C, H, W]) for every spatial layer, which are exactly the Unet's
// (same classes, same parameter names). Time, labels and text are shared by the frames of a video. A
// TemporalBlock runs after each level's blocks on the way down (before the level's last skip is kept and
// before its downsample), after the middle, and after each level's blocks on the way up (before its
// upsample): GroupNorm over (C, T, H, W), a fixed 1D sin-cos table over the frame index, self-attention
// across the T frames at each pixel, residual. Its output projection starts at zero, so at initialisation
// the model equals the 2D Unet applied frame by frame.
#pragma once
#include <torch/arg.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/normalization.h>

#include <map>
#include <string>
#include <vector>

#include "dew/io/weights.h"
#include "dew/nn/backbones/unet.h"

namespace dew::nn {

/// Fields of `unet_3d`: every field of `unet` (the spatial body; norm_groups also sizes the temporal blocks'
/// GroupNorm) plus temporal_heads. The unet setters return UnetOptions&, so set temporal_heads last:
/// Example: UNet3DOptions o; o.feature_depths({64, 128}).attention_configs({{}, 4}); o.temporal_heads(4);
struct UNet3DOptions : UnetOptions {
#define DEW_UNET_3D_FIELDS(F, C) \
  F(int64_t, temporal_heads, 8, "heads of the temporal attention (divides every feature depth)")
  DEW_OPTION_MEMBERS(DEW_UNET_3D_FIELDS)

 public:
  /// The fields of the spatial body as `unet` options.
  UnetOptions unet_options() const { return *this; }

  template <class V>
  void visit(V& v) {
    UnetOptions::visit(v);
    DEW_VISIT_FIELDS(DEW_UNET_3D_FIELDS)
  }
#undef DEW_UNET_3D_FIELDS
};

/// Options of TemporalBlock. Example: TemporalBlockOptions(128, 8).norm_groups(8)
struct TemporalBlockOptions {
  TemporalBlockOptions(int64_t channels, int64_t num_heads) : channels_(channels), num_heads_(num_heads) {}
  /// channels C (even: the frame position table splits it into sin and cos halves)
  TORCH_ARG(int64_t, channels);
  /// attention heads; must divide channels
  TORCH_ARG(int64_t, num_heads);
  /// GroupNorm groups; must divide channels
  TORCH_ARG(int64_t, norm_groups) = 8;
  TORCH_ARG(double, norm_eps) = 1e-5;
  /// one of attention_impls()
  TORCH_ARG(std::string, impl) = "auto";
  TORCH_ARG(bool, force_fp32_for_softmax) = true;
};

/// Self-attention across frames at each pixel: out = x + attn(norm(x) + sincos_1d(frame index)), tokens
/// [B H W, T, C]. attn.proj starts at zero, so the block is the identity at initialisation.
/// Parameters: norm.{weight,bias} [C], attn.qkv.{weight [3C, C], bias}, attn.proj.{weight [C, C], bias}.
class TemporalBlockImpl : public torch::nn::Module {
 public:
  explicit TemporalBlockImpl(TemporalBlockOptions options);
  void reset();
  void reset_parameters();
  /// h: [B T, C, H, W] (frames folded into the batch, frame-minor); frames: T. Returns h's shape and dtype.
  at::Tensor forward(const at::Tensor& h, int64_t frames);

  TemporalBlockOptions options;
  torch::nn::GroupNorm norm{nullptr};
  SelfAttention attn{nullptr};
};
TORCH_MODULE(TemporalBlock);

/// The UNet3D backbone. Parameters (names stable across dtype, attention_impl and remat):
///   every parameter of `unet` built from unet_options(), under the same name (t_embedder.*, conv_in.*,
///   down_blocks.I.*, mid_block.*, up_blocks.I.*, norm_out.*, conv_out.*, y_embedder.weight), plus
///   temporal_down.I.*  after down level I (I = 0 is the finest level)
///   temporal_mid.*     after the middle blocks
///   temporal_up.I.*    after up level I (I = 0 is the deepest level, as up_blocks.I)
/// each a TemporalBlock (norm.*, attn.qkv.*, attn.proj.*).
class UNet3DImpl : public UnetImpl {
 public:
  explicit UNet3DImpl(UNet3DOptions options = {});
  /// x: [B, in_channels, T, H, W] with H, W multiples of 2^(levels - 1), any T >= 1; time: [B] (or a
  /// scalar); cond: optional labels [B], context [B, L, context_features] + context_mask [B, L], shared by
  /// the frames of each video. Returns [B, output_channels, T, H, W] float32.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) override;

  UNet3DOptions options3d;
  torch::nn::ModuleList temporal_down{nullptr}, temporal_up{nullptr};
  TemporalBlock temporal_mid{nullptr};
  std::vector<TemporalBlock> temporal_down_list, temporal_up_list;  // typed views

 private:
  void reset_temporal();  // registers the temporal blocks (the Unet constructor built the rest)
  at::Tensor run_temporal(TemporalBlock block, const at::Tensor& h, int64_t frames);
};
TORCH_MODULE(UNet3D);

/// True for the names of UNet3D's temporal parameters (temporal_down.*, temporal_mid.*, temporal_up.*).
bool is_temporal_parameter(const std::string& name);

/// The inflation key map: a 2D unet's names are the spatial names of a UNet3D; the temporal blocks
/// (temporal_down.*, temporal_mid.*, temporal_up.*) may be absent and keep their values, and a source that
/// carries them is refused. Load with io::LoadOptions::require_buffers = false (buffers may be absent).
io::KeyMap unet_3d_inflation_map();

/// Inflation: copies a 2D `unet` state (parameter and buffer name -> tensor, as named_parameters() and
/// named_buffers() of a Unet built with model.options3d.unet_options()) into the spatial parameters of
/// `model`; temporal blocks keep their values. Every spatial parameter must be present with its shape
/// and every key must name a spatial parameter or buffer (buffers may be absent); otherwise a dew::Error
/// names the offending key and nothing is changed (io::load_weights with unet_3d_inflation_map()). Returns the
/// names loaded, sorted.
std::vector<std::string> load_unet_weights(UNet3DImpl& model, const std::map<std::string, at::Tensor>& unet_state);
/// The same from a built Unet.
std::vector<std::string> load_unet_weights(UNet3DImpl& model, const UnetImpl& unet);

}  // namespace dew::nn
