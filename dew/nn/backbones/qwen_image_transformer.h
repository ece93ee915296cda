// QwenImageTransformer (docs/backbones/qwen_image_transformer.md): diffusers' QwenImage21Transformer2DModel, the
// single-stream block-causal denoiser of Qwen-Image 2.1, with its module tree and parameter names (a diffusers
// checkpoint loads with an identity key map); also built from a diffusers config.json
// (models::fields_from_reference_config).
//
//   auto qwen = dew::nn::QwenImageTransformer(dew::nn::QwenImageTransformerOptions());   // Qwen-Image 2.1's
//   dew::Conditioning c;
//   c.context = text_states;          // [B, L, 4096], right-padded (each row's real tokens first)
//   c.context_mask = mask;            // [B, L] bool, true = real token
//   at::Tensor v = qwen->forward(latents, sigma * 1000, c);   // [B, 64, H, W] -> [B, 64, H, W] (H W % 4 == 0)
//
//   // Sampling with the prefix KV cache (causal_condition): the text's keys and values do not depend on t.
//   dew::nn::QwenImageKVCache cache;
//   v = qwen->forward_extract(latents, t0, c, cache);   // the first step fills the cache
//   v = qwen->forward_cached(latents, t1, c, cache);    // later steps recompute only the image tokens
//
// Layout: one joint sequence [text; image] (condition images may sit inside the text, at the vision-language
// encoder's image slots, each slot standing for 2 x 2 latent tokens; the target image comes last). img_in and
// txt_in (zero-centred RMSNorm, Linear, GELU-tanh, Linear) project the two; temb = timestep_embedder(cos/sin
// sinusoid of 1000 t); one shared `modulation` (SiLU, Linear D -> 4 D) gives every block its
// (scale, gate) x 2 (x (1 + scale), gates through tanh, no shift). With causal_condition the text and the
// condition images take the modulation of t = 0. Blocks: LayerNorm, attention (q / k RMS-normalised per head,
// 3-axis RoPE, block-causal mask: (q >= k) or same image block, padded text keys excluded), LayerNorm, SwiGLU
// feed-forward of width mlp_ratio D. Then the scale-only AdaLayerNormContinuous (norm_out) and proj_out on
// every token of the joint sequence.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <vector>

#include "dew/nn/attention.h"
#include "dew/nn/backbones/backbone.h"
#include "dew/nn/option_fields.h"

namespace dew::nn {

/// Fields of `qwen_image_transformer`. Defaults are Qwen-Image 2.1's.
struct QwenImageTransformerOptions {
#define DEW_QWEN_IMAGE_TRANSFORMER_FIELDS(F, C)                                                             \
  F(int64_t, in_channels, 64, "latent channels C of x [B, C, H, W] (one token per latent position)")        \
  F(int64_t, output_channels, 64, "channels of the prediction (diffusers' out_channels)")                   \
  F(int64_t, num_classes, 0, "must be 0: Qwen-Image conditions on text, not on class labels")               \
  F(int64_t, context_features, 4096, "width of the text states (context_in_dim; Qwen3-VL's 4096)")          \
  F(int64_t, num_layers, 32, "single-stream blocks (transformer_blocks)")                                   \
  F(int64_t, num_attention_heads, 32, "attention heads; the model width is num_attention_heads x head dim") \
  F(int64_t, attention_head_dim, 128, "width of each head")                                                 \
  F(int64_t, mlp_ratio, 3, "SwiGLU hidden width = mlp_ratio x model width")                                 \
  F(std::vector<int64_t>, axes_dims_rope, (std::vector<int64_t>{16, 56, 56}),                               \
    "RoPE widths of the frame, height and width axes (even, summing to attention_head_dim)")                \
  F(double, eps, 1e-6, "epsilon of every norm")                                                             \
  F(bool, causal_condition, true,                                                                           \
    "text (and condition-image) tokens modulated from t = 0, which makes the prefix KV cache valid")        \
  F(bool, force_fp32_for_softmax, true, "softmax in fp32 under bf16/fp16 compute")                          \
  DEW_COMPUTE_FIELDS(F, C, "block")
  DEW_OPTIONS(DEW_QWEN_IMAGE_TRANSFORMER_FIELDS)
#undef DEW_QWEN_IMAGE_TRANSFORMER_FIELDS
};

/// QwenImage21Rope's tables: per position the unit complex numbers exp(i p f_j) of the three axes, concatenated,
/// in complex64 as diffusers builds them with torch.polar (whose cos / sin differ from at::cos / at::sin in the
/// last float32 bit, so they are built the same way).
struct QwenRope {
  at::Tensor freqs;  // [S, attention_head_dim / 2] complex64
};
/// apply_rotary_emb_qwen (use_real false): x [B, S, H, D] as D / 2 complex pairs (interleaved) times freqs,
/// computed in float32 (also for float64 x) and returned in x's dtype.
at::Tensor qwen_apply_rope(const at::Tensor& x, const QwenRope& rope);

namespace qwen_image_detail {
/// The rotary tables of positions pos [S, 3] (frame, height, width; int64, negative allowed): per axis of width d,
/// the frequencies 1 / 10000^(2j / d) and their products with the positions in float32, then torch.polar, as
/// diffusers' rope_params builds them (QwenImage21Rope and Qwen-Image 1's QwenEmbedRope alike).
QwenRope qwen_rope(const at::Tensor& pos, const std::vector<int64_t>& axes_dims);
/// diffusers' RMSNorm over the last axis: the variance in float32 (even for float64 x), the product in x's dtype;
/// half types take HeadNorm's float32 path.
at::Tensor qwen_rms_heads(const at::Tensor& x, HeadNorm& norm);
}  // namespace qwen_image_detail

/// The joint sequence's layout, shared by every block of one forward: which positions hold image tokens, which
/// image block each belongs to, the rotary tables and which keys may be attended.
struct QwenImageLayout {
  at::Tensor image_pad;    // [S] bool: image-token positions of the joint sequence
  at::Tensor image_ids;    // [S] int64: -1 at text, the image block's index (condition images first, target last)
  at::Tensor target;       // [S] bool: the target image's tokens (the last block)
  at::Tensor text_index;   // [T] int64: the joint positions of the text tokens, in order
  at::Tensor text_cols;    // [T] int64: their entries in the vision-language sequence (rows of the text states)
  at::Tensor image_index;  // [N] int64: the joint positions of the image tokens, in order
  at::Tensor key_valid;    // [B, S] bool (false at padded text) or undefined (every key valid)
  QwenRope rope;           // [S, attention_head_dim / 2] complex64
  int64_t prefix_len = 0;  // tokens before the target image
  int64_t vlm_len = 0;     // V: the text states cover its first V - (target tokens) / 4 entries
};

/// QwenImage21Rope + build_token_metadata + the key mask of QwenImage21Transformer2DModel.forward.
/// img_shapes: the (frame, height, width) of each image block in latent tokens, condition images first, the
/// target last; vlm_image: [V] bool, the vision-language sequence's image slots (each 2 x 2 latent tokens), text
/// elsewhere; text_mask: [B, E] bool over the encoder states (E <= V: text and condition slots alike) or
/// undefined. Mismatches (slots that do not cover img_shapes' tokens, a mask longer than the sequence) are a
/// dew::Error naming `where`.
QwenImageLayout qwen_image_layout(const std::vector<std::vector<int64_t>>& img_shapes, const at::Tensor& vlm_image,
                                  const at::Tensor& text_mask, const std::vector<int64_t>& axes_dims,
                                  const std::string& where, const at::Device& device = at::kCPU);

/// The prefix KV cache of one conditioning (QwenImage21KVCache): per block the keys and values of the tokens
/// before the target image, after norm and RoPE, [B, H, prefix_len, head_dim]. Valid only for the same text
/// (and condition images) and a causal_condition model: the prefix never sees t.
struct QwenImageKVCache {
  std::vector<at::Tensor> k, v;
  int64_t prefix_len = 0;
  bool filled() const { return !k.empty(); }
};

/// What one forward does with a cache.
enum class QwenImageCacheMode { kNone, kExtract, kCached };

/// diffusers' QwenImage21Attention: to_q / to_k / to_v / to_out.0 without bias, RMSNorm of each head's queries
/// and keys (norm_q, norm_k).
class QwenImageAttentionImpl : public torch::nn::Module {
 public:
  QwenImageAttentionImpl(int64_t dim, int64_t heads, int64_t head_dim, double eps);
  int64_t heads, head_dim;
  torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr}, out{nullptr};  // out: to_out.0
  HeadNorm norm_q{nullptr}, norm_k{nullptr};
};
TORCH_MODULE(QwenImageAttention);

/// diffusers' QwenImage21SwiGLUFeedForward: out(silu(gate_layer x) * proj x), no biases.
class QwenImageFeedForwardImpl : public torch::nn::Module {
 public:
  QwenImageFeedForwardImpl(int64_t dim, int64_t hidden);
  /// x: [B, S, D] -> [B, S, D]
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear proj{nullptr}, out{nullptr}, gate_layer{nullptr};
};
TORCH_MODULE(QwenImageFeedForward);

/// diffusers' QwenImage21TransformerBlock. Parameters: attn.*, img_mlp.* (the LayerNorms have none; the
/// modulation is the model's).
class QwenImageBlockImpl : public torch::nn::Module {
 public:
  QwenImageBlockImpl(int64_t heads, int64_t head_dim, int64_t mlp_ratio, double eps, std::string attention_impl,
                     bool force_fp32_for_softmax);
  /// h: [B, Sq, D] the joint sequence (or its target tokens in kCached); mods: {scale1, gate1, scale2, gate2}
  /// per token [B, Sq, D] or per sample [B, 1, D]; rope: tables of the Sq query rows; mask: prepared [B|1, 1, Sq,
  /// Sk]; k_cache / v_cache: the prefix's keys and values (kExtract writes them, kCached prepends them).
  at::Tensor forward(const at::Tensor& h, const std::vector<at::Tensor>& mods, const QwenRope& rope,
                     const AttentionMask& mask, QwenImageCacheMode mode, int64_t prefix_len, at::Tensor* k_cache,
                     at::Tensor* v_cache);
  double eps;
  std::string attention_impl;
  bool force_fp32_for_softmax;
  QwenImageAttention attn{nullptr};
  QwenImageFeedForward img_mlp{nullptr};
};
TORCH_MODULE(QwenImageBlock);

/// The QwenImageTransformer backbone. Parameters (diffusers' names): img_in [D, in_channels],
/// txt_in.{text_norm.weight [context_features] (stored as scale - 1), in_layer, out_layer},
/// time_text_embed.timestep_embedder.linear_{1,2}, modulation.1 [4 D, D], transformer_blocks.I.*,
/// norm_out.linear [D, D], proj_out [output_channels, D]; none has a bias.
class QwenImageTransformerImpl : public BackboneImpl {
 public:
  explicit QwenImageTransformerImpl(QwenImageTransformerOptions options = {});
  void reset();
  /// x: [B, in_channels, H, W] latents (H W a multiple of 4: the target's 2 x 2 slots); time: [B] or a scalar,
  /// the model time sigma x 1000 (diffusers' timestep x 1000); cond: context [B, L, context_features]
  /// (required), context_mask [B, L] (optional; right padding: each row's real tokens first). The joint
  /// sequence is [text; image] -> [B, output_channels, H, W] float32 (float64 for a float64 model).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond) override;
  /// forward, also filling `cache` with the text's keys and values (causal_condition only).
  at::Tensor forward_extract(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond,
                             QwenImageKVCache& cache);
  /// forward from a filled cache of the same conditioning: only the image tokens are computed; equal to
  /// forward to float rounding.
  at::Tensor forward_cached(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond,
                            const QwenImageKVCache& cache);
  /// diffusers' forward on the joint layout: tokens [B, N, in_channels] (every image block's tokens, condition
  /// images first); context [B, E, context_features]; time [B] = diffusers' timestep x 1000; layout from
  /// qwen_image_layout -> [B, S, output_channels] over the joint sequence ([B, S - prefix_len, ...] in
  /// kCached).
  at::Tensor forward_joint(const at::Tensor& tokens, const at::Tensor& context, const at::Tensor& time,
                           const QwenImageLayout& layout, QwenImageCacheMode mode = QwenImageCacheMode::kNone,
                           QwenImageKVCache* cache = nullptr);
  bool requires_text() const override { return true; }

  QwenImageTransformerOptions options;
  torch::nn::Linear img_in{nullptr}, proj_out{nullptr}, txt_in_layer{nullptr}, txt_out_layer{nullptr},
      time_linear_1{nullptr}, time_linear_2{nullptr}, modulation{nullptr}, norm_out{nullptr};
  at::Tensor txt_norm_weight;          // txt_in.text_norm.weight
  std::vector<QwenImageBlock> blocks;  // transformer_blocks, in order

 private:
  at::Tensor nchw_forward(const at::Tensor& x, const at::Tensor& time, const Conditioning& cond,
                          QwenImageCacheMode mode, QwenImageKVCache* cache);
  at::ScalarType dtype_ = at::kFloat;
};
TORCH_MODULE(QwenImageTransformer);

/// The fields of a diffusers QwenImage21Transformer2DModel config.json (bookkeeping keys already removed); an
/// unsupported setting (patch_size other than 1, an unknown key) is a dew::Error naming it.
json qwen_image_transformer_fields_from_diffusers(const json& config);

/// The reference methods of QwenImage21Transformer2DModel as `dew forward` runs them: "forward" (hidden_states
/// [B, N, in_channels], encoder_hidden_states [B, E, context_in_dim], timestep in [0, 1] (a scalar or [B]),
/// img_shapes int [B, n, 3] or [n, 3], img_mask bool [B, V], optional encoder_hidden_states_mask bool [B, E]
/// -> sample [B, S, out_channels] over the joint sequence), and "forward_kv_cache" (the same inputs plus
/// cached_hidden_states and cached_timestep: diffusers' "extract" call, then a "cached" call -> sample and
/// cached_sample [B, N_target, out_channels]).
std::vector<models::ReferenceMethod> qwen_image_transformer_methods();

}  // namespace dew::nn
