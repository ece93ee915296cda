// UNet3D (SPEC section 5, `unet_3d`): the Unet body applied to every frame of a video, plus a
// zero-initialised TemporalBlock at every level, so a 2D Unet checkpoint inflates directly.
//
//   auto model = dew::nn::UNet3D(dew::nn::UNet3DOptions().feature_depths({32, 64}).attention_configs({{}, 4}));
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

#include "dew/nn/backbones/unet.h"

namespace dew::nn {

/// Fields of `unet_3d`: every field of `unet` plus temporal_heads.
/// Example: UNet3DOptions().feature_depths({64, 128}).attention_configs({{}, 4}).temporal_heads(4)
struct UNet3DOptions {
  /// channels of the prediction
  TORCH_ARG(int64_t, output_channels) = 3;
  /// width of the time embedding, e.g. 256
  TORCH_ARG(int64_t, emb_features) = 256;
  /// channels per level, e.g. (64, 128, 256, 512); each a multiple of norm_groups
  TORCH_ARG(std::vector<int64_t>, feature_depths) = std::vector<int64_t>{64, 128, 256, 512};
  /// spatial attention heads per level, or null for none; one entry per level
  TORCH_ARG(std::vector<std::optional<int64_t>>, attention_configs) =
      std::vector<std::optional<int64_t>>{8, 8, 8, 8};
  /// residual blocks per level on the way down (one more on the way up)
  TORCH_ARG(int64_t, num_res_blocks) = 2;
  /// (res, attention, res) groups in the middle
  TORCH_ARG(int64_t, num_middle_res_blocks) = 1;
  /// activation of the residual blocks: swish, silu, gelu, gelu_tanh, relu, mish
  TORCH_ARG(std::string, activation) = "swish";
  /// GroupNorm groups (residual blocks and temporal blocks)
  TORCH_ARG(int64_t, norm_groups) = 8;
  /// channels of the input
  TORCH_ARG(int64_t, in_channels) = 3;
  /// label classes (0 = unconditional); the table has num_classes + 1 rows, the last the null class
  TORCH_ARG(int64_t, num_classes) = 0;
  /// width of text context features for cross-attention; 0 = no text
  TORCH_ARG(int64_t, context_features) = 0;
  /// dropout inside residual blocks
  TORCH_ARG(double, dropout_rate) = 0.0;
  /// softmax in fp32 under bf16/fp16 compute
  TORCH_ARG(bool, force_fp32_for_softmax) = true;
  /// compute dtype: float32, bfloat16 or float16 (parameters stay float32)
  TORCH_ARG(std::string, dtype) = "float32";
  /// auto, reference, chunked or sdpa
  TORCH_ARG(std::string, attention_impl) = "auto";
  /// recompute each block's activations in backward
  TORCH_ARG(bool, remat) = false;
  /// heads of the temporal attention; must divide every feature depth, e.g. 8
  TORCH_ARG(int64_t, temporal_heads) = 8;

 public:
  /// The fields of the spatial body as `unet` options.
  UnetOptions unet_options() const;

  template <class V>
  void visit(V& v) {
    v("output_channels", output_channels_, "channels of the prediction");
    v("emb_features", emb_features_, "width of the time embedding");
    v("feature_depths", feature_depths_, "channels per level (multiples of norm_groups)");
    v("attention_configs", attention_configs_, "spatial attention heads per level, null for none");
    v("num_res_blocks", num_res_blocks_, "residual blocks per level (one more on the way up)");
    v("num_middle_res_blocks", num_middle_res_blocks_, "(res, attention, res) groups in the middle");
    v.choice("activation", activation_, {"swish", "silu", "gelu", "gelu_tanh", "relu", "mish"},
             "activation of the residual blocks");
    v("norm_groups", norm_groups_, "GroupNorm groups (residual and temporal blocks)");
    v("in_channels", in_channels_, "channels of the input");
    v("num_classes", num_classes_, "label classes (0 = unconditional); label num_classes is the null class");
    v("context_features", context_features_, "width of text context features (0 = no text)");
    v("dropout_rate", dropout_rate_, "dropout inside residual blocks");
    v("force_fp32_for_softmax", force_fp32_for_softmax_, "softmax in fp32 under bf16/fp16 compute");
    v.choice("dtype", dtype_, {"float32", "bfloat16", "float16"}, "compute dtype (parameters stay float32)");
    v.choice("attention_impl", attention_impl_, {"auto", "reference", "chunked", "sdpa"}, "attention implementation");
    v("remat", remat_, "recompute block activations in backward (gradient checkpointing)");
    v("temporal_heads", temporal_heads_, "heads of the temporal attention (divides every feature depth)");
  }
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
  TORCH_ARG(bool, force_fp32_softmax) = true;
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

/// Inflation: copies a 2D `unet` state (parameter and buffer name -> tensor, as named_parameters() and
/// named_buffers() of a Unet built with model.options3d.unet_options()) into the spatial parameters of
/// `model`; temporal blocks keep their values. Every spatial parameter must be present with its shape
/// and every key must name a spatial parameter or buffer (buffers may be absent); otherwise a dew::Error
/// names the offending key and nothing is changed. Returns the names loaded, sorted.
std::vector<std::string> load_unet_weights(UNet3DImpl& model, const std::map<std::string, at::Tensor>& unet_state);
/// The same from a built Unet.
std::vector<std::string> load_unet_weights(UNet3DImpl& model, const UnetImpl& unet);

}  // namespace dew::nn
