// Building blocks of the diffusion backbones: time embedding, adaLN-Zero DiT block and final layer,
// GroupNorm residual block with time injection, and gradient checkpointing (remat).
//
//   dew::nn::DiTBlock block(dew::nn::DiTBlockOptions(384, 6));
//   auto y = block(x, c, rope);                                    // x: [B, S, 384], c: [B, 384]
//   auto z = dew::nn::remat(*block, [block, rope](const std::vector<at::Tensor>& in) mutable {
//     return block(in[0], in[1], rope); }, {x, c});               // same values, activations recomputed
//
// Normalisations run in fp32 and return the compute dtype; parameters stay fp32 and are cast per use.
#pragma once
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <functional>
#include <string>
#include <vector>

#include "dew/nn/attention.h"
#include "dew/nn/embeddings.h"

namespace dew::nn {

using at::Tensor;

// ---- small shared pieces ----

/// The accepted compute dtypes: float32, bfloat16, float16.
const std::vector<std::string>& compute_dtypes();
/// The scalar type named by a `dtype` field; dew::Error naming `where` for anything else.
at::ScalarType parse_compute_dtype(const std::string& name, const std::string& where);
/// The accepted activations: swish (= silu), silu, gelu, gelu_tanh, relu, mish.
const std::vector<std::string>& activations();
/// Applies the named activation; dew::Error for an unknown name.
Tensor activation(const Tensor& x, const std::string& name);
/// LayerNorm without affine parameters over the last axis, in fp32, returned in x's dtype.
Tensor layer_norm_fp32(const Tensor& x, double eps);
/// LayerNorm with the module's affine parameters, in fp32 at least (float64 stays), returned in x's dtype.
Tensor layer_norm_affine(const Tensor& x, const torch::nn::LayerNorm& ln);
/// adaLN modulation x * (1 + scale) + shift. x: [B, S, D]; shift, scale: [B, D].
Tensor modulate(const Tensor& x, const Tensor& shift, const Tensor& scale);
/// conv2d with the module's parameters cast to x's dtype (padding and stride from its options).
Tensor conv(const Tensor& x, const torch::nn::Conv2d& layer);
/// x: [B, C, H, W] with channels-last (NHWC) strides when it is a float32 CPU tensor, else x itself. On the
/// CPU the convolutional networks run that way: oneDNN's convolutions and the Winograd path (conv()) take
/// it, the fused GroupNorm + SiLU reads it natively, and a [B, H W, C] token view needs no copy. Strides are
/// set even for one channel, where contiguous(ChannelsLast) would keep NCHW's (convolutions then return NCHW).
Tensor cpu_channels_last(const Tensor& x);
/// GroupNorm computed in fp32 with the module's affine parameters, returned in x's dtype.
Tensor group_norm_fp32(const Tensor& x, const torch::nn::GroupNorm& layer);
/// activation(group_norm_fp32(x + shift, layer), act) with shift: [B, C] broadcast over the positions
/// (undefined: none); swish/silu on float32 CPU tensors run the fused kernel of dew/nn/fused.h.
Tensor group_norm_act(const Tensor& x, const torch::nn::GroupNorm& layer, const std::string& act,
                      const Tensor& shift = Tensor());
/// {group_norm_act(x, layer, act, shift), x}: on the fused path the second output is x passed through the
/// kernel, whose backward then adds that output's gradient into dx (dew/nn/fused.h); use it for a skip path.
std::array<Tensor, 2> group_norm_act_and_input(const Tensor& x, const torch::nn::GroupNorm& layer,
                                               const std::string& act, const Tensor& shift = Tensor());
/// Mean of x: [B, L, D] over the tokens where mask [B, L] (bool) is true (all tokens when mask is
/// undefined; zeros for a row with none) -> [B, D] float32.
Tensor masked_mean(const Tensor& x, const Tensor& mask);

// ---- time embedding ----

/// Options of TimeEmbedding. Example: TimeEmbeddingOptions(768)
struct TimeEmbeddingOptions {
  /* implicit */ TimeEmbeddingOptions(int64_t features) : features_(features) {}
  /// width of the Fourier features and of the output, e.g. 768
  TORCH_ARG(int64_t, features);
  /// std of the fixed Fourier frequencies
  TORCH_ARG(double, scale) = 16.0;
};

/// t -> Linear(SiLU(Linear(fourier(t)))): the conditioning vector of a diffusion backbone.
/// Parameters: fourier.freqs (buffer), linear_1.{weight,bias}, linear_2.{weight,bias}.
class TimeEmbeddingImpl : public torch::nn::Module {
 public:
  explicit TimeEmbeddingImpl(TimeEmbeddingOptions options);
  void reset();
  void reset_parameters();
  /// t: [B] -> [B, features] in `dtype` (the Fourier features are fp32, the MLP runs in dtype).
  Tensor forward(const Tensor& t, at::ScalarType dtype = at::kFloat);

  TimeEmbeddingOptions options;
  FourierFeatures fourier{nullptr};
  torch::nn::Linear linear_1{nullptr}, linear_2{nullptr};
};
TORCH_MODULE(TimeEmbedding);

// ---- MLP ----

/// Options of Mlp. Example: MlpOptions(768, 3072)
struct MlpOptions {
  MlpOptions(int64_t dim, int64_t hidden) : dim_(dim), hidden_(hidden) {}
  /// input and output width
  TORCH_ARG(int64_t, dim);
  /// hidden width, e.g. 4 * dim
  TORCH_ARG(int64_t, hidden);
  /// one of activations()
  TORCH_ARG(std::string, activation) = "gelu_tanh";
  /// dropout after the activation and after fc2
  TORCH_ARG(double, dropout) = 0.0;
};

/// fc2(act(fc1(x))). Parameters (timm names): fc1.{weight,bias}, fc2.{weight,bias}.
class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(MlpOptions options);
  void reset();
  void reset_parameters();
  /// x: [B, S, dim] -> [B, S, dim]
  Tensor forward(const Tensor& x);

  MlpOptions options;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

// ---- adaLN-Zero DiT block ----

/// Options of DiTBlock. Example: DiTBlockOptions(768, 12).mlp_ratio(4).qk_norm(true)
struct DiTBlockOptions {
  DiTBlockOptions(int64_t dim, int64_t num_heads) : dim_(dim), num_heads_(num_heads) {}
  /// width, e.g. 768
  TORCH_ARG(int64_t, dim);
  /// heads, e.g. 12
  TORCH_ARG(int64_t, num_heads);
  /// MLP hidden width = mlp_ratio * dim
  TORCH_ARG(double, mlp_ratio) = 4.0;
  /// dropout in the MLP and on the attention output
  TORCH_ARG(double, dropout) = 0.0;
  /// epsilon of the two LayerNorms (no affine)
  TORCH_ARG(double, norm_eps) = 1e-5;
  /// RMSNorm over head_dim on q and k
  TORCH_ARG(bool, qk_norm) = false;
  /// one of attention_impls()
  TORCH_ARG(std::string, attention_impl) = "auto";
  TORCH_ARG(bool, force_fp32_for_softmax) = true;
};

/// DiT block with adaLN-Zero: (shift, scale, gate) x 2 from a zero-initialised Linear of SiLU(c), so the
/// block is the identity at initialisation.
/// Parameters: adaLN_modulation.{weight,bias} [6 dim, dim], attn.*, mlp.fc1.*, mlp.fc2.*.
class DiTBlockImpl : public torch::nn::Module {
 public:
  explicit DiTBlockImpl(DiTBlockOptions options);
  void reset();
  void reset_parameters();
  /// x: [B, S, dim]; c: [B, dim] conditioning; rope: tables for S positions or undefined.
  /// Returns [B, S, dim] in x's dtype.
  Tensor forward(const Tensor& x, const Tensor& c, const Rope& rope = {});

  DiTBlockOptions options;
  torch::nn::Linear adaLN_modulation{nullptr};
  SelfAttention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(DiTBlock);

/// Options of FinalLayer. Example: FinalLayerOptions(768, 16 * 16 * 3)
struct FinalLayerOptions {
  FinalLayerOptions(int64_t dim, int64_t out_features) : dim_(dim), out_features_(out_features) {}
  TORCH_ARG(int64_t, dim);
  /// per-token output, e.g. p * p * output_channels
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(double, norm_eps) = 1e-5;
};

/// LayerNorm (no affine) + adaLN (shift, scale) + zero-initialised linear: the output is exactly zero at
/// initialisation. Parameters: adaLN_modulation.{weight,bias} [2 dim, dim], linear.{weight,bias}.
class FinalLayerImpl : public torch::nn::Module {
 public:
  explicit FinalLayerImpl(FinalLayerOptions options);
  void reset();
  void reset_parameters();
  /// x: [B, S, dim]; c: [B, dim] -> [B, S, out_features]
  Tensor forward(const Tensor& x, const Tensor& c);

  FinalLayerOptions options;
  torch::nn::Linear adaLN_modulation{nullptr}, linear{nullptr};
};
TORCH_MODULE(FinalLayer);

// ---- GroupNorm residual block ----

/// Options of ResBlock. Example: ResBlockOptions(64, 128, 256).norm_groups(8)
struct ResBlockOptions {
  ResBlockOptions(int64_t in_channels, int64_t out_channels, int64_t emb_features)
      : in_channels_(in_channels), out_channels_(out_channels), emb_features_(emb_features) {}
  TORCH_ARG(int64_t, in_channels);
  TORCH_ARG(int64_t, out_channels);
  /// width of the time embedding injected after the first conv; 0 = none (the autoencoder's blocks)
  TORCH_ARG(int64_t, emb_features);
  /// GroupNorm groups; must divide in_channels and out_channels
  TORCH_ARG(int64_t, norm_groups) = 8;
  TORCH_ARG(double, norm_eps) = 1e-5;
  /// one of activations()
  TORCH_ARG(std::string, activation) = "swish";
  /// dropout before the second conv
  TORCH_ARG(double, dropout) = 0.0;
  /// conv2 starts at zero (ADM), so the block starts as its skip path; false keeps PyTorch's default
  /// initialisation, as diffusers' ResnetBlock2D does
  TORCH_ARG(bool, zero_init) = true;
};

/// h = conv1(act(norm1(x))) + time_emb_proj(act(temb)); out = skip(x) + conv2(dropout(act(norm2(h)))).
/// Parameters (diffusers' ResnetBlock2D names): norm1, conv1, time_emb_proj (only when emb_features > 0),
/// norm2, conv2, conv_shortcut (1x1, only when in_channels != out_channels).
class ResBlockImpl : public torch::nn::Module {
 public:
  explicit ResBlockImpl(ResBlockOptions options);
  void reset();
  void reset_parameters();
  /// x: [B, in, H, W]; temb: [B, emb_features] (undefined when emb_features is 0) -> [B, out, H, W] in
  /// x's dtype.
  Tensor forward(const Tensor& x, const Tensor& temb = {});

  ResBlockOptions options;
  torch::nn::GroupNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv_shortcut{nullptr};
  torch::nn::Linear time_emb_proj{nullptr};
};
TORCH_MODULE(ResBlock);

// ---- gradient checkpointing ----

/// A block as a function of its differentiable inputs.
using RematFn = std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs)>;

/// Runs fn(inputs) without keeping its activations; backward re-runs fn with grad enabled and
/// back-propagates through the recomputation (gradient checkpointing). `params` are the tensors fn
/// reads besides `inputs` (a block's parameters): their gradients accumulate as without remat.
/// Tensors fn captures by other means are constants (no gradient); fn is kept until backward, so it must
/// capture by value what it needs. The default RNG state of the inputs'
/// device is replayed, so dropout draws the same masks. Outputs must be floating point; the graph
/// can be traversed once (no retain_graph). Without grad mode or anything requiring grad, just fn(inputs).
std::vector<Tensor> remat(const RematFn& fn, const std::vector<Tensor>& inputs, const std::vector<Tensor>& params);
/// remat of a one-output function over a module's parameters.
Tensor remat(const torch::nn::Module& block, const std::function<Tensor(const std::vector<Tensor>&)>& fn,
             const std::vector<Tensor>& inputs);

}  // namespace dew::nn
